package adaptertest

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// childEnv carries a childSpec, as JSON, to the test binary started again
// as a consumer process.
const childEnv = "IDEM_ADAPTERTEST_CHILD"

// Lines a child writes to its stdout.
const (
	lineReady     = "adaptertest-child: ready"
	lineDuplicate = "adaptertest-child: duplicate "
)

// Kill points of a child: it SIGKILLs itself there.
const (
	killBefore      = "before_effect" // in the handler, before the effect's row
	killInTx        = "in_tx"         // the row written, the transaction not committed
	killAfterCommit = "after_commit"  // the claim committed, the delivery not settled
)

// childSpec tells a child what to run.
type childSpec struct {
	// Test is the name of the test that called Run; the child runs only
	// that test, and its Run starts the consumer.
	Test   string      `json:"test"`
	Dest   Destination `json:"dest"`
	Schema string      `json:"schema"`
	// Kill is the kill point, empty for none; the child dies there on the
	// KillAt-th call (1-based) that reaches it, counted over every
	// message, or only over KillID's when that is set.
	Kill   string `json:"kill,omitempty"`
	KillAt int    `json:"kill_at,omitempty"`
	KillID string `json:"kill_id,omitempty"`
}

// childSpecFor returns the spec of this process when it is a child started
// for the test t.
func childSpecFor(t *testing.T) (childSpec, bool) {
	raw := os.Getenv(childEnv)
	if raw == "" {
		return childSpec{}, false
	}
	var spec childSpec
	if err := json.Unmarshal([]byte(raw), &spec); err != nil {
		fmt.Fprintln(os.Stderr, "adaptertest-child:", err)
		os.Exit(2)
	}
	return spec, spec.Test == t.Name()
}

// runChild runs a consumer of spec.Dest with the oracle of spec.Schema
// until SIGTERM (a graceful stop, exit 0) or its kill point.
func runChild(h Harness, spec childSpec) int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "adaptertest-child:", err)
		return 3
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		return fail(err)
	}
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	o, err := openOracle(ctx, pool, spec.Schema)
	if err != nil {
		return fail(err)
	}
	var calls atomic.Int64
	die := func(point string, msg *consumer.Message) {
		if spec.Kill != point || (spec.KillID != "" && msg.ID != spec.KillID) {
			return
		}
		if calls.Add(1) == int64(spec.KillAt) {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {} // the signal is on its way
		}
	}
	var out sync.Mutex
	say := func(s string) {
		out.Lock()
		fmt.Println(s)
		out.Unlock()
	}
	o.hook = func(msg *consumer.Message) { die(killInTx, msg) }
	w, err := childWork(o, Work{
		Store: o.store,
		Scope: scope,
		Effect: func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			die(killBefore, msg)
			return o.effect(ctx, tx, msg)
		},
		OnOutcome: func(_ context.Context, r consumer.Report) {
			if r.Outcome == consumer.OutcomeDuplicate {
				say(lineDuplicate + r.Key.ID)
			}
		},
		AfterCommit: func(msg *consumer.Message) { die(killAfterCommit, msg) },
	})
	if err != nil {
		return fail(err)
	}
	sctx, cancel := context.WithTimeout(ctx, time.Minute)
	c, err := h.Start(sctx, spec.Dest, w, options())
	cancel()
	if err != nil {
		return fail(err)
	}
	say(lineReady)
	<-ctx.Done()
	sctx, cancel = context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if err := c.Stop(sctx); err != nil {
		return fail(err)
	}
	return 0
}

// childWork builds the Work of a child from w's Effect, OnOutcome and
// AfterCommit.
func childWork(o *oracle, w Work) (Work, error) {
	h, err := consumer.Transactional(o.store, consumer.TxOptions{Scope: scope, Telemetry: consumer.Telemetry{OnOutcome: w.OnOutcome}}, w.Effect)
	if err != nil {
		return Work{}, err
	}
	after := w.AfterCommit
	w.Handler = consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		err := h.Handle(ctx, msg)
		if err == nil {
			after(msg)
		}
		return err
	})
	return w, nil
}

// child is a consumer process started by the parent.
type child struct {
	p     *childproc.Proc
	ready chan struct{}
	dups  atomic.Int64
}

// startChild starts the test binary again as a consumer of spec.Dest. It
// skips the case (fails it under CI) when the harness cannot run a
// consumer in another process and did not declare the case unsupported.
func (s *suite) startChild(t *testing.T, spec childSpec) *child {
	t.Helper()
	if !s.caps.ChildProcess {
		cannot(t, "the harness cannot run its consumer in a child process (Capabilities.ChildProcess is false)")
	}
	spec.Test = s.name
	raw, err := json.Marshal(spec)
	if err != nil {
		t.Fatal(err)
	}
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run="+runPattern(spec.Test), "-test.count=1")
	cmd.Env = append(os.Environ(), childEnv+"="+string(raw))
	ch := &child{ready: make(chan struct{})}
	var once sync.Once
	p, err := childproc.Start(cmd, 16<<10, func(line string) {
		switch {
		case line == lineReady:
			once.Do(func() { close(ch.ready) })
		case strings.HasPrefix(line, lineDuplicate):
			ch.dups.Add(1)
		}
	})
	if err != nil {
		cannot(t, fmt.Sprintf("starting the consumer child process: %v", err))
	}
	ch.p = p
	t.Cleanup(func() {
		p.Kill()
		<-p.Exited()
	})
	select {
	case <-ch.ready:
	case <-p.Exited():
		t.Fatalf("the consumer child exited before it consumed: %v%s", p.ExitErr(), p.StderrTail())
	case <-time.After(2 * time.Minute):
		t.Fatalf("the consumer child did not start consuming in 2m%s", p.StderrTail())
	}
	return ch
}

// waitKilled waits for a child to die at its kill point.
func (ch *child) waitKilled(t testing.TB, limit time.Duration) {
	t.Helper()
	select {
	case <-ch.p.Exited():
	case <-time.After(limit):
		ch.p.Kill()
		<-ch.p.Exited()
		t.Fatalf("the consumer child did not reach its kill point in %v%s", limit, ch.p.StderrTail())
	}
	if !ch.p.DiedOfSIGKILL() {
		t.Fatalf("the consumer child exited with %v, not at its kill point%s", ch.p.ExitErr(), ch.p.StderrTail())
	}
}

// stop stops a child with SIGTERM (a graceful stop) and waits for it.
func (ch *child) stop(t testing.TB) {
	t.Helper()
	_ = ch.p.Cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-ch.p.Exited():
	case <-time.After(2 * time.Minute):
		ch.p.Kill()
		<-ch.p.Exited()
		t.Fatalf("the consumer child did not stop within 2m of SIGTERM%s", ch.p.StderrTail())
	}
	if err := ch.p.Err(); err != nil {
		t.Fatalf("the consumer child's graceful stop failed: %v%s", err, ch.p.StderrTail())
	}
}

// runPattern is a -test.run pattern that matches the test name exactly,
// level by level.
func runPattern(name string) string {
	parts := strings.Split(name, "/")
	for i, p := range parts {
		parts[i] = "^" + regexp.QuoteMeta(p) + "$"
	}
	return strings.Join(parts, "/")
}
