package pgtable_test

import (
	"encoding/json"
	"slices"
	"testing"
	"time"

	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// planNode is the part of EXPLAIN (FORMAT JSON) output the tests read.
type planNode struct {
	NodeType  string     `json:"Node Type"`
	Relation  string     `json:"Relation Name"`
	IndexName string     `json:"Index Name"`
	Plans     []planNode `json:"Plans"`
}

func (n planNode) walk(f func(planNode)) {
	f(n)
	for _, c := range n.Plans {
		c.walk(f)
	}
}

// TestCleanupUsesExpiresAtIndex: on a table whose expired rows are scattered
// among live ones, one cleanup batch reads the expires_at index, not the
// whole table (planner settings left at their defaults, statistics fresh).
func TestCleanupUsesExpiresAtIndex(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 2)
	s := newStore(t, pool, pgtable.Options{})
	ctx := testenv.Ctx(t)
	// 50,000 rows, expiring from a day ago to a day ahead in random order.
	if _, err := pool.Exec(ctx, `INSERT INTO `+s.Table()+` (key, fingerprint, expires_at)
		SELECT `+pgtable.KeySQL("'plan'", "'id-' || g")+`, '\x00', now() + (random() * 2 - 1) * interval '1 day'
		FROM generate_series(1, 50000) g`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "ANALYZE "+s.Table()); err != nil {
		t.Fatal(err)
	}
	stmt, args := pgtable.CleanupStatement(s, time.Now())
	var out []byte
	if err := pool.QueryRow(ctx, "EXPLAIN (FORMAT JSON) "+stmt, args...).Scan(&out); err != nil {
		t.Fatal(err)
	}
	var plans []struct {
		Plan planNode `json:"Plan"`
	}
	if err := json.Unmarshal(out, &plans); err != nil || len(plans) != 1 {
		t.Fatalf("EXPLAIN output %s: %v", out, err)
	}
	var nodes, indexes []string
	plans[0].Plan.walk(func(n planNode) {
		nodes = append(nodes, n.NodeType)
		if n.IndexName != "" {
			indexes = append(indexes, n.IndexName)
		}
		if n.NodeType == "Seq Scan" {
			t.Errorf("cleanup batch scans %s sequentially", n.Relation)
		}
	})
	if !slices.Contains(indexes, "processed_events_expires_at_idx") {
		t.Errorf("cleanup batch does not read processed_events_expires_at_idx; plan nodes %v, indexes %v\n%s", nodes, indexes, out)
	}
}

// TestCleanupDeletesExpiredOnly: expired rows go, in several batches, and
// every live row stays, with expired and live rows interleaved.
func TestCleanupDeletesExpiredOnly(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 2)
	s := newStore(t, pool, pgtable.Options{CleanupBatch: 64, KeepKeys: true})
	ctx := testenv.Ctx(t)
	// Even ids expired (up to an hour ago), odd ids live (from a minute
	// to an hour ahead).
	if _, err := pool.Exec(ctx, `INSERT INTO `+s.Table()+` (key, scope, id, expires_at)
		SELECT `+pgtable.KeySQL("'mix'", "g::text")+`, 'mix', g::text, CASE WHEN g % 2 = 0
			THEN clock_timestamp() - interval '1 second' - random() * interval '1 hour'
			ELSE clock_timestamp() + interval '1 minute' + random() * interval '1 hour' END
		FROM generate_series(1, 1000) g`); err != nil {
		t.Fatal(err)
	}
	n, err := s.Cleanup(ctx)
	if err != nil || n != 500 {
		t.Fatalf("Cleanup = %d, %v; want the 500 expired rows", n, err)
	}
	var live, odd int
	if err := pool.QueryRow(ctx, "SELECT count(*), count(*) FILTER (WHERE id::int % 2 = 1) FROM "+s.Table()).Scan(&live, &odd); err != nil {
		t.Fatal(err)
	}
	if live != 500 || odd != 500 {
		t.Fatalf("%d rows left, %d of them live; want the 500 live rows", live, odd)
	}
	if n, err := s.Cleanup(ctx); err != nil || n != 0 {
		t.Fatalf("second Cleanup = %d, %v; want nothing left to delete", n, err)
	}
}
