package main

import (
	"context"
	"database/sql"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	wm "github.com/ThreeDotsLabs/watermill"
	wmsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	idemwatermill "github.com/idemkit/idem/adapters/watermill"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// wmRig is a Watermill router on watermill-sql (PostgreSQL) consuming
// topic with Transactional on the oracle's pgtable store, and Watermill's
// poison queue outermost, publishing what cannot succeed to poison.
type wmRig struct {
	oracle        *poisonOracle
	pool          *pgxpool.Pool
	db            *sql.DB
	schema        string
	topic, poison string
	adapter       wmsql.DefaultPostgreSQLSchema

	mu         sync.Mutex
	duplicates map[string]int // by message id: deliveries acknowledged as duplicates
}

func newWMRig(t *testing.T) *wmRig {
	t.Helper()
	pool := testenv.Pool(t, 8)
	r := &wmRig{oracle: newPoisonOracle(t), pool: pool, db: stdlib.OpenDBFromPool(pool),
		schema: testenv.Schema(t, pool), topic: "payments", poison: "payments_poison", duplicates: map[string]int{}}
	t.Cleanup(func() { _ = r.db.Close() })
	// Payloads that are not JSON: the tables' payload column is bytea.
	r.adapter = wmsql.DefaultPostgreSQLSchema{GenerateMessagesTableName: func(topic string) string {
		return pgx.Identifier{r.schema, "watermill_" + topic}.Sanitize()
	}, GeneratePayloadType: func(string) string { return "BYTEA" }}
	offsets := wmsql.DefaultPostgreSQLOffsetsAdapter{GenerateMessagesOffsetsTableName: func(topic string) string {
		return pgx.Identifier{r.schema, "watermill_offsets_" + topic}.Sanitize()
	}}
	queries := append(r.adapter.SchemaInitializingQueries(r.topic), offsets.SchemaInitializingQueries(r.topic)...)
	queries = append(queries, r.adapter.SchemaInitializingQueries(r.poison)...)
	for _, q := range queries {
		if _, err := pool.Exec(context.Background(), q.Query, q.Args...); err != nil {
			t.Fatal(err)
		}
	}

	sub, err := wmsql.NewSubscriber(r.db, wmsql.SubscriberConfig{ConsumerGroup: "billing", SchemaAdapter: r.adapter,
		OffsetsAdapter: offsets, PollInterval: 20 * time.Millisecond}, wm.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	pub, err := wmsql.NewPublisher(r.db, wmsql.PublisherConfig{SchemaAdapter: r.adapter}, wm.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 30 * time.Second}, wm.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	pq, err := middleware.PoisonQueueWithFilter(pub, r.poison, func(err error) bool { return !idemwatermill.Retryable(err) })
	if err != nil {
		t.Fatal(err)
	}
	tx, err := idemwatermill.Transactional(r.oracle.store, idemwatermill.Options{Scope: "billing/charge",
		Telemetry: consumer.Telemetry{OnOutcome: func(_ context.Context, rep consumer.Report) {
			if rep.Outcome == consumer.OutcomeDuplicate {
				r.mu.Lock()
				r.duplicates[rep.Key.ID]++
				r.mu.Unlock()
			}
		}}})
	if err != nil {
		t.Fatal(err)
	}
	router.AddMiddleware(pq, tx)
	o := r.oracle
	router.AddConsumerHandler("charge", r.topic, sub, func(m *message.Message) error {
		o.mu.Lock()
		o.deliveries[m.UUID]++
		o.mu.Unlock()
		p := string(m.Payload)
		if !o.fixed.Load() && strings.HasPrefix(p, "bad-") {
			return consumer.Permanent(fmt.Errorf("cannot parse %s", p))
		}
		_, err := idemwatermill.Tx[pgx.Tx](m.Context()).Exec(m.Context(), "INSERT INTO "+o.effects+" (id, payload) VALUES ($1, $2)", m.UUID, p)
		return err
	})
	done := make(chan error, 1)
	go func() { done <- router.Run(context.Background()) }()
	t.Cleanup(func() {
		if err := router.Close(); err != nil {
			t.Errorf("close the router: %v", err)
		}
		if err := <-done; err != nil {
			t.Errorf("router: %v", err)
		}
		_ = pub.Close()
	})
	select {
	case <-router.Running():
	case err := <-done:
		t.Fatalf("the router stopped: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("the router is not running")
	}
	return r
}

// publish publishes msgs to topic in one transaction.
func (r *wmRig) publish(t *testing.T, topic string, msgs ...*message.Message) {
	t.Helper()
	pub, err := wmsql.NewPublisher(r.db, wmsql.PublisherConfig{SchemaAdapter: r.adapter}, wm.NopLogger{})
	if err != nil {
		t.Fatal(err)
	}
	if err := pub.Publish(topic, msgs...); err != nil {
		t.Fatal(err)
	}
}

// rows returns the number of rows of topic's table, by message UUID.
func (r *wmRig) rows(t *testing.T, topic string) map[string]int {
	t.Helper()
	return countByID(t, r.pool, "SELECT uuid, count(*) FROM "+r.adapter.MessagesTable(topic)+" GROUP BY uuid")
}

func (r *wmRig) letters(t *testing.T) int {
	t.Helper()
	n := 0
	for _, c := range r.rows(t, r.poison) {
		n += c
	}
	return n
}

func (r *wmRig) duplicatesOf(id string) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.duplicates[id]
}

func (r *wmRig) flags() []string {
	return []string{"--watermill-sql", r.poison, "--postgres", testenv.PostgresURL(), "--schema", r.schema}
}

// letter is a poison message as idem's middleware leaves it: its reason,
// error and source in the metadata.
func (r *wmRig) letter(id, payload string) *message.Message {
	m := message.NewMessage(id, []byte(payload))
	m.Metadata.Set(consumer.HeaderReason, string(consumer.OutcomePermanent))
	m.Metadata.Set(consumer.HeaderError, "cannot parse "+payload)
	m.Metadata.Set(consumer.HeaderSource, r.topic)
	m.Metadata.Set(middleware.PoisonedTopicKey, r.topic)
	m.Metadata.Set("tenant", "acme")
	return m
}

// TestDeadletterWatermill poisons messages through a Watermill router on
// watermill-sql (permanent errors, a producer's duplicate of a poison
// message), lists them by reason, replays nothing with --dry-run, discards
// one, fixes the handler and replays the rest. A letter of a message that
// was applied already is replayed too, and the consumer acknowledges it as
// a duplicate without running the handler. The oracle checks that every
// message but the discarded one was applied exactly once.
func TestDeadletterWatermill(t *testing.T) {
	t.Parallel()
	r := newWMRig(t)
	ok, bad := ids("ok", 5), ids("bad", 4)
	var msgs []*message.Message
	for _, id := range ok {
		msgs = append(msgs, message.NewMessage(id, []byte("ok-"+id)))
	}
	for _, id := range bad {
		m := message.NewMessage(id, []byte("bad-"+id))
		m.Metadata.Set("tenant", "acme")
		msgs = append(msgs, m)
	}
	msgs = append(msgs, message.NewMessage(bad[0], []byte("bad-"+bad[0]))) // a producer's duplicate
	r.publish(t, r.topic, msgs...)
	testenv.Eventually(t, 60*time.Second, "5 dead letters and 5 messages applied", func() bool {
		return r.letters(t) == 5 && len(r.oracle.applied(t)) == 5
	})
	r.oracle.check(t, ok)

	run := dlqRun{t: t, flags: r.flags()}
	out := run.run(0, "list")
	if n := groupCount(t, out, "permanent", r.topic); n != 5 {
		t.Fatalf("list:\n%s\nwant 5 permanent letters from %s", out, r.topic)
	}
	out = run.run(0, "show", bad[1])
	for _, want := range []string{"reason       permanent", "source       " + r.topic, `payload      9 bytes: "bad-` + bad[1] + `"`,
		"error        cannot parse bad-" + bad[1], "  tenant: acme", "  " + middleware.PoisonedTopicKey + ": " + r.topic} {
		if !strings.Contains(out, want) {
			t.Errorf("show lacks %q:\n%s", want, out)
		}
	}
	run.run(4, "show", "no-such-letter")

	out = run.run(0, "replay", "--all", "--dry-run")
	if s := summary(t, out); !regexp.MustCompile(`dry run.*would replay 4.*would remove 1 copies`).MatchString(s) {
		t.Errorf("dry run: %q", s)
	}
	if n := r.letters(t); n != 5 {
		t.Fatalf("%d letters after the dry run, want 5", n)
	}
	out = run.run(0, "discard", "--id", bad[3])
	if s := summary(t, out); !strings.Contains(s, ": 1 discarded") {
		t.Errorf("discard: %q", s)
	}
	if n := r.letters(t); n != 4 {
		t.Fatalf("%d letters after the discard, want 4", n)
	}

	// A letter of a message the consumer applied already.
	r.publish(t, r.poison, r.letter(ok[0], "ok-"+ok[0]))
	r.oracle.fixed.Store(true)
	replayed, copies := summaryCounts(t, run.run(0, "replay", "--reason", "permanent"))
	if replayed != 4 || copies != 1 {
		t.Errorf("replay: %d replayed, %d copies removed; want 4 and 1", replayed, copies)
	}
	if n := r.letters(t); n != 0 {
		t.Fatalf("%d letters after the replay, want 0", n)
	}
	want := append(append([]string{}, ok...), bad[:3]...)
	r.oracle.waitApplied(t, want)
	testenv.Eventually(t, 30*time.Second, "the replay of "+ok[0]+" acknowledged as a duplicate", func() bool {
		return r.duplicatesOf(ok[0]) == 1
	})
	r.oracle.check(t, want)
	if n := r.oracle.delivered(ok[0]); n != 1 {
		t.Errorf("the handler ran %d times for %s, want 1: its replay is a duplicate", n, ok[0])
	}
	// The replay keeps the message's metadata and drops the poison fields.
	var meta string
	if err := r.pool.QueryRow(context.Background(), "SELECT metadata::text FROM "+r.adapter.MessagesTable(r.topic)+
		` WHERE uuid = $1 ORDER BY "offset" DESC LIMIT 1`, bad[1]).Scan(&meta); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(meta, `"tenant"`) || strings.Contains(meta, consumer.HeaderPrefix) || strings.Contains(meta, "_poisoned") {
		t.Errorf("the replay of %s carries metadata %s: want tenant and no poison fields", bad[1], meta)
	}
}

// TestDeadletterWatermillReplayKilled SIGKILLs "idem deadletter replay"
// halfway: a test transaction holds the lock of one letter, the replay
// stops on it with that letter's publish in its transaction, and is
// killed there. The killed publish never lands; a second replay finishes
// the job. Every message is applied exactly once and published to its
// topic exactly once.
func TestDeadletterWatermillReplayKilled(t *testing.T) {
	t.Parallel()
	r := newWMRig(t)
	r.oracle.fixed.Store(true)
	const n, stuck = 300, 150
	var (
		want    []string
		letters []*message.Message
	)
	for i := range n {
		id := "k-" + strconv.Itoa(i)
		want = append(want, id)
		letters = append(letters, r.letter(id, "ok-"+id))
	}
	r.publish(t, r.poison, letters...)

	ctx := context.Background()
	lock, err := r.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = lock.Rollback(ctx) }()
	var got string
	if err := lock.QueryRow(ctx, "SELECT uuid FROM "+r.adapter.MessagesTable(r.poison)+" WHERE uuid = $1 FOR UPDATE", want[stuck]).Scan(&got); err != nil {
		t.Fatal(err)
	}

	cmd, exited, out := startProcess(t, append([]string{"deadletter", "replay", "--all", "--limit", "1000"}, r.flags()...)...)
	testenv.Eventually(t, 60*time.Second, "the replay waiting on the locked letter", func() bool {
		select {
		case err := <-exited:
			t.Fatalf("the replay exited before it reached the locked letter: %v\n%s", err, out.String())
		default:
		}
		var waiting bool
		err := r.pool.QueryRow(ctx, `SELECT count(*) > 0 FROM pg_stat_activity WHERE wait_event_type = 'Lock'
			AND query LIKE 'DELETE FROM %' AND position($1 in query) > 0`, r.adapter.MessagesTable(r.poison)).Scan(&waiting)
		if err != nil {
			t.Fatal(err)
		}
		return waiting
	})
	if left := r.letters(t); left != n-stuck {
		t.Fatalf("%d letters left when the replay reached letter %d, want %d", left, stuck, n-stuck)
	}
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	if err := <-exited; err == nil {
		t.Fatal("the replay exited 0 after SIGKILL")
	}
	if err := lock.Rollback(ctx); err != nil {
		t.Fatal(err)
	}

	replayed, copies := summaryCounts(t, dlqRun{t: t, flags: r.flags()}.run(0, "replay", "--all", "--limit", "1000"))
	if replayed != n-stuck || copies != 0 {
		t.Errorf("second replay: %d replayed, %d copies removed; want %d and 0", replayed, copies, n-stuck)
	}
	if left := r.letters(t); left != 0 {
		t.Fatalf("%d letters after the second replay, want 0", left)
	}
	r.oracle.waitApplied(t, want)
	r.oracle.check(t, want)
	var twice []string
	published := r.rows(t, r.topic)
	for _, id := range want {
		if published[id] != 1 {
			twice = append(twice, fmt.Sprintf("%s:%d", id, published[id]))
		}
	}
	if len(twice) > 0 {
		t.Errorf("published to %s other than once: %v", r.topic, twice)
	}
}
