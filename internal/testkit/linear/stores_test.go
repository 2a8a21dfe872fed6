//go:build unix

package linear_test

import (
	"context"
	"errors"
	"testing"

	"github.com/idemkit/idem/internal/testkit/linear"
	"github.com/idemkit/idem/internal/testkit/linear/scenario"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// checkScenario runs a scenario of internal/testkit/linear/scenario with
// its default workload and fails t when its history is not linearizable.
// A server the scenario needs that is missing skips t (fails it under
// CI=true).
func checkScenario(t *testing.T, run func(ctx context.Context) (*scenario.Outcome, error)) {
	t.Helper()
	o, err := run(testenv.Ctx(t))
	switch {
	case errors.Is(err, scenario.ErrUnavailable):
		testenv.Unavailable(t, err.Error())
	case err != nil:
		t.Fatal(err)
	}
	t.Logf("%s: %s", o.Name, o.Note)
	linear.Check(t, o.Name, o.Model, o.History)
}

// TestRedisnxKilledLinearizable: eight clients on three keys of redisnx,
// with go-redis's default retries, on a Redis that fsyncs every write
// before answering (appendonly yes, appendfsync always) and is SIGKILLed
// and restarted every 300ms (scenario.RedisnxKilled). Calls cut by a kill
// are Unknown outcomes. The history is linearizable under LeaseModel: a
// restart loses no acknowledged lease or done mark, and no call is run
// twice.
func TestRedisnxKilledLinearizable(t *testing.T) {
	checkScenario(t, func(ctx context.Context) (*scenario.Outcome, error) {
		return scenario.RedisnxKilled(ctx, scenario.Size{})
	})
}

// TestRedisnxClusterLinearizable: eight clients on six keys of redisnx on
// a three-master Redis Cluster, while every 500ms one master in turn is
// either frozen (SIGSTOP) for 300ms, shorter than the cluster's node
// timeout, so calls to it time out as Unknown outcomes, or failed over to
// its replica once the replica has every write the master acknowledged
// (scenario.RedisnxCluster). The history is linearizable under
// LeaseModel.
func TestRedisnxClusterLinearizable(t *testing.T) {
	checkScenario(t, func(ctx context.Context) (*scenario.Outcome, error) {
		return scenario.RedisnxCluster(ctx, scenario.Size{})
	})
}

// TestPgtableLeaseLinearizable: eight clients on eight keys of pgtable's
// lease mode, through a proxy that every 300ms spends 20ms cutting
// connections after forwarding a statement and before its reply reaches
// the client (scenario.PgtableLease). Reads are Store.Lookup. The history
// is linearizable under LeaseModel.
func TestPgtableLeaseLinearizable(t *testing.T) {
	checkScenario(t, func(ctx context.Context) (*scenario.Outcome, error) {
		return scenario.PgtableLease(ctx, testenv.PostgresURL(), scenario.Size{})
	})
}

// TestTwolevelLinearizable: eight clients process 40 keys through
// twolevel (redisnx in front of pgtable), while the cache, a Redis without
// persistence, is SIGKILLed and restarted empty every 100ms; one fn in
// eight fails (scenario.Twolevel). The history is linearizable under
// TxModel: each key's fn is committed at most once and every duplicate
// carries its result, whatever the cache forgot.
func TestTwolevelLinearizable(t *testing.T) {
	checkScenario(t, func(ctx context.Context) (*scenario.Outcome, error) {
		return scenario.Twolevel(ctx, testenv.PostgresURL(), scenario.Size{})
	})
}
