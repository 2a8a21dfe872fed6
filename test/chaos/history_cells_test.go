//go:build unix

package chaos

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testkit/linear"
	"github.com/idemkit/idem/internal/testkit/linear/scenario"
)

func TestHistoryCellsRegistered(t *testing.T) {
	mu.Lock()
	defer mu.Unlock()
	for _, n := range []string{"history/memstore", "history/redisnx/kill", "history/redisnx-cluster/failover",
		"history/pgtable-lease/cut", "history/twolevel/cache-kill"} {
		c, ok := cells[n]
		if !ok {
			t.Errorf("cell %s is not registered", n)
			continue
		}
		if c.ExpectDuplicates || c.Last {
			t.Errorf("cell %s: ExpectDuplicates %v, Last %v", n, c.ExpectDuplicates, c.Last)
		}
	}
}

// twoClaims records two claims of one key, the second called after the
// first returned, well inside a lease of a minute; the second answers
// second.
func twoClaims(second linear.Output) *scenario.Outcome {
	h := linear.NewHistory()
	in := linear.Input{Kind: linear.Claim, Key: "k0", Call: h.Now()}
	h.Add(0, in, linear.Output{Result: linear.Granted, Token: "first"}, h.Now())
	in = linear.Input{Kind: linear.Claim, Key: "k0", Call: h.Now()}
	h.Add(1, in, second, h.Now())
	return &scenario.Outcome{Name: "two claims", Model: linear.LeaseModel(time.Minute, time.Minute, scenario.Slack),
		History: h, Faults: 3, Restarts: 2, Note: "no faults"}
}

func TestHistoryResult(t *testing.T) {
	t.Setenv("IDEM_LINEAR_DIR", t.TempDir())
	res, err := historyResult(twoClaims(linear.Output{Result: linear.InFlight}))
	if err != nil {
		t.Fatalf("a linearizable history: %v", err)
	}
	want := Result{Messages: 2, Kills: 3, Restarts: 2, Note: "2 operations, 0 unknown outcomes; no faults; linearizable"}
	if res != want {
		t.Fatalf("result %+v, want %+v", res, want)
	}

	res, err = historyResult(twoClaims(linear.Output{Result: linear.Granted, Token: "second"}))
	if err == nil {
		t.Fatalf("two owners at once passed the check: %+v", res)
	}
	if !strings.HasSuffix(res.Note, "; NOT linearizable") || res.Messages != 2 {
		t.Fatalf("result %+v", res)
	}
	_, after, ok := strings.Cut(err.Error(), "visualization: ")
	path, _, _ := strings.Cut(after, "\n")
	if !ok {
		t.Fatalf("the error names no visualization: %v", err)
	}
	if _, serr := os.Stat(path); serr != nil {
		t.Fatalf("the error names no visualization that exists (%v): %v", serr, err)
	}
	t.Log(err)
}
