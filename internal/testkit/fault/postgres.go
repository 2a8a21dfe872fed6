//go:build unix

package fault

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// PostgresOptions configure a throwaway PostgreSQL. The zero value is usable.
type PostgresOptions struct {
	// BinDir holds initdb, postgres and pg_ctl. Defaults to
	// $IDEM_PG_BINDIR, then `pg_config --bindir`, then the newest
	// /usr/lib/postgresql/*/bin, then the directory of initdb on $PATH.
	BinDir string
	// Settings are extra server settings, passed as -c name=value. They
	// win over the defaults (fsync on, synchronous_commit on,
	// max_connections 50, shared_buffers 32MB, and from PostgreSQL 14 on
	// recovery_init_sync_method syncfs).
	Settings map[string]string
	// StartTimeout bounds each start (and the crash recovery it runs).
	// Defaults to 60s.
	StartTimeout time.Duration
}

// Postgres is a throwaway PostgreSQL cluster: its own data directory, its
// own port on 127.0.0.1, the superuser "postgres" with trust
// authentication. Stop crashes it (pg_ctl stop -m immediate: no checkpoint,
// the next Start runs crash recovery); Start brings it back on the same data
// directory and port. Close stops it and removes the directory. Safe for
// concurrent use.
type Postgres struct {
	bin    string
	dir    string // owned by the server's user; removed by Close
	data   string
	log    string
	port   int
	cred   *syscall.Credential
	opts   PostgresOptions
	mu     sync.Mutex
	proc   *owned // nil while stopped
	closed bool
}

// StartPostgres creates a cluster with initdb in a fresh temporary directory
// and starts it on a free port. The caller must Close it.
func StartPostgres(ctx context.Context, opts PostgresOptions) (*Postgres, error) {
	if opts.StartTimeout <= 0 {
		opts.StartTimeout = 60 * time.Second
	}
	bin, err := postgresBinDir(opts.BinDir)
	if err != nil {
		return nil, err
	}
	cred, err := postgresCredential()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "idem-fault-pg-")
	if err != nil {
		return nil, fmt.Errorf("fault: postgres: %w", err)
	}
	p := &Postgres{bin: bin, dir: dir, data: filepath.Join(dir, "data"), log: filepath.Join(dir, "postgres.log"), cred: cred, opts: opts}
	fail := func(err error) (*Postgres, error) {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	if cred != nil {
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			return fail(fmt.Errorf("fault: postgres: chown %s to the postgres user: %w", dir, err))
		}
	}
	// -N: the cluster's files are not fsynced at creation (the faults crash
	// PostgreSQL, not the machine); the server itself runs with fsync on.
	initdb := exec.CommandContext(ctx, filepath.Join(bin, "initdb"),
		"-D", p.data, "-U", "postgres", "-A", "trust", "-E", "UTF8", "--locale=C", "-N")
	initdb.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	initdb.Dir = dir
	if out, err := initdb.CombinedOutput(); err != nil {
		hint := ""
		if cred != nil {
			hint = " (initdb ran as the postgres user: it needs to reach " + dir + ")"
		}
		return fail(fmt.Errorf("fault: postgres: initdb: %w%s: %s", err, hint, strings.TrimSpace(string(out))))
	}
	var lastErr error
	for range 3 {
		if p.port, err = FreePort(); err != nil {
			return fail(err)
		}
		if lastErr = p.Start(ctx); lastErr == nil {
			return p, nil
		}
		if ctx.Err() != nil || !strings.Contains(lastErr.Error(), "could not bind") {
			break
		}
	}
	return fail(lastErr)
}

// postgresBinDir finds initdb, postgres and pg_ctl.
func postgresBinDir(dir string) (string, error) {
	ok := func(d string) bool {
		for _, b := range []string{"initdb", "postgres", "pg_ctl"} {
			if st, err := os.Stat(filepath.Join(d, b)); err != nil || st.IsDir() {
				return false
			}
		}
		return true
	}
	if dir != "" {
		if !ok(dir) {
			return "", fmt.Errorf("fault: postgres: %s does not hold initdb, postgres and pg_ctl", dir)
		}
		return dir, nil
	}
	if d := os.Getenv("IDEM_PG_BINDIR"); d != "" {
		if !ok(d) {
			return "", fmt.Errorf("fault: postgres: IDEM_PG_BINDIR=%s does not hold initdb, postgres and pg_ctl", d)
		}
		return d, nil
	}
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		if d := strings.TrimSpace(string(out)); ok(d) {
			return d, nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	sort.Slice(dirs, func(i, j int) bool { return pgVersion(dirs[i]) > pgVersion(dirs[j]) })
	for _, d := range dirs {
		if ok(d) {
			return d, nil
		}
	}
	if p, err := exec.LookPath("initdb"); err == nil {
		if r, err := filepath.EvalSymlinks(p); err == nil && ok(filepath.Dir(r)) {
			return filepath.Dir(r), nil
		}
		if ok(filepath.Dir(p)) {
			return filepath.Dir(p), nil
		}
	}
	return "", errors.New("fault: postgres: initdb, postgres and pg_ctl not found (install PostgreSQL's server package, or set IDEM_PG_BINDIR)")
}

// pgVersion is the major version in /usr/lib/postgresql/<v>/bin.
func pgVersion(binDir string) float64 {
	v, _ := strconv.ParseFloat(filepath.Base(filepath.Dir(binDir)), 64)
	return v
}

// postgresCredential returns the credential to run PostgreSQL with: nil
// when the caller is not root, the "postgres" user's when it is.
func postgresCredential() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("fault: postgres: running as root, and PostgreSQL refuses to run as root, but there is no postgres OS user to run it as (%w): run as another user or create one", err)
	}
	uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
	gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
	if err := errors.Join(err1, err2); err != nil {
		return nil, fmt.Errorf("fault: postgres: the postgres user's ids: %w", err)
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), NoSetGroups: true}, nil
}

// URL is the connection string of the cluster's "postgres" database.
func (p *Postgres) URL() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", p.port)
}

// Addr is the host:port the server listens on.
func (p *Postgres) Addr() string { return fmt.Sprintf("127.0.0.1:%d", p.port) }

// Dir is the cluster's temporary directory (data directory and log).
func (p *Postgres) Dir() string { return p.dir }

// Running reports whether the server process is up (it may still be
// starting).
func (p *Postgres) Running() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.proc != nil && !p.proc.exited()
}

// Start starts the server on its data directory and port and waits until it
// accepts connections, crash recovery included. It fails when the server is
// already running.
func (p *Postgres) Start(ctx context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return errors.New("fault: postgres: closed")
	}
	if p.proc != nil && !p.proc.exited() {
		return errors.New("fault: postgres: already running")
	}
	p.proc = nil
	settings := map[string]string{
		"port":                    strconv.Itoa(p.port),
		"listen_addresses":        "127.0.0.1",
		"unix_socket_directories": p.dir,
		"fsync":                   "on",
		"synchronous_commit":      "on",
		"full_page_writes":        "on",
		"max_connections":         "50",
		"shared_buffers":          "32MB",
		"logging_collector":       "off",
		"log_min_messages":        "warning",
	}
	if v, err := os.ReadFile(filepath.Join(p.data, "PG_VERSION")); err == nil {
		if major, _ := strconv.Atoi(strings.TrimSpace(string(v))); major >= 14 {
			// After a crash PostgreSQL syncs the data directory before
			// recovery: one syncfs is much faster than an fsync per
			// file (PostgreSQL 14 and later).
			settings["recovery_init_sync_method"] = "syncfs"
		}
	}
	for k, v := range p.opts.Settings {
		settings[k] = v
	}
	names := make([]string, 0, len(settings))
	for k := range settings {
		names = append(names, k)
	}
	sort.Strings(names)
	args := []string{"-D", p.data}
	for _, k := range names {
		args = append(args, "-c", k+"="+settings[k])
	}
	logf, err := os.OpenFile(p.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return fmt.Errorf("fault: postgres: log: %w", err)
	}
	defer func() { _ = logf.Close() }() // the child holds its own descriptor
	cmd := exec.Command(filepath.Join(p.bin, "postgres"), args...)
	cmd.Dir = p.dir
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: p.cred}
	// SIGQUIT is PostgreSQL's immediate shutdown: if this process dies,
	// the server and its backends go with it.
	proc, err := startOwned(cmd, syscall.SIGQUIT)
	if err != nil {
		return fmt.Errorf("fault: postgres: start: %w", err)
	}
	p.proc = proc
	sctx, cancel := context.WithTimeout(ctx, p.opts.StartTimeout)
	defer cancel()
	for {
		cctx, ccancel := context.WithTimeout(sctx, time.Second)
		c, err := pgconn.Connect(cctx, p.URL())
		ccancel()
		if err == nil {
			_ = c.Close(sctx)
			return nil
		}
		if proc.exited() {
			p.proc = nil
			return fmt.Errorf("fault: postgres: the server exited while starting (%w): %s", exitErr(proc.err), logTail(p.log, 2000))
		}
		select {
		case <-sctx.Done():
			proc.kill()
			p.proc = nil
			return fmt.Errorf("fault: postgres: not accepting connections after %v: %w: %s", p.opts.StartTimeout, err, logTail(p.log, 2000))
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Stop crashes the server: `pg_ctl stop -m immediate` (every backend quits
// at once, nothing is checkpointed, the next Start runs crash recovery). It
// waits until the server has exited. Stopping a stopped server does nothing.
func (p *Postgres) Stop(ctx context.Context) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.stopLocked(ctx)
}

func (p *Postgres) stopLocked(ctx context.Context) error {
	proc := p.proc
	if proc == nil {
		return nil
	}
	p.proc = nil
	if proc.exited() {
		return nil
	}
	cmd := exec.CommandContext(ctx, filepath.Join(p.bin, "pg_ctl"), "stop", "-D", p.data, "-m", "immediate", "-w", "-t", "30")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: p.cred}
	out, err := cmd.CombinedOutput()
	if err != nil && !proc.exited() {
		// pg_ctl could not do it: SIGQUIT is the same immediate shutdown.
		_ = proc.cmd.Process.Signal(syscall.SIGQUIT)
	}
	if !proc.wait(30 * time.Second) {
		if err != nil {
			return fmt.Errorf("fault: postgres: the server did not exit within 30s of an immediate stop; killed it (pg_ctl: %w: %s)", err, strings.TrimSpace(string(out)))
		}
		return errors.New("fault: postgres: the server did not exit within 30s of an immediate stop; killed it")
	}
	return nil
}

// Close stops the server (immediately) and removes its directory.
func (p *Postgres) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	p.closed = true
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	err := p.stopLocked(ctx)
	if rerr := os.RemoveAll(p.dir); rerr != nil {
		err = errors.Join(err, fmt.Errorf("fault: postgres: remove %s: %w", p.dir, rerr))
	}
	return err
}

// StartLogicalPostgres starts a throwaway cluster with wal_level = logical
// and room for a few replication slots and WAL senders: what the WAL relay
// (outbox/walrelay) needs, which the shared test server does not have.
func StartLogicalPostgres(ctx context.Context) (*Postgres, error) {
	return StartPostgres(ctx, PostgresOptions{Settings: map[string]string{
		"wal_level":             "logical",
		"max_wal_senders":       "10",
		"max_replication_slots": "10",
	}})
}
