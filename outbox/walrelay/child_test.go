package walrelay_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/walrelay"
)

// The relay child process: the test binary re-executed with childEnv set
// runs a relay (TestMain dispatches to runChild) on the outbox named by the
// other variables, publishing into a table (tablePublisher), and SIGKILLs
// itself right after its first Publish returned nil: the broker confirmed
// the batch, the relay has not confirmed its position.
const (
	childEnv       = "IDEM_WALRELAY_TEST_CHILD" // "relay"
	childURLEnv    = "IDEM_WALRELAY_TEST_URL"
	childSchemaEnv = "IDEM_WALRELAY_TEST_SCHEMA"
	childSourceEnv = "IDEM_WALRELAY_TEST_SOURCE"
)

// tablePublisher is a broker whose confirmation is a committed row: one
// row per published copy in <schema>.published (no unique constraint), so
// that copies published by a killed process stay countable.
type tablePublisher struct {
	pool  *pgxpool.Pool
	table string
}

func newTablePublisher(ctx context.Context, pool *pgxpool.Pool, schema string) (*tablePublisher, error) {
	p := &tablePublisher{pool: pool, table: pgx.Identifier{schema, "published"}.Sanitize()}
	_, err := pool.Exec(ctx, "CREATE TABLE IF NOT EXISTS "+p.table+" (n bigint GENERATED ALWAYS AS IDENTITY, id uuid NOT NULL, key text NOT NULL)")
	return p, err
}

func (p *tablePublisher) Publish(ctx context.Context, msgs []*outbox.Message) error {
	ids := make([]string, len(msgs))
	keys := make([]string, len(msgs))
	for i, m := range msgs {
		ids[i], keys[i] = m.ID, string(m.Key)
	}
	_, err := p.pool.Exec(ctx, "INSERT INTO "+p.table+" (id, key) SELECT * FROM unnest($1::uuid[], $2::text[])", ids, keys)
	return err
}

// copies returns how many copies of each id were published.
func (p *tablePublisher) copies(t testing.TB) map[string]int {
	t.Helper()
	rows, err := p.pool.Query(context.Background(), "SELECT id::text, count(*) FROM "+p.table+" GROUP BY id")
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	var (
		id string
		n  int
	)
	if _, err := pgx.ForEachRow(rows, []any{&id, &n}, func() error { out[id] = n; return nil }); err != nil {
		t.Fatal(err)
	}
	return out
}

func runChild() int {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "relay child:", err)
		return 2
	}
	pool, err := pgxpool.New(ctx, os.Getenv(childURLEnv))
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	src, _ := strconv.Atoi(os.Getenv(childSourceEnv))
	schema := os.Getenv(childSchemaEnv)
	ob, err := walrelay.New(pool, walrelay.Options{Source: walrelay.Source(src), Schema: schema, Logger: quiet()})
	if err != nil {
		return fail(err)
	}
	pub, err := newTablePublisher(ctx, pool, schema)
	if err != nil {
		return fail(err)
	}
	r, err := walrelay.NewRelay(ob, pub, fastRelay(walrelay.RelayOptions{BatchSize: 20}))
	if err != nil {
		return fail(err)
	}
	walrelay.SetAfterPublish(r, func(_ []*outbox.Message, err error) {
		if err == nil {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {} // never record the outcome
		}
	})
	if err := r.Run(ctx); err != nil {
		return fail(err)
	}
	return 3 // the context ended before the kill point
}

// A relay SIGKILLed after the broker confirmed a batch and before it
// confirmed the position: the next relay (which takes the slot over once
// the server saw the dead one go) publishes that batch again with the same
// ids, and every other message once. Nothing is lost.
func TestCrashBetweenPublishAndConfirm(t *testing.T) {
	t.Parallel()
	sources(t, func(t *testing.T, src walrelay.Source) {
		pool := logicalPool(t)
		ob := newWAL(t, pool, walrelay.Options{Source: src})
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		pub, err := newTablePublisher(ctx, pool, ob.Options().Schema)
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for i := range 5 {
			var batch []outbox.Message
			for j := range 10 {
				batch = append(batch, msg("t", fmt.Sprintf("k%d", j%4), fmt.Sprintf("%d/%d", i, j)))
			}
			ids = append(ids, enqueue(t, pool, ob, batch...)...)
		}

		cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
		cmd.Env = append(os.Environ(), childEnv+"=relay", childURLEnv+"="+logicalURL(t),
			childSchemaEnv+"="+ob.Options().Schema, childSourceEnv+"="+strconv.Itoa(int(src)))
		cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
		err = cmd.Run()
		var ee *exec.ExitError
		if !errors.As(err, &ee) || ee.ProcessState.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
			t.Fatalf("relay child: %v; want killed by SIGKILL at the kill point", err)
		}
		inFlight := pub.copies(t)
		if len(inFlight) == 0 {
			t.Fatal("the child published nothing before it was killed")
		}

		start(t, newRelay(t, ob, pub, walrelay.RelayOptions{}))
		more := enqueue(t, pool, ob, msg("t", "k0", "after the crash"))
		ids = append(ids, more...)
		var got map[string]int
		testenv.Eventually(t, 60*time.Second, "every message published after the restart", func() bool {
			got = pub.copies(t)
			for _, id := range ids {
				if got[id] == 0 {
					return false
				}
			}
			return true
		})
		for _, id := range ids {
			want := 1
			if inFlight[id] > 0 {
				want = 2
			}
			if got[id] != want {
				t.Fatalf("message %s published %d times, want %d (in flight at the crash: %v)", id, got[id], want, inFlight[id] > 0)
			}
		}
		t.Logf("%d messages; %d in flight at the crash were published again with the same ids", len(ids), len(inFlight))
	})
}
