package bench

import (
	"context"
	"crypto/sha256"
	"database/sql"
	"fmt"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/sqltable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// sqlConns is the size of the *sql.DB pools of the sqltable rows, open and
// idle: database/sql keeps 2 idle connections by default, and 8 clients
// on it would dial a connection per transaction.
const sqlConns = 24

// mariadb returns the run's *sql.DB on the test MariaDB (or MySQL)
// database, opened on first use, with the DSN the tests use
// (go-sql-driver/mysql's defaults: a statement with arguments is
// prepared, executed and closed on the server).
func (e *env) mariadb(ctx context.Context) (*sql.DB, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.mysql != nil {
		return e.mysql, nil
	}
	cfg, err := mysql.ParseDSN(testenv.MySQLDSN())
	if err != nil {
		return nil, fmt.Errorf("IDEM_TEST_MYSQL_DSN: %w", err)
	}
	c, err := mysql.NewConnector(cfg)
	if err != nil {
		return nil, err
	}
	db := sql.OpenDB(c)
	sizePool(db)
	if err := db.PingContext(ctx); err != nil {
		_ = db.Close()
		return nil, fmt.Errorf("MariaDB at %s: %w (make up starts it)", testenv.MySQLDSN(), err)
	}
	e.mysql = db
	return db, nil
}

// pgsql returns the run's *sql.DB on the test PostgreSQL database through
// pgx's stdlib driver, opened on first use.
func (e *env) pgsql() (*sql.DB, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.pgstd != nil {
		return e.pgstd, nil
	}
	cfg, err := pgx.ParseConfig(testenv.PostgresURL())
	if err != nil {
		return nil, err
	}
	e.pgstd = stdlib.OpenDB(*cfg)
	sizePool(e.pgstd)
	return e.pgstd, nil
}

func sizePool(db *sql.DB) {
	db.SetMaxOpenConns(sqlConns)
	db.SetMaxIdleConns(sqlConns)
}

// mariaTable creates a table in the test MariaDB database, dropped at the
// end, and returns its quoted name.
func (e *env) mariaTable(ctx context.Context, db *sql.DB, name, cols string) (string, error) {
	t := "`" + name + "`"
	if _, err := db.ExecContext(ctx, "CREATE TABLE "+t+" ("+cols+") ENGINE = InnoDB"); err != nil {
		return "", err
	}
	e.onClose(func(ctx context.Context) { _, _ = db.ExecContext(ctx, "DROP TABLE IF EXISTS "+t) })
	return t, nil
}

// mariaEffects creates a business table on MariaDB, without a unique
// constraint, and returns the statement that inserts one row (the id,
// the payload).
func (e *env) mariaEffects(ctx context.Context, db *sql.DB, name string) (string, error) {
	t, err := e.mariaTable(ctx, db, testenv.Name("idembench_"+name),
		"id VARCHAR(64) NOT NULL, payload BLOB, at DATETIME(6) NOT NULL DEFAULT CURRENT_TIMESTAMP(6)")
	return "INSERT INTO " + t + " (id, payload) VALUES (?, ?)", err
}

// sqlClaims migrates a sqltable store on db, whose tables are dropped at
// the end (on PostgreSQL with the run's schema).
func (e *env) sqlClaims(ctx context.Context, db *sql.DB, d sqltable.Dialect, opts sqltable.Options) (*sqltable.Store, error) {
	s, err := sqltable.New(db, d, opts)
	if err != nil {
		return nil, err
	}
	if d == sqltable.MySQL {
		e.onClose(func(ctx context.Context) {
			_, _ = db.ExecContext(ctx, "DROP TABLE IF EXISTS "+s.Table()+", `"+opts.Table+"_migrations`")
		})
	}
	return s, s.Migrate(ctx)
}

// sqlTx runs f in a transaction of db and commits it: the bare
// transaction a user writes with database/sql.
func sqlTx(ctx context.Context, db *sql.DB, f func(tx *sql.Tx) error) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	if err := f(tx); err != nil {
		_ = tx.Rollback()
		return err
	}
	return tx.Commit()
}

func sqltableMariaRow() row {
	return row{
		path:     "sqltable claim in a business tx on MariaDB (sqltable.Process), 8 clients",
		baseline: "the bare business tx on database/sql (the same INSERT)",
		target:   0.90, unit: "tx/s",
		build: func(ctx context.Context, e *env) (side, side, error) {
			db, err := e.mariadb(ctx)
			if err != nil {
				return nil, nil, err
			}
			bareInsert, err := e.mariaEffects(ctx, db, "sql_bare")
			if err != nil {
				return nil, nil, err
			}
			idemInsert, err := e.mariaEffects(ctx, db, "sql_idem")
			if err != nil {
				return nil, nil, err
			}
			claims, err := e.sqlClaims(ctx, db, sqltable.MySQL, sqltable.Options{Table: testenv.Name("idembench_sqlc")})
			if err != nil {
				return nil, nil, err
			}
			bare := func(ctx context.Context, warm bool) (float64, error) {
				return closedLoop(ctx, storeClients, warmedFor(e.size.duration, warm), func(ctx context.Context) error {
					return sqlTx(ctx, db, func(tx *sql.Tx) error {
						_, err := tx.ExecContext(ctx, bareInsert, e.id("m"), payload)
						return err
					})
				})
			}
			idem := func(ctx context.Context, warm bool) (float64, error) {
				return closedLoop(ctx, storeClients, warmedFor(e.size.duration, warm), func(ctx context.Context) error {
					id := e.id("m")
					key := dedup.Key{Scope: "bench/sql", ID: id, Fingerprint: dedup.FingerprintOf(payload)}
					_, err := claims.Process(ctx, key, func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
						_, err := tx.ExecContext(ctx, idemInsert, id, payload)
						return nil, err
					})
					return err
				})
			}
			return bare, idem, nil
		},
		byHand: func(ctx context.Context, e *env) (side, error) {
			db, err := e.mariadb(ctx)
			if err != nil {
				return nil, err
			}
			insert, err := e.mariaEffects(ctx, db, "sql_hand")
			if err != nil {
				return nil, err
			}
			// The claims table, made by sqltable's migration; the
			// statements below are sent by hand.
			claims, err := e.sqlClaims(ctx, db, sqltable.MySQL, sqltable.Options{Table: testenv.Name("idembench_sqlh")})
			if err != nil {
				return nil, err
			}
			h := newHandSQL(db, sqltable.MySQL, claims.Table(), insert)
			return func(ctx context.Context, warm bool) (float64, error) {
				return closedLoop(ctx, storeClients, warmedFor(e.size.duration, warm), func(ctx context.Context) error {
					id := e.id("m")
					return h.process(ctx, "bench/sql", id, payload)
				})
			}, nil
		},
		handNote: sqlHandNote,
	}
}

// handSQL sends by hand, with database/sql and the row's driver, the
// statements sqltable's Process sends for a first delivery whose handler
// makes one INSERT and returns no result. On MySQL (go-sql-driver/mysql):
//
//	BEGIN
//	INSERT INTO <claims> (digest, expires_at, fingerprint, scope, id)
//	VALUES (?, (UTC_TIMESTAMP(6) + INTERVAL ? * 1000 MICROSECOND), ?, ?, ?)
//	    the key's digest, the retention in ms (7 days), the fingerprint, NULL, NULL
//	INSERT INTO <business> (id, payload) VALUES (?, ?)
//	COMMIT
//
// On PostgreSQL (pgx's stdlib driver) the claim is the same INSERT with
// $n placeholders, clock_timestamp() plus the retention, and ON CONFLICT
// (digest) DO NOTHING.
//
// The digest is the first 16 bytes of SHA-256(scope || 0x00 || id). Like
// sqltable, it reads the claim's rows affected (1: the key is claimed).
type handSQL struct {
	db            *sql.DB
	claim, insert string
	retentionMs   int64
	fp            []byte // dedup.FingerprintOf(payload): every message has the same
}

const sqlRetention = 7 * 24 * time.Hour // sqltable's default Options.Retention

func newHandSQL(db *sql.DB, d sqltable.Dialect, claims, insert string) *handSQL {
	claim := "INSERT INTO " + claims + " (digest, expires_at, fingerprint, scope, id)\n" +
		"VALUES (?, (UTC_TIMESTAMP(6) + INTERVAL ? * 1000 MICROSECOND), ?, ?, ?)"
	if d == sqltable.Postgres {
		claim = "INSERT INTO " + claims + " (digest, expires_at, fingerprint, scope, id)\n" +
			"VALUES ($1, (clock_timestamp() + CAST($2 AS bigint) * interval '1 millisecond'), $3, $4, $5) ON CONFLICT (digest) DO NOTHING"
	}
	return &handSQL{db: db, insert: insert, retentionMs: sqlRetention.Milliseconds(),
		fp: dedup.FingerprintOf(payload).Bytes(), claim: claim}
}

func (h *handSQL) process(ctx context.Context, scope, id string, body []byte) error {
	sum := sha256.Sum256([]byte(scope + "\x00" + id))
	return sqlTx(ctx, h.db, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, h.claim, sum[:16], h.retentionMs, h.fp, nil, nil)
		if err != nil {
			return err
		}
		n, err := res.RowsAffected()
		if err != nil {
			return err
		}
		if n != 1 {
			return fmt.Errorf("hand claim of %s: %d rows affected, want 1", id, n)
		}
		_, err = tx.ExecContext(ctx, h.insert, id, body)
		return err
	})
}

const sqlHandNote = "For the sqltable row on MariaDB, statements-by-hand is the statements sqltable sends " +
	"(BEGIN, the claim's INSERT, the handler's INSERT, COMMIT), sent by the same clients with database/sql and " +
	"go-sql-driver/mysql and no idem code (test/bench/sqltable.go): there is no pgbench for MySQL, so this is " +
	"its SQL floor; hand ratio is the ratio the SQL allows, idem / hand how close sqltable comes to it."

func sqltablePgRow() row {
	return row{
		path:     "sqltable on PostgreSQL (pgx stdlib) against pgtable, claim in a business tx, 8 clients",
		baseline: "pgtable.Process on a pgx pool, the same INSERT",
		target:   0.90, unit: "tx/s", floor: sqltableFloor,
		build: func(ctx context.Context, e *env) (side, side, error) {
			db, err := e.pgsql()
			if err != nil {
				return nil, nil, err
			}
			pgInsert, err := e.effects(ctx, "pgt_idem")
			if err != nil {
				return nil, nil, err
			}
			sqlInsert, err := e.effects(ctx, "sqlt_idem")
			if err != nil {
				return nil, nil, err
			}
			pgClaims, err := e.claims(ctx, "pgt_claims", pgtable.Options{})
			if err != nil {
				return nil, nil, err
			}
			sqlClaims, err := e.sqlClaims(ctx, db, sqltable.Postgres, sqltable.Options{Schema: e.schema, Table: "sqlt_claims"})
			if err != nil {
				return nil, nil, err
			}
			base := func(ctx context.Context, warm bool) (float64, error) {
				return closedLoop(ctx, storeClients, warmedFor(e.size.duration, warm), func(ctx context.Context) error {
					id := e.id("m")
					key := dedup.Key{Scope: "bench/pg", ID: id, Fingerprint: dedup.FingerprintOf(payload)}
					_, err := pgClaims.Process(ctx, key, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
						_, err := tx.Exec(ctx, pgInsert, id, payload)
						return nil, err
					})
					return err
				})
			}
			idem := func(ctx context.Context, warm bool) (float64, error) {
				return closedLoop(ctx, storeClients, warmedFor(e.size.duration, warm), func(ctx context.Context) error {
					id := e.id("m")
					key := dedup.Key{Scope: "bench/pg", ID: id, Fingerprint: dedup.FingerprintOf(payload)}
					_, err := sqlClaims.Process(ctx, key, func(ctx context.Context, tx *sql.Tx) ([]byte, error) {
						_, err := tx.ExecContext(ctx, sqlInsert, id, payload)
						return nil, err
					})
					return err
				})
			}
			return base, idem, nil
		},
		byHand: func(ctx context.Context, e *env) (side, error) {
			db, err := e.pgsql()
			if err != nil {
				return nil, err
			}
			insert, err := e.effects(ctx, "sqlt_hand")
			if err != nil {
				return nil, err
			}
			// The claims table, made by sqltable's migration; the
			// statements below are sent by hand.
			claims, err := e.sqlClaims(ctx, db, sqltable.Postgres, sqltable.Options{Schema: e.schema, Table: "sqlt_hand_claims"})
			if err != nil {
				return nil, err
			}
			h := newHandSQL(db, sqltable.Postgres, claims.Table(), insert)
			return func(ctx context.Context, warm bool) (float64, error) {
				return closedLoop(ctx, storeClients, warmedFor(e.size.duration, warm), func(ctx context.Context) error {
					return h.process(ctx, "bench/pg", e.id("m"), payload)
				})
			}, nil
		},
		handNote: sqlPgHandNote,
	}
}

const sqlPgHandNote = "For the sqltable row on PostgreSQL, statements-by-hand is the statements sqltable sends " +
	"(BEGIN, the claim's INSERT, the handler's INSERT, COMMIT) with database/sql and pgx's stdlib driver and no idem code: " +
	"what the driver allows, beside pgbench's SQL floor of the same statements above; " +
	"its hand ratio is against the row's baseline, pgtable on a pgx pool."
