package chaos

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Querier is what Oracle.Record writes through: a pool, a conn or the
// handler's transaction (so the effect commits or rolls back with it).
type Querier interface {
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
}

// Oracle is the effects table: one row per applied effect, no
// unique constraint, in a schema of its own. It lives on the shared
// PostgreSQL even when the store under test is another server, so a crash
// of that server cannot erase the evidence.
type Oracle struct {
	pool   *pgxpool.Pool
	schema string
	table  string // quoted, qualified
}

// NewOracle creates a fresh schema named after the cell and its effects
// table.
func NewOracle(ctx context.Context, pool *pgxpool.Pool, cell string, seed uint64) (*Oracle, error) {
	schema := fmt.Sprintf("chaos_%s_%d", sanitize(cell), seed%1_000_000_007)
	o := &Oracle{pool: pool, schema: schema, table: pgx.Identifier{schema, "effects"}.Sanitize()}
	_, err := pool.Exec(ctx, fmt.Sprintf(`DROP SCHEMA IF EXISTS %[1]s CASCADE;
CREATE SCHEMA %[1]s;
CREATE TABLE %[2]s (id text NOT NULL, worker text NOT NULL DEFAULT '', at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE INDEX ON %[2]s (id);`, pgx.Identifier{schema}.Sanitize(), o.table))
	if err != nil {
		return nil, fmt.Errorf("chaos: oracle: %w", err)
	}
	return o, nil
}

// Schema is the oracle's schema; cells may create their own tables in it
// (pgtable's processed_events, an outbox, kafkapg offsets); Drop removes
// them all.
func (o *Oracle) Schema() string { return o.schema }

// Table is the quoted, qualified effects table, for cells that write the
// effect in their own SQL: INSERT INTO <Table()> (id, worker) VALUES ($1, $2).
func (o *Oracle) Table() string { return o.table }

// Record writes one effect row for id through q.
func (o *Oracle) Record(ctx context.Context, q Querier, id, worker string) error {
	_, err := q.Exec(ctx, "INSERT INTO "+o.table+" (id, worker) VALUES ($1, $2)", id, worker)
	return err
}

// Check returns the oracle's verdict over the inputs that must have an
// effect (the acknowledged ones): duplicates are ids with more than one row
// (over every row, acknowledged or not), lost are ids in must without a row.
func (o *Oracle) Check(ctx context.Context, must []string) (duplicates, lost int, err error) {
	err = o.pool.QueryRow(ctx, "SELECT count(*) FROM (SELECT id FROM "+o.table+" GROUP BY id HAVING count(*) > 1) d").Scan(&duplicates)
	if err != nil {
		return 0, 0, fmt.Errorf("chaos: oracle duplicates: %w", err)
	}
	err = o.pool.QueryRow(ctx, "SELECT count(*) FROM unnest($1::text[]) AS m(id) WHERE NOT EXISTS (SELECT 1 FROM "+o.table+" e WHERE e.id = m.id)", must).Scan(&lost)
	if err != nil {
		return 0, 0, fmt.Errorf("chaos: oracle lost: %w", err)
	}
	return duplicates, lost, nil
}

// Effects returns the number of effect rows.
func (o *Oracle) Effects(ctx context.Context) (n int, err error) {
	err = o.pool.QueryRow(ctx, "SELECT count(*) FROM "+o.table).Scan(&n)
	return n, err
}

// Drop removes the oracle's schema and everything in it.
func (o *Oracle) Drop(ctx context.Context) error {
	_, err := o.pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{o.schema}.Sanitize()+" CASCADE")
	return err
}

func sanitize(s string) string {
	b := []byte(s)
	for i, c := range b {
		switch {
		case c >= 'a' && c <= 'z', c >= '0' && c <= '9':
		case c >= 'A' && c <= 'Z':
			b[i] = c + 'a' - 'A'
		default:
			b[i] = '_'
		}
	}
	if len(b) > 40 {
		b = b[:40]
	}
	return string(b)
}
