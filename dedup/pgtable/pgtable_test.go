package pgtable_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.uber.org/goleak"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/deduptest"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m, testenv.LeakOptions()...) }

// newStore makes a store in a fresh schema and migrates it.
func newStore(t testing.TB, pool *pgxpool.Pool, opts pgtable.Options) *pgtable.Store {
	t.Helper()
	if opts.Schema == "" {
		opts.Schema = testenv.Schema(t, pool)
	}
	s, err := pgtable.New(pool, opts)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return s
}

// whereKey selects the row of the key whose scope and id are $1 and $2.
var whereKey = " WHERE key = " + pgtable.KeySQL("$1::text", "$2::text")

func downPool(t testing.TB) *pgxpool.Pool {
	cfg, err := pgxpool.ParseConfig("postgres://postgres@" + testenv.DeadAddr(t) + "/test?sslmode=disable&connect_timeout=2")
	if err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func TestConformanceTx(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 20)
	deduptest.RunTx(t, deduptest.TxHarness[pgx.Tx]{
		New: func(t testing.TB) dedup.TxStore[pgx.Tx] { return newStore(t, pool, pgtable.Options{}) },
		Down: func(t testing.TB) dedup.TxStore[pgx.Tx] {
			s, err := pgtable.New(downPool(t), pgtable.Options{})
			if err != nil {
				t.Fatal(err)
			}
			return s
		},
		Expire: func(t testing.TB, s dedup.TxStore[pgx.Tx]) { expireAll(t, pool, s.(*pgtable.Store)) },
	})
}

// expireAll back-dates every row past its retention and runs the cleanup,
// which must then delete them.
func expireAll(t testing.TB, pool *pgxpool.Pool, s *pgtable.Store) {
	t.Helper()
	ctx := context.Background()
	tag, err := pool.Exec(ctx, "UPDATE "+s.Table()+" SET expires_at = clock_timestamp() - interval '1 second'")
	if err != nil {
		t.Fatal(err)
	}
	n, err := s.Cleanup(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if n != tag.RowsAffected() {
		t.Fatalf("cleanup deleted %d rows, %d were expired", n, tag.RowsAffected())
	}
}

func TestConformanceLease(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 20)
	deduptest.RunLease(t, deduptest.LeaseHarness{
		New: func(t testing.TB, cfg deduptest.Config) deduptest.LeaseInstance {
			s := newStore(t, pool, pgtable.Options{Lease: cfg.Lease, Retention: cfg.TTL})
			return deduptest.LeaseInstance{Store: s.Lease()}
		},
		Down: func(t testing.TB) dedup.LeaseStore {
			s, err := pgtable.New(downPool(t), pgtable.Options{})
			if err != nil {
				t.Fatal(err)
			}
			return s.Lease()
		},
	})
}

func TestOptionErrors(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 2)
	var nilPool *pgxpool.Pool
	var nilConn *pgx.Conn
	cases := []struct {
		name string
		db   pgtable.DB
		opts pgtable.Options
		want string
	}{
		{"nil pool", nilPool, pgtable.Options{}, "db is nil"},
		{"nil conn", nilConn, pgtable.Options{}, "db is nil"},
		{"nil interface", nil, pgtable.Options{}, "db is nil"},
		{"injected table", pool, pgtable.Options{Table: "events; drop table x"}, "Options.Table"},
		{"quoted schema", pool, pgtable.Options{Schema: `a"b`}, "Options.Schema"},
		{"upper case", pool, pgtable.Options{Table: "Events"}, "Options.Table"},
		{"long table", pool, pgtable.Options{Table: strings.Repeat("t", 51)}, "Options.Table"},
		{"negative retention", pool, pgtable.Options{Retention: -time.Hour}, "Options.Retention"},
		{"negative lease", pool, pgtable.Options{Lease: -time.Second}, "Options.Lease"},
		{"sub-millisecond lease", pool, pgtable.Options{Lease: time.Microsecond}, "Options.Lease"},
		{"negative batch", pool, pgtable.Options{CleanupBatch: -1}, "Options.CleanupBatch"},
		{"width without partitions", pool, pgtable.Options{PartitionWidth: time.Hour}, "Options.Partitioned"},
		{"lock timeout without partitions", pool, pgtable.Options{PartitionLockTimeout: time.Second}, "Options.Partitioned"},
		{"width of 90m", pool, pgtable.Options{Partitioned: true, PartitionWidth: 90 * time.Minute}, "Options.PartitionWidth"},
		{"width of 5h", pool, pgtable.Options{Partitioned: true, PartitionWidth: 5 * time.Hour}, "Options.PartitionWidth"},
		{"width of 2 days", pool, pgtable.Options{Partitioned: true, PartitionWidth: 48 * time.Hour}, "Options.PartitionWidth"},
		{"width of 30m", pool, pgtable.Options{Partitioned: true, PartitionWidth: 30 * time.Minute}, "Options.PartitionWidth"},
		{"negative width", pool, pgtable.Options{Partitioned: true, PartitionWidth: -time.Hour}, "Options.PartitionWidth"},
		{"negative lock timeout", pool, pgtable.Options{Partitioned: true, PartitionLockTimeout: -time.Second}, "Options.PartitionLockTimeout"},
	}
	for _, c := range cases {
		_, err := pgtable.New(c.db, c.opts)
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: New = %v, want an error naming %q", c.name, err, c.want)
		}
	}
}

func TestMigrateConcurrentAndIdempotent(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 20)
	schema := testenv.Name("idemmig") // does not exist yet: Migrate creates it
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS "`+schema+`" CASCADE`) })
	s, err := pgtable.New(pool, pgtable.Options{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	ctx := testenv.Ctx(t)
	before, err := s.MigrationStatus(ctx)
	if err != nil || len(before) != 0 {
		t.Fatalf("status before Migrate = %v, %v; want none", before, err)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 10)
	for range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- s.Migrate(ctx)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("concurrent Migrate: %v", err)
		}
	}
	if err := s.Migrate(ctx); err != nil {
		t.Fatalf("Migrate again: %v", err)
	}
	after, err := s.MigrationStatus(ctx)
	if err != nil || strings.Join(after, ",") != "0001_processed_events,0002_key_digest" {
		t.Fatalf("status = %v, %v", after, err)
	}
	sql, err := s.SQL()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(sql, `"`+schema+`"."processed_events"`) || strings.Contains(sql, "{{") {
		t.Fatalf("SQL() is not rendered for the schema:\n%s", sql)
	}
	// The printed SQL applies cleanly on its own (for goose/migrate users).
	other := testenv.Schema(t, pool)
	s2, err := pgtable.New(pool, pgtable.Options{Schema: other, Table: "events_seen"})
	if err != nil {
		t.Fatal(err)
	}
	sql2, _ := s2.SQL()
	if _, err := pool.Exec(ctx, sql2); err != nil {
		t.Fatalf("applying SQL(): %v", err)
	}
	if _, err := s2.Process(ctx, dedup.Key{Scope: "s", ID: "1"}, func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil }); err != nil {
		t.Fatalf("store on hand-applied SQL: %v", err)
	}
}

func TestCleanupBoundedBatches(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 4)
	s := newStore(t, pool, pgtable.Options{CleanupBatch: 7, KeepKeys: true})
	ctx := testenv.Ctx(t)
	keys := make([]dedup.Key, 50)
	for i := range keys {
		keys[i] = dedup.Key{Scope: "c", ID: testenv.UniqueID("k")}
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := s.ClaimBatchTx(ctx, tx, keys)
		return err
	}); err != nil {
		t.Fatal(err)
	}
	// Expire 30 of the 50.
	if _, err := pool.Exec(ctx, "UPDATE "+s.Table()+" SET expires_at = clock_timestamp() - interval '1 hour' WHERE id = ANY($1)",
		idsOf(keys[:30])); err != nil {
		t.Fatal(err)
	}
	n, err := s.Cleanup(ctx)
	if err != nil || n != 30 {
		t.Fatalf("Cleanup = %d, %v; want 30 deleted", n, err)
	}
	var left int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+s.Table()).Scan(&left); err != nil || left != 20 {
		t.Fatalf("%d rows left (%v), want 20", left, err)
	}
	// The loop stops with its context and leaves no goroutine behind
	// (goleak checks at the end of the package).
	lctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- s.CleanupLoop(lctx, 10*time.Millisecond) }()
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("CleanupLoop returned %v, want context.Canceled", err)
	}
	if err := s.CleanupLoop(ctx, 0); err == nil {
		t.Fatal("CleanupLoop with a zero interval did not fail")
	}
}

func idsOf(keys []dedup.Key) []string {
	out := make([]string, len(keys))
	for i, k := range keys {
		out[i] = k.ID
	}
	return out
}
