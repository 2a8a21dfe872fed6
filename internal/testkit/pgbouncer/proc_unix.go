//go:build unix

package pgbouncer

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"runtime"
	"strconv"
	"syscall"
	"time"

	"github.com/idemkit/idem/internal/childproc"
)

// proc is a started pgbouncer, reaped by a goroutine of its own that holds
// its OS thread for the child's lifetime: the parent-death signal fires
// when the thread that forked the child exits.
type proc struct {
	cmd  *exec.Cmd
	done chan struct{}
	err  error // Wait's error; read after done
}

// startProc starts bin on the configuration file ini, its output appended
// to log. Run by root, it runs as the postgres (or nobody) OS user, and
// reads ini through a descriptor opened here (/dev/fd/3): the directory may
// be closed to that user.
func startProc(bin, ini, log string) (*proc, error) {
	logf, err := os.OpenFile(log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer func() { _ = logf.Close() }() // the child holds its own descriptor
	cfg, err := os.Open(ini)
	if err != nil {
		return nil, err
	}
	defer func() { _ = cfg.Close() }()
	cmd := exec.Command(bin, "/dev/fd/3")
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.ExtraFiles = []*os.File{cfg}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if os.Geteuid() == 0 {
		cred, err := unprivileged()
		if err != nil {
			return nil, err
		}
		cmd.SysProcAttr.Credential = cred
	}
	childproc.SetDeathSignal(cmd, syscall.SIGKILL)
	p := &proc{cmd: cmd, done: make(chan struct{})}
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := cmd.Start(); err != nil {
			started <- err
			close(p.done)
			return
		}
		started <- nil
		p.err = cmd.Wait()
		close(p.done)
	}()
	if err := <-started; err != nil {
		return nil, err
	}
	return p, nil
}

// unprivileged is the credential of the postgres OS user, or of nobody.
func unprivileged() (*syscall.Credential, error) {
	var errs []error
	for _, name := range []string{"postgres", "nobody"} {
		u, err := user.Lookup(name)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
		gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
		if err := errors.Join(err1, err2); err != nil {
			return nil, fmt.Errorf("the %s user's ids: %w", name, err)
		}
		return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), NoSetGroups: true}, nil
	}
	return nil, fmt.Errorf("pgbouncer refuses to run as root, and there is neither a postgres nor a nobody OS user to run it as: %w", errors.Join(errs...))
}

func (p *proc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

func (p *proc) exitErr() error {
	if !p.exited() {
		return errors.New("running")
	}
	if p.err == nil {
		return errors.New("exit status 0")
	}
	return p.err
}

// kill SIGKILLs the process and waits until it is reaped.
func (p *proc) kill() {
	if !p.exited() {
		_ = p.cmd.Process.Kill()
	}
	<-p.done
}

// stop sends SIGTERM (PgBouncer's immediate shutdown), then SIGKILL after
// grace.
func (p *proc) stop(grace time.Duration) {
	if !p.exited() {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
	}
	t := time.NewTimer(grace)
	defer t.Stop()
	select {
	case <-p.done:
	case <-t.C:
		p.kill()
	}
}
