package pgtable_test

import (
	"strconv"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// maxRowBytes bounds the bytes a consumer's claim (a done mark without
// result or fingerprint) takes in a plain table, indexes included.
const maxRowBytes = 150

// TestRowSize claims 100,000 keys through ClaimBatchTx into a fresh table
// and checks the table's total size (heap, indexes, free space and
// visibility maps) per row. It logs the heap and index bytes and the WAL
// written per claim, batched and one transaction per claim (other sessions
// of the server write WAL too, so these are upper bounds).
func TestRowSize(t *testing.T) {
	t.Parallel()
	const rows, batch = 100_000, 1000
	pool := testenv.Pool(t, 2)
	s := newStore(t, pool, pgtable.Options{})
	ctx := testenv.Ctx(t)
	walBytes := func() int64 {
		var lsn string
		if err := pool.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&lsn); err != nil {
			t.Fatal(err)
		}
		var n int64
		if err := pool.QueryRow(ctx, "SELECT pg_wal_lsn_diff($1::pg_lsn, '0/0')::bigint", lsn).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	keys := make([]dedup.Key, batch)
	wal0 := walBytes()
	for b := range rows / batch {
		for i := range keys {
			keys[i] = dedup.Key{Scope: "orders/charge", ID: "order-" + strconv.Itoa(b*batch+i) + "-" + testenv.UniqueID("")}
		}
		var errs []error
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			var err error
			errs, err = s.ClaimBatchTx(ctx, tx, keys)
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
		for i, err := range errs {
			if err != nil {
				t.Fatalf("claim of %s: %v", keys[i], err)
			}
		}
	}
	walBatched := walBytes() - wal0
	if _, err := pool.Exec(ctx, "VACUUM ANALYZE "+s.Table()); err != nil {
		t.Fatal(err)
	}
	var n, total, heap, indexes int64
	if err := pool.QueryRow(ctx, "SELECT count(*), pg_total_relation_size($1::regclass), pg_relation_size($1::regclass), pg_indexes_size($1::regclass) FROM "+s.Table(),
		s.Table()).Scan(&n, &total, &heap, &indexes); err != nil {
		t.Fatal(err)
	}
	if n != rows {
		t.Fatalf("%d rows, want %d", n, rows)
	}
	per := float64(total) / rows
	t.Logf("%d rows: %.1f bytes per row (heap %.1f, indexes %.1f, maps %.1f); WAL %.1f bytes per claim in batches of %d",
		rows, per, float64(heap)/rows, float64(indexes)/rows, float64(total-heap-indexes)/rows, float64(walBatched)/rows, batch)
	if per > maxRowBytes {
		t.Errorf("a claimed key takes %.1f bytes with its indexes, want at most %d", per, maxRowBytes)
	}

	// One transaction per claim, as a consumer without batches runs.
	const single = 2000
	wal0 = walBytes()
	for i := range single {
		key := dedup.Key{Scope: "orders/charge", ID: "single-" + strconv.Itoa(i)}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return s.ClaimTx(ctx, tx, key) }); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("WAL %.1f bytes per claim, one transaction per claim", float64(walBytes()-wal0)/single)
}
