package pgbouncer_test

import (
	"context"
	"errors"
	"strconv"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.uber.org/goleak"

	"github.com/idemkit/idem/internal/testkit/pgbouncer"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, testenv.LeakOptions()...)
}

func connect(t *testing.T, url string) *pgx.Conn {
	t.Helper()
	c, err := pgx.Connect(testenv.Ctx(t), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	return c
}

func backend(t *testing.T, c *pgx.Conn) uint32 {
	t.Helper()
	var pid int32
	if err := c.QueryRow(testenv.Ctx(t), "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	return uint32(pid)
}

// In transaction mode two clients share the one server connection of a
// pool of one, and a session setting one of them makes is seen by the
// other: the state stays with the server connection, not the client.
func TestTransactionModeSharesServerConnections(t *testing.T) {
	b := pgbouncer.New(t, pgbouncer.Options{PoolSize: 1})
	ctx := testenv.Ctx(t)
	a, c := connect(t, b.URL()), connect(t, b.URL())
	if pa, pc := backend(t, a), backend(t, c); pa != pc {
		t.Fatalf("clients on backends %d and %d; a pool of one server connection has one", pa, pc)
	}
	if backend(t, a) == a.PgConn().PID() {
		t.Fatalf("the client was announced its server's pid %d; PgBouncer announces a key of its own", a.PgConn().PID())
	}
	value := testenv.Name("v")
	if _, err := a.Exec(ctx, "SELECT set_config('idem.pgbouncer_probe', $1, false)", value); err != nil {
		t.Fatal(err)
	}
	var got string
	if err := c.QueryRow(ctx, "SELECT current_setting('idem.pgbouncer_probe', true)").Scan(&got); err != nil {
		t.Fatal(err)
	}
	if got != value {
		t.Fatalf("the other client reads %q; the server connection carries %q", got, value)
	}
	if _, err := c.Exec(ctx, "RESET idem.pgbouncer_probe"); err != nil {
		t.Fatal(err)
	}
}

// In session mode each client keeps a server connection of its own.
func TestSessionModeKeepsServerConnections(t *testing.T) {
	b := pgbouncer.New(t, pgbouncer.Options{PoolMode: pgbouncer.Session, PoolSize: 2})
	a, c := connect(t, b.URL()), connect(t, b.URL())
	pa := backend(t, a)
	if pc := backend(t, c); pa == pc {
		t.Fatalf("two clients on backend %d in session mode", pa)
	}
	for range 5 {
		if p := backend(t, a); p != pa {
			t.Fatalf("a client moved from backend %d to %d in session mode", pa, p)
		}
	}
}

func TestKillAndStart(t *testing.T) {
	b := pgbouncer.New(t, pgbouncer.Options{})
	ctx := testenv.Ctx(t)
	c := connect(t, b.URL())
	b.Kill()
	if b.Running() {
		t.Fatal("running after Kill")
	}
	if _, err := c.Exec(ctx, "SELECT 1"); err == nil {
		t.Fatal("a client's connection survived the kill")
	}
	if err := b.Start(ctx); err != nil {
		t.Fatal(err)
	}
	c = connect(t, b.URL())
	if backend(t, c) == 0 {
		t.Fatal("no backend after the restart")
	}
}

// The exec modes the package documents as working through transaction
// pooling run parameterized statements and batches from many clients on a
// pool of two server connections without an error.
func TestExecModes(t *testing.T) {
	b := pgbouncer.New(t, pgbouncer.Options{PoolSize: 2})
	for _, mode := range []string{"cache_describe", "exec", "simple_protocol"} {
		t.Run(mode, func(t *testing.T) {
			if errs := hammer(t, b, mode); errs != nil {
				t.Fatalf("%d errors, the first: %v", len(errs), errs[0])
			}
		})
	}
	// pgx's default mode prepares named statements, which PgBouncer
	// follows across server connections only from 1.21 on, with
	// max_prepared_statements set.
	t.Run("cache_statement", func(t *testing.T) {
		major, minor, err := b.Version()
		if err != nil {
			t.Fatal(err)
		}
		if major > 1 || minor >= 21 {
			t.Skipf("PgBouncer %d.%d may track prepared statements (max_prepared_statements)", major, minor)
		}
		errs := hammer(t, b, "cache_statement")
		if len(errs) == 0 {
			t.Fatalf("PgBouncer %d.%d ran named prepared statements of many clients without an error", major, minor)
		}
		var pgErr *pgconn.PgError
		if !errors.As(errs[0], &pgErr) || (pgErr.Code != "42P05" && pgErr.Code != "26000") {
			t.Fatalf("want a duplicate or missing prepared statement, got %v", errs[0])
		}
		t.Logf("PgBouncer %d.%d, default exec mode: %d errors, the first: %v", major, minor, len(errs), errs[0])
	})
}

// hammer runs statements and batches from 8 clients and returns the errors.
func hammer(t *testing.T, b *pgbouncer.Bouncer, mode string) []error {
	t.Helper()
	pool := b.PoolMode(t, 8, mode)
	ctx := testenv.Ctx(t)
	var (
		mu   sync.Mutex
		errs []error
		wg   sync.WaitGroup
	)
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 40 {
				var n int
				var s string
				err := pool.QueryRow(ctx, "SELECT $1::int + 1, $2::text", g*100+i, "x").Scan(&n, &s)
				if err == nil && (n != g*100+i+1 || s != "x") {
					err = errors.New("wrong answer " + strconv.Itoa(n) + " " + s)
				}
				if err == nil {
					batch := &pgx.Batch{}
					batch.Queue("SELECT $1::bigint", int64(i))
					batch.Queue("SELECT $1::text || $2::text", "a", "b")
					err = pool.SendBatch(ctx, batch).Close()
				}
				if err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
				}
			}
		}()
	}
	wg.Wait()
	return errs
}
