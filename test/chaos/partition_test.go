//go:build unix

package chaos

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/idemkit/idem/consumer"
)

// A cell that cannot run here is SKIPPED, and the run passes, except where
// services are required: there it fails.
func TestSkippedCell(t *testing.T) {
	mu.Lock()
	_, registered := cells["test/skipped"] // by an earlier -count run
	mu.Unlock()
	if !registered {
		Register(Cell{Name: "test/skipped", Run: func(context.Context, *Env) (Result, error) {
			return Result{}, fmt.Errorf("%w: no tool", ErrSkipped)
		}})
	}
	run := func() (string, error) {
		var out bytes.Buffer
		err := Run(context.Background(), Config{Scale: Small, Seed: 1, Only: regexp.MustCompile("^test/skipped$"), Out: &out})
		return out.String(), err
	}
	t.Setenv("CI", "")
	t.Setenv("IDEM_REQUIRE_SERVICES", "")
	out, err := run()
	if err != nil || !strings.Contains(out, "SKIPPED: the cell cannot run here: no tool") {
		t.Fatalf("without CI: %v\n%s", err, out)
	}
	t.Setenv("CI", "true")
	out, err = run()
	if err == nil || !strings.Contains(out, "FAILED: the cell cannot run here: no tool") {
		t.Fatalf("under CI=true: %v\n%s", err, out)
	}
}

func TestPartOutcomes(t *testing.T) {
	dir := t.TempDir()
	write := func(name, s string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("outcomes-s0-0001.log", "completed a\ncomplete_failed b redis: i/o timeout\ncompleted b\n")
	write("outcomes-s1-0002.log", "effect_error c context deadline exceeded\nreleased c\ncompleted c\nlease_lost b\n\n")
	write("deliveries-s1-0002.log", "complete_failed d\n")
	counts, unmarked, err := partOutcomes(dir)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := counts.String(), "complete_failed 1, completed 3, effect_error 1, lease_lost 1, released 1"; got != want {
		t.Errorf("counts %q, want %q", got, want)
	}
	if len(unmarked) != 2 || unmarked["b"] != 2 || unmarked["c"] != 1 {
		t.Errorf("unmarked %v, want b 2, c 1", unmarked)
	}
}

func TestOutcomeLogLines(t *testing.T) {
	path := filepath.Join(t.TempDir(), partOutcomesPath("deliveries-s0-0001.log"))
	o, err := openOutcomeLog(path)
	if err != nil {
		t.Fatal(err)
	}
	o.add(consumer.Report{Outcome: consumer.OutcomeCompleteFailed, Message: &consumer.Message{ID: "m-1"}, Err: errors.New("two\nlines")})
	o.add(consumer.Report{Outcome: consumer.OutcomeCompleted, Message: &consumer.Message{ID: "m-2"}})
	o.close()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := string(b), "complete_failed m-1 two lines\ncompleted m-2\n"; got != want {
		t.Fatalf("%q, want %q", got, want)
	}
	if filepath.Base(path) != "outcomes-s0-0001.log" {
		t.Fatalf("path %s", path)
	}
}

func TestWithPort(t *testing.T) {
	for in, want := range map[string]string{
		"127.0.0.1":      "127.0.0.1:5432",
		"127.0.0.1:6543": "127.0.0.1:6543",
		"[::1]":          "[::1]:5432",
		"localhost":      "localhost:5432",
	} {
		if got := withPort(in, "5432"); got != want {
			t.Errorf("withPort(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestPartitionCellsRegistered(t *testing.T) {
	mu.Lock()
	defer mu.Unlock()
	for n, lease := range map[string]bool{
		"partition/pgtable/both": false, "partition/pgtable/oneway": false, "partition/amqp-pgtable": false,
		"partition/redisnx/both": true, "partition/redisnx/oneway": true,
	} {
		c, ok := cells[n]
		if !ok {
			t.Errorf("cell %s is not registered", n)
			continue
		}
		if c.ExpectDuplicates != lease {
			t.Errorf("cell %s: ExpectDuplicates %v, want %v", n, c.ExpectDuplicates, lease)
		}
	}
	if children[partChildName] == nil {
		t.Errorf("child %s is not registered", partChildName)
	}
}
