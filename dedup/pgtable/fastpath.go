package pgtable

import (
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/dedup"
)

// The fast path of Process sends BEGIN and the claim's INSERT as one simple
// query, so a first-time claim costs no round trip of its own: the
// transaction is BEGIN+claim, the handler's statements, COMMIT — as many
// round trips as the bare business transaction.
//
// The INSERT has no ON CONFLICT clause: when the key exists the query fails
// with unique_violation (after waiting for a concurrent claim to end), the
// connection is rolled back and the row is read to give the verdict. Rows that
// are expired but not yet cleaned up, and DBs other than a pool or a conn,
// take the regular path (BEGIN, then ClaimTx).
//
// The simple protocol cannot bind parameters, so the values are written as
// literals: scope and id are validated keys (valid UTF-8, no control bytes,
// hence no NUL) quoted by doubling single quotes, which is exact when
// standard_conforming_strings is on (checked per connection; otherwise the
// regular path runs); the fingerprint is hex; the retention an integer.

const uniqueViolation = "23505"

func quoteLiteral(s string) string { return "'" + strings.ReplaceAll(s, "'", "''") + "'" }

func (s *Store) fastBeginSQL(key dedup.Key) string {
	fp := "NULL"
	if !key.Fingerprint.IsZero() {
		fp = `'\x` + hex.EncodeToString(key.Fingerprint[:]) + `'::bytea`
	}
	return "BEGIN; INSERT INTO " + s.table +
		" (scope, id, fingerprint, state, created_at, completed_at, expires_at) VALUES (" +
		quoteLiteral(key.Scope) + ", " + quoteLiteral(key.ID) + ", " + fp +
		", 2, clock_timestamp(), clock_timestamp(), clock_timestamp() + " +
		strconv.FormatInt(millis(s.opts.Retention), 10) + " * interval '1 millisecond')"
}

// begin returns a transaction that holds key's claim, and a function to call
// once the transaction has ended. When the fast path was taken it also
// returns the connection, on which literals may be sent (see
// commitWithResult).
func (s *Store) begin(ctx context.Context, key dedup.Key) (pgx.Tx, *pgx.Conn, func(), error) {
	tx, conn, release, err := s.beginInner(ctx, key)
	if err != nil {
		return nil, nil, nil, err
	}
	return tx, conn, release, nil
}

func (s *Store) beginInner(ctx context.Context, key dedup.Key) (pgx.Tx, *pgx.Conn, func(), error) {
	var (
		conn    *pgx.Conn
		release = func() {}
	)
	if s.opts.Partitioned {
		tx, err := s.slowBegin(ctx, s.db, key)
		return tx, nil, release, err
	}
	switch db := s.db.(type) {
	case *pgxpool.Pool:
		pc, err := db.Acquire(ctx)
		if err != nil {
			return nil, nil, nil, fmt.Errorf("pgtable: acquire: %w", err)
		}
		conn, release = pc.Conn(), pc.Release
	case *pgx.Conn:
		conn = db
	default:
		tx, err := s.slowBegin(ctx, s.db, key)
		return tx, nil, release, err
	}
	if conn.PgConn().ParameterStatus("standard_conforming_strings") != "on" {
		tx, err := s.slowBegin(ctx, conn, key)
		if err != nil {
			release()
			return nil, nil, nil, err
		}
		return tx, nil, release, nil
	}
	tx, err := conn.BeginTx(ctx, pgx.TxOptions{BeginQuery: s.fastBeginSQL(key)})
	if err == nil {
		return tx, conn, release, nil
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		release()
		return nil, nil, nil, fmt.Errorf("pgtable: claim %s: %w", key, err)
	}
	// The query failed inside its transaction block: end it.
	if _, rerr := conn.Exec(context.WithoutCancel(ctx), "ROLLBACK"); rerr != nil {
		release()
		return nil, nil, nil, fmt.Errorf("pgtable: claim %s: %w", key, errors.Join(err, rerr))
	}
	if pgErr.Code != uniqueViolation {
		release()
		return nil, nil, nil, fmt.Errorf("pgtable: claim %s: %w", key, err)
	}
	// The key exists: read it with a fresh snapshot.
	var (
		e       existing
		st      *int16
		ms      *int64
		expired bool
	)
	err = conn.QueryRow(ctx, s.sql.lookup, key.Scope, key.ID).Scan(&st, &e.fp, &e.result, &ms, &expired)
	if err == nil && !expired {
		release()
		e.state, e.leaseMs = deref(st), deref(ms)
		return nil, nil, nil, verdict(key, e)
	}
	if err != nil && !errors.Is(err, pgx.ErrNoRows) {
		release()
		return nil, nil, nil, fmt.Errorf("pgtable: claim %s: %w", key, err)
	}
	// Gone or expired since: the regular path settles it.
	tx, err = s.slowBegin(ctx, conn, key)
	if err != nil {
		release()
		return nil, nil, nil, err
	}
	return tx, nil, release, nil
}

type beginner interface {
	Begin(ctx context.Context) (pgx.Tx, error)
}

// slowBegin is BEGIN, then ClaimTx.
func (s *Store) slowBegin(ctx context.Context, db beginner, key dedup.Key) (pgx.Tx, error) {
	tx, err := db.Begin(ctx)
	if err != nil {
		return nil, fmt.Errorf("pgtable: begin: %w", err)
	}
	if err := s.ClaimTx(ctx, tx, key); err != nil {
		_ = tx.Rollback(context.WithoutCancel(ctx))
		return nil, err
	}
	return tx, nil
}

// commitWithResult stores result with key's claim and commits, in one simple
// query on conn (the connection of a fast-path transaction, whose
// standard_conforming_strings was checked): "UPDATE ...; COMMIT". The pgx.Tx
// of that transaction must not be used afterwards.
func (s *Store) commitWithResult(ctx context.Context, conn *pgx.Conn, key dedup.Key, result []byte) error {
	sql := "UPDATE " + s.table + ` SET result = '\x` + hex.EncodeToString(result) + "'::bytea WHERE scope = " +
		quoteLiteral(key.Scope) + " AND id = " + quoteLiteral(key.ID) + " AND state = 2; COMMIT"
	results, err := conn.PgConn().Exec(ctx, sql).ReadAll()
	if err != nil {
		return fmt.Errorf("pgtable: store result and commit %s: %w", key, err)
	}
	if len(results) != 2 {
		return fmt.Errorf("pgtable: store result and commit %s: %d results, want 2", key, len(results))
	}
	if n := results[0].CommandTag.RowsAffected(); n != 1 {
		return fmt.Errorf("pgtable: store result of %s: %d rows updated, want 1", key, n)
	}
	if tag := results[1].CommandTag.String(); tag != "COMMIT" {
		return fmt.Errorf("pgtable: commit %s: the server answered %s: %w", key, tag, pgx.ErrTxCommitRollback)
	}
	return nil
}
