//go:build unix

package chaos

// history/ cells: the histories of the dedup stores under faults, checked
// for linearizability with Porcupine against a model of each store's
// promise (internal/testkit/linear; the scenarios themselves, the same
// ones its Go tests run, are in internal/testkit/linear/scenario):
//
//   - history/memstore: memstore with leases and done marks of 100ms, no
//     fault beyond time (leases run out, stale owners come back).
//   - history/redisnx/kill: redisnx on a throwaway Redis with appendfsync
//     always, SIGKILLed and restarted every 300ms.
//   - history/redisnx-cluster/failover: redisnx on a throwaway three-master
//     Redis Cluster while, every 500ms, one master in turn is frozen for
//     300ms (no failover) or failed over to its replica once the replica
//     has every write it acknowledged.
//   - history/pgtable-lease/cut: pgtable's lease mode on the shared
//     PostgreSQL (a schema of its own) through a proxy that cuts replies
//     after PostgreSQL ran the statement, 20ms in every 300ms.
//   - history/twolevel/cache-kill: twolevel (redisnx in front of pgtable)
//     while its cache, a throwaway Redis without persistence, is SIGKILLed
//     and restarted empty every 100ms.
//
// The lease cells are checked under linear.LeaseModel, twolevel under
// linear.TxModel. Messages counts the operations; a call whose outcome
// its client could not know (a cut reply, a timeout) is an Unknown
// outcome, counted in the note, that the check lets take effect or not.
// There is no oracle table: Duplicates and Lost stay 0, and a history no
// order of operations explains fails the cell with the failing key's
// sub-history and the path of its visualization (kept under
// $IDEM_LINEAR_DIR when set, else the system's temporary directory), as
// does a key whose check runs out of linear.CheckTimeout.

import (
	"context"
	"fmt"

	"github.com/idemkit/idem/internal/testkit/linear/scenario"
)

func init() {
	for _, c := range []struct {
		name string
		run  func(ctx context.Context, env *Env) (*scenario.Outcome, error)
	}{
		{"history/memstore", func(ctx context.Context, env *Env) (*scenario.Outcome, error) {
			return scenario.Memstore(ctx, historySize(env, scenario.Size{Clients: 16, Ops: 400, Keys: 40}))
		}},
		{"history/redisnx/kill", func(ctx context.Context, env *Env) (*scenario.Outcome, error) {
			return scenario.RedisnxKilled(ctx, historySize(env, scenario.Size{Clients: 16, Ops: 300, Keys: 24}))
		}},
		{"history/redisnx-cluster/failover", func(ctx context.Context, env *Env) (*scenario.Outcome, error) {
			return scenario.RedisnxCluster(ctx, historySize(env, scenario.Size{Clients: 16, Ops: 600, Keys: 96}))
		}},
		{"history/pgtable-lease/cut", func(ctx context.Context, env *Env) (*scenario.Outcome, error) {
			return scenario.PgtableLease(ctx, env.PGURL, historySize(env, scenario.Size{Clients: 16, Ops: 250, Keys: 64}))
		}},
		{"history/twolevel/cache-kill", func(ctx context.Context, env *Env) (*scenario.Outcome, error) {
			size := historySize(env, scenario.Size{Clients: 16, Ops: 300, Keys: 320})
			if env.Scale == Small {
				size.Ops = 50 // half the Go test's, to keep the small matrix short
			}
			return scenario.Twolevel(ctx, env.PGURL, size)
		}},
	} {
		Register(Cell{Name: c.name, Run: func(ctx context.Context, env *Env) (Result, error) {
			o, err := c.run(ctx, env)
			if err != nil {
				return Result{}, err
			}
			env.Logf("%s: %v", o.Name, o.History.Counts())
			return historyResult(o)
		}})
	}
}

// historySize is the scenario's own small workload (its Go test's) at
// the small scale, full at the full one.
func historySize(env *Env, full scenario.Size) scenario.Size {
	if env.Scale == Small {
		return scenario.Size{}
	}
	return full
}

// historyResult checks o's history and fills the cell's result: its
// operations as messages, its faults as kills, an error when the history
// is not linearizable or its check ran out of time.
func historyResult(o *scenario.Outcome) (Result, error) {
	res := Result{
		Messages: len(o.History.Operations()),
		Kills:    o.Faults,
		Restarts: o.Restarts,
		Note:     fmt.Sprintf("%s; %s", o.Summary(), o.Note),
	}
	v, err := o.Search()
	switch {
	case err != nil:
		res.Note += "; not checked"
		return res, err
	case v != nil:
		res.Note += "; NOT linearizable"
		return res, fmt.Errorf("%s: %w", o.Name, v)
	}
	res.Note += "; linearizable"
	return res, nil
}
