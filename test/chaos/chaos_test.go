package chaos

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"
)

// The helpers of the SIGKILL and RabbitMQ cells; the matrix itself runs
// from cmd/chaos, never from go test.

func TestCountDeliveries(t *testing.T) {
	dir := t.TempDir()
	write := func(name, s string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("deliveries-0001.log", "a\nb\n")
	write("deliveries-0002.log", "b\nc\n\n")
	write("publishes-0003.log", "a\na\n")
	n, distinct, err := countDeliveries(dir, "deliveries")
	if err != nil || n != 4 || distinct != 3 {
		t.Fatalf("deliveries: %d, %d, %v; want 4, 3", n, distinct, err)
	}
	n, distinct, err = countDeliveries(dir, "publishes")
	if err != nil || n != 2 || distinct != 1 {
		t.Fatalf("publishes: %d, %d, %v; want 2, 1", n, distinct, err)
	}
}

func TestDeliveryLogAppends(t *testing.T) {
	path := filepath.Join(t.TempDir(), "deliveries-0001.log")
	d, err := openDeliveryLog(path)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for i := range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d.record(makeIDs("x", 50)[i])
		}()
	}
	wg.Wait()
	_ = d.f.Close()
	n, distinct, err := countDeliveries(filepath.Dir(path), "deliveries")
	if err != nil || n != 50 || distinct != 50 {
		t.Fatalf("%d, %d, %v; want 50, 50", n, distinct, err)
	}
}

func TestKillerIgnoresOtherPoints(t *testing.T) {
	k := newKiller(childConfig{Point: pointAfterCommit, After: 1})
	for range 10 {
		k.at(pointBeforeTx) // would kill the test if it fired
	}
	var none *killer
	none.at(pointAfterCommit)
	if k.passes.Load() != 0 {
		t.Fatalf("%d passes counted at another point", k.passes.Load())
	}
}

// paced sends in paced batches until over is closed (here, after two
// batches), then sends the rest: every id, in order.
func TestPacedSendsEverything(t *testing.T) {
	ids := makeIDs("p", 95)
	over := make(chan struct{})
	var (
		got     []string
		batches int
	)
	done := make(chan error, 1)
	go func() {
		done <- paced(context.Background(), ids, time.Second, over, func(_ context.Context, b []string) error {
			got = append(got, b...)
			if batches++; batches == 2 {
				close(over)
			}
			return nil
		})
	}()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if strings.Join(got, ",") != strings.Join(ids, ",") {
		t.Fatalf("sent %d ids out of order or not all (want %d)", len(got), len(ids))
	}
}

func TestVhostOf(t *testing.T) {
	for url, want := range map[string]string{
		"amqp://guest:guest@127.0.0.1:5672/":        "/",
		"amqp://guest:guest@127.0.0.1:5672":         "/",
		"amqp://guest:guest@127.0.0.1:5672/chaos_1": "chaos_1",
	} {
		if got := vhostOf(url); got != want {
			t.Errorf("vhostOf(%q) = %q, want %q", url, got, want)
		}
	}
}

func TestKillStatsNote(t *testing.T) {
	s := killStats{byPoint: map[string]int{"random": 3, pointBeforeTx: 1}, missed: 1}
	want := "kills: before_tx 1, random 3 (1 named points not reached in time, killed by the runner)"
	if got := s.note(); got != want {
		t.Fatalf("note %q, want %q", got, want)
	}
}

func TestCellsRegistered(t *testing.T) {
	names := map[string]bool{}
	for _, n := range Names() {
		names[n] = true
	}
	for _, adapter := range []string{"kafka", "amqp", "watermill", "http"} {
		for _, store := range []string{storePG, storeRedis} {
			if n := adapter + "/" + store + "/sigkill"; !names[n] {
				t.Errorf("cell %s is not registered", n)
			}
		}
	}
	for _, n := range []string{"relay/kafka/sigkill", "relay/amqp/sigkill", "rabbit/amqp/close-all+stop-app", "rabbit/relay/close-all+stop-app",
		"wal/amqp/sigkill", "wal/pg/immediate", "wal/proxy/amqp", "proxy/outbox-amqp", "redis/cluster/master-kill",
		"nats/pgtable/sigkill", "nats/pgtable/server-kill"} {
		if !names[n] {
			t.Errorf("cell %s is not registered", n)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for _, n := range []string{"rabbit/amqp/close-all+stop-app", "rabbit/relay/close-all+stop-app"} {
		if !cells[n].Last {
			t.Errorf("cell %s does not run last", n)
		}
	}
	if !cells["kafka/redisnx/sigkill"].ExpectDuplicates || cells["kafka/pgtable/sigkill"].ExpectDuplicates {
		t.Error("only the redisnx cells expect duplicates")
	}
}

func TestTotalLineSeparatesExpectedDuplicates(t *testing.T) {
	var total tally
	total.add(Cell{Name: "pg"}, Result{Messages: 1000, Kills: 3, Restarts: 1, Redeliveries: 40})
	total.add(Cell{Name: "lease", ExpectDuplicates: true}, Result{Messages: 2000, Kills: 2, Redeliveries: 10, Duplicates: 185})
	total.add(Cell{Name: "broken"}, Result{Messages: 1000, Duplicates: 2, Lost: 1})
	want := "chaos: total: 4000 messages, 5 kills, 1 restarts, 50 redeliveries, 2 duplicate effects where 0 was promised, " +
		"185 in the lease cells where they are expected (9.250% of their 2000 messages), 1 lost"
	if got := total.line(); got != want {
		t.Fatalf("total line\n%s\nwant\n%s", got, want)
	}

	var none tally
	none.add(Cell{Name: "pg"}, Result{Messages: 10})
	want = "chaos: total: 10 messages, 0 kills, 0 restarts, 0 redeliveries, 0 duplicate effects where 0 was promised, 0 lost"
	if got := none.line(); got != want {
		t.Fatalf("total line without lease cells\n%s\nwant\n%s", got, want)
	}
}

// Run runs up to Parallel cells at a time, the Last cells after every
// other one and alone, prints every cell's line and sums them, and names
// the cells that broke their promise.
func TestRunParallel(t *testing.T) {
	const par = 3
	p := &parRun{gate: make(chan struct{})}
	p.arrived.Add(par)
	go func() { p.arrived.Wait(); close(p.gate) }()
	parMu.Lock()
	parCur = p
	parMu.Unlock()
	mu.Lock()
	_, registered := cells["test/par/0"] // by an earlier -count run
	mu.Unlock()
	if !registered {
		for i := range 8 {
			Register(parCell(i, par, i >= 6, i == 4))
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	var out strings.Builder
	err := Run(ctx, Config{Scale: Small, Seed: 1, Only: regexp.MustCompile(`^test/par/`), Out: &out, Parallel: par})
	if err == nil || !strings.Contains(err.Error(), "[test/par/4]") {
		t.Fatalf("Run = %v; want the broken cell test/par/4 named\n%s", err, out.String())
	}
	if ctx.Err() != nil {
		t.Fatalf("the first %d cells did not run at once\n%s", par, out.String())
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.most > par {
		t.Errorf("%d cells ran at once, want at most %d", p.most, par)
	}
	if p.othersAfter || p.lastBeside {
		t.Errorf("a Last cell ran beside another (%v) or before one (%v)", p.lastBeside, p.othersAfter)
	}
	for i := range 8 {
		if !strings.Contains(out.String(), fmt.Sprintf("chaos: test/par/%d: 10 messages, 1 kills", i)) {
			t.Errorf("no line for test/par/%d", i)
		}
	}
	if !strings.Contains(out.String(), "chaos: total: 80 messages, 8 kills") {
		t.Errorf("total line wrong:\n%s", out.String())
	}
}

// parRun is what the test/par/ cells of one TestRunParallel run record.
type parRun struct {
	mu          sync.Mutex
	running     int
	most        int
	lastStarted bool
	othersAfter bool // a cell that is not Last started after a Last one
	lastBeside  bool // a Last cell ran beside another
	// The first cells wait at gate until all of them arrived.
	arrived sync.WaitGroup
	gate    chan struct{}
}

var (
	parMu  sync.Mutex
	parCur *parRun
)

// parCell is test/par/i: it records what runs beside it, and the first
// par cells wait for one another.
func parCell(i, par int, last, broken bool) Cell {
	return Cell{Name: fmt.Sprintf("test/par/%d", i), Last: last, Run: func(ctx context.Context, _ *Env) (Result, error) {
		parMu.Lock()
		p := parCur
		parMu.Unlock()
		p.mu.Lock()
		p.running++
		p.most = max(p.most, p.running)
		if last {
			p.lastBeside = p.lastBeside || p.running > 1
			p.lastStarted = true
		} else if p.lastStarted {
			p.othersAfter = true
		}
		p.mu.Unlock()
		defer func() {
			p.mu.Lock()
			p.running--
			p.mu.Unlock()
		}()
		if i < par {
			p.arrived.Done()
			select {
			case <-p.gate:
			case <-ctx.Done():
				return Result{}, ctx.Err()
			}
		}
		time.Sleep(5 * time.Millisecond)
		r := Result{Messages: 10, Kills: 1}
		if broken {
			r.Duplicates = 1
		}
		return r, nil
	}}
}

// A multiple scales the full sizes that go through Env.Pick, not the small
// ones, nor what Scale.Pick returns.
func TestPickMultiple(t *testing.T) {
	full := &Env{Scale: Full, Mult: 3}
	if got := full.Pick(5, 40); got != 120 {
		t.Errorf("full x3: Env.Pick = %d, want 120", got)
	}
	if got := full.Scale.Pick(25, 40); got != 40 {
		t.Errorf("full x3: Scale.Pick = %d, want 40", got)
	}
	if got := (&Env{Scale: Small, Mult: 3}).Pick(5, 40); got != 5 {
		t.Errorf("small x3: Env.Pick = %d, want 5", got)
	}
	if got := (&Env{Scale: Full}).Pick(5, 40); got != 40 {
		t.Errorf("full without a multiple: Env.Pick = %d, want 40", got)
	}
}
