// Package childproc runs the child processes that idem's crash runs
// SIGKILL: the chaos matrix's consumers and relays (test/chaos) and the
// demo's consumer (cmd/idem). It starts a command with pipes, hands each
// line the child writes to stdout to a callback, keeps the end of its
// stderr for error messages, reaps it, and tells a SIGKILL from any other
// exit.
package childproc

import (
	"bufio"
	"errors"
	"io"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
)

// Proc is one started child.
type Proc struct {
	Cmd   *exec.Cmd
	Stdin io.WriteCloser

	stderr    *tail
	exited    chan struct{}
	err       error
	signalled atomic.Bool
}

// Start starts cmd with its stdin and stdout piped and its stderr kept
// (the last stderrMax bytes). Each line the child writes to stdout is passed
// to line, in order, on one goroutine; line may be nil. On Linux the child
// gets SIGKILL when the parent dies, so no child outlives a runner or demo
// that was itself killed.
func Start(cmd *exec.Cmd, stderrMax int, line func(string)) (*Proc, error) {
	SetDeathSignal(cmd, syscall.SIGKILL)
	p := &Proc{Cmd: cmd, stderr: &tail{max: stderrMax}, exited: make(chan struct{})}
	cmd.Stderr = p.stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if p.Stdin, err = cmd.StdinPipe(); err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if line != nil {
				line(sc.Text())
			}
		}
		_, _ = io.Copy(io.Discard, out)
		// Wait closes the pipes: only after stdout was read to its end.
		p.err = cmd.Wait()
		close(p.exited)
	}()
	return p, nil
}

// Exited is closed once the child was reaped; Err is set then.
func (p *Proc) Exited() <-chan struct{} { return p.exited }

// Err is how the child exited (cmd.Wait's error). Read it after Exited.
func (p *Proc) Err() error { return p.err }

// ExitErr is Err, or "exit status 0" for a clean exit: for messages about a
// child that should not have exited.
func (p *Proc) ExitErr() error {
	if p.err == nil {
		return errors.New("exit status 0")
	}
	return p.err
}

// Kill sends SIGKILL unless the child has exited already.
func (p *Proc) Kill() {
	select {
	case <-p.exited:
	default:
		p.signalled.Store(true)
		_ = p.Cmd.Process.Signal(syscall.SIGKILL)
	}
}

// Signalled reports whether Kill sent SIGKILL.
func (p *Proc) Signalled() bool { return p.signalled.Load() }

// DiedOfSIGKILL reports whether the exited child died of SIGKILL (sent by
// Kill or by anyone else).
func (p *Proc) DiedOfSIGKILL() bool {
	var ee *exec.ExitError
	if errors.As(p.err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL {
			return true
		}
	}
	return false
}

// Stderr is what the child wrote to stderr, its last stderrMax bytes.
func (p *Proc) Stderr() string {
	p.stderr.mu.Lock()
	defer p.stderr.mu.Unlock()
	return string(p.stderr.b)
}

// StderrTail is the end of the child's stderr as a suffix for an error
// message ("; its stderr ends with: ..."), or "" when it wrote nothing.
func (p *Proc) StderrTail() string { return p.stderr.suffix() }

// tail keeps the last max bytes written to it.
type tail struct {
	mu  sync.Mutex
	max int
	b   []byte
}

func (t *tail) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if len(t.b) > t.max {
		t.b = append(t.b[:0], t.b[len(t.b)-t.max:]...)
	}
	return len(p), nil
}

func (t *tail) suffix() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := strings.TrimSpace(string(t.b))
	if s == "" {
		return ""
	}
	if len(s) > 2000 {
		s = "..." + s[len(s)-2000:]
	}
	return "; its stderr ends with:\n" + s
}
