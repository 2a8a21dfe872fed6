// Package testenv finds the services idem's integration tests talk to.
//
// A test that needs a service calls one of the functions here. When the
// service is unreachable the test is skipped with a message that says how to
// start it — except under CI=true or IDEM_REQUIRE_SERVICES=1, where it fails:
// in CI a missing service is a broken run, never a pass.
//
// Addresses come from IDEM_TEST_POSTGRES_URL, IDEM_TEST_MYSQL_DSN,
// IDEM_TEST_REDIS_ADDR, IDEM_TEST_AMQP_URL and IDEM_TEST_NATS_URL, defaulting to the local
// services on their standard ports.
package testenv

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
)

// Required reports whether missing services fail tests instead of skipping
// them.
func Required() bool {
	return os.Getenv("CI") == "true" || os.Getenv("IDEM_REQUIRE_SERVICES") == "1"
}

func unavailable(t testing.TB, service string, err error) {
	t.Helper()
	Unavailable(t, fmt.Sprintf("%s is unreachable: %v (start it with `make up`, or see README.md)", service, err))
}

func env(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// PostgresURL is the connection string of the test database.
func PostgresURL() string {
	return env("IDEM_TEST_POSTGRES_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable")
}

// RedisAddr is the address of the test Redis.
func RedisAddr() string { return env("IDEM_TEST_REDIS_ADDR", "127.0.0.1:6379") }

// AMQPURL is the URL of the test RabbitMQ.
func AMQPURL() string { return env("IDEM_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/") }

// Pool returns a pgxpool.Pool on the test database, closed when the test
// ends. maxConns of zero keeps pgxpool's default.
func Pool(t testing.TB, maxConns int32) *pgxpool.Pool {
	t.Helper()
	return PoolWith(t, maxConns, nil)
}

// PoolWith is Pool with extra session settings (RuntimeParams), such as
// synchronous_commit.
func PoolWith(t testing.TB, maxConns int32, params map[string]string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(PostgresURL())
	if err != nil {
		t.Fatalf("IDEM_TEST_POSTGRES_URL: %v", err)
	}
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	for k, v := range params {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err == nil {
		err = pool.Ping(ctx)
	}
	if err != nil {
		if pool != nil {
			pool.Close()
		}
		unavailable(t, "PostgreSQL at "+PostgresURL(), err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// Redis returns a client on the test Redis, closed when the test ends.
func Redis(t testing.TB) *redis.Client {
	t.Helper()
	// Probe once, without go-redis's dial and command retries, so a
	// missing Redis is reported at once rather than after seconds.
	probe := redis.NewClient(&redis.Options{Addr: RedisAddr(), MaxRetries: -1, DialerRetries: 1, DialTimeout: 2 * time.Second})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := probe.Ping(ctx).Err()
	_ = probe.Close()
	if err != nil {
		unavailable(t, "Redis at "+RedisAddr(), err)
	}
	c := redis.NewClient(&redis.Options{Addr: RedisAddr()})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// RequireTCP checks that addr accepts connections, for services reached
// through other clients (RabbitMQ).
func RequireTCP(t testing.TB, service, addr string) {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 3*time.Second)
	if err != nil {
		unavailable(t, service+" at "+addr, err)
		return
	}
	_ = c.Close()
}

// Name returns a fresh lowercase identifier that starts with prefix, usable
// as a table, schema, key prefix, topic or queue name.
func Name(prefix string) string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return strings.ToLower(prefix) + "_" + hex.EncodeToString(b[:])
}

// Schema creates a fresh schema and drops it (with everything in it) when the
// test ends.
func Schema(t testing.TB, pool *pgxpool.Pool) string {
	t.Helper()
	name := Name("idemtest")
	ctx := context.Background()
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatalf("create schema %s: %v", name, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, _ = pool.Exec(ctx, "DROP SCHEMA "+pgx.Identifier{name}.Sanitize()+" CASCADE")
	})
	return name
}

// DeadAddr returns a loopback address nothing listens on, for "store down"
// tests.
func DeadAddr(t testing.TB) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	_ = l.Close()
	return addr
}

// LeakOptions are the goleak options every package's TestMain uses: they
// ignore go-redis's background redial loop, which a client pointed at a dead
// address starts once all its dials failed and which ends only at its next
// wake-up after Close.
func LeakOptions() []goleak.Option {
	return []goleak.Option{
		goleak.IgnoreTopFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).tryDial"),
		goleak.IgnoreAnyFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).tryDial"),
	}
}

// Eventually polls cond every few milliseconds until it holds, and fails the
// test when it still does not after timeout. The timeout bounds a broken
// test's hang; it is not a timing assertion, so make it generous.
func Eventually(t testing.TB, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("gave up after %v waiting for %s", timeout, what)
		}
		<-tick.C
	}
}

// Ctx returns a context that ends with the test, with a generous deadline so
// a hung store fails the test instead of hanging CI.
func Ctx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// UniqueID returns a random id that starts with prefix, so runs against a
// shared server never see each other's keys.
func UniqueID(prefix string) string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return prefix + "-" + hex.EncodeToString(b[:])
}

// StartRun runs run (a consumer's Run) until the returned stop is called
// or the test ends, and waits for ready (its Ready channel); the test
// fails when run returns first or ready does not come within 30s. stop
// cancels run's context and returns its error, the same one on every
// call; the test fails when run has not returned a minute later.
func StartRun(t testing.TB, run func(context.Context) error, ready <-chan struct{}) (stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- run(ctx) }()
	var (
		once sync.Once
		err  error
	)
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case err = <-done:
			case <-time.After(time.Minute):
				err = errors.New("the consumer's Run did not return a minute after its context ended")
				t.Error(err)
			}
		})
		return err
	}
	t.Cleanup(func() { _ = stop() })
	select {
	case <-ready:
	case err := <-done:
		once.Do(cancel)
		t.Fatalf("Run returned before it was ready: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("Run was not ready within 30s")
	}
	return stop
}
