// Package scenario holds the fault scenarios whose histories
// internal/testkit/linear checks: each starts the servers it needs
// (throwaway redis-server processes and Redis Clusters, a fault proxy in
// front of the shared PostgreSQL, a schema of its own), runs linear's
// clients against a store while it injects its faults, stops everything
// it started, and returns the history with the model it is checked
// against. The Go tests of linear run them with their small default
// workloads; the history/ cells of the chaos matrix (test/chaos) run the
// same scenarios with workloads sized by the matrix's scale.
//
// This package is test-only: nothing in the library imports it.
package scenario

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/internal/testkit/linear"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// Slack covers the difference between a store's clock and the history's,
// and the stores' rounding of expiries to milliseconds.
const Slack = 20 * time.Millisecond

// ErrUnavailable is wrapped in the error of a scenario that cannot start
// a server it needs (redis-server or redis-cli missing, PostgreSQL
// unreachable).
var ErrUnavailable = errors.New("scenario: a server it needs is unavailable")

// Size shapes a scenario's workload. A zero field keeps the scenario's
// default: the small workload its Go test runs.
type Size struct {
	// Clients is the number of concurrent clients.
	Clients int
	// Ops is how many operations each client makes.
	Ops int
	// Keys is how many keys the clients share. More keys keep each key's
	// history, which is checked on its own, short.
	Keys int
}

func (s Size) apply(w *linear.Workload) {
	if s.Clients > 0 {
		w.Clients = s.Clients
	}
	if s.Ops > 0 {
		w.Ops = s.Ops
	}
	if s.Keys > 0 {
		w.Keys = s.Keys
	}
}

// Outcome is what a scenario recorded.
type Outcome struct {
	// Name names the scenario in messages and visualization directories.
	Name string
	// Model is the specification the history is checked against.
	Model porcupine.Model
	// History holds the clients' operations.
	History *linear.History
	// Faults counts the faults injected (kills, failovers, freezes, cut
	// windows); Restarts the servers started again after one.
	Faults, Restarts int
	// Note describes the faults, for a report.
	Note string
}

// Unknown counts the operations whose outcome the client could not know.
func (o *Outcome) Unknown() int {
	n := 0
	for k, c := range o.History.Counts() {
		if strings.HasSuffix(k, " "+linear.Unknown.String()) {
			n += c
		}
	}
	return n
}

// Summary counts the operations and the unknown outcomes among them.
func (o *Outcome) Summary() string {
	return fmt.Sprintf("%d operations, %d unknown outcomes", len(o.History.Operations()), o.Unknown())
}

// Search checks the history against the model key by key (linear.Search).
func (o *Outcome) Search() (*linear.Violation, error) {
	return linear.Search(o.Name, o.Model, o.History.Operations())
}

// Memstore runs clients on a memstore with a lease and retention of 100ms, so
// leases run out, stale owners come back and done marks expire; no fault
// beyond time. Checked under LeaseModel. Defaults: 8 clients, 3 keys, 60
// operations each.
func Memstore(ctx context.Context, size Size) (*Outcome, error) {
	const lease, ttl = 100 * time.Millisecond, 100 * time.Millisecond
	s, err := memstore.New(memstore.Options{Lease: lease, TTL: ttl})
	if err != nil {
		return nil, err
	}
	defer func() { _ = s.Close() }()
	w := linear.Workload{Scope: testenv.UniqueID("mem"), Lease: lease, TTL: ttl}
	size.apply(&w)
	h := linear.RunLease(ctx, linear.Target{Store: s}, w, nil)
	return &Outcome{Name: "memstore", Model: linear.LeaseModel(lease, ttl, Slack), History: h,
		Note: "no faults: leases and done marks run out"}, nil
}
