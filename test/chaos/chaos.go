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

// Pick returns small when s is Small, else full.
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

// Run runs the cells in order and prints their lines and the total. It
// returns an error when a cell failed to run or broke its promise.
func Run(ctx context.Context, cfg Config) error {
	_, _ = fmt.Fprintf(cfg.Out, "chaos: scale %s, seed %d\n", cfg.Scale, cfg.Seed)
	var total tally
	var failed []string
	ran := 0
	for _, name := range Names() {
		if cfg.Only != nil && !cfg.Only.MatchString(name) {
			continue
		}
		ran++
		mu.Lock()
		c := cells[name]
		mu.Unlock()
		dir, err := os.MkdirTemp("", "idem-chaos-")
		if err != nil {
			return err
		}
		env := &Env{
			Scale: cfg.Scale, Seed: cfg.Seed,
			Rand:  rand.New(rand.NewPCG(cfg.Seed, hash(name))),
			PGURL: cfg.PGURL, RedisAddr: cfg.RedisAddr, AMQPURL: cfg.AMQPURL, NATSURL: cfg.NATSURL,
			Exe: cfg.Exe, TempDir: dir, Verbose: cfg.Verbose, out: cfg.Out, name: name,
		}
		start := time.Now()
		r, err := c.Run(ctx, env)
		_ = os.RemoveAll(dir)
		took := time.Since(start).Round(100 * time.Millisecond)
		total.add(c, r)
		line := fmt.Sprintf("chaos: %s: %d messages, %d kills, %d restarts, %d redeliveries, %d duplicate effects, %d lost",
			name, r.Messages, r.Kills, r.Restarts, r.Redeliveries, r.Duplicates, r.Lost)
		if c.ExpectDuplicates && r.Messages > 0 {
			line += fmt.Sprintf(" (duplicates expected: %.3f%% of messages)", 100*float64(r.Duplicates)/float64(r.Messages))
		}
		if r.Note != "" {
			line += " [" + r.Note + "]"
		}
		line += fmt.Sprintf(" in %s", took)
		switch {
		case errors.Is(err, ErrSkipped) && !testenv.Required():
			line += " SKIPPED: " + err.Error()
		case err != nil:
			line += " FAILED: " + err.Error()
			failed = append(failed, name)
		case r.Messages == 0:
			line += " FAILED: the cell sent no messages"
			failed = append(failed, name)
		case r.Lost != 0 || (!c.ExpectDuplicates && r.Duplicates != 0):
			line += " FAILED: promise broken"
			failed = append(failed, name)
		}
		_, _ = fmt.Fprintln(cfg.Out, line)
		if ctx.Err() != nil {
			break
		}
	}
	_, _ = fmt.Fprintln(cfg.Out, total.line())
	if ran == 0 {
		return ErrNoCells
	}
	if len(failed) > 0 {
		return fmt.Errorf("chaos: %d cell(s) failed: %v (seed %d)", len(failed), failed, cfg.Seed)
	}
	if ctx.Err() != nil {
		return ctx.Err()
	}
	return nil
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
