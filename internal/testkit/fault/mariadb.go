//go:build unix

package fault

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/go-sql-driver/mysql"
)

// MariaDBOptions configure a throwaway MariaDB. The zero value is usable.
type MariaDBOptions struct {
	// BinDir holds mariadbd and mariadb-install-db. Defaults to
	// $IDEM_MARIADB_BINDIR, then each of them on $PATH, /usr/sbin and
	// /usr/bin.
	BinDir string
	// Args are extra mariadbd options ("--innodb-lock-wait-timeout=5",
	// ...). They come after the defaults (InnoDB with
	// innodb_flush_log_at_trx_commit=1, a 32MB buffer pool, 100
	// connections, no binary log, no name resolution), so they win.
	Args []string
	// StartTimeout bounds each start (and the crash recovery it runs).
	// Defaults to 60s.
	StartTimeout time.Duration
}

// MariaDB is a throwaway MariaDB server: its own data directory made by
// mariadb-install-db, its own port on 127.0.0.1 and its own socket, the
// user root with an empty password over TCP. Kill SIGKILLs it (nothing is
// flushed; the next Start runs InnoDB crash recovery); Start brings it back
// on the same data directory and port. Close kills it and removes the
// directory. Safe for concurrent use.
type MariaDB struct {
	server string // mariadbd
	dir    string // owned by the server's user; removed by Close
	data   string
	log    string
	port   int
	cred   *syscall.Credential
	opts   MariaDBOptions
	mu     sync.Mutex
	proc   *owned // nil while stopped
	closed bool
}

// StartMariaDB creates a data directory with mariadb-install-db in a fresh
// temporary directory and starts mariadbd on it on a free port. The caller
// must Close it.
func StartMariaDB(ctx context.Context, opts MariaDBOptions) (*MariaDB, error) {
	if opts.StartTimeout <= 0 {
		opts.StartTimeout = 60 * time.Second
	}
	server, install, err := mariadbBinaries(opts.BinDir)
	if err != nil {
		return nil, err
	}
	cred, err := mariadbCredential()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "idem-fault-mariadb-")
	if err != nil {
		return nil, fmt.Errorf("fault: mariadb: %w", err)
	}
	m := &MariaDB{
		server: server, dir: dir, data: filepath.Join(dir, "data"), log: filepath.Join(dir, "mariadb.log"),
		cred: cred, opts: opts,
	}
	fail := func(err error) (*MariaDB, error) {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	if cred != nil {
		if err := os.Chown(dir, int(cred.Uid), int(cred.Gid)); err != nil {
			return fail(fmt.Errorf("fault: mariadb: chown %s to the mysql user: %w", dir, err))
		}
	}
	// --no-defaults: no /etc/mysql option file may point the throwaway
	// server at the shared one's datadir, port or socket.
	// --auth-root-authentication-method=normal: root logs in without a
	// password (the default is unix_socket authentication).
	cmd := exec.CommandContext(ctx, install, "--no-defaults", "--datadir="+m.data,
		"--auth-root-authentication-method=normal", "--skip-test-db", "--skip-name-resolve")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: cred}
	cmd.Dir = dir
	if out, err := cmd.CombinedOutput(); err != nil {
		return fail(fmt.Errorf("fault: mariadb: mariadb-install-db: %w: %s", err, strings.TrimSpace(string(out))))
	}
	var lastErr error
	for range 3 {
		if m.port, err = FreePort(); err != nil {
			return fail(err)
		}
		if lastErr = m.Start(ctx); lastErr == nil {
			return m, nil
		}
		if ctx.Err() != nil || !strings.Contains(lastErr.Error(), "Address already in use") {
			break
		}
	}
	return fail(lastErr)
}

// mariadbBinaries finds mariadbd and mariadb-install-db.
func mariadbBinaries(dir string) (server, install string, err error) {
	find := func(dirs []string, name string) string {
		for _, d := range dirs {
			p := filepath.Join(d, name)
			if st, err := os.Stat(p); err == nil && !st.IsDir() {
				return p
			}
		}
		return ""
	}
	var dirs []string
	switch {
	case dir != "":
		dirs = []string{dir}
	case os.Getenv("IDEM_MARIADB_BINDIR") != "":
		dirs = []string{os.Getenv("IDEM_MARIADB_BINDIR")}
	default:
		for _, name := range []string{"mariadbd", "mariadb-install-db"} {
			if p, err := exec.LookPath(name); err == nil {
				dirs = append(dirs, filepath.Dir(p))
			}
		}
		dirs = append(dirs, "/usr/sbin", "/usr/bin")
	}
	server, install = find(dirs, "mariadbd"), find(dirs, "mariadb-install-db")
	if server == "" || install == "" {
		return "", "", fmt.Errorf("fault: mariadb: mariadbd and mariadb-install-db not found in %s (install MariaDB's server package, or set IDEM_MARIADB_BINDIR)", strings.Join(dirs, ", "))
	}
	return server, install, nil
}

// mariadbCredential returns the credential to run MariaDB with: nil when
// the caller is not root, the "mysql" user's when it is (mariadbd refuses
// to run as root unless told to).
func mariadbCredential() (*syscall.Credential, error) {
	if os.Geteuid() != 0 {
		return nil, nil
	}
	u, err := user.Lookup("mysql")
	if err != nil {
		return nil, fmt.Errorf("fault: mariadb: running as root, and mariadbd refuses to run as root, but there is no mysql OS user to run it as (%w): run as another user or create one", err)
	}
	uid, err1 := strconv.ParseUint(u.Uid, 10, 32)
	gid, err2 := strconv.ParseUint(u.Gid, 10, 32)
	if err := errors.Join(err1, err2); err != nil {
		return nil, fmt.Errorf("fault: mariadb: the mysql user's ids: %w", err)
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid), NoSetGroups: true}, nil
}

// DSN is the go-sql-driver/mysql DSN of the server's root user, without a
// database.
func (m *MariaDB) DSN() string { return fmt.Sprintf("root@tcp(127.0.0.1:%d)/", m.port) }

// Addr is the host:port the server listens on.
func (m *MariaDB) Addr() string { return fmt.Sprintf("127.0.0.1:%d", m.port) }

// Dir is the server's temporary directory (data directory, socket, log).
func (m *MariaDB) Dir() string { return m.dir }

// Running reports whether the server process is up (it may still be
// starting).
func (m *MariaDB) Running() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.proc != nil && !m.proc.exited()
}

// Start starts mariadbd on the data directory and port and waits until it
// accepts connections, crash recovery included. It fails when the server is
// already running.
func (m *MariaDB) Start(ctx context.Context) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return errors.New("fault: mariadb: closed")
	}
	if m.proc != nil && !m.proc.exited() {
		return errors.New("fault: mariadb: already running")
	}
	m.proc = nil
	args := append([]string{
		"--no-defaults", // must come first
		"--datadir=" + m.data,
		"--port=" + strconv.Itoa(m.port),
		"--bind-address=127.0.0.1",
		"--socket=" + filepath.Join(m.dir, "mariadb.sock"),
		"--pid-file=" + filepath.Join(m.dir, "mariadb.pid"),
		"--tmpdir=" + m.dir,
		"--log-error=" + m.log,
		"--skip-name-resolve",
		"--skip-log-bin",
		"--innodb-flush-log-at-trx-commit=1",
		"--innodb-buffer-pool-size=32M",
		"--max-connections=100",
	}, m.opts.Args...)
	cmd := exec.Command(m.server, args...)
	cmd.Dir = m.dir
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: m.cred}
	proc, err := startOwned(cmd, syscall.SIGKILL)
	if err != nil {
		return fmt.Errorf("fault: mariadb: start: %w", err)
	}
	m.proc = proc
	sctx, cancel := context.WithTimeout(ctx, m.opts.StartTimeout)
	defer cancel()
	for {
		err := m.ping(sctx)
		if err == nil {
			return nil
		}
		if proc.exited() {
			m.proc = nil
			return fmt.Errorf("fault: mariadb: the server exited while starting (%w): %s", exitErr(proc.err), logTail(m.log, 2000))
		}
		select {
		case <-sctx.Done():
			proc.kill()
			m.proc = nil
			return fmt.Errorf("fault: mariadb: not accepting connections after %v: %w: %s", m.opts.StartTimeout, err, logTail(m.log, 2000))
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// ping opens one connection as root and closes it.
func (m *MariaDB) ping(ctx context.Context) error {
	cfg, err := mysql.ParseDSN(m.DSN())
	if err != nil {
		return err
	}
	cfg.Timeout = time.Second
	conn, err := mysql.NewConnector(cfg)
	if err != nil {
		return err
	}
	db := sql.OpenDB(conn)
	defer func() { _ = db.Close() }()
	pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	return db.PingContext(pctx)
}

// Kill SIGKILLs the server and waits until it is gone: nothing is flushed
// or checkpointed, and the next Start runs InnoDB's crash recovery. What
// committed survives (innodb_flush_log_at_trx_commit=1); what did not is
// rolled back. Killing a stopped server does nothing.
func (m *MariaDB) Kill() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.proc != nil {
		m.proc.kill()
		m.proc = nil
	}
	return nil
}

// Close kills the server and removes its directory.
func (m *MariaDB) Close() error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return nil
	}
	m.closed = true
	if m.proc != nil {
		m.proc.kill()
		m.proc = nil
	}
	if err := os.RemoveAll(m.dir); err != nil {
		return fmt.Errorf("fault: mariadb: remove %s: %w", m.dir, err)
	}
	return nil
}
