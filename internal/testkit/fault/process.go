//go:build unix

package fault

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"syscall"
	"time"

	"github.com/idemkit/idem/internal/childproc"
)

// Pause stops p with SIGSTOP: it keeps its sockets and memory but runs no
// instruction, like a process descheduled by a long GC pause or a frozen VM.
func Pause(p *os.Process) error {
	if err := p.Signal(syscall.SIGSTOP); err != nil {
		return fmt.Errorf("fault: SIGSTOP %d: %w", p.Pid, err)
	}
	return nil
}

// Resume continues a process stopped by Pause (SIGCONT).
func Resume(p *os.Process) error {
	if err := p.Signal(syscall.SIGCONT); err != nil {
		return fmt.Errorf("fault: SIGCONT %d: %w", p.Pid, err)
	}
	return nil
}

// owned is a child process whose exit is waited for by a goroutine of its
// own. The goroutine holds its OS thread for the child's lifetime: the
// parent-death signal (Pdeathsig) fires when the thread that forked the
// child exits, and this way that thread outlives the child whatever the
// rest of the program does with LockOSThread.
type owned struct {
	cmd  *exec.Cmd
	done chan struct{} // closed when the process has exited and been reaped
	err  error         // Wait's error; read after done
}

// startOwned starts cmd with a parent-death signal and in a process group of
// its own (a terminal's ^C does not reach it; the owner stops it).
func startOwned(cmd *exec.Cmd, deathSig syscall.Signal) (*owned, error) {
	if cmd.SysProcAttr == nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{}
	}
	cmd.SysProcAttr.Setpgid = true
	childproc.SetDeathSignal(cmd, deathSig)
	o := &owned{cmd: cmd, done: make(chan struct{})}
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := cmd.Start(); err != nil {
			started <- err
			close(o.done)
			return
		}
		started <- nil
		o.err = cmd.Wait()
		close(o.done)
	}()
	if err := <-started; err != nil {
		return nil, err
	}
	return o, nil
}

// exited reports whether the process has exited.
func (o *owned) exited() bool {
	select {
	case <-o.done:
		return true
	default:
		return false
	}
}

// wait waits up to d for the process to exit, then SIGKILLs it and waits
// for good. It reports whether the process exited on its own.
func (o *owned) wait(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-o.done:
		return true
	case <-t.C:
	}
	_ = o.cmd.Process.Kill()
	<-o.done
	return false
}

// kill SIGKILLs the process and waits until it is reaped.
func (o *owned) kill() {
	if !o.exited() {
		// An error means the process is already gone; wait below either way.
		_ = o.cmd.Process.Kill()
	}
	<-o.done
}

// exitErr is a process's Wait error, or one that says it exited with 0.
func exitErr(err error) error {
	if err == nil {
		return errors.New("exit status 0")
	}
	return err
}

// logTail returns the last n bytes of the file at path, for error messages.
func logTail(path string, n int64) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer func() { _ = f.Close() }()
	st, err := f.Stat()
	if err != nil {
		return ""
	}
	off := st.Size() - n
	if off < 0 {
		off = 0
	}
	b := make([]byte, st.Size()-off)
	if _, err := f.ReadAt(b, off); err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// Process is a child process a test owns, for packages that start servers
// of their own: started in a process group of its own with a parent-death
// signal, and reaped by a goroutine that holds its OS thread for the
// child's lifetime, as fault's own servers are.
type Process struct{ o *owned }

// StartProcess starts cmd (keeping the SysProcAttr it has, a Credential
// say) and returns it owned; deathSig reaches it when the thread that
// forked it exits.
func StartProcess(cmd *exec.Cmd, deathSig syscall.Signal) (*Process, error) {
	o, err := startOwned(cmd, deathSig)
	if err != nil {
		return nil, err
	}
	return &Process{o: o}, nil
}

// Exited reports whether the process has exited.
func (p *Process) Exited() bool { return p.o.exited() }

// Err is the process's exit error: "running" while it runs, "exit status 0"
// when it exited cleanly.
func (p *Process) Err() error {
	if !p.o.exited() {
		return errors.New("running")
	}
	return exitErr(p.o.err)
}

// Kill SIGKILLs the process and waits until it is reaped.
func (p *Process) Kill() { p.o.kill() }

// Stop sends sig, waits up to grace for the process to exit, then SIGKILLs
// it and waits until it is reaped.
func (p *Process) Stop(sig syscall.Signal, grace time.Duration) {
	if !p.o.exited() {
		// An error means the process is already gone; wait below either way.
		_ = p.o.cmd.Process.Signal(sig)
	}
	p.o.wait(grace)
}
