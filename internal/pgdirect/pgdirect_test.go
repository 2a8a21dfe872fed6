package pgdirect_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	"github.com/idemkit/idem/internal/pgdirect"
	"github.com/idemkit/idem/internal/testkit/pgbouncer"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m, testenv.LeakOptions()...)
}

func probe(t *testing.T, url string) pgdirect.Probe {
	t.Helper()
	ctx := testenv.Ctx(t)
	c, err := pgx.Connect(ctx, url)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Close(context.Background()) }()
	p, err := pgdirect.Detect(ctx, c)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestDirect(t *testing.T) {
	testenv.Pool(t, 1)
	if p := probe(t, testenv.PostgresURL()); p.Pooled() {
		t.Fatalf("a direct connection reported as %s", p)
	}
}

// Every pool mode is reported: a session-mode pooler answers the startup
// with a key of its own too.
func TestThroughPgBouncer(t *testing.T) {
	for _, mode := range []string{pgbouncer.Transaction, pgbouncer.Session} {
		t.Run(mode, func(t *testing.T) {
			b := pgbouncer.New(t, pgbouncer.Options{PoolMode: mode})
			for _, exec := range []string{"cache_describe", "exec", "simple_protocol"} {
				p := probe(t, b.URLMode(exec))
				if !p.Pooled() {
					t.Fatalf("%s: a connection through PgBouncer reported as %s", exec, p)
				}
				t.Logf("%s: %s", exec, p)
			}
		})
	}
}
