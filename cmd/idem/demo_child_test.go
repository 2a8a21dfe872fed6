package main

import (
	"context"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// The demo's child processes re-execute the running binary: here the test
// binary, whose init (demo_child.go) turns into the child when
// IDEM_DEMO_CHILD is set, before TestMain runs.

// demoRun is the outcome of one demo run in process.
type demoRun struct {
	out string
	// last holds the numbers of the last line: payments, duplicate
	// deliveries, naive extra, idem extra, lost.
	last [5]int
}

// row returns the naive and idem columns of the table row named name
// ("-" reads as -1).
func (r *demoRun) row(t *testing.T, name string) (naive, idem int) {
	t.Helper()
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + `\s+(-|\d+)\s+(-|\d+)$`).FindStringSubmatch(r.out)
	if m == nil {
		t.Fatalf("no row %q in the table", name)
	}
	num := func(s string) int {
		if s == "-" {
			return -1
		}
		n, _ := strconv.Atoi(s)
		return n
	}
	return num(m[1]), num(m[2])
}

// runDemo runs the demo with a small --payments and checks what every run
// must show: exit status 0, naive extra > 0, idem extra = 0, lost = 0.
func runDemoChecked(t *testing.T, payments int, args ...string) *demoRun {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	code, out, errOut := runCmd(ctx, t, append([]string{"demo", "--payments", strconv.Itoa(payments), "--progress", "plain"}, args...)...)
	t.Logf("stdout:\n%s\nstderr:\n%s", out, errOut)
	if code != 0 {
		t.Fatalf("exit status %d", code)
	}
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	m := lastLine.FindStringSubmatch(lines[len(lines)-1])
	if m == nil {
		t.Fatalf("last line %q is not the demo's summary", lines[len(lines)-1])
	}
	// The rerun line repeats every flag given.
	rerun := regexp.MustCompile(`(?m)^Rerun with: idem demo (.*)$`).FindStringSubmatch(out)
	if rerun == nil {
		t.Fatal("no Rerun with line")
	}
	given := append([]string{"--payments", strconv.Itoa(payments), "--progress", "plain"}, args...)
	for i := 0; i+1 < len(given); i += 2 {
		if want := given[i] + " " + shellQuote(given[i+1]); !strings.Contains(rerun[1]+" ", want+" ") {
			t.Errorf("rerun line %q does not have %q", rerun[1], want)
		}
	}
	r := &demoRun{out: out}
	for i := range r.last {
		r.last[i], _ = strconv.Atoi(m[i+1])
	}
	if r.last[0] != payments {
		t.Errorf("payments = %d, want %d", r.last[0], payments)
	}
	if r.last[1] <= 0 || r.last[2] <= 0 {
		t.Errorf("duplicates = %d, naive extra = %d: want both > 0", r.last[1], r.last[2])
	}
	if r.last[3] != 0 || r.last[4] != 0 {
		t.Errorf("idem extra = %d, lost = %d: want 0 and 0", r.last[3], r.last[4])
	}
	return r
}

// checkChildren checks that the idem consumer ran as child processes that
// were SIGKILLed and restarted, and that none is left.
func checkChildren(t *testing.T, r *demoRun) {
	t.Helper()
	if !strings.Contains(r.out, "idem consumer in child processes") {
		t.Errorf("the header does not say the idem consumer ran in child processes")
	}
	_, kills := r.row(t, "  child processes SIGKILLed")
	_, restarts := r.row(t, "  child processes restarted")
	_, crashes := r.row(t, "consumer crashes (restarted)")
	if kills <= 0 || restarts <= 0 {
		t.Errorf("child processes SIGKILLed %d, restarted %d: want both > 0", kills, restarts)
	}
	if crashes != kills {
		t.Errorf("idem consumer crashes %d, SIGKILLs %d: want them equal", crashes, kills)
	}
	if left := childrenOf(t, os.Getpid()); len(left) > 0 {
		t.Errorf("child processes left behind: %v", left)
	}
}

// childrenOf returns the processes whose parent is pid (Linux only).
func childrenOf(t *testing.T, pid int) []int {
	t.Helper()
	if runtime.GOOS != "linux" {
		return nil
	}
	stats, err := filepath.Glob("/proc/[0-9]*/stat")
	if err != nil {
		t.Fatal(err)
	}
	var out []int
	for _, name := range stats {
		b, err := os.ReadFile(name)
		if err != nil {
			continue // gone meanwhile
		}
		// pid (comm) state ppid ...: comm may hold spaces, so split
		// after its closing parenthesis.
		s := string(b)
		i := strings.LastIndexByte(s, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(s[i+1:])
		if len(f) < 2 {
			continue
		}
		if ppid, _ := strconv.Atoi(f[1]); ppid == pid {
			n, _ := strconv.Atoi(filepath.Base(filepath.Dir(name)))
			out = append(out, n)
		}
	}
	return out
}

// The child tests run with a fixed seed: each group draws its crashes from
// its own generator seeded with it, one draw per idem record a live child
// handled, whatever the timing. With seed 7 and --crash-rate 0.002 the idem
// group's draws 165, 229 and 307 are crashes, so 400 payments (more than
// 400 idem records) see SIGKILLs and restarts every time.

func TestDemoPostgres(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	pool := testenv.Pool(t, 2) // skips (or fails under CI=true) without PostgreSQL
	schema := testenv.Name("idem_demo")
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
			t.Errorf("drop schema %s: %v", schema, err)
		}
	})
	// A relay crash rate high enough that the payments see re-publishes.
	r := runDemoChecked(t, 400, "--postgres", testenv.PostgresURL(), "--schema", schema,
		"--crash-rate", "0.002", "--republish-rate", "0.2", "--seed", "7")
	checkChildren(t, r)
}

func TestDemoRedis(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	_ = testenv.Redis(t) // skips (or fails under CI=true) without Redis
	r := runDemoChecked(t, 400, "--redis", "redis://"+testenv.RedisAddr()+"/0",
		"--crash-rate", "0.002", "--republish-rate", "0.2", "--seed", "7")
	checkChildren(t, r)

	// A TTL a killed child's redelivery could outlast is refused.
	code, _, errOut := runCmd(context.Background(), t, "demo", "--payments", "10", "--redis", "redis://"+testenv.RedisAddr()+"/0", "--dedup-ttl", "3s")
	if want := "is shorter than a killed consumer's deliveries may take to come back"; code != 1 || !strings.Contains(errOut, want) {
		t.Errorf("--dedup-ttl 3s with --redis: exit status %d, stderr %q; want 1 and %q", code, errOut, want)
	}
}

// TestDemoPostgresFreshSchema runs the demo with --postgres and no
// --schema: it makes a schema of its own and drops it at the end.
func TestDemoPostgresFreshSchema(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	pool := testenv.Pool(t, 2) // skips (or fails under CI=true) without PostgreSQL
	r := runDemoChecked(t, 200, "--postgres", testenv.PostgresURL(), "--seed", "3")
	m := regexp.MustCompile(`schema (idem_demo\w*)`).FindStringSubmatch(r.out)
	if m == nil {
		t.Fatalf("the header names no schema:\n%s", r.out)
	}
	var left bool
	if err := pool.QueryRow(context.Background(), "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)", m[1]).Scan(&left); err != nil {
		t.Fatal(err)
	}
	if left {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{m[1]}.Sanitize()+" CASCADE")
		t.Errorf("the run left its schema %s behind", m[1])
	}
}
