package pgtable_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/deduptest"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

func TestConformancePartitionedTx(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 20)
	deduptest.RunTx(t, deduptest.TxHarness[pgx.Tx]{
		New: func(t testing.TB) dedup.TxStore[pgx.Tx] {
			return newStore(t, pool, pgtable.Options{Partitioned: true, Retention: 48 * time.Hour})
		},
		Down: func(t testing.TB) dedup.TxStore[pgx.Tx] {
			s, err := pgtable.New(downPool(t), pgtable.Options{Partitioned: true})
			if err != nil {
				t.Fatal(err)
			}
			return s
		},
		// Expired rows in today's partition are not deleted until the
		// day is over; claims treat them as gone.
		Expire: func(t testing.TB, s dedup.TxStore[pgx.Tx]) {
			if _, err := pool.Exec(context.Background(), "UPDATE "+s.(*pgtable.Store).Table()+
				" SET expires_at = clock_timestamp() - interval '1 second'"); err != nil {
				t.Fatal(err)
			}
		},
	})
}

func TestConformancePartitionedLease(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 20)
	deduptest.RunLease(t, deduptest.LeaseHarness{
		New: func(t testing.TB, cfg deduptest.Config) deduptest.LeaseInstance {
			s := newStore(t, pool, pgtable.Options{Partitioned: true, Lease: cfg.Lease, Retention: cfg.TTL})
			return deduptest.LeaseInstance{Store: s.Lease()}
		},
		Down: func(t testing.TB) dedup.LeaseStore {
			s, err := pgtable.New(downPool(t), pgtable.Options{Partitioned: true})
			if err != nil {
				t.Fatal(err)
			}
			return s.Lease()
		},
	})
}

// partitionNames lists the partitions of s's table, sorted.
func partitionNames(t testing.TB, pool *pgxpool.Pool, s *pgtable.Store) []string {
	t.Helper()
	rows, err := pool.Query(context.Background(), `SELECT c.relname FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
		WHERE i.inhparent = $1::regclass ORDER BY 1`, s.Table())
	if err != nil {
		t.Fatal(err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return names
}

// addPastPartition attaches the partition [from, to) to s's table, as if
// the store had run then, with n expired rows in it, and analyzes it.
func addPastPartition(t testing.TB, pool *pgxpool.Pool, s *pgtable.Store, suffix, from, to string, n int) {
	t.Helper()
	ctx := context.Background()
	o := s.Options()
	col, key := "part_day", "(e AT TIME ZONE 'UTC')::date"
	if o.PartitionWidth < 24*time.Hour {
		col, key = "part_hour", "date_trunc('hour', e AT TIME ZONE 'UTC')"
	}
	part := `"` + o.Schema + `"."` + o.Table + `_p` + suffix + `"`
	if _, err := pool.Exec(ctx, `CREATE TABLE `+part+` PARTITION OF `+s.Table()+` FOR VALUES FROM ('`+from+`') TO ('`+to+`')`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `INSERT INTO `+s.Table()+` (key, scope, id, expires_at, `+col+`)
		SELECT `+pgtable.KeySQL("'s'", "'old-' || g")+`, 's', 'old-' || g, e, `+key+` FROM generate_series(1, $2) g, (SELECT $1::timestamptz AS e) x`,
		from+"Z", n); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "ANALYZE "+part); err != nil {
		t.Fatal(err)
	}
}

// TestPartitionedCleanupDropsPastDays: the partitions of past days go with
// their rows; the current partitions and their rows stay.
func TestPartitionedCleanupDropsPastDays(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 4)
	s := newStore(t, pool, pgtable.Options{Partitioned: true, Retention: 24 * time.Hour})
	ctx := testenv.Ctx(t)
	// Migrate made today .. today+3: the retention and a margin of two
	// days.
	today := time.Now().UTC()
	var want []string
	for d := range 4 {
		want = append(want, "processed_events_p"+today.AddDate(0, 0, d).Format("20060102"))
	}
	if got := partitionNames(t, pool, s); !slices.Equal(got, want) {
		t.Fatalf("partitions after Migrate %v, want %v", got, want)
	}
	for _, d := range []int{-2, -1} {
		day := today.AddDate(0, 0, d)
		addPastPartition(t, pool, s, day.Format("20060102"), day.Format(time.DateOnly), day.AddDate(0, 0, 1).Format(time.DateOnly), 5)
	}
	// Live rows of today's claims.
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := s.ClaimBatchTx(ctx, tx, []dedup.Key{{Scope: "s", ID: "live-1"}, {Scope: "s", ID: "live-2"}})
		return err
	}); err != nil {
		t.Fatal(err)
	}
	n, err := s.Cleanup(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n != 10 {
		t.Fatalf("Cleanup removed %d rows, want the 10 of the two dropped partitions", n)
	}
	if got := partitionNames(t, pool, s); !slices.Equal(got, want) {
		t.Fatalf("partitions after Cleanup %v, want %v", got, want)
	}
	var left int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+s.Table()).Scan(&left); err != nil || left != 2 {
		t.Fatalf("%d rows left (%v), want the 2 live ones", left, err)
	}
	// The live keys are still duplicates.
	if _, err := s.Process(ctx, dedup.Key{Scope: "s", ID: "live-1"}, func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil }); !errors.Is(err, dedup.ErrDuplicate) {
		t.Fatalf("live key after cleanup: %v, want ErrDuplicate", err)
	}
	if err := s.EnsurePartitions(ctx); err != nil {
		t.Fatalf("EnsurePartitions again: %v", err)
	}
	if n, err := s.Cleanup(ctx); err != nil || n != 0 {
		t.Fatalf("Cleanup again = %d, %v; want nothing to drop", n, err)
	}
}

func TestConformancePartitionedHourlyTx(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 20)
	deduptest.RunTx(t, deduptest.TxHarness[pgx.Tx]{
		New: func(t testing.TB) dedup.TxStore[pgx.Tx] {
			return newStore(t, pool, pgtable.Options{Partitioned: true, PartitionWidth: time.Hour, Retention: 3 * time.Hour})
		},
		Down: func(t testing.TB) dedup.TxStore[pgx.Tx] {
			s, err := pgtable.New(downPool(t), pgtable.Options{Partitioned: true, PartitionWidth: time.Hour})
			if err != nil {
				t.Fatal(err)
			}
			return s
		},
		Expire: func(t testing.TB, s dedup.TxStore[pgx.Tx]) {
			if _, err := pool.Exec(context.Background(), "UPDATE "+s.(*pgtable.Store).Table()+
				" SET expires_at = clock_timestamp() - interval '1 second'"); err != nil {
				t.Fatal(err)
			}
		},
	})
}

// TestPartitionedHourly: with hourly partitions, Migrate makes the
// partitions from the current hour to the retention horizon plus the
// margin, claims land in the hour of their expiry, and Cleanup drops the
// partitions of past hours only.
func TestPartitionedHourly(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 4)
	ctx := testenv.Ctx(t)
	dbHour := func() time.Time {
		var now time.Time
		if err := pool.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&now); err != nil {
			t.Fatal(err)
		}
		return now.UTC().Truncate(time.Hour)
	}
	// The current hour, 3 hours of retention and 6 of margin: from the
	// hour Migrate ran in, which is one of these two.
	wantFrom := func(hour time.Time) (want []string) {
		for h := range 10 {
			want = append(want, "processed_events_p"+hour.Add(time.Duration(h)*time.Hour).Format("2006010215"))
		}
		return want
	}
	before := dbHour()
	s := newStore(t, pool, pgtable.Options{Partitioned: true, PartitionWidth: time.Hour, Retention: 3 * time.Hour})
	hour := dbHour()
	want := wantFrom(hour)
	if got := partitionNames(t, pool, s); !slices.Equal(got, want) {
		if want = wantFrom(before); !slices.Equal(got, want) {
			t.Fatalf("partitions after Migrate %v, want %v", got, wantFrom(hour))
		}
	}
	for _, h := range []int{-2, -1} {
		from := hour.Add(time.Duration(h) * time.Hour)
		addPastPartition(t, pool, s, from.Format("2006010215"), from.Format(time.DateTime), from.Add(time.Hour).Format(time.DateTime), 4)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return s.ClaimTx(ctx, tx, dedup.Key{Scope: "s", ID: "live"})
	}); err != nil {
		t.Fatal(err)
	}
	var (
		part    string
		expires time.Time
	)
	if err := pool.QueryRow(ctx, "SELECT tableoid::regclass::text, expires_at FROM "+s.Table()+whereKey, "s", "live").Scan(&part, &expires); err != nil {
		t.Fatal(err)
	}
	if wantPart := "processed_events_p" + expires.UTC().Format("2006010215"); !strings.HasSuffix(part, wantPart) {
		t.Fatalf("a claim expiring at %v is in %s, want %s", expires, part, wantPart)
	}
	if n, err := s.Cleanup(ctx); err != nil || n != 8 {
		t.Fatalf("Cleanup = %d, %v; want the 8 rows of the two past hours", n, err)
	}
	if got := partitionNames(t, pool, s); !slices.Equal(got, want) {
		t.Fatalf("partitions after Cleanup %v, want %v", got, want)
	}
	if _, err := s.Process(ctx, dedup.Key{Scope: "s", ID: "live"}, func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil }); !errors.Is(err, dedup.ErrDuplicate) {
		t.Fatalf("live key after cleanup: %v, want ErrDuplicate", err)
	}
}

// TestPartitionWidthIsPartOfTheLayout: a table made with daily partitions
// refuses hourly ones, with a message that says why.
func TestPartitionWidthIsPartOfTheLayout(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 4)
	daily := newStore(t, pool, pgtable.Options{Partitioned: true})
	hourly, err := pgtable.New(pool, pgtable.Options{Schema: daily.Options().Schema, Partitioned: true, PartitionWidth: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	ctx := testenv.Ctx(t)
	for name, f := range map[string]func(context.Context) error{"Migrate": hourly.Migrate, "EnsurePartitions": hourly.EnsurePartitions} {
		if err := f(ctx); err == nil || !strings.Contains(err.Error(), "partitioned by part_day") {
			t.Errorf("%s of an hourly store on a daily table = %v, want an error naming part_day", name, err)
		}
	}
}

// TestMigrateFoldsDefaultPartition: a partitioned table with a default
// partition (the layout's first form) loses it on Migrate; the default
// partition's live rows keep answering as duplicates, its expired rows go.
func TestMigrateFoldsDefaultPartition(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 4)
	schema := testenv.Schema(t, pool)
	ctx := testenv.Ctx(t)
	tbl := `"` + schema + `".processed_events`
	if _, err := pool.Exec(ctx, `
CREATE TABLE `+tbl+` (
    scope text NOT NULL, id text NOT NULL, fingerprint bytea, state smallint NOT NULL, token text,
    lease_until timestamptz, result bytea, created_at timestamptz NOT NULL, completed_at timestamptz,
    expires_at timestamptz NOT NULL, part_day date NOT NULL,
    PRIMARY KEY (scope, id, part_day), CHECK (state IN (1, 2))
) PARTITION BY RANGE (part_day);
CREATE TABLE `+tbl+`_pdefault PARTITION OF `+tbl+` DEFAULT;
CREATE INDEX processed_events_expires_at_idx ON `+tbl+` (expires_at);
CREATE TABLE `+tbl+`_migrations (version text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT clock_timestamp());
INSERT INTO `+tbl+`_migrations (version) VALUES ('0001_processed_events');
INSERT INTO `+tbl+` (scope, id, state, created_at, expires_at, part_day)
SELECT 's', 'live-' || g, 2, now(), e, (e AT TIME ZONE 'UTC')::date
FROM generate_series(1, 3) g, LATERAL (SELECT now() + g * interval '1 day' AS e) x;
INSERT INTO `+tbl+` (scope, id, state, created_at, expires_at, part_day)
SELECT 's', 'old-' || g, 2, now(), now() - interval '1 year', ((now() - interval '1 year') AT TIME ZONE 'UTC')::date
FROM generate_series(1, 4) g`); err != nil {
		t.Fatal(err)
	}
	s := newStore(t, pool, pgtable.Options{Schema: schema, Partitioned: true, Retention: 24 * time.Hour, KeepKeys: true})
	if got := partitionNames(t, pool, s); slices.Contains(got, "processed_events_pdefault") {
		t.Fatalf("partitions after Migrate %v still hold the default partition", got)
	}
	var ids []string
	rows, err := pool.Query(ctx, "SELECT id FROM "+s.Table()+" ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	if ids, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil || strings.Join(ids, ",") != "live-1,live-2,live-3" {
		t.Fatalf("rows after Migrate %v (%v), want the three live ones", ids, err)
	}
	for _, id := range ids {
		if _, err := s.Process(ctx, dedup.Key{Scope: "s", ID: id}, func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil }); !errors.Is(err, dedup.ErrDuplicate) {
			t.Fatalf("key %s after Migrate: %v, want ErrDuplicate", id, err)
		}
	}
	if st, err := s.MigrationStatus(ctx); err != nil || len(st) != 3 {
		t.Fatalf("migration status %v, %v; want three versions", st, err)
	}
}

// TestPartitionedClaimWithoutPartition: a claim whose expiry no partition
// covers fails, and says what to run.
func TestPartitionedClaimWithoutPartition(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 4)
	s := newStore(t, pool, pgtable.Options{Partitioned: true, PartitionWidth: time.Hour, Retention: time.Hour})
	ctx := testenv.Ctx(t)
	for _, p := range partitionNames(t, pool, s) {
		if _, err := pool.Exec(ctx, `DROP TABLE "`+s.Options().Schema+`".`+p); err != nil {
			t.Fatal(err)
		}
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return s.ClaimTx(ctx, tx, dedup.Key{Scope: "s", ID: "1"}) })
	if err == nil || !strings.Contains(err.Error(), "EnsurePartitions") {
		t.Fatalf("claim without a partition = %v, want an error naming EnsurePartitions", err)
	}
	_, err = s.Process(ctx, dedup.Key{Scope: "s", ID: "2"}, func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil })
	if err == nil || !strings.Contains(err.Error(), "EnsurePartitions") {
		t.Fatalf("Process without a partition = %v, want an error naming EnsurePartitions", err)
	}
	if err := s.EnsurePartitions(ctx); err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return s.ClaimTx(ctx, tx, dedup.Key{Scope: "s", ID: "1"}) }); err != nil {
		t.Fatalf("claim after EnsurePartitions: %v", err)
	}
}
