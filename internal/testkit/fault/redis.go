//go:build unix

package fault

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// RedisOptions configure a throwaway Redis. The zero value is usable.
type RedisOptions struct {
	// Binary is the redis-server to run. Defaults to $IDEM_REDIS_SERVER,
	// then redis-server on $PATH.
	Binary string
	// Args are extra redis-server arguments ("--maxmemory", "10mb", ...).
	Args []string
	// StartTimeout bounds each start. Defaults to 30s.
	StartTimeout time.Duration
}

// Redis is a throwaway redis-server on its own port on 127.0.0.1, without
// persistence: no RDB snapshots, no AOF. Kill SIGKILLs it and Restart
// starts a new, empty one on the same port — what a Redis restart without
// persistence does to every mark. Close stops it and removes its directory.
// Safe for concurrent use.
type Redis struct {
	bin    string
	dir    string
	log    string
	port   int
	opts   RedisOptions
	mu     sync.Mutex
	proc   *owned
	closed bool
}

// StartRedis starts a redis-server on a free port. The caller must Close it.
func StartRedis(ctx context.Context, opts RedisOptions) (*Redis, error) {
	if opts.StartTimeout <= 0 {
		opts.StartTimeout = 30 * time.Second
	}
	bin := opts.Binary
	if bin == "" {
		bin = os.Getenv("IDEM_REDIS_SERVER")
	}
	if bin == "" {
		p, err := exec.LookPath("redis-server")
		if err != nil {
			return nil, errors.New("fault: redis: redis-server not found on $PATH (install Redis, or set IDEM_REDIS_SERVER)")
		}
		bin = p
	}
	dir, err := os.MkdirTemp("", "idem-fault-redis-")
	if err != nil {
		return nil, fmt.Errorf("fault: redis: %w", err)
	}
	r := &Redis{bin: bin, dir: dir, log: filepath.Join(dir, "redis.log"), opts: opts}
	var lastErr error
	for range 3 {
		if r.port, err = FreePort(); err != nil {
			_ = os.RemoveAll(dir)
			return nil, err
		}
		if lastErr = r.Restart(ctx); lastErr == nil {
			return r, nil
		}
		if ctx.Err() != nil {
			break
		}
	}
	_ = os.RemoveAll(dir)
	return nil, lastErr
}

// Addr is the host:port the server listens on.
func (r *Redis) Addr() string { return fmt.Sprintf("127.0.0.1:%d", r.port) }

// Dir is the server's working directory (its --dir), which a Restart
// keeps.
func (r *Redis) Dir() string { return r.dir }

// Running reports whether the server process is up.
func (r *Redis) Running() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.proc != nil && !r.proc.exited()
}

// Kill SIGKILLs the server and waits until it is gone. Every key is lost.
// Killing a stopped server does nothing.
func (r *Redis) Kill() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.proc != nil {
		r.proc.kill()
		r.proc = nil
	}
	return nil
}

// Restart starts a new, empty server on the same port (after Kill; a
// running server is killed first) and waits until it answers PING.
func (r *Redis) Restart(ctx context.Context) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return errors.New("fault: redis: closed")
	}
	if r.proc != nil {
		r.proc.kill()
		r.proc = nil
	}
	args := append([]string{
		"--port", strconv.Itoa(r.port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", r.dir,
		"--daemonize", "no", "--protected-mode", "no", "--loglevel", "warning",
	}, r.opts.Args...)
	logf, err := os.OpenFile(r.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("fault: redis: log: %w", err)
	}
	defer func() { _ = logf.Close() }()
	cmd := exec.Command(r.bin, args...)
	cmd.Dir = r.dir
	cmd.Stdout, cmd.Stderr = logf, logf
	proc, err := startOwned(cmd, syscall.SIGKILL)
	if err != nil {
		return fmt.Errorf("fault: redis: start: %w", err)
	}
	r.proc = proc
	sctx, cancel := context.WithTimeout(ctx, r.opts.StartTimeout)
	defer cancel()
	for {
		reply, err := RedisCommand(sctx, r.Addr(), "PING")
		if err == nil && reply == "PONG" {
			return nil
		}
		if proc.exited() {
			r.proc = nil
			return fmt.Errorf("fault: redis: the server exited while starting (%w): %s", exitErr(proc.err), logTail(r.log, 2000))
		}
		select {
		case <-sctx.Done():
			proc.kill()
			r.proc = nil
			return fmt.Errorf("fault: redis: no PONG after %v: %w: %s", r.opts.StartTimeout, err, logTail(r.log, 2000))
		case <-time.After(10 * time.Millisecond):
		}
	}
}

// ClientKill closes every normal client connection (CLIENT KILL TYPE normal;
// the connection that sends it is spared) and returns how many it closed.
func (r *Redis) ClientKill(ctx context.Context) (int, error) {
	reply, err := RedisCommand(ctx, r.Addr(), "CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
	if err != nil {
		return 0, fmt.Errorf("fault: redis: CLIENT KILL: %w", err)
	}
	n, err := strconv.Atoi(reply)
	if err != nil {
		return 0, fmt.Errorf("fault: redis: CLIENT KILL answered %q", reply)
	}
	return n, nil
}

// Close kills the server and removes its directory.
func (r *Redis) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil
	}
	r.closed = true
	if r.proc != nil {
		r.proc.kill()
		r.proc = nil
	}
	if err := os.RemoveAll(r.dir); err != nil {
		return fmt.Errorf("fault: redis: remove %s: %w", r.dir, err)
	}
	return nil
}

// RedisCommand sends one command to the Redis at addr on a connection of
// its own and returns the reply: a simple string, an integer or a bulk
// string as text ("" for a nil bulk string). An error reply is returned as
// an error. Arrays are not supported.
func RedisCommand(ctx context.Context, addr string, args ...string) (string, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return "", err
	}
	defer func() { _ = c.Close() }()
	if dl, ok := ctx.Deadline(); ok {
		_ = c.SetDeadline(dl)
	} else {
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	}
	var b strings.Builder
	fmt.Fprintf(&b, "*%d\r\n", len(args))
	for _, a := range args {
		fmt.Fprintf(&b, "$%d\r\n%s\r\n", len(a), a)
	}
	if _, err := c.Write([]byte(b.String())); err != nil {
		return "", err
	}
	br := bufio.NewReader(c)
	line, err := br.ReadString('\n')
	if err != nil {
		return "", err
	}
	line = strings.TrimRight(line, "\r\n")
	if line == "" {
		return "", errors.New("fault: redis: empty reply")
	}
	switch line[0] {
	case '+', ':':
		return line[1:], nil
	case '-':
		return "", fmt.Errorf("fault: redis: %s", line[1:])
	case '$':
		n, err := strconv.Atoi(line[1:])
		if err != nil {
			return "", fmt.Errorf("fault: redis: bad bulk length %q", line)
		}
		if n < 0 {
			return "", nil
		}
		buf := make([]byte, n+2)
		if _, err := io.ReadFull(br, buf); err != nil {
			return "", err
		}
		return string(buf[:n]), nil
	default:
		return "", fmt.Errorf("fault: redis: unsupported reply %q", line)
	}
}
