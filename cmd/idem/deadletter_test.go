package main

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// poisonOracle is the handler of a consumer whose poison messages are
// dead-lettered until the handler is "fixed", and the oracle of its
// effects: every effect is a row of a table without a unique constraint,
// written in the transaction of the message's claim (pgtable), so a
// message applied twice shows as two rows.
//
// Payloads: "ok-*" apply; "bad-*" fail with a permanent error and
// "boom-*" panic, until fixed is set.
type poisonOracle struct {
	pool    *pgxpool.Pool
	effects string // the effects table, quoted
	store   *pgtable.Store
	fixed   atomic.Bool

	mu         sync.Mutex
	deliveries map[string]int // by message id: the deliveries that reached the handler
}

func newPoisonOracle(t *testing.T) *poisonOracle {
	t.Helper()
	pool := testenv.Pool(t, 8)
	schema := testenv.Schema(t, pool)
	ctx := context.Background()
	o := &poisonOracle{pool: pool, effects: pgx.Identifier{schema, "effects"}.Sanitize(), deliveries: map[string]int{}}
	if _, err := pool.Exec(ctx, "CREATE TABLE "+o.effects+" (id text NOT NULL, payload text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	var err error
	if o.store, err = pgtable.New(pool, pgtable.Options{Schema: schema}); err != nil {
		t.Fatal(err)
	}
	if err := o.store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	return o
}

// handler is the consumer's chain: count the delivery, recover panics,
// claim in pgtable and apply in the claim's transaction.
func (o *poisonOracle) handler(t *testing.T, scope string) consumer.Handler {
	t.Helper()
	tx, err := consumer.Transactional(o.store, consumer.TxOptions{Scope: scope},
		func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			p := string(msg.Payload)
			switch {
			case o.fixed.Load():
			case strings.HasPrefix(p, "bad-"):
				return consumer.Permanent(fmt.Errorf("cannot parse %s", p))
			case strings.HasPrefix(p, "boom-"):
				panic("boom in " + p)
			}
			_, err := tx.Exec(ctx, "INSERT INTO "+o.effects+" (id, payload) VALUES ($1, $2)", msg.ID, p)
			return err
		})
	if err != nil {
		t.Fatal(err)
	}
	count := func(next consumer.Handler) consumer.Handler {
		return consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
			o.mu.Lock()
			o.deliveries[msg.ID]++
			o.mu.Unlock()
			return next.Handle(ctx, msg)
		})
	}
	return consumer.Chain(tx, count, consumer.Recover())
}

// delivered returns how many deliveries of id reached the handler.
func (o *poisonOracle) delivered(id string) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.deliveries[id]
}

// applied returns the effects, counted by message id.
func (o *poisonOracle) applied(t *testing.T) map[string]int {
	t.Helper()
	return countByID(t, o.pool, "SELECT id, count(*) FROM "+o.effects+" GROUP BY id")
}

// countByID runs query, whose rows are an id and a count, and returns the
// counts by id.
func countByID(t *testing.T, pool *pgxpool.Pool, query string) map[string]int {
	t.Helper()
	rows, err := pool.Query(context.Background(), query)
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	for rows.Next() {
		var (
			id string
			n  int
		)
		if err := rows.Scan(&id, &n); err != nil {
			t.Fatal(err)
		}
		out[id] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// waitApplied waits until exactly want are applied, then checks that each
// was applied once.
func (o *poisonOracle) waitApplied(t *testing.T, want []string) {
	t.Helper()
	testenv.Eventually(t, 60*time.Second, fmt.Sprintf("%d messages applied", len(want)), func() bool {
		return len(o.applied(t)) >= len(want)
	})
	o.check(t, want)
}

// check checks the oracle: every message of want applied exactly once, and
// nothing else.
func (o *poisonOracle) check(t *testing.T, want []string) {
	t.Helper()
	got := o.applied(t)
	for _, id := range want {
		switch n := got[id]; {
		case n == 0:
			t.Errorf("message %s lost: never applied", id)
		case n > 1:
			t.Errorf("message %s applied %d times", id, n)
		}
	}
	for id := range got {
		if !slices.Contains(want, id) {
			t.Errorf("message %s applied, and should not have been", id)
		}
	}
}

// ids returns prefix-0 .. prefix-(n-1).
func ids(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = prefix + "-" + strconv.Itoa(i)
	}
	return out
}

// dlqRun runs "idem deadletter" with args and the destination's flags.
type dlqRun struct {
	t     *testing.T
	flags []string
}

func (r dlqRun) run(want int, args ...string) string {
	r.t.Helper()
	code, out, errOut := runCmd(context.Background(), r.t, append(append([]string{"deadletter"}, args...), r.flags...)...)
	r.t.Logf("deadletter %v:\n%s", args, out)
	if code != want {
		r.t.Fatalf("deadletter %v: exit %d, want %d\nstdout:\n%s\nstderr:\n%s", args, code, want, out, errOut)
	}
	return out
}

// count returns the number of dead letters "list" reports.
func (r dlqRun) count() int {
	r.t.Helper()
	out := r.run(0, "list", "--limit", "1000")
	m := regexp.MustCompile(`: (\d+) dead letters`).FindStringSubmatch(out)
	if m == nil {
		r.t.Fatalf("list: no count in\n%s", out)
	}
	n, _ := strconv.Atoi(m[1])
	return n
}

// groupCount returns the count of a (reason, source) group in list's output, 0
// when there is none.
func groupCount(t *testing.T, out, reason, source string) int {
	t.Helper()
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(reason) + `\s+` + regexp.QuoteMeta(source) + `\s+(\d+)\s`).FindStringSubmatch(out)
	if m == nil {
		return 0
	}
	n, _ := strconv.Atoi(m[1])
	return n
}

// summary returns the summary line of a replay or discard.
func summary(t *testing.T, out string) string {
	t.Helper()
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, "deadletter ") {
			return l
		}
	}
	t.Fatalf("no summary line in\n%s", out)
	return ""
}

func TestDeadletterUsage(t *testing.T) {
	ctx := context.Background()
	t.Setenv("IDEM_KAFKA_BROKERS", "")
	t.Setenv("IDEM_AMQP_URL", "")
	t.Setenv("IDEM_NATS_URL", "")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "missing action"},
		{[]string{"purge"}, `unknown action "purge"`},
		{[]string{"list"}, "name one dead-letter destination"},
		{[]string{"list", "--kafka", "k:9092", "--amqp", "amqp://x"}, "name one dead-letter destination"},
		{[]string{"list", "--kafka", "k:9092"}, "--kafka needs --topic"},
		{[]string{"list", "--amqp", "amqp://x"}, "--amqp needs --queue"},
		{[]string{"list", "--nats", "nats://x"}, "--nats needs --stream"},
		{[]string{"replay", "--outbox"}, "replay needs a selection"},
		{[]string{"discard", "--outbox"}, "discard needs a selection"},
		{[]string{"replay", "--outbox", "--all", "--reason", "panic"}, "leave out --reason and --id"},
		{[]string{"list", "--outbox", "--dry-run"}, "--dry-run is for replay and discard"},
		{[]string{"show", "--outbox"}, "show needs one id"},
		{[]string{"show", "a", "b", "--outbox"}, "show takes one id"},
		{[]string{"list", "extra", "--outbox"}, `unexpected argument "extra"`},
		{[]string{"list", "--outbox", "--limit", "0"}, "--limit and --scan must be at least 1"},
	} {
		code, _, errOut := runCmd(ctx, t, append([]string{"deadletter"}, tc.args...)...)
		if code != 2 || !strings.Contains(errOut, tc.want) {
			t.Errorf("%v: exit %d, stderr %q; want exit 2 and %q", tc.args, code, errOut, tc.want)
		}
	}
	code, _, errOut := runCmd(ctx, t, "deadletter", "list", "--kafka", testenv.DeadAddr(t), "--topic", "t")
	if code != 1 || !strings.Contains(errOut, "unreachable") {
		t.Errorf("dead Kafka: exit %d, stderr %q", code, errOut)
	}
}
