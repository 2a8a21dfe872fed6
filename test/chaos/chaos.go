// Package chaos is idem's reliability matrix: a set of cells, each a
// workload with an oracle run under one kind of fault (a SIGKILLed consumer,
// a PostgreSQL stopped with -m immediate, a Redis restarted without
// persistence, a TCP proxy that cuts a connection after the request was
// sent, ...). Every cell prints one line:
//
//	chaos: <cell>: 10000 messages, 57 kills, 3 restarts, 1834 redeliveries, 0 duplicate effects, 0 lost
//
// and the run ends with a total line. The run fails when a cell that
// promises 0 duplicate effects or 0 lost does not hold; a cell marked
// ExpectDuplicates (a lease store under a fault aimed at its window, such
// as Redis without persistence) prints its rate and does not fail on
// duplicates. The total line sums the duplicates of the two kinds of cell
// apart: those where 0 was promised, and those of the lease cells.
//
// The oracle: effects are written to a table with no
// unique constraint, duplicates are ids with more than one effect row, and
// lost are acknowledged (or sent) inputs without an effect row. The
// history/ cells have none: they check the stores' answers for
// linearizability (history_cells.go), count the operations as messages,
// and fail on a history their model does not explain.
//
// Child processes: a cell that SIGKILLs a consumer re-executes the chaos
// binary itself with IDEM_CHAOS_CHILD set to the name of a function
// registered with RegisterChild; main calls ChildMain first thing.
//
// The command lives in test/chaos/cmd/chaos and is run by `make chaos`
// (CHAOS_SCALE=small for the quick run inside the test command).
package chaos

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"regexp"
	"sort"
	"sync"
	"time"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// Scale selects the size of every cell's workload.
type Scale string

// The scales. Small is the quick run inside the test command (a few cuts,
// kills or faults per cell); Full is the run whose figures go to
// docs/RELIABILITY.md (at least 100,000 messages and 200 kills over all
// cells).
const (
	Small Scale = "small"
	Full  Scale = "full"
)

// Pick returns small when s is Small, else full, whatever the run's
// multiple: for what a multiple must not change (a rate, how long a drain
// may take). A cell's sizes go through Env.Pick.
func (s Scale) Pick(small, full int) int {
	if s == Small {
		return small
	}
	return full
}

// Env is what a cell gets: the scale, a random source seeded from the run's
// seed and the cell's name (so a cell repeats on its own with -only), the
// shared services' addresses and the path of the running binary for child
// processes.
type Env struct {
	Scale     Scale
	Mult      int // the full scale's multiple (Config.Mult), at least 1
	Seed      uint64
	Rand      *rand.Rand
	PGURL     string // shared PostgreSQL (database test)
	RedisAddr string // shared Redis
	AMQPURL   string // shared RabbitMQ
	NATSURL   string // shared NATS (JetStream)
	Exe       string // this binary, for RegisterChild children
	TempDir   string // removed after the cell
	Verbose   bool
	out       io.Writer
	name      string
}

// Pick returns the size of something the cell counts (messages, kills,
// rounds of faults) or the time it may take in all: small at the small
// scale, full times the run's multiple at the full one.
func (e *Env) Pick(small, full int) int {
	if e.Scale == Small {
		return small
	}
	return full * max(e.Mult, 1)
}

// Logf prints a progress line for the cell when the run is verbose.
func (e *Env) Logf(format string, args ...any) {
	if e.Verbose {
		_, _ = fmt.Fprintf(e.out, "chaos: %s: "+format+"\n", append([]any{e.name}, args...)...)
	}
}

// Result is what a cell measured.
type Result struct {
	Messages     int // inputs sent (or requests made)
	Kills        int // processes SIGKILLed, connections killed, servers crashed
	Restarts     int // servers or processes restarted
	Redeliveries int // deliveries beyond the first, as counted by the consumers
	Duplicates   int // inputs with more than one effect row (oracle)
	Lost         int // acknowledged inputs with no effect row (oracle)
	Note         string
}

// Cell is one entry of the matrix.
type Cell struct {
	Name string
	// Last cells run after all others (the rabbit/ cells, which boot a
	// RabbitMQ node of their own).
	Last bool
	// ExpectDuplicates marks a cell whose guarantee does not cover
	// duplicates (Redis without persistence): its duplicates are reported
	// as a rate and do not fail the run. Lost still fails it.
	ExpectDuplicates bool
	Run              func(ctx context.Context, env *Env) (Result, error)
}

var (
	mu       sync.Mutex
	cells    = map[string]Cell{}
	children = map[string]func(ctx context.Context) error{}
)

// Register adds a cell; call it from init. Names are unique.
func Register(c Cell) {
	mu.Lock()
	defer mu.Unlock()
	if _, dup := cells[c.Name]; dup || c.Name == "" || c.Run == nil {
		panic("chaos: bad or duplicate cell " + c.Name)
	}
	cells[c.Name] = c
}

// RegisterChild adds a function a cell can run in a child process (see
// StartChild); call it from init.
func RegisterChild(name string, f func(ctx context.Context) error) {
	mu.Lock()
	defer mu.Unlock()
	if _, dup := children[name]; dup {
		panic("chaos: duplicate child " + name)
	}
	children[name] = f
}

// ChildEnv is the environment variable that names the child function.
const ChildEnv = "IDEM_CHAOS_CHILD"

// ChildMain runs the child named by IDEM_CHAOS_CHILD and exits, when set.
// It returns at once in the parent. A child reads its parameters from its
// own environment variables, set by the cell that started it.
func ChildMain() {
	name := os.Getenv(ChildEnv)
	if name == "" {
		return
	}
	mu.Lock()
	f := children[name]
	mu.Unlock()
	if f == nil {
		fmt.Fprintf(os.Stderr, "chaos child: no child %q\n", name)
		os.Exit(2)
	}
	if err := f(context.Background()); err != nil {
		fmt.Fprintf(os.Stderr, "chaos child %s: %v\n", name, err)
		os.Exit(1)
	}
	os.Exit(0)
}

// Config is one run of the matrix.
type Config struct {
	Scale     Scale
	Seed      uint64
	Only      *regexp.Regexp // nil: every cell
	PGURL     string
	RedisAddr string
	AMQPURL   string
	NATSURL   string
	Exe       string
	Verbose   bool
	Out       io.Writer
	// Mult multiplies the full scale's sizes (messages, faults, time
	// limits; 0 or 1: as they are). It does not apply at the small scale.
	Mult int
	// Parallel is how many cells run at a time (0 or 1: one). The cells
	// share the services but nothing else: each has its own schema, key
	// prefix, queue, topic, throwaway servers and namespaces.
	Parallel int
}

// Names returns the registered cells in run order.
func Names() []string {
	mu.Lock()
	defer mu.Unlock()
	names := make([]string, 0, len(cells))
	for n := range cells {
		names = append(names, n)
	}
	sort.Slice(names, func(i, j int) bool {
		a, b := cells[names[i]], cells[names[j]]
		if a.Last != b.Last {
			return !a.Last
		}
		return names[i] < names[j]
	})
	return names
}

// Run runs the cells and prints their lines and the total. Up to
// cfg.Parallel cells run at a time (1 when unset), each line printed when
// its cell ends; the Last cells run after all others, one at a time. It
// returns an error when a cell failed to run or broke its promise.
func Run(ctx context.Context, cfg Config) error {
	par := max(cfg.Parallel, 1)
	scale := string(cfg.Scale)
	if cfg.Scale == Full && cfg.Mult > 1 {
		scale += fmt.Sprintf(" x%d", cfg.Mult)
	}
	_, _ = fmt.Fprintf(cfg.Out, "chaos: scale %s, seed %d, %d cell(s) at a time\n", scale, cfg.Seed, par)
	var first, last []string
	for _, name := range Names() {
		if cfg.Only != nil && !cfg.Only.MatchString(name) {
			continue
		}
		mu.Lock()
		c := cells[name]
		mu.Unlock()
		if c.Last {
			last = append(last, name)
		} else {
			first = append(first, name)
		}
	}
	if len(first)+len(last) == 0 {
		_, _ = fmt.Fprintln(cfg.Out, (&tally{}).line())
		return ErrNoCells
	}
	r := &runner{cfg: cfg}
	r.runAll(ctx, first, par)
	r.runAll(ctx, last, 1)
	_, _ = fmt.Fprintln(cfg.Out, r.total.line())
	if len(r.failed) > 0 {
		sort.Strings(r.failed)
		return fmt.Errorf("chaos: %d cell(s) failed: %v (seed %d)", len(r.failed), r.failed, cfg.Seed)
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return nil
}

// runner runs the cells of one Run and keeps what they add up to.
type runner struct {
	cfg    Config
	mu     sync.Mutex // guards total, failed and the writes to cfg.Out
	total  tally
	failed []string
}

// runAll runs names, par at a time, in order of start; it starts none once
// ctx is done.
func (r *runner) runAll(ctx context.Context, names []string, par int) {
	slots := make(chan struct{}, par)
	var wg sync.WaitGroup
	for _, name := range names {
		select {
		case slots <- struct{}{}:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			break
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-slots }()
			r.runCell(ctx, name)
		}()
	}
	wg.Wait()
}

// runCell runs one cell in a temporary directory of its own and prints its
// line.
func (r *runner) runCell(ctx context.Context, name string) {
	cfg := r.cfg
	mu.Lock()
	c := cells[name]
	mu.Unlock()
	out := &lockedWriter{mu: &r.mu, w: cfg.Out}
	dir, err := os.MkdirTemp("", "idem-chaos-")
	if err != nil {
		r.report(c, Result{}, fmt.Sprintf("chaos: %s: FAILED: %v", name, err))
		return
	}
	env := &Env{
		Scale: cfg.Scale, Mult: max(cfg.Mult, 1), Seed: cfg.Seed,
		Rand:  rand.New(rand.NewPCG(cfg.Seed, hash(name))),
		PGURL: cfg.PGURL, RedisAddr: cfg.RedisAddr, AMQPURL: cfg.AMQPURL, NATSURL: cfg.NATSURL,
		Exe: cfg.Exe, TempDir: dir, Verbose: cfg.Verbose, out: out, name: name,
	}
	start := time.Now()
	res, err := c.Run(ctx, env)
	_ = os.RemoveAll(dir)
	took := time.Since(start).Round(100 * time.Millisecond)
	line := fmt.Sprintf("chaos: %s: %d messages, %d kills, %d restarts, %d redeliveries, %d duplicate effects, %d lost",
		name, res.Messages, res.Kills, res.Restarts, res.Redeliveries, res.Duplicates, res.Lost)
	if c.ExpectDuplicates && res.Messages > 0 {
		line += fmt.Sprintf(" (duplicates expected: %.3f%% of messages)", 100*float64(res.Duplicates)/float64(res.Messages))
	}
	if res.Note != "" {
		line += " [" + res.Note + "]"
	}
	line += fmt.Sprintf(" in %s", took)
	failed := true
	switch {
	case errors.Is(err, ErrSkipped) && !testenv.Required():
		line += " SKIPPED: " + err.Error()
		failed = false
	case err != nil:
		line += " FAILED: " + err.Error()
	case res.Messages == 0:
		line += " FAILED: the cell sent no messages"
	case res.Lost != 0 || (!c.ExpectDuplicates && res.Duplicates != 0):
		line += " FAILED: promise broken"
	default:
		failed = false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	r.total.add(c, res)
	if failed {
		r.failed = append(r.failed, name)
	}
	_, _ = fmt.Fprintln(cfg.Out, line)
}

// report records a cell that could not start.
func (r *runner) report(c Cell, res Result, line string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.total.add(c, res)
	r.failed = append(r.failed, c.Name)
	_, _ = fmt.Fprintln(r.cfg.Out, line)
}

// lockedWriter serializes the progress lines of cells running at once.
type lockedWriter struct {
	mu *sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// tally sums the cells' results for the total line. Duplicates in the
// cells that promise none and duplicates in the cells marked
// ExpectDuplicates are summed apart: the first must be 0, the second is
// the lease stores' rate under faults aimed at their window.
type tally struct {
	Result
	expectedDups int // duplicate effects in the ExpectDuplicates cells
	expectedMsgs int // messages of the ExpectDuplicates cells
}

func (t *tally) add(c Cell, r Result) {
	t.Messages += r.Messages
	t.Kills += r.Kills
	t.Restarts += r.Restarts
	t.Redeliveries += r.Redeliveries
	t.Lost += r.Lost
	if c.ExpectDuplicates {
		t.expectedDups += r.Duplicates
		t.expectedMsgs += r.Messages
	} else {
		t.Duplicates += r.Duplicates
	}
}

// line is the total line.
func (t *tally) line() string {
	s := fmt.Sprintf("chaos: total: %d messages, %d kills, %d restarts, %d redeliveries, %d duplicate effects where 0 was promised",
		t.Messages, t.Kills, t.Restarts, t.Redeliveries, t.Duplicates)
	if t.expectedMsgs > 0 {
		s += fmt.Sprintf(", %d in the lease cells where they are expected (%.3f%% of their %d messages)",
			t.expectedDups, 100*float64(t.expectedDups)/float64(t.expectedMsgs), t.expectedMsgs)
	}
	return s + fmt.Sprintf(", %d lost", t.Lost)
}

// ErrNoCells is returned by the command when -only matches nothing.
var ErrNoCells = errors.New("chaos: no cell matches")

// ErrSkipped is wrapped in the error of a cell that cannot run on this
// machine (a privilege or a tool it needs is missing). The run prints the
// cell as SKIPPED with the reason and goes on, except where services are
// required (CI=true, testenv.Required): there it fails like any error.
var ErrSkipped = errors.New("the cell cannot run here")

func hash(s string) uint64 {
	var h uint64 = 14695981039346656037
	for i := 0; i < len(s); i++ {
		h ^= uint64(s[i])
		h *= 1099511628211
	}
	return h
}
