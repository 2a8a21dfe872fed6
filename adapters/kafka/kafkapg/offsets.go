package kafkapg

import (
	"context"
	"embed"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/pgmigrate"
	"github.com/idemkit/idem/internal/sqlname"
)

// OffsetsOptions configure Offsets. The zero value is usable.
type OffsetsOptions struct {
	// Schema holds the table. Defaults to "public".
	Schema string
	// Table is the table name. Defaults to "kafka_offsets".
	Table string
}

// Offsets keeps consumer-group positions in a PostgreSQL table, one row per
// (group, topic, partition) with the offset the group resumes from. It
// implements idemkafka.OffsetStore; SaveTx writes a position in the caller's
// transaction. A position only moves forward: every write keeps the greater
// offset, so a late write from a member that lost the partition cannot move
// it back. To rewind a group, update or delete its rows while no member runs.
type Offsets struct {
	db    pgtable.DB
	opts  OffsetsOptions
	table string // quoted, schema-qualified
	save  string
	// saveOne writes one partition's position: $1 group, $2 topic, $3
	// partition, $4 offset.
	saveOne string
	load    string
	// The statements of OffsetsOnly's claim (claimRange): $1 group, $2
	// topic, $3 partition, $4 offset, and for advance $5 the batch's first
	// offset.
	advance, lockRow, insertNew string
}

var _ idemkafka.OffsetStore = (*Offsets)(nil)

// NewOffsets returns an Offsets on db. It does not touch the database: call
// Migrate (or apply SQL) once before use.
func NewOffsets(db pgtable.DB, opts OffsetsOptions) (*Offsets, error) {
	switch v := db.(type) {
	case nil:
		return nil, errors.New("kafkapg: NewOffsets: db is nil: pass a *pgxpool.Pool or *pgx.Conn")
	case *pgxpool.Pool:
		if v == nil {
			return nil, errors.New("kafkapg: NewOffsets: db is a nil *pgxpool.Pool")
		}
	case *pgx.Conn:
		if v == nil {
			return nil, errors.New("kafkapg: NewOffsets: db is a nil *pgx.Conn")
		}
	}
	if err := sqlname.SchemaTable("kafkapg: OffsetsOptions", &opts.Schema, &opts.Table, "kafka_offsets", 50); err != nil {
		return nil, err
	}
	o := &Offsets{db: db, opts: opts, table: sqlname.Qualified(opts.Schema, opts.Table)}
	// $1 group, $2 topics, $3 partitions, $4 offsets. The greater offset
	// wins; a row that would not move is left alone, and one already at or
	// past its offset is not even locked (ON CONFLICT DO UPDATE locks the
	// row it finds, and a lock is a write): the Consumer's periodic commit
	// of positions that the batches' transactions stored already writes
	// nothing, and commits without waiting for a WAL flush.
	o.save = `INSERT INTO ` + o.table + ` AS t (group_id, topic, partition, next_offset, updated_at)
SELECT $1, u.topic, u.partition, u.next_offset, clock_timestamp()
FROM unnest($2::text[], $3::integer[], $4::bigint[]) AS u(topic, partition, next_offset)
WHERE NOT EXISTS (SELECT 1 FROM ` + o.table + ` s
    WHERE s.group_id = $1 AND s.topic = u.topic AND s.partition = u.partition AND s.next_offset >= u.next_offset)
ORDER BY u.topic, u.partition
ON CONFLICT (group_id, topic, partition) DO UPDATE
    SET next_offset = EXCLUDED.next_offset, updated_at = EXCLUDED.updated_at
    WHERE t.next_offset < EXCLUDED.next_offset`
	o.saveOne = `INSERT INTO ` + o.table + ` AS t (group_id, topic, partition, next_offset, updated_at)
VALUES ($1, $2, $3, $4, clock_timestamp())
ON CONFLICT (group_id, topic, partition) DO UPDATE
    SET next_offset = EXCLUDED.next_offset, updated_at = EXCLUDED.updated_at
    WHERE t.next_offset < EXCLUDED.next_offset`
	// The position moves to $4 only from at most $5: a concurrent
	// transaction that holds the row makes it wait, then it is checked
	// against the row that transaction left.
	o.advance = `UPDATE ` + o.table + ` SET next_offset = $4, updated_at = clock_timestamp()
WHERE group_id = $1 AND topic = $2 AND partition = $3 AND next_offset <= $5`
	o.lockRow = `SELECT next_offset FROM ` + o.table + ` WHERE group_id = $1 AND topic = $2 AND partition = $3 FOR UPDATE`
	o.insertNew = `INSERT INTO ` + o.table + ` (group_id, topic, partition, next_offset, updated_at)
VALUES ($1, $2, $3, $4, clock_timestamp())
ON CONFLICT (group_id, topic, partition) DO NOTHING`
	o.load = `SELECT partition, next_offset FROM ` + o.table + ` WHERE group_id = $1 AND topic = $2 AND partition = ANY($3::integer[])`
	return o, nil
}

// Table returns the quoted, schema-qualified table name.
func (o *Offsets) Table() string { return o.table }

// LoadOffsets implements idemkafka.OffsetStore.
func (o *Offsets) LoadOffsets(ctx context.Context, group, topic string, partitions []int) (map[int]int64, error) {
	ps := make([]int32, len(partitions))
	for i, p := range partitions {
		ps[i] = int32(p)
	}
	rows, err := o.db.Query(ctx, o.load, group, topic, ps)
	if err != nil {
		return nil, fmt.Errorf("kafkapg: load offsets: %w", err)
	}
	out := map[int]int64{}
	var (
		p   int32
		off int64
	)
	if _, err := pgx.ForEachRow(rows, []any{&p, &off}, func() error {
		out[int(p)] = off
		return nil
	}); err != nil {
		return nil, fmt.Errorf("kafkapg: load offsets: %w", err)
	}
	return out, nil
}

type execer interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

func (o *Offsets) saveOn(ctx context.Context, db execer, group string, offsets map[string]map[int]int64) error {
	var (
		topics []string
		parts  []int32
		offs   []int64
	)
	for t, ps := range offsets {
		for p, off := range ps {
			topics = append(topics, t)
			parts = append(parts, int32(p))
			offs = append(offs, off)
		}
	}
	if len(topics) == 0 {
		return nil
	}
	if _, err := db.Exec(ctx, o.save, group, topics, parts, offs); err != nil {
		return fmt.Errorf("kafkapg: save offsets: %w", err)
	}
	return nil
}

// SaveOffsets implements idemkafka.OffsetStore.
func (o *Offsets) SaveOffsets(ctx context.Context, group string, offsets map[string]map[int]int64) error {
	return o.saveOn(ctx, o.db, group, offsets)
}

// SaveTx writes pos in tx: it commits with the effect and the claim, or not
// at all. Get pos from idemkafka.PositionAfter.
func (o *Offsets) SaveTx(ctx context.Context, tx pgx.Tx, pos idemkafka.Position) error {
	if _, err := tx.Exec(ctx, o.saveOne, o.saveArgs(pos)...); err != nil {
		return fmt.Errorf("kafkapg: save offsets: %w", err)
	}
	return nil
}

// saveArgs are the arguments of o.saveOne that write pos.
func (o *Offsets) saveArgs(pos idemkafka.Position) []any {
	return []any{pos.Group, pos.Topic, int32(pos.Partition), pos.Offset}
}

//go:embed migrations/*.sql
var migrationFS embed.FS

type tmplData struct{ schema, table string }

func (d tmplData) Table() string { return sqlname.Qualified(d.schema, d.table) }

// Migrations returns the migrations in order.
func (o *Offsets) Migrations() ([]pgtable.Migration, error) {
	return pgmigrate.Render("kafkapg", migrationFS, "migrations", tmplData{schema: o.opts.Schema, table: o.opts.Table})
}

// SQL returns every migration as one script, with the schema creation, for
// goose, golang-migrate or by hand.
func (o *Offsets) SQL() (string, error) {
	ms, err := o.Migrations()
	if err != nil {
		return "", err
	}
	return pgmigrate.Script("kafkapg", o.opts.Schema, ms), nil
}

func (o *Offsets) versionTable() string {
	return sqlname.Qualified(o.opts.Schema, o.opts.Table+"_migrations")
}

// Migrate applies the migrations not applied yet, in one transaction under an
// advisory lock, so several processes may run it at once. Applied versions
// are recorded in <table>_migrations.
func (o *Offsets) Migrate(ctx context.Context) error {
	ms, err := o.Migrations()
	if err != nil {
		return err
	}
	return pgmigrate.Migrate(ctx, o.db, pgmigrate.Target{
		Who:          "kafkapg",
		Schema:       o.opts.Schema,
		VersionTable: o.versionTable(),
		LockKey:      pgmigrate.LockKey("idem:kafkapg:migrate:" + o.opts.Schema + "." + o.opts.Table),
	}, ms, nil)
}
