package pgtable_test

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/deduptest"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testenv"
)

func TestConformancePartitionedTx(t *testing.T) {
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
	if _, err := pool.Exec(ctx, `INSERT INTO `+s.Table()+` (scope, id, state, created_at, expires_at, `+col+`)
		SELECT 's', 'old-' || g, 2, e, e, `+key+` FROM generate_series(1, $2) g, (SELECT $1::timestamptz AS e) x`,
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
	pool := testenv.Pool(t, 4)
	s := newStore(t, pool, pgtable.Options{Partitioned: true, Retention: 24 * time.Hour})
	ctx := deduptest.Ctx(t)
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
