package pgbouncer

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// New starts a Bouncer for the test in front of opts.Upstream (by default
// the test database, testenv.PostgresURL), its files in t.TempDir(), and
// stops it when the test ends. A missing pgbouncer executable skips the
// test, and fails it under CI=true or IDEM_REQUIRE_SERVICES=1; so does an
// unreachable test database.
func New(t testing.TB, opts Options) *Bouncer {
	t.Helper()
	if _, err := Find(opts.Bin); err != nil {
		testenv.Unavailable(t, err.Error())
	}
	if opts.Upstream == "" {
		opts.Upstream = testenv.PostgresURL()
		testenv.Pool(t, 1) // skips (or fails) when the database is unreachable
	}
	if opts.Dir == "" {
		opts.Dir = t.TempDir()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	b, err := Start(ctx, opts)
	if errors.Is(err, ErrNotInstalled) {
		testenv.Unavailable(t, err.Error())
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(b.Close)
	return b
}

// Pool returns a pgxpool.Pool of at most maxConns connections (pgxpool's
// default when 0) through b, in the cache_describe exec mode (URL),
// closed when the test ends.
func (b *Bouncer) Pool(t testing.TB, maxConns int32) *pgxpool.Pool {
	t.Helper()
	return b.PoolMode(t, maxConns, DefaultExecMode)
}

// PoolMode is Pool in pgx's exec mode mode (see URLMode).
func (b *Bouncer) PoolMode(t testing.TB, maxConns int32, mode string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(b.URLMode(mode))
	if err != nil {
		t.Fatal(err)
	}
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		err = pool.Ping(ctx)
	}
	if err != nil {
		t.Fatalf("pool through pgbouncer at %s: %v: %s", b.Addr(), err, b.LogTail())
	}
	t.Cleanup(pool.Close)
	return pool
}
