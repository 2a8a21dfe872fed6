package kafkasql

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sort"
	"strings"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/internal/sqldialect"
	"github.com/idemkit/idem/internal/sqlname"
)

// Dialect is the SQL server family behind the *sql.DB.
type Dialect = sqldialect.Dialect

// The dialects Offsets speaks.
const (
	// Postgres is PostgreSQL through database/sql (pgx's stdlib driver or
	// lib/pq).
	Postgres = sqldialect.Postgres
	// MySQL is MySQL 8 or MariaDB 10.6 and later, with InnoDB tables
	// (go-sql-driver/mysql).
	MySQL = sqldialect.MySQL
	// SQLite is SQLite 3.35 or later (modernc.org/sqlite, or another
	// driver).
	SQLite = sqldialect.SQLite
)

// ErrTransient marks a database error that says nothing about the
// positions: a deadlock, a lock wait the server gave up on, a serialization
// failure, a busy SQLite database. The transaction was rolled back (or must
// be); run it again. The Consumer retries a handler that returns it.
var ErrTransient = errors.New("kafkasql: transient database error: retry the transaction")

// Options configure Offsets. The zero value is usable.
type Options struct {
	// Schema qualifies the table: a PostgreSQL schema (Migrate creates
	// it), a MySQL database or an attached SQLite database (both must
	// exist). Defaults to "" (the connection's own: search_path, the
	// current database, main).
	Schema string
	// Table is the table name. Defaults to "kafka_offsets".
	Table string
}

// Offsets keeps consumer-group positions in a table reached through
// database/sql, one row per (group, topic, partition) with the offset the
// group resumes from. It implements idemkafka.OffsetStore; SaveTx writes a
// position in the caller's transaction. A position only moves forward: every
// write keeps the greater offset, so a late write from a member that lost
// the partition cannot move it back. To rewind a group, update or delete its
// rows while no member runs.
//
// Offsets is safe for concurrent use.
type Offsets struct {
	db      *sql.DB
	dialect Dialect
	opts    Options
	table   string // quoted, qualified
}

var _ idemkafka.OffsetStore = (*Offsets)(nil)

// New returns an Offsets on db, which speaks dialect. It does not touch the
// database: call Migrate (or apply SQL) once before use.
func New(db *sql.DB, dialect Dialect, opts Options) (*Offsets, error) {
	if db == nil {
		return nil, errors.New("kafkasql: New: db is nil: pass the *sql.DB of sql.Open")
	}
	if !dialect.Valid() {
		return nil, fmt.Errorf("kafkasql: New: dialect %v is not supported: use kafkasql.MySQL, kafkasql.Postgres or kafkasql.SQLite", dialect)
	}
	if opts.Schema != "" {
		if err := sqlname.Check("kafkasql: Options.Schema", opts.Schema); err != nil {
			return nil, err
		}
	}
	if opts.Table == "" {
		opts.Table = "kafka_offsets"
	}
	if err := sqlname.Check("kafkasql: Options.Table", opts.Table); err != nil {
		return nil, err
	}
	if len(opts.Table) > 50 {
		return nil, fmt.Errorf("kafkasql: Options.Table %q is longer than 50 bytes; the name of its migrations table is derived from it", opts.Table)
	}
	return &Offsets{db: db, dialect: dialect, opts: opts, table: qualified(dialect, opts.Schema, opts.Table)}, nil
}

// qualified returns name quoted in d, qualified by schema when there is one.
func qualified(d Dialect, schema, name string) string {
	if schema == "" {
		return d.Quote(name)
	}
	return d.Quote(schema) + "." + d.Quote(name)
}

// Table returns the quoted, qualified table name.
func (o *Offsets) Table() string { return o.table }

// Dialect returns the dialect given to New.
func (o *Offsets) Dialect() Dialect { return o.dialect }

// placeholders returns n comma-separated groups of ? each of width
// placeholders, in parentheses when width > 1.
func placeholders(n, width int) string {
	one := "?"
	if width > 1 {
		one = "(" + strings.TrimSuffix(strings.Repeat("?, ", width), ", ") + ")"
	}
	return strings.TrimSuffix(strings.Repeat(one+", ", n), ", ")
}

// LoadOffsets implements idemkafka.OffsetStore.
func (o *Offsets) LoadOffsets(ctx context.Context, group, topic string, partitions []int) (map[int]int64, error) {
	out := map[int]int64{}
	if len(partitions) == 0 {
		return out, nil
	}
	args := make([]any, 0, 2+len(partitions))
	args = append(args, group, topic)
	for _, p := range partitions {
		args = append(args, int64(p))
	}
	q := o.dialect.Rebind("SELECT partition_id, next_offset FROM " + o.table +
		" WHERE group_id = ? AND topic = ? AND partition_id IN (" + placeholders(len(partitions), 1) + ")")
	rows, err := o.db.QueryContext(ctx, q, args...)
	if err != nil {
		return nil, o.wrap("load offsets", err)
	}
	defer func() { _ = rows.Close() }()
	for rows.Next() {
		var (
			p   int64
			off int64
		)
		if err := rows.Scan(&p, &off); err != nil {
			return nil, o.wrap("load offsets", err)
		}
		out[int(p)] = off
	}
	if err := rows.Err(); err != nil {
		return nil, o.wrap("load offsets", err)
	}
	return out, nil
}

type execer interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

type row struct {
	topic     string
	partition int
	offset    int64
}

// saveSQL returns the upsert of n positions: the greater offset wins, and a
// row that would not move is left alone.
func (o *Offsets) saveSQL(n int) string {
	var b strings.Builder
	b.WriteString("INSERT INTO ")
	b.WriteString(o.table)
	if o.dialect != MySQL {
		b.WriteString(" AS t")
	}
	b.WriteString(" (group_id, topic, partition_id, next_offset, updated_at) VALUES ")
	var now string
	switch o.dialect {
	case MySQL:
		now = "UTC_TIMESTAMP(6)"
	case Postgres:
		now = "clock_timestamp()"
	default:
		now = "strftime('%Y-%m-%dT%H:%M:%fZ', 'now')"
	}
	for i := range n {
		if i > 0 {
			b.WriteString(", ")
		}
		b.WriteString("(?, ?, ?, ?, " + now + ")")
	}
	if o.dialect == MySQL {
		// The assignments run left to right on the updated row:
		// updated_at reads next_offset before it moves.
		b.WriteString(" ON DUPLICATE KEY UPDATE" +
			" updated_at = IF(next_offset < VALUES(next_offset), VALUES(updated_at), updated_at)," +
			" next_offset = GREATEST(next_offset, VALUES(next_offset))")
	} else {
		b.WriteString(" ON CONFLICT (group_id, topic, partition_id) DO UPDATE" +
			" SET next_offset = excluded.next_offset, updated_at = excluded.updated_at" +
			" WHERE t.next_offset < excluded.next_offset")
	}
	return o.dialect.Rebind(b.String())
}

func (o *Offsets) saveOn(ctx context.Context, db execer, group string, offsets map[string]map[int]int64) error {
	var rows []row
	for t, ps := range offsets {
		for p, off := range ps {
			rows = append(rows, row{t, p, off})
		}
	}
	if len(rows) == 0 {
		return nil
	}
	// In key order, so that concurrent writers take the rows' locks in the
	// same order.
	sort.Slice(rows, func(i, j int) bool {
		if rows[i].topic != rows[j].topic {
			return rows[i].topic < rows[j].topic
		}
		return rows[i].partition < rows[j].partition
	})
	args := make([]any, 0, 4*len(rows))
	for _, r := range rows {
		args = append(args, group, r.topic, int64(r.partition), r.offset)
	}
	if _, err := db.ExecContext(ctx, o.saveSQL(len(rows)), args...); err != nil {
		return o.wrap("save offsets", err)
	}
	return nil
}

// wrap adds the package and what failed to err, and ErrTransient when the
// server says the transaction may succeed when run again.
func (o *Offsets) wrap(what string, err error) error {
	if o.dialect.Transient(err) {
		return fmt.Errorf("kafkasql: %s in %s: %w: %w", what, o.table, ErrTransient, err)
	}
	return fmt.Errorf("kafkasql: %s in %s: %w", what, o.table, err)
}

// SaveOffsets implements idemkafka.OffsetStore. It writes every position in
// one statement, outside any transaction of the caller. Positions already
// stored (or passed) are dropped first by a plain read: an upsert locks the
// row it finds even when it changes nothing, and the Consumer's periodic
// commit saves positions that the handlers' transactions (SaveTx) stored
// already, so without the read each of those commits would wait for a
// handler's transaction on the row and write to the log for nothing.
func (o *Offsets) SaveOffsets(ctx context.Context, group string, offsets map[string]map[int]int64) error {
	ahead := make(map[string]map[int]int64, len(offsets))
	for topic, ps := range offsets {
		if len(ps) == 0 {
			continue
		}
		parts := make([]int, 0, len(ps))
		for p := range ps {
			parts = append(parts, p)
		}
		stored, err := o.LoadOffsets(ctx, group, topic, parts)
		if err != nil {
			return err
		}
		for p, off := range ps {
			if cur, ok := stored[p]; ok && cur >= off {
				continue
			}
			if ahead[topic] == nil {
				ahead[topic] = map[int]int64{}
			}
			ahead[topic][p] = off
		}
	}
	return o.saveOn(ctx, o.db, group, ahead)
}

// SaveTx writes pos in tx, a transaction begun on the Offsets' database: it
// commits with the effect and the claim, or not at all. Get pos from
// idemkafka.PositionAfter.
func (o *Offsets) SaveTx(ctx context.Context, tx *sql.Tx, pos idemkafka.Position) error {
	if tx == nil {
		return errors.New("kafkasql: SaveTx: tx is nil: pass the transaction of the effect")
	}
	return o.saveOn(ctx, tx, pos.Group, map[string]map[int]int64{pos.Topic: {pos.Partition: pos.Offset}})
}
