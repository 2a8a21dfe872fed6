// Package pgdirect tells whether a pgx connection reaches PostgreSQL
// itself or goes through a connection pooler such as PgBouncer, for the
// parts of idem that need a session of their own: the outbox relay's
// session-level advisory locks and LISTEN, and the partitioned dedup
// table's cleanup (a session-level lock and lock_timeout around ALTER
// TABLE ... DETACH PARTITION ... CONCURRENTLY, which cannot run in a
// transaction).
//
// The test: when a connection starts, PostgreSQL announces the process id
// of the backend that serves it (the BackendKeyData message, which cancel
// requests quote). A pooler answers the startup itself, with a key of its
// own, and runs each statement on one of its server connections. So
// SELECT pg_backend_pid() returns the announced id on a direct connection
// and another one through any pooler (PgBouncer, Odyssey, PgCat, ...), in
// any pool mode. Unlike a test that compares the backends of two
// transactions, it does not depend on the pooler happening to hand out
// another server connection: one round trip answers for sure.
//
// A pooler in session mode (PgBouncer's pool_mode=session) keeps a client
// on one server connection, so session state survives there; the test
// cannot tell it from transaction mode, and the callers take an explicit
// setting for it.
package pgdirect

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// Probe is what Detect found about a connection.
type Probe struct {
	// Announced is the backend process id the server sent when the
	// connection started.
	Announced uint32
	// Backend is the process id of the backend that ran Detect's
	// statement.
	Backend uint32
}

// Pooled reports whether a pooler stands between the connection and
// PostgreSQL: the statement ran on another backend than the announced one.
func (p Probe) Pooled() bool { return p.Announced != p.Backend }

// String describes the probe for error messages.
func (p Probe) String() string {
	if !p.Pooled() {
		return fmt.Sprintf("a direct connection to PostgreSQL (backend pid %d)", p.Backend)
	}
	return fmt.Sprintf("a connection through a pooler: its statements run on backend pid %d, not on pid %d announced when it connected",
		p.Backend, p.Announced)
}

// Detect runs SELECT pg_backend_pid() on conn, outside any transaction, and
// compares it with the process id announced at its start. Call it before
// conn takes any session state: through a pooler, state set by a statement
// stays on a server connection that other clients get next.
func Detect(ctx context.Context, conn *pgx.Conn) (Probe, error) {
	p := Probe{Announced: conn.PgConn().PID()}
	var pid int32
	if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		return p, fmt.Errorf("backend pid: %w", err)
	}
	p.Backend = uint32(pid)
	return p, nil
}
