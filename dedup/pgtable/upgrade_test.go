package pgtable_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// keyedLayout is the first layout of the table, keyed by (scope, id) in
// text, as its 0001 migration made it (%s: the table; %s: the partition
// column's definition and primary key part, or empty; %s: the PARTITION BY
// clause, or empty).
const keyedLayout = `
CREATE TABLE %s (
    scope        text        NOT NULL,
    id           text        NOT NULL,
    fingerprint  bytea,
    state        smallint    NOT NULL,
    token        text,
    lease_until  timestamptz,
    result       bytea,
    created_at   timestamptz NOT NULL,
    completed_at timestamptz,
    expires_at   timestamptz NOT NULL,
    %s
    CHECK (state IN (1, 2))
) %s`

// keyedTable makes the first layout of the table, plain or partitioned by
// day with the partitions of the coming week, records the migrations that
// made it, and fills it through its own columns:
//
//   - done/plain: a done mark, no fingerprint, no result;
//   - done/result: a done mark with the fingerprint of "payload" and a
//     stored result;
//   - lease/held: an in-flight lease with token "tok-held", 10 minutes left;
//   - lease/expired: a lease that ran out a second ago;
//   - done/expired: a done mark past its retention.
func keyedTable(t *testing.T, pool *pgxpool.Pool, schema string, partitioned bool) {
	t.Helper()
	ctx := testenv.Ctx(t)
	tbl := `"` + schema + `".processed_events`
	versions := []string{"0001_processed_events"}
	var ddl, partCol, partVal string
	if partitioned {
		ddl = fmt.Sprintf(keyedLayout, tbl, "part_day date NOT NULL, PRIMARY KEY (scope, id, part_day),", "PARTITION BY RANGE (part_day)")
		partCol, partVal = ", part_day", ", (e AT TIME ZONE 'UTC')::date"
		versions = append(versions, "0002_no_default_partition")
	} else {
		ddl = fmt.Sprintf(keyedLayout, tbl, "PRIMARY KEY (scope, id),", "")
	}
	stmts := []string{
		ddl,
		`CREATE INDEX processed_events_expires_at_idx ON ` + tbl + ` (expires_at)`,
		`CREATE TABLE ` + tbl + `_migrations (version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT clock_timestamp())`,
	}
	for _, v := range versions {
		stmts = append(stmts, `INSERT INTO `+tbl+`_migrations (version) VALUES ('`+v+`')`)
	}
	if partitioned {
		today := time.Now().UTC().Truncate(24 * time.Hour)
		for d := -1; d < 8; d++ {
			from := today.AddDate(0, 0, d)
			stmts = append(stmts, fmt.Sprintf(`CREATE TABLE %s_p%s PARTITION OF %s FOR VALUES FROM ('%s') TO ('%s')`,
				tbl, from.Format("20060102"), tbl, from.Format(time.DateOnly), from.AddDate(0, 0, 1).Format(time.DateOnly)))
		}
	}
	stmts = append(stmts, `
INSERT INTO `+tbl+` (scope, id, fingerprint, state, token, lease_until, result, created_at, completed_at, expires_at`+partCol+`)
SELECT r.scope, r.id, r.fp, r.state, r.token, r.lease_until, r.result, now(), r.completed_at, e`+partVal+`
FROM (VALUES
    ('done', 'plain', NULL::bytea, 2::smallint, NULL, NULL::timestamptz, NULL::bytea, now(), now() + interval '3 days'),
    ('done', 'result', $1::bytea, 2, NULL, NULL, 'stored'::bytea, now(), now() + interval '3 days'),
    ('lease', 'held', NULL, 1, 'tok-held', now() + interval '10 minutes', NULL, NULL, now() + interval '10 minutes'),
    ('lease', 'expired', NULL, 1, 'tok-gone', now() - interval '1 second', NULL, NULL, now() - interval '1 second'),
    ('done', 'expired', NULL, 2, NULL, NULL, NULL, now() - interval '2 days', now() - interval '1 second')
) AS r(scope, id, fp, state, token, lease_until, result, completed_at, e)`)
	for i, stmt := range stmts {
		var args []any
		if i == len(stmts)-1 {
			args = append(args, dedup.FingerprintOf([]byte("payload")).Bytes())
		}
		if _, err := pool.Exec(ctx, stmt, args...); err != nil {
			t.Fatalf("%s: %v", stmt, err)
		}
	}
}

// TestMigrateConvertsKeyedTable: a table of the first layout, keyed by
// (scope, id), keeps its marks through Migrate: done marks answer as
// duplicates (with their stored result and fingerprint), the lease stays
// held by its token, expired rows count as absent, and scope and id are
// kept only with Options.KeepKeys.
func TestMigrateConvertsKeyedTable(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 4)
	for _, partitioned := range []bool{false, true} {
		for _, keep := range []bool{false, true} {
			t.Run(fmt.Sprintf("partitioned=%v/keep_keys=%v", partitioned, keep), func(t *testing.T) {
				schema := testenv.Schema(t, pool)
				keyedTable(t, pool, schema, partitioned)
				s := newStore(t, pool, pgtable.Options{Schema: schema, Partitioned: partitioned, Retention: 24 * time.Hour, KeepKeys: keep})
				checkConverted(t, pool, s, partitioned, keep)
			})
		}
	}
}

func checkConverted(t *testing.T, pool *pgxpool.Pool, s *pgtable.Store, partitioned, keep bool) {
	ctx := testenv.Ctx(t)
	want := "0001_processed_events,0002_key_digest"
	if partitioned {
		want = "0001_processed_events,0002_no_default_partition,0003_key_digest"
	}
	if st, err := s.MigrationStatus(ctx); err != nil || strings.Join(st, ",") != want {
		t.Fatalf("migration status %v, %v; want %s", st, err, want)
	}
	var cols string
	if err := pool.QueryRow(ctx, `SELECT string_agg(attname, ',' ORDER BY attname) FROM pg_attribute
		WHERE attrelid = $1::regclass AND attnum > 0 AND NOT attisdropped`, s.Table()).Scan(&cols); err != nil {
		t.Fatal(err)
	}
	wantCols := "expires_at,fingerprint,id,key,result,scope,token"
	if partitioned {
		wantCols = "expires_at,fingerprint,id,key,part_day,result,scope,token"
	}
	if cols != wantCols {
		t.Errorf("columns after Migrate: %s, want %s", cols, wantCols)
	}
	var rows, kept int
	if err := pool.QueryRow(ctx, "SELECT count(*), count(scope) + count(id) FROM "+s.Table()).Scan(&rows, &kept); err != nil {
		t.Fatal(err)
	}
	if wantKept := map[bool]int{false: 0, true: 2 * rows}[keep]; rows != 5 || kept != wantKept {
		t.Errorf("%d rows with %d scopes and ids after Migrate, want 5 rows with %d", rows, kept, wantKept)
	}

	none := func(context.Context, pgx.Tx) ([]byte, error) { t.Error("fn ran for a converted mark"); return nil, nil }
	// Done marks are duplicates, with their stored result.
	if _, err := s.Process(ctx, dedup.Key{Scope: "done", ID: "plain"}, none); !errors.Is(err, dedup.ErrDuplicate) {
		t.Errorf("done/plain after Migrate: %v, want ErrDuplicate", err)
	}
	_, err := s.Process(ctx, dedup.NewKey("done", "result", []byte("payload")), none)
	if res, ok := dedup.StoredResult(err); !ok || string(res) != "stored" {
		t.Errorf("done/result after Migrate: %v (%q), want ErrDuplicate with the stored result", err, res)
	}
	// Its fingerprint is the one it was claimed with.
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return s.ClaimTx(ctx, tx, dedup.NewKey("done", "result", []byte("other")))
	}); !errors.Is(err, dedup.ErrFingerprintMismatch) {
		t.Errorf("done/result with another fingerprint after Migrate: %v, want ErrFingerprintMismatch", err)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return s.ClaimTx(ctx, tx, dedup.NewKey("done", "result", []byte("payload")))
	}); !errors.Is(err, dedup.ErrDuplicate) {
		t.Errorf("done/result with its fingerprint after Migrate: %v, want ErrDuplicate", err)
	}

	// The lease is still held: others see it in flight, its owner's token
	// still extends and completes it.
	lease := s.Lease()
	if _, err := lease.Claim(ctx, dedup.Key{Scope: "lease", ID: "held"}); !errors.Is(err, dedup.ErrInFlight) {
		t.Errorf("lease/held after Migrate: %v, want ErrInFlight", err)
	} else if ce := (*dedup.ClaimError)(nil); !errors.As(err, &ce) || ce.RetryAfter < 9*time.Minute || ce.RetryAfter > 10*time.Minute {
		t.Errorf("lease/held after Migrate: %v, want about 10 minutes left", err)
	}
	held := &dedup.Lease{Key: dedup.Key{Scope: "lease", ID: "held"}, Token: "tok-held"}
	if err := lease.Extend(ctx, &dedup.Lease{Key: held.Key, Token: "tok-gone"}); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Errorf("extending lease/held with another token: %v, want ErrLeaseLost", err)
	}
	if err := lease.Extend(ctx, held); err != nil {
		t.Errorf("extending lease/held with its token after Migrate: %v", err)
	}
	if err := lease.Complete(ctx, held, []byte("late")); err != nil {
		t.Errorf("completing lease/held with its token after Migrate: %v", err)
	}
	_, err = s.Process(ctx, held.Key, none)
	if res, ok := dedup.StoredResult(err); !ok || string(res) != "late" {
		t.Errorf("lease/held once completed: %v (%q), want ErrDuplicate with its result", err, res)
	}

	// Expired rows count as absent.
	for _, k := range []dedup.Key{{Scope: "lease", ID: "expired"}, {Scope: "done", ID: "expired"}} {
		ran := false
		if _, err := s.Process(ctx, k, func(context.Context, pgx.Tx) ([]byte, error) { ran = true; return nil, nil }); err != nil || !ran {
			t.Errorf("%s/%s after Migrate: %v, ran %v; want it to run", k.Scope, k.ID, err, ran)
		}
	}
	// New keys are claimed in the converted table.
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return s.ClaimTx(ctx, tx, dedup.Key{Scope: "new", ID: "1"})
	}); err != nil {
		t.Errorf("a new key after Migrate: %v", err)
	}
	if err := s.Migrate(ctx); err != nil {
		t.Errorf("Migrate again: %v", err)
	}
}

// TestMigrateConvertsKeyedTableOrderedKeys: converted with
// Options.TimeOrderedKeys, a mark of the first layout whose id is a UUID of
// version 7 gets the time-ordered row key, and answers as a duplicate.
func TestMigrateConvertsKeyedTableOrderedKeys(t *testing.T) {
	pool := testenv.Pool(t, 4)
	for _, partitioned := range []bool{false, true} {
		t.Run(fmt.Sprintf("partitioned=%v", partitioned), func(t *testing.T) {
			schema := testenv.Schema(t, pool)
			keyedTable(t, pool, schema, partitioned)
			ctx := testenv.Ctx(t)
			id := v7(1_700_000_000_000, 3)
			partCol, partVal := "", ""
			if partitioned {
				partCol, partVal = ", part_day", ", ((now() + interval '3 days') AT TIME ZONE 'UTC')::date"
			}
			if _, err := pool.Exec(ctx, `INSERT INTO "`+schema+`".processed_events
				(scope, id, state, created_at, completed_at, expires_at`+partCol+`)
				VALUES ('done', $1, 2, now(), now(), now() + interval '3 days'`+partVal+`)`, id); err != nil {
				t.Fatal(err)
			}
			s := newStore(t, pool, pgtable.Options{Schema: schema, Partitioned: partitioned, Retention: 24 * time.Hour, TimeOrderedKeys: true})
			k := dedup.Key{Scope: "done", ID: id}
			var n int
			if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+s.Table()+" WHERE key = $1::uuid", pgtable.RowKey(s, k)).Scan(&n); err != nil || n != 1 {
				t.Fatalf("rows keyed %s after Migrate: %d (%v), want 1", pgtable.RowKey(s, k), n, err)
			}
			if err := s.Lookup(ctx, k); !errors.Is(err, dedup.ErrDuplicate) {
				t.Fatalf("Lookup of the converted mark = %v, want ErrDuplicate", err)
			}
			if _, err := s.Process(ctx, dedup.Key{Scope: "done", ID: "plain"},
				func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil }); !errors.Is(err, dedup.ErrDuplicate) {
				t.Fatalf("done/plain after Migrate: %v, want ErrDuplicate", err)
			}
		})
	}
}
