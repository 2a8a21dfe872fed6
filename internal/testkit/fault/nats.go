//go:build unix

package fault

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
	"time"
)

// NATSOptions configure a throwaway NATS server. The zero value is usable.
type NATSOptions struct {
	// Binary is the nats-server to run. Defaults to $IDEM_NATS_SERVER,
	// then nats-server on $PATH, then /usr/sbin/nats-server.
	Binary string
	// StartTimeout bounds each start. Defaults to 30s.
	StartTimeout time.Duration
}

// NATS is a throwaway nats-server with JetStream (-js) on its own port on
// 127.0.0.1 and its own store directory. Kill SIGKILLs it; Restart starts
// it again on the same port and store, where JetStream recovers its
// streams and consumers from what reached the disk. Close stops it and
// removes its directory. Safe for concurrent use.
type NATS struct {
	bin    string
	dir    string
	log    string
	port   int
	opts   NATSOptions
	mu     sync.Mutex
	proc   *owned
	closed bool
}

// StartNATS starts a nats-server with JetStream on a free port. The caller
// must Close it.
func StartNATS(ctx context.Context, opts NATSOptions) (*NATS, error) {
	if opts.StartTimeout <= 0 {
		opts.StartTimeout = 30 * time.Second
	}
	bin := opts.Binary
	if bin == "" {
		bin = os.Getenv("IDEM_NATS_SERVER")
	}
	if bin == "" {
		if p, err := exec.LookPath("nats-server"); err == nil {
			bin = p
		} else if _, err := os.Stat("/usr/sbin/nats-server"); err == nil {
			bin = "/usr/sbin/nats-server"
		} else {
			return nil, errors.New("fault: nats: nats-server not found on $PATH or in /usr/sbin (install it, or set IDEM_NATS_SERVER)")
		}
	}
	dir, err := os.MkdirTemp("", "idem-fault-nats-")
	if err != nil {
		return nil, fmt.Errorf("fault: nats: %w", err)
	}
	n := &NATS{bin: bin, dir: dir, log: filepath.Join(dir, "nats.log"), opts: opts}
	var lastErr error
	for range 3 {
		if n.port, err = FreePort(); err != nil {
			_ = os.RemoveAll(dir)
			return nil, err
		}
		if lastErr = n.Restart(ctx); lastErr == nil {
			return n, nil
		}
		if ctx.Err() != nil {
			break
		}
	}
	_ = os.RemoveAll(dir)
	return nil, lastErr
}

// URL is the nats:// URL of the server.
func (n *NATS) URL() string { return fmt.Sprintf("nats://127.0.0.1:%d", n.port) }

// Kill SIGKILLs the server and waits until it is gone. Killing a stopped
// server does nothing.
func (n *NATS) Kill() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.proc != nil {
		n.proc.kill()
		n.proc = nil
	}
	return nil
}

// Restart starts the server again on the same port and store (a running
// server is killed first) and waits until it accepts connections.
func (n *NATS) Restart(ctx context.Context) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		return errors.New("fault: nats: closed")
	}
	if n.proc != nil {
		n.proc.kill()
		n.proc = nil
	}
	logf, err := os.OpenFile(n.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("fault: nats: log: %w", err)
	}
	defer func() { _ = logf.Close() }()
	cmd := exec.Command(n.bin, "-js", "-sd", filepath.Join(n.dir, "store"), "-a", "127.0.0.1", "-p", strconv.Itoa(n.port))
	cmd.Dir = n.dir
	cmd.Stdout, cmd.Stderr = logf, logf
	proc, err := startOwned(cmd, syscall.SIGKILL)
	if err != nil {
		return fmt.Errorf("fault: nats: start: %w", err)
	}
	n.proc = proc
	sctx, cancel := context.WithTimeout(ctx, n.opts.StartTimeout)
	defer cancel()
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(n.port))
	for {
		var d net.Dialer
		c, err := d.DialContext(sctx, "tcp", addr)
		if err == nil {
			_ = c.Close()
			return nil
		}
		if proc.exited() {
			n.proc = nil
			return fmt.Errorf("fault: nats: the server exited while starting (%w): %s", exitErr(proc.err), logTail(n.log, 2000))
		}
		select {
		case <-sctx.Done():
			proc.kill()
			n.proc = nil
			return fmt.Errorf("fault: nats: not listening after %v: %w: %s", n.opts.StartTimeout, err, logTail(n.log, 2000))
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// Close kills the server and removes its directory.
func (n *NATS) Close() error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		return nil
	}
	n.closed = true
	if n.proc != nil {
		n.proc.kill()
		n.proc = nil
	}
	if err := os.RemoveAll(n.dir); err != nil {
		return fmt.Errorf("fault: nats: remove %s: %w", n.dir, err)
	}
	return nil
}
