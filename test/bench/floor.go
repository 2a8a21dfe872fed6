package bench

import (
	"context"
	"embed"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/adapters/kafka/kafkapg"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/sqltable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// The pgbench scripts: the statements each side of a database path sends,
// on tables of the run's schema (floor_*), found through search_path.
//
//go:embed testdata/*.sql
var scripts embed.FS

const pgbenchClients, pgbenchThreads = 8, 2

// floor is the SQL floor of a database path: pgbench replaying the
// baseline's statements and idem's. rows is the records one pgbench
// transaction stands for.
type floor struct {
	name       string
	bare, idem string // scripts in testdata
	rows       int
}

var (
	txFloor          = &floor{name: "per-message transaction", bare: "tx_bare.sql", idem: "tx_idem.sql", rows: 1}
	batchFloor       = &floor{name: "Kafka batch", bare: "batch_bare.sql", idem: "batch_idem.sql", rows: 100}
	batchNoPKFloor   = &floor{name: "Kafka batch, tables without an index", bare: "batch_bare_nopk.sql", idem: "batch_idem_nopk.sql", rows: 100}
	offsetsOnlyFloor = &floor{name: "Kafka batch, offsets only", bare: "batch_bare.sql", idem: "batch_offsets.sql", rows: 100}
	httpFloor        = &floor{name: "HTTP first request", bare: "http_bare.sql", idem: "http_idem.sql", rows: 1}
	// sqltableFloor compares sqltable's statements on PostgreSQL with
	// pgtable's (the baseline of its row).
	sqltableFloor = &floor{name: "sqltable on PostgreSQL", bare: "tx_idem.sql", idem: "sqltable_idem.sql", rows: 1}
)

type floorResult struct {
	bare, idem []float64 // pgbench transactions per second, per round
	err        error
}

// measureFloor runs f's two scripts in alternating rounds, like a row.
func measureFloor(ctx context.Context, e *env, f *floor) floorResult {
	var err error
	e.floorOnce.Do(func() { err = e.floorTables(ctx) })
	if err != nil {
		return floorResult{err: err}
	}
	dir, err := os.MkdirTemp("", "idembench")
	if err != nil {
		return floorResult{err: err}
	}
	defer func() { _ = os.RemoveAll(dir) }()
	run := func(script string) side {
		return func(ctx context.Context, warm bool) (float64, error) {
			b, err := scripts.ReadFile("testdata/" + script)
			if err != nil {
				return 0, err
			}
			path := filepath.Join(dir, script)
			if err := os.WriteFile(path, b, 0o600); err != nil {
				return 0, err
			}
			secs := e.size.pgbench
			if warm {
				// Two seconds: under load, eight clients can take a
				// whole second to connect and prepare, and a run that
				// finished no transaction prints no rate.
				secs = 2
			}
			return e.pgbench(ctx, path, secs)
		}
	}
	rates, err := alternate(ctx, e, "SQL floor, "+f.name, e.cfg.Rounds, run(f.bare), run(f.idem))
	if err != nil {
		e.logf("SQL floor, %s: not measured: %v", f.name, err)
		return floorResult{err: err}
	}
	return floorResult{bare: rates[0], idem: rates[1]}
}

func (e *env) floorTables(ctx context.Context) error {
	for name, cols := range map[string]string{
		"floor_bare":          "id text NOT NULL, payload bytea, at timestamptz NOT NULL DEFAULT now()",
		"floor_idem":          "id text NOT NULL, payload bytea, at timestamptz NOT NULL DEFAULT now()",
		"floor_bare_pk":       "id text PRIMARY KEY, payload bytea, at timestamptz NOT NULL DEFAULT now()",
		"floor_idem_pk":       "id text PRIMARY KEY, payload bytea, at timestamptz NOT NULL DEFAULT now()",
		"floor_payments_bare": "id bigserial PRIMARY KEY, amount bigint NOT NULL, currency text NOT NULL, customer text NOT NULL",
		"floor_payments_idem": "id bigserial PRIMARY KEY, amount bigint NOT NULL, currency text NOT NULL, customer text NOT NULL",
	} {
		if _, err := e.table(ctx, name, cols); err != nil {
			return err
		}
	}
	if _, err := e.claims(ctx, "floor_claims", pgtable.Options{}); err != nil {
		return err
	}
	db, err := e.pgsql()
	if err != nil {
		return err
	}
	if _, err := e.sqlClaims(ctx, db, sqltable.Postgres, sqltable.Options{Schema: e.schema, Table: "floor_sqlclaims"}); err != nil {
		return err
	}
	offsets, err := kafkapg.NewOffsets(e.pool, kafkapg.OffsetsOptions{Schema: e.schema, Table: "floor_offsets"})
	if err != nil {
		return err
	}
	if err := offsets.Migrate(ctx); err != nil {
		return err
	}
	// The batch scripts' ids and keys come from floor_seq (time-ordered,
	// as the Go rows' UUIDv7 ids); batch_offsets.sql moves the positions of
	// group "g", topic "o", one partition per pgbench client.
	if _, err := e.pool.Exec(ctx, "CREATE SEQUENCE "+pgx.Identifier{e.schema, "floor_seq"}.Sanitize()); err != nil {
		return err
	}
	_, err = e.pool.Exec(ctx, "INSERT INTO "+offsets.Table()+" (group_id, topic, partition, next_offset, updated_at) "+
		"SELECT 'g', 'o', p, 0, now() FROM generate_series(0, $1::int - 1) p", pgbenchClients)
	return err
}

var tpsLine = regexp.MustCompile(`(?m)^tps = ([0-9.]+)`)

// pgbench runs script for secs seconds on the test database, with the run's
// schema as search_path, and returns its transactions per second.
func (e *env) pgbench(ctx context.Context, script string, secs int) (float64, error) {
	u, err := url.Parse(testenv.PostgresURL())
	if err != nil {
		return 0, err
	}
	args := []string{"-n", "-M", "prepared", "-c", strconv.Itoa(pgbenchClients), "-j", strconv.Itoa(pgbenchThreads),
		"-T", strconv.Itoa(secs), "-f", script, "-h", u.Hostname()}
	if p := u.Port(); p != "" {
		args = append(args, "-p", p)
	}
	if n := u.User.Username(); n != "" {
		args = append(args, "-U", n)
	}
	args = append(args, u.Path[1:])
	cmd := exec.CommandContext(ctx, "pgbench", args...)
	cmd.Env = append(os.Environ(), "PGOPTIONS=-c search_path="+e.schema)
	if pw, ok := u.User.Password(); ok {
		cmd.Env = append(cmd.Env, "PGPASSWORD="+pw)
	}
	// pgbench connects with the URL's sslmode, as the Go paths' pool does;
	// without it libpq would take its own default (prefer), which can
	// differ from what the URL says.
	if m := u.Query().Get("sslmode"); m != "" {
		cmd.Env = append(cmd.Env, "PGSSLMODE="+m)
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		return 0, fmt.Errorf("pgbench %s: %w: %s", filepath.Base(script), err, lastLines(out, 5))
	}
	m := tpsLine.FindSubmatch(out)
	if m == nil {
		return 0, fmt.Errorf("pgbench %s: no tps in its output: %s", filepath.Base(script), lastLines(out, 5))
	}
	return strconv.ParseFloat(string(m[1]), 64)
}

func lastLines(b []byte, n int) string {
	lines := regexp.MustCompile(`\r?\n`).Split(string(b), -1)
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return fmt.Sprint(lines)
}
