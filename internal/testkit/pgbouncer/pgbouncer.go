// Package pgbouncer starts throwaway PgBouncer processes in front of the
// test PostgreSQL, for the tests and chaos cells that check idem's
// PostgreSQL paths through a transaction-pooling proxy.
//
// A Bouncer is one pgbouncer process on a free port of 127.0.0.1, in
// pool_mode=transaction by default, with auth_type=any (it logs in to
// PostgreSQL as the upstream URL's user, whatever user the client names),
// server_round_robin=1 (consecutive transactions of one client land on
// different server connections as often as possible) and a small pool
// (Options.PoolSize, 4 by default), so that the clients of a test share
// server connections and any session state one of them leaves behind is
// seen by the others. Its pgbouncer.ini and pgbouncer.log live in
// Options.Dir (New uses t.TempDir()). PgBouncer writes its pid file only
// after it dropped root, into a directory it may not reach, so none is
// kept: the Bouncer holds the process and stops it.
//
// PgBouncer refuses to run as root. Run by root, the Bouncer starts it as
// the "postgres" OS user (or "nobody") and hands it its configuration as
// an open file (/dev/fd/3) and its log as its stderr, so the files stay in
// the test's own directory. The process gets SIGKILL when the test binary
// dies (Linux), so none outlives a killed run.
//
// # pgx through PgBouncer
//
// pgx prepares every statement under a name by default
// (QueryExecModeCacheStatement). PgBouncer before 1.21, or with
// max_prepared_statements = 0 (its default before 1.24), does not follow
// named prepared statements from one server connection to the next: a
// client finds its statement missing, or another client's under the same
// name ("prepared statement ... already exists"). The exec modes that work
// through it are cache_describe (an unnamed statement per execution; the
// descriptions are cached on the client), exec and simple_protocol. Never
// describe_exec: it describes a statement in one round trip and binds it
// in the next, which may reach another server connection and bind another
// client's unnamed statement. URL sets default_query_exec_mode to
// cache_describe; URLMode picks another.
package pgbouncer

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
)

// Pool modes.
const (
	Transaction = "transaction"
	Session     = "session"
)

// DefaultExecMode is the pgx default_query_exec_mode URL sets.
const DefaultExecMode = "cache_describe"

// ErrNotInstalled is returned when no pgbouncer executable is found.
var ErrNotInstalled = errors.New("pgbouncer: the pgbouncer executable is not installed (Debian: apt-get install pgbouncer; `make up` installs it; or set IDEM_PGBOUNCER to its path)")

// Options configure a Bouncer. Only Dir is required.
type Options struct {
	// Upstream is the connection string of the PostgreSQL database to
	// pool. Defaults to the test database (testenv.PostgresURL).
	Upstream string
	// PoolMode is PgBouncer's pool_mode: Transaction or Session.
	// Defaults to Transaction.
	PoolMode string
	// PoolSize is default_pool_size: the server connections of the
	// database. Defaults to 4.
	PoolSize int
	// Dir holds pgbouncer.ini and pgbouncer.log.
	Dir string
	// Bin is the pgbouncer executable. Defaults to $IDEM_PGBOUNCER, then
	// pgbouncer on $PATH, then /usr/sbin/pgbouncer.
	Bin string
	// StartTimeout bounds each start. Defaults to 30s.
	StartTimeout time.Duration
}

// Bouncer is a running pgbouncer. Safe for concurrent use.
type Bouncer struct {
	opts     Options
	bin      string
	upstream *pgconn.Config
	port     int
	ini, log string

	mu     sync.Mutex
	proc   *proc // nil while stopped
	closed bool
}

// Find returns the pgbouncer executable: bin when set, else
// $IDEM_PGBOUNCER, pgbouncer on $PATH, /usr/sbin/pgbouncer or
// /usr/local/bin/pgbouncer. It returns ErrNotInstalled when there is none.
func Find(bin string) (string, error) {
	if bin == "" {
		bin = os.Getenv("IDEM_PGBOUNCER")
	}
	if bin != "" {
		if st, err := os.Stat(bin); err != nil || st.IsDir() {
			return "", fmt.Errorf("%w: %s is not an executable", ErrNotInstalled, bin)
		}
		return bin, nil
	}
	if p, err := exec.LookPath("pgbouncer"); err == nil {
		return p, nil
	}
	for _, p := range []string{"/usr/sbin/pgbouncer", "/usr/local/bin/pgbouncer", "/usr/local/sbin/pgbouncer"} {
		if st, err := os.Stat(p); err == nil && !st.IsDir() {
			return p, nil
		}
	}
	return "", ErrNotInstalled
}

// Start writes the configuration into opts.Dir and starts pgbouncer on a
// free port; it returns once a client got through it to PostgreSQL. The
// caller must Close it.
func Start(ctx context.Context, opts Options) (*Bouncer, error) {
	if opts.Dir == "" {
		return nil, errors.New("pgbouncer: Options.Dir is required")
	}
	if opts.Upstream == "" {
		return nil, errors.New("pgbouncer: Options.Upstream is required")
	}
	switch opts.PoolMode {
	case "":
		opts.PoolMode = Transaction
	case Transaction, Session:
	default:
		return nil, fmt.Errorf("pgbouncer: Options.PoolMode %q: use %q or %q", opts.PoolMode, Transaction, Session)
	}
	if opts.PoolSize <= 0 {
		opts.PoolSize = 4
	}
	if opts.StartTimeout <= 0 {
		opts.StartTimeout = 30 * time.Second
	}
	bin, err := Find(opts.Bin)
	if err != nil {
		return nil, err
	}
	up, err := pgconn.ParseConfig(opts.Upstream)
	if err != nil {
		return nil, fmt.Errorf("pgbouncer: Options.Upstream: %w", err)
	}
	b := &Bouncer{opts: opts, bin: bin, upstream: up,
		ini: filepath.Join(opts.Dir, "pgbouncer.ini"), log: filepath.Join(opts.Dir, "pgbouncer.log")}
	var lastErr error
	for range 3 {
		if b.port, err = freePort(); err != nil {
			return nil, err
		}
		if err := b.writeConfig(); err != nil {
			return nil, err
		}
		if lastErr = b.Start(ctx); lastErr == nil {
			return b, nil
		}
		if ctx.Err() != nil || !strings.Contains(lastErr.Error(), "in use") {
			break
		}
	}
	return nil, lastErr
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("pgbouncer: free port: %w", err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	if err := l.Close(); err != nil {
		return 0, fmt.Errorf("pgbouncer: free port: %w", err)
	}
	return port, nil
}

// iniValue quotes a value of a [databases] entry.
func iniValue(v string) string {
	if v != "" && !strings.ContainsAny(v, " '\\\t") {
		return v
	}
	return "'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(v) + "'"
}

func (b *Bouncer) writeConfig() error {
	up := b.upstream
	entry := []string{
		"host=" + iniValue(up.Host),
		"port=" + strconv.Itoa(int(up.Port)),
		"dbname=" + iniValue(up.Database),
		"user=" + iniValue(up.User),
	}
	if up.Password != "" {
		entry = append(entry, "password="+iniValue(up.Password))
	}
	ini := fmt.Sprintf(`[databases]
%s = %s

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = any
pool_mode = %s
default_pool_size = %d
max_client_conn = 500
server_round_robin = 1
ignore_startup_parameters = extra_float_digits
`, up.Database, strings.Join(entry, " "), b.port, b.opts.PoolMode, b.opts.PoolSize)
	if err := os.WriteFile(b.ini, []byte(ini), 0o644); err != nil {
		return fmt.Errorf("pgbouncer: %w", err)
	}
	return nil
}

// Addr is the host:port PgBouncer listens on.
func (b *Bouncer) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(b.port)) }

// Database is the database name clients connect to (the upstream's).
func (b *Bouncer) Database() string { return b.upstream.Database }

// URL is the connection string of the pooled database through PgBouncer,
// with pgx's default_query_exec_mode set to cache_describe.
func (b *Bouncer) URL() string { return b.URLMode(DefaultExecMode) }

// URLMode is URL with default_query_exec_mode set to mode (cache_describe,
// exec, simple_protocol, ...), or not set when mode is empty.
func (b *Bouncer) URLMode(mode string) string {
	q := url.Values{"sslmode": {"disable"}}
	if mode != "" {
		q.Set("default_query_exec_mode", mode)
	}
	u := url.URL{Scheme: "postgres", User: url.User(b.upstream.User), Host: b.Addr(), Path: "/" + b.upstream.Database, RawQuery: q.Encode()}
	return u.String()
}

// LogTail returns the end of PgBouncer's log, for failure messages.
func (b *Bouncer) LogTail() string {
	data, err := os.ReadFile(b.log)
	if err != nil {
		return ""
	}
	if len(data) > 4000 {
		data = data[len(data)-4000:]
	}
	return strings.TrimSpace(string(data))
}

// Running reports whether the process is up.
func (b *Bouncer) Running() bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.proc != nil && !b.proc.exited()
}

// Start starts pgbouncer again (after Kill) on the same port and waits
// until a client gets through it. It fails when it is running.
func (b *Bouncer) Start(ctx context.Context) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return errors.New("pgbouncer: closed")
	}
	if b.proc != nil && !b.proc.exited() {
		return errors.New("pgbouncer: already running")
	}
	p, err := startProc(b.bin, b.ini, b.log)
	if err != nil {
		return fmt.Errorf("pgbouncer: start %s: %w", b.bin, err)
	}
	b.proc = p
	ctx, cancel := context.WithTimeout(ctx, b.opts.StartTimeout)
	defer cancel()
	for {
		if p.exited() {
			b.proc = nil
			return fmt.Errorf("pgbouncer: exited at start: %w: %s", p.exitErr(), b.LogTail())
		}
		cctx, ccancel := context.WithTimeout(ctx, 2*time.Second)
		c, err := pgconn.Connect(cctx, b.URLMode(""))
		if err == nil {
			err = c.Exec(cctx, "SELECT 1").Close()
			_ = c.Close(cctx)
		}
		ccancel()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			p.kill()
			b.proc = nil
			return fmt.Errorf("pgbouncer: no client got through within %v: %w: %s", b.opts.StartTimeout, err, b.LogTail())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Kill SIGKILLs pgbouncer: its clients' connections and its server
// connections drop at once (PostgreSQL rolls back what they had open).
// Start brings it back on the same port.
func (b *Bouncer) Kill() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.proc != nil {
		b.proc.kill()
		b.proc = nil
	}
}

// Close stops pgbouncer (SIGTERM, then SIGKILL after 5s). The files stay in
// Options.Dir.
func (b *Bouncer) Close() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.closed = true
	if b.proc != nil {
		b.proc.stop(5 * time.Second)
		b.proc = nil
	}
}

// Version returns the major and minor version of the pgbouncer executable
// (pgbouncer --version).
func (b *Bouncer) Version() (major, minor int, err error) {
	out, err := exec.Command(b.bin, "--version").Output()
	if err != nil {
		return 0, 0, fmt.Errorf("pgbouncer --version: %w", err)
	}
	first, _, _ := strings.Cut(string(out), "\n")
	v, ok := strings.CutPrefix(strings.TrimSpace(first), "PgBouncer ")
	parts := strings.Split(v, ".")
	if !ok || len(parts) < 2 {
		return 0, 0, fmt.Errorf("pgbouncer --version: unexpected %q", first)
	}
	major, err1 := strconv.Atoi(parts[0])
	minor, err2 := strconv.Atoi(parts[1])
	if err := errors.Join(err1, err2); err != nil {
		return 0, 0, fmt.Errorf("pgbouncer --version: %q: %w", first, err)
	}
	return major, minor, nil
}
