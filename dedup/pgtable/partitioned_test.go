package pgtable_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/deduptest"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
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

// TestPartitionedCleanupDropsPastDays: rows of past days go with their
// partition; today's rows stay; the default partition is emptied of
// expired rows in batches.
func TestPartitionedCleanupDropsPastDays(t *testing.T) {
	pool := testenv.Pool(t, 4)
	s := newStore(t, pool, pgtable.Options{Partitioned: true, Retention: 24 * time.Hour, CleanupBatch: 3})
	ctx := deduptest.Ctx(t)
	sch := s.Options().Schema
	partitions := func() int {
		var n int
		if err := pool.QueryRow(ctx, `SELECT count(*) FROM pg_inherits i JOIN pg_class p ON p.oid = i.inhparent
			JOIN pg_namespace ns ON ns.oid = p.relnamespace WHERE ns.nspname = $1 AND p.relname = 'processed_events'`, sch).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	// Migrate made today .. today+1+2 plus the default partition.
	if got := partitions(); got != 5 {
		t.Fatalf("%d partitions after Migrate, want 5 (4 days and the default)", got)
	}
	// Two past days, as if the store had run then.
	for _, d := range []int{-2, -1} {
		day := time.Now().UTC().AddDate(0, 0, d).Format("20060102")
		from := time.Now().UTC().AddDate(0, 0, d).Format(time.DateOnly)
		to := time.Now().UTC().AddDate(0, 0, d+1).Format(time.DateOnly)
		if _, err := pool.Exec(ctx, `CREATE TABLE "`+sch+`".processed_events_p`+day+` PARTITION OF `+s.Table()+
			` FOR VALUES FROM ('`+from+`') TO ('`+to+`')`); err != nil {
			t.Fatal(err)
		}
	}
	insert := `INSERT INTO ` + s.Table() + ` (scope, id, state, created_at, expires_at, part_day)
		SELECT 's', $1 || g, 2, now(), $2::timestamptz, ($2::timestamptz AT TIME ZONE 'UTC')::date FROM generate_series(1, $3) g`
	past := time.Now().UTC().AddDate(0, 0, -1).Truncate(24 * time.Hour).Add(time.Hour)
	if _, err := pool.Exec(ctx, insert, "old-", past, 10); err != nil {
		t.Fatal(err)
	}
	// Far in the past: lands in the default partition, expired.
	if _, err := pool.Exec(ctx, insert, "ancient-", time.Now().AddDate(-1, 0, 0), 7); err != nil {
		t.Fatal(err)
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
	if n != 17 {
		t.Fatalf("Cleanup removed %d rows, want 17 (10 in dropped partitions, 7 from the default)", n)
	}
	if got := partitions(); got != 5 {
		t.Fatalf("%d partitions after Cleanup, want the 2 past ones dropped (5 left)", got)
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
}
