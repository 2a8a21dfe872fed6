package childproc

import (
	"os/exec"
	"strings"
	"testing"
	"time"
)

func TestLinesExitAndStderr(t *testing.T) {
	var lines []string
	p, err := Start(exec.Command("sh", "-c", "echo one; echo two; echo oops >&2; exit 3"), 64, func(l string) { lines = append(lines, l) })
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.Exited():
	case <-time.After(10 * time.Second):
		t.Fatal("the child did not exit")
	}
	if strings.Join(lines, ",") != "one,two" {
		t.Fatalf("lines %q", lines)
	}
	if p.Err() == nil || p.DiedOfSIGKILL() || p.Signalled() {
		t.Fatalf("exit 3: Err %v, DiedOfSIGKILL %v, Signalled %v", p.Err(), p.DiedOfSIGKILL(), p.Signalled())
	}
	if got := p.StderrTail(); !strings.HasSuffix(got, "oops") {
		t.Fatalf("StderrTail %q", got)
	}
}

func TestKill(t *testing.T) {
	p, err := Start(exec.Command("sleep", "60"), 64, nil)
	if err != nil {
		t.Fatal(err)
	}
	p.Kill()
	select {
	case <-p.Exited():
	case <-time.After(10 * time.Second):
		t.Fatal("SIGKILL did not end the child")
	}
	if !p.Signalled() || !p.DiedOfSIGKILL() {
		t.Fatalf("Signalled %v, DiedOfSIGKILL %v (%v)", p.Signalled(), p.DiedOfSIGKILL(), p.Err())
	}
	p.Kill() // after the exit: nothing to do
	if p.ExitErr() == nil {
		t.Fatal("ExitErr of a killed child is nil")
	}
}

func TestCleanExitAndTailBound(t *testing.T) {
	p, err := Start(exec.Command("sh", "-c", "head -c 5000 /dev/zero | tr '\\0' x >&2"), 100, nil)
	if err != nil {
		t.Fatal(err)
	}
	<-p.Exited()
	if p.Err() != nil || p.ExitErr().Error() != "exit status 0" {
		t.Fatalf("Err %v, ExitErr %v", p.Err(), p.ExitErr())
	}
	if got := strings.TrimPrefix(p.StderrTail(), "; its stderr ends with:\n"); len(got) != 100 {
		t.Fatalf("kept %d bytes of stderr, want the last 100", len(got))
	}
}

func TestTailKeepsTheEnd(t *testing.T) {
	b := &tail{max: 8}
	_, _ = b.Write([]byte("0123456789"))
	_, _ = b.Write([]byte("ab"))
	if got := string(b.b); got != "456789ab" {
		t.Fatalf("kept %q, want %q", got, "456789ab")
	}
	if !strings.HasSuffix(b.suffix(), "456789ab") {
		t.Fatalf("suffix %q", b.suffix())
	}
	if (&tail{max: 8}).suffix() != "" {
		t.Fatal("an empty buffer has a suffix")
	}
}
