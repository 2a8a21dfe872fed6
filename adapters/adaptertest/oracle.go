package adaptertest

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// scope is the claims' scope in every case.
const scope = "adaptertest/effects"

// effectsDDL is the oracle table: no unique constraint, so a message
// applied twice is two rows; seq is the commit order of the rows.
const effectsDDL = ` (seq bigserial, id text NOT NULL, key text NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`

// oracle is one case's schema: the pgtable claims and the effects table,
// and what the handler saw in this process.
type oracle struct {
	pool   *pgxpool.Pool // the test's own connections, never cut
	schema string
	store  *pgtable.Store

	mu       sync.Mutex
	runs     map[string]int                // effect calls per id
	outcomes map[string][]consumer.Outcome // claim reports per id
	fail     map[string]func(run int) error
	// hook, if set, runs in the effect after the row is written.
	hook func(msg *consumer.Message)
	// afterCommit, if set, runs after a claim committed.
	afterCommit func(msg *consumer.Message)
}

// newOracle makes a schema with the claims table and the effects table. The
// store claims through claims when it is not nil (the StoreDown case
// points it at a proxy), else through the test's pool.
func newOracle(t testing.TB, claims *pgxpool.Pool) *oracle {
	t.Helper()
	pool := testenv.Pool(t, 8)
	schema := testenv.Schema(t, pool)
	o, err := openOracle(context.Background(), pool, schema)
	if err != nil {
		t.Fatal(err)
	}
	if err := o.store.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(context.Background(), "CREATE TABLE "+o.table()+effectsDDL); err != nil {
		t.Fatal(err)
	}
	if claims != nil {
		o.store, err = pgtable.New(claims, pgtable.Options{Schema: schema})
		if err != nil {
			t.Fatal(err)
		}
	}
	return o
}

func openOracle(_ context.Context, pool *pgxpool.Pool, schema string) (*oracle, error) {
	store, err := pgtable.New(pool, pgtable.Options{Schema: schema})
	if err != nil {
		return nil, err
	}
	return &oracle{pool: pool, schema: schema, store: store, runs: map[string]int{},
		outcomes: map[string][]consumer.Outcome{}, fail: map[string]func(int) error{}}, nil
}

func (o *oracle) table() string { return pgx.Identifier{o.schema, "effects"}.Sanitize() }

// failWith makes the effect of id return f(run) before it writes, run being
// the 1-based effect call for id.
func (o *oracle) failWith(id string, f func(run int) error) {
	o.mu.Lock()
	o.fail[id] = f
	o.mu.Unlock()
}

// effect is the suite's TxHandler: it checks the payload is JSON (a
// malformed one is a permanent error), writes the row, then runs hook.
func (o *oracle) effect(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
	o.mu.Lock()
	o.runs[msg.ID]++
	run := o.runs[msg.ID]
	f := o.fail[msg.ID]
	o.mu.Unlock()
	if f != nil {
		if err := f(run); err != nil {
			return err
		}
	}
	if !json.Valid(msg.Payload) {
		return consumer.Permanent(fmt.Errorf("adaptertest: malformed payload %q", short(string(msg.Payload))))
	}
	if _, err := tx.Exec(ctx, "INSERT INTO "+o.table()+" (id, key) VALUES ($1, $2)", msg.ID, string(msg.Key)); err != nil {
		return err
	}
	if o.hook != nil {
		o.hook(msg)
	}
	return nil
}

func (o *oracle) onOutcome(_ context.Context, r consumer.Report) {
	id := r.Key.ID
	if r.Message != nil {
		id = r.Message.ID
	}
	o.mu.Lock()
	o.outcomes[id] = append(o.outcomes[id], r.Outcome)
	o.mu.Unlock()
}

// work is what the consumers of the case run.
func (o *oracle) work() (Work, error) {
	h, err := consumer.Transactional(o.store, consumer.TxOptions{Scope: scope, Telemetry: consumer.Telemetry{OnOutcome: o.onOutcome}}, o.effect)
	if err != nil {
		return Work{}, err
	}
	after := func(msg *consumer.Message) {
		if o.afterCommit != nil {
			o.afterCommit(msg)
		}
	}
	wrapped := consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		err := h.Handle(ctx, msg)
		if err == nil {
			after(msg)
		}
		return err
	})
	return Work{Handler: wrapped, Store: o.store, Scope: scope, Effect: o.effect, OnOutcome: o.onOutcome, AfterCommit: after}, nil
}

func (o *oracle) mustWork(t testing.TB) Work {
	t.Helper()
	w, err := o.work()
	if err != nil {
		t.Fatal(err)
	}
	return w
}

func (o *oracle) runsOf(id string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.runs[id]
}

func (o *oracle) outcomesOf(id string) []consumer.Outcome {
	o.mu.Lock()
	defer o.mu.Unlock()
	return slices.Clone(o.outcomes[id])
}

// rows returns the number of effect rows of each id.
func (o *oracle) rows(t testing.TB) map[string]int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rows, err := o.pool.Query(ctx, "SELECT id, count(*) FROM "+o.table()+" GROUP BY id")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	var (
		id string
		n  int
	)
	if _, err := pgx.ForEachRow(rows, []any{&id, &n}, func() error { out[id] = n; return nil }); err != nil {
		t.Fatal(err)
	}
	return out
}

// applied reports whether every id has an effect row.
func (o *oracle) applied(t testing.TB, ids ...string) bool {
	t.Helper()
	got := o.rows(t)
	for _, id := range ids {
		if got[id] == 0 {
			return false
		}
	}
	return true
}

// appliedNow is applied for a handler's goroutine: false on an error.
func (o *oracle) appliedNow(ids ...string) bool {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var n int
	if err := o.pool.QueryRow(ctx, "SELECT count(DISTINCT id) FROM "+o.table()+" WHERE id = ANY($1)", ids).Scan(&n); err != nil {
		return false
	}
	return n == len(ids)
}

// order returns the ids of the effect rows in commit order.
func (o *oracle) order(t testing.TB) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rows, err := o.pool.Query(ctx, "SELECT id FROM "+o.table()+" ORDER BY seq")
	if err != nil {
		t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

// check is the oracle's verdict: no id applied twice (GROUP BY id HAVING
// count(*) > 1 is empty), every id of want applied, no id applied that
// is not in want or allowed.
func (o *oracle) check(t testing.TB, want []string, allowed ...string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	rows, err := o.pool.Query(ctx, "SELECT id, count(*) FROM "+o.table()+" GROUP BY id HAVING count(*) > 1")
	if err != nil {
		t.Fatal(err)
	}
	var dups []string
	var (
		id string
		n  int
	)
	if _, err := pgx.ForEachRow(rows, []any{&id, &n}, func() error { dups = append(dups, fmt.Sprintf("%s×%d", short(id), n)); return nil }); err != nil {
		t.Fatal(err)
	}
	got := o.rows(t)
	var lost []string
	for _, id := range want {
		if got[id] == 0 {
			lost = append(lost, short(id))
		}
		delete(got, id)
	}
	for _, id := range allowed {
		delete(got, id)
	}
	var unknown []string
	for id := range got {
		unknown = append(unknown, short(id))
	}
	if len(dups) > 0 || len(lost) > 0 || len(unknown) > 0 {
		t.Fatalf("oracle: %d ids applied more than once %v, %d of %d published ids lost %v, %d unexpected ids applied %v",
			len(dups), dups, len(lost), len(want), lost, len(unknown), unknown)
	}
}

// errTransient is the transient error the suite's effects return.
var errTransient = errors.New("adaptertest: transient failure")
