//go:build unix

package pgbouncer

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"strconv"
	"syscall"
	"time"

	"github.com/idemkit/idem/internal/testkit/fault"
)

// proc is a started pgbouncer (see fault.Process).
type proc struct{ p *fault.Process }

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
	p, err := fault.StartProcess(cmd, syscall.SIGKILL)
	if err != nil {
		return nil, err
	}
	return &proc{p: p}, nil
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

func (p *proc) exited() bool { return p.p.Exited() }

func (p *proc) exitErr() error { return p.p.Err() }

// kill SIGKILLs the process and waits until it is reaped.
func (p *proc) kill() { p.p.Kill() }

// stop sends SIGTERM (PgBouncer's immediate shutdown), then SIGKILL after
// grace.
func (p *proc) stop(grace time.Duration) { p.p.Stop(syscall.SIGTERM, grace) }
