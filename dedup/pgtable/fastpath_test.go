package pgtable_test

import (
	"context"
	"errors"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestProcessHostileKeys: keys that would break naive SQL quoting go through
// Process and come back unchanged, on a pool and on a single conn.
func TestProcessHostileKeys(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 4)
	schema := testenv.Schema(t, pool)
	ctx := testenv.Ctx(t)
	conn, err := pgx.Connect(ctx, testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = conn.Close(context.Background()) }()
	hostile := []string{
		`'); DROP TABLE processed_events; --`,
		`it's`, `''`, `\`, `\'`, `$$`, `$1`, `E'\x41'`, `ключ'ы`, `{braces}:colons`, "tab-free 'quote' \\\\ end",
	}
	for _, db := range []pgtable.DB{pool, conn} {
		s, err := pgtable.New(db, pgtable.Options{Schema: schema, Table: testenv.Name("pe"), KeepKeys: true})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		for _, id := range hostile {
			key := dedup.NewKey("scope'x", id, []byte(id))
			ran := 0
			fn := func(context.Context, pgx.Tx) ([]byte, error) { ran++; return []byte("r:" + id), nil }
			if _, err := s.Process(ctx, key, fn); err != nil {
				t.Fatalf("id %q: %v", id, err)
			}
			_, err := s.Process(ctx, key, fn)
			if res, ok := dedup.StoredResult(err); !ok || string(res) != "r:"+id || ran != 1 {
				t.Fatalf("id %q: second Process = %v (%q), ran %d", id, err, res, ran)
			}
			var got string
			if err := pool.QueryRow(ctx, "SELECT id FROM "+s.Table()+whereKey+" AND scope = $1 AND id = $2", key.Scope, id).Scan(&got); err != nil || got != id {
				t.Fatalf("id %q stored as %q (%v)", id, got, err)
			}
		}
		var n int
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+s.Table()).Scan(&n); err != nil || n != len(hostile) {
			t.Fatalf("%d rows (%v), want %d", n, err, len(hostile))
		}
	}
}

// TestProcessExpiredRowIsReclaimed: a row past its retention that cleanup has
// not deleted yet does not block a new claim (Process deletes it before its
// insert).
func TestProcessExpiredRowIsReclaimed(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 4)
	s := newStore(t, pool, pgtable.Options{})
	ctx := testenv.Ctx(t)
	key := dedup.NewKey("s", "old", []byte("x"))
	noop := func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil }
	if _, err := s.Process(ctx, key, noop); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "UPDATE "+s.Table()+" SET expires_at = clock_timestamp() - interval '1 second'"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Process(ctx, key, noop); err != nil {
		t.Fatalf("Process of an expired key = %v, want it to run", err)
	}
	if _, err := s.Process(ctx, key, noop); !errors.Is(err, dedup.ErrDuplicate) {
		t.Fatalf("then = %v, want ErrDuplicate", err)
	}
	// The pool's connections survived the conflicts: nothing was destroyed
	// for a duplicate.
	st := pool.Stat()
	if st.TotalConns() == 0 {
		t.Fatal("pool has no connections")
	}
}

// TestProcessInsideTx: a store built on a pgx.Tx runs Process in a savepoint.
func TestProcessInsideTx(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 4)
	base := newStore(t, pool, pgtable.Options{})
	ctx := testenv.Ctx(t)
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	s, err := pgtable.New(tx, pgtable.Options{Schema: base.Options().Schema})
	if err != nil {
		t.Fatal(err)
	}
	key := dedup.Key{Scope: "s", ID: "in-tx"}
	if _, err := s.Process(ctx, key, func(context.Context, pgx.Tx) ([]byte, error) { return nil, errors.New("fail") }); err == nil {
		t.Fatal("want the fn error")
	}
	if _, err := s.Process(ctx, key, func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil }); err != nil {
		t.Fatalf("after the savepoint rolled back: %v", err)
	}
	if _, err := s.Process(ctx, key, func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil }); !errors.Is(err, dedup.ErrDuplicate) {
		t.Fatalf("third = %v, want ErrDuplicate", err)
	}
}
