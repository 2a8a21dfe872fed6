package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// kfake's Close and kafka-go's Transport.CloseIdleConnections join their
// goroutines, so the command needs no goleak ignores beyond testenv's.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m, testenv.LeakOptions()...) }

// mainEnv makes the test binary run the command of its arguments, as the
// idem binary would, and exit: for what only a separate process shows, such
// as what a library writes to the process's own stderr.
const mainEnv = "IDEM_TEST_MAIN"

func init() {
	if os.Getenv(mainEnv) == "1" {
		os.Exit(run(context.Background(), os.Args[1:], os.Stdout, os.Stderr))
	}
}

// runProcess runs the command in a child process of the test binary.
func runProcess(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], args...)
	cmd.Env = append(os.Environ(), mainEnv+"=1")
	var out, errOut bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errOut
	err := cmd.Run()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatalf("run %v: %v", args, err)
	}
	return cmd.ProcessState.ExitCode(), out.String(), errOut.String()
}

// syncBuffer is a bytes.Buffer that a command writes while a test reads.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// startProcess starts the command in a child process of the test binary,
// for a test that kills it: exited receives the child's end, out collects
// its stdout and stderr. The child is killed when the test ends.
func startProcess(t *testing.T, args ...string) (*exec.Cmd, <-chan error, *syncBuffer) {
	t.Helper()
	cmd := exec.Command(os.Args[0], args...)
	cmd.Env = append(os.Environ(), mainEnv+"=1")
	out := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() { _ = cmd.Process.Kill() })
	return cmd, exited, out
}

// runCmd runs the command in process and returns its exit status and output.
func runCmd(ctx context.Context, t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	code = run(ctx, args, &out, &errOut)
	return code, out.String(), errOut.String()
}

// demoTable is a demo's output without the line of its running time.
func demoTable(out string) string {
	return regexp.MustCompile(`(?m)^Ran in .*\n`).ReplaceAllString(out, "")
}

// TestDemoRepeatsWithSeed runs the embedded demo twice with one seed: the
// runs must print the same table, whatever the goroutines did.
func TestDemoRepeatsWithSeed(t *testing.T) {
	args := []string{"--crash-rate", "0.01", "--republish-rate", "0.5", "--seed", "7", "--clients", "8"}
	first := runDemoChecked(t, 400, args...)
	for _, row := range []string{"  double click", "  client retry after timeout", "  re-publish (relay crash)", "  redelivery (consumer crash)"} {
		if naive, _ := first.row(t, row); naive <= 0 {
			t.Errorf("row %q: naive %d, want > 0 (a seed that shows every cause)", row, naive)
		}
	}
	second := runDemoChecked(t, 400, args...)
	if a, b := demoTable(first.out), demoTable(second.out); a != b {
		t.Errorf("two runs with --seed 7 differ:\n%s\n%s", a, b)
	}
}

var lastLine = regexp.MustCompile(`(?m)^demo: (\d+) payments, (\d+) duplicate deliveries, naive (\d+) extra, idem (\d+) extra, (\d+) lost$`)

func checkDemo(t *testing.T, args ...string) {
	t.Helper()
	checkDemoN(t, 500, args...)
}

func checkDemoN(t *testing.T, payments int, args ...string) {
	t.Helper()
	runDemoChecked(t, payments, args...)
}

func TestDemo(t *testing.T) {
	// Rates high enough that 500 payments see every cause of duplicates.
	checkDemo(t, "--crash-rate", "0.002", "--republish-rate", "0.2", "--seed", "42")
}

func TestFlagErrors(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{nil, 2, "Usage:"},
		{[]string{"frobnicate"}, 2, `unknown command "frobnicate"`},
		{[]string{"demo", "--payments", "0"}, 2, "--payments must be between 1 and 1000000"},
		{[]string{"demo", "--payments", "1000001"}, 2, "--payments must be between 1 and 1000000"},
		{[]string{"demo", "--payments", "99999999999"}, 2, "--payments must be between 1 and 1000000"},
		{[]string{"demo", "--payments", "9223372036854775807"}, 2, "--payments must be between 1 and 1000000"},
		{[]string{"demo", "--timeout", "-1s"}, 2, "--timeout must be positive"},
		{[]string{"demo", "--dedup-ttl", "500ms"}, 2, "--dedup-ttl must be at least 1s"},
		{[]string{"demo", "--payments", "x"}, 2, "invalid value"},
		{[]string{"demo", "--crash-rate", "2"}, 2, "rates must be between 0 and 1"},
		{[]string{"demo", "--nope"}, 2, "flag provided but not defined: -nope"},
		{[]string{"demo", "extra"}, 2, `unexpected argument "extra"`},
		{[]string{"demo", "--postgres", "postgres://x@" + testenv.DeadAddr(t) + "/db"}, 1, "is unreachable"},
		{[]string{"demo", "--postgres", "postgres://x", "--schema", "Bad-Name"}, 2, "--schema must be a lowercase identifier"},
		{[]string{"demo", "--postgres", "postgres://x", "--redis", "redis://y"}, 2, "exclusive"},
		{[]string{"demo", "--amqp", "amqp://guest:guest@" + testenv.DeadAddr(t) + "/"}, 1, "is unreachable"},
		{[]string{"demo", "--amqp", "http://x"}, 1, "--amqp:"},
		{[]string{"demo", "--amqp", "amqp://x", "--kafka", "k:9092"}, 2, "exclusive"},
		{[]string{"demo", "--redis", "bogus://"}, 1, "--redis:"},
		{[]string{"migrate"}, 2, "missing action"},
		{[]string{"migrate", "sideways"}, 2, `unknown action "sideways"`},
		{[]string{"migrate", "up", "--postgres", ""}, 1, "--postgres (or IDEM_POSTGRES_URL) is required"},
		{[]string{"migrate", "up", "--postgres", "postgres://x@" + testenv.DeadAddr(t) + "/db"}, 1, "is unreachable"},
		{[]string{"relay"}, 2, "--postgres (or IDEM_POSTGRES_URL) is required"},
		{[]string{"relay", "--postgres", "postgres://x"}, 2, "exactly one of --kafka and --amqp"},
		{[]string{"relay", "--postgres", "postgres://x", "--kafka", "k:9092", "--log-format", "xml"}, 2, "--log-format"},
		{[]string{"outbox"}, 2, "missing action"},
		{[]string{"outbox", "requeue"}, 2, "requeue needs the ids"},
		{[]string{"dedup", "purge"}, 2, `unknown action "purge"`},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			t.Setenv("IDEM_POSTGRES_URL", "")
			code, _, errOut := runCmd(ctx, t, tc.args...)
			if code != tc.code {
				t.Errorf("exit status %d, want %d; stderr:\n%s", code, tc.code, errOut)
			}
			if !strings.Contains(errOut, tc.want) {
				t.Errorf("stderr %q does not contain %q", errOut, tc.want)
			}
			if strings.Contains(errOut, "goroutine ") || strings.Contains(errOut, "panic") {
				t.Errorf("stderr has a stack trace:\n%s", errOut)
			}
		})
	}
}

// TestFlagErrorsNameTheCommand: a flag error names the command and points
// to its -h, in every command.
func TestFlagErrorsNameTheCommand(t *testing.T) {
	for _, tc := range []struct {
		args []string
		cmd  string
	}{
		{[]string{"demo", "--bogus"}, "idem demo"},
		{[]string{"demo", "--payments", "x"}, "idem demo"},
		{[]string{"migrate", "up", "--bogus"}, "idem migrate"},
		{[]string{"relay", "--bogus"}, "idem relay"},
		{[]string{"relay", "slot", "show", "--bogus"}, "idem relay slot"},
		{[]string{"outbox", "stats", "--bogus"}, "idem outbox"},
		{[]string{"dedup", "stats", "--bogus"}, "idem dedup"},
		{[]string{"dedup", "show", "--bogus"}, "idem dedup show"},
		{[]string{"deadletter", "list", "--bogus"}, "idem deadletter"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			code, _, errOut := runCmd(context.Background(), t, tc.args...)
			lines := strings.Split(strings.TrimSuffix(errOut, "\n"), "\n")
			if code != 2 || len(lines) != 2 || !strings.HasPrefix(lines[0], tc.cmd+": ") ||
				lines[1] != "Run '"+tc.cmd+" -h' for its flags." {
				t.Errorf("exit %d, stderr:\n%s\nwant exit 2, a line starting %q and a pointer to %q", code, errOut, tc.cmd+": ", tc.cmd+" -h")
			}
		})
	}
}

func TestHelp(t *testing.T) {
	for _, cmd := range []string{"demo", "migrate", "relay", "outbox", "dedup", "dedup show", "deadletter"} {
		code, _, errOut := runCmd(context.Background(), t, append(strings.Fields(cmd), "-help")...)
		if code != 0 || !strings.Contains(errOut, "Usage: idem "+cmd) {
			t.Errorf("%s -help: exit %d, output %q", cmd, code, errOut)
		}
	}
	code, out, _ := runCmd(context.Background(), t, "help")
	if code != 0 || !strings.Contains(out, "idem demo") {
		t.Errorf("help: exit %d, output %q", code, out)
	}
}

// TestDemoRedisAddress checks that --redis takes a host:port as well as a
// URL, and that an unreachable Redis is one line on stderr, with none of
// go-redis's own log lines before it.
func TestDemoRedisAddress(t *testing.T) {
	dead := testenv.DeadAddr(t)
	for _, addr := range []string{dead, "redis://" + dead + "/0"} {
		code, _, errOut := runProcess(t, "demo", "--redis", addr, "--payments", "10", "--progress", "none")
		want := "idem demo: redis at " + dead + " is unreachable"
		if code != 1 || !strings.HasPrefix(errOut, want) || strings.Count(errOut, "\n") != 1 {
			t.Errorf("--redis %s: exit %d, stderr:\n%s\nwant exit 1 and one line starting %q", addr, code, errOut, want)
		}
	}
}
