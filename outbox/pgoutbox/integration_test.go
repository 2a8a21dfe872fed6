package pgoutbox_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"

	idemamqp "github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/outboxtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

func newAMQPPublisher(t testing.TB, rawURL string) *idemamqp.Publisher {
	t.Helper()
	p, err := idemamqp.NewPublisher(rawURL, idemamqp.PublisherOptions{
		Logger: quiet(), ReconnectBackoff: consumer.Backoff{Initial: 20 * time.Millisecond, Max: 200 * time.Millisecond},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// effects is the oracle: the downstream consumer's effects, in a table with
// no unique constraint, so an effect applied twice shows up as two rows.
type effects struct {
	pool  *pgxpool.Pool
	table string
}

func newEffects(t testing.TB, pool *pgxpool.Pool, schema string) *effects {
	t.Helper()
	e := &effects{pool: pool, table: pgx.Identifier{schema, "effects"}.Sanitize()}
	if _, err := pool.Exec(context.Background(), "CREATE TABLE "+e.table+" (msg_id text NOT NULL, payload text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	return e
}

// counts returns the number of effects per message id.
func (e *effects) counts(t testing.TB) map[string]int {
	t.Helper()
	rows, err := e.pool.Query(context.Background(), "SELECT msg_id, count(*) FROM "+e.table+" GROUP BY msg_id")
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

// idemConsumer is the downstream service: consumer.Transactional on pgtable,
// applying each message's effect in the transaction that holds its claim.
func idemConsumer(t testing.TB, pool *pgxpool.Pool, schema string, eff *effects) func(ctx context.Context, d amqp091.Delivery) bool {
	t.Helper()
	store, err := pgtable.New(pool, pgtable.Options{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	h, err := consumer.Transactional(store, consumer.TxOptions{Scope: "billing/apply"},
		func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			_, err := tx.Exec(ctx, "INSERT INTO "+eff.table+" (msg_id, payload) VALUES ($1, $2)", m.ID, string(m.Payload))
			return err
		})
	if err != nil {
		t.Fatal(err)
	}
	return func(ctx context.Context, d amqp091.Delivery) bool {
		m := &consumer.Message{ID: d.MessageId, Key: []byte(d.RoutingKey), Payload: d.Body, Topic: d.Exchange, Redelivered: d.Redelivered}
		return consumer.Process(ctx, h, m).Action == consumer.ActionAck
	}
}

// The relay is SIGKILLed after the broker confirmed a batch and before the
// rows were marked. After a restart it publishes the batch again, and the
// downstream idem consumer applies each message once.
func TestRelayKilledBetweenPublishAndMark(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 6)
	ob := newOutbox(t, pool, pgoutbox.Options{})
	schema := ob.Options().Schema
	rb := outboxtest.NewRabbit(t, "", false)
	eff := newEffects(t, pool, schema)
	col := rb.Collect(t, idemConsumer(t, pool, schema, eff))

	var msgs []outbox.Message
	for i := range 5 {
		msgs = append(msgs, msg(rb.Exchange, fmt.Sprint("acct-", i), fmt.Sprint("charge-", i)))
	}
	ids := enqueue(t, pool, ob, msgs...)

	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	err := childCommand(ctx, schema, rb.URL, childKillEnv+"="+childKillPoint).Run()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("relay child: %v; want killed by SIGKILL at the kill point", err)
	}
	// Confirmed by the broker, not marked.
	for _, id := range ids {
		if ri := rowsByID(t, pool, ob)[id]; ri.state != 0 || ri.attempts != 0 {
			t.Fatalf("row %s after the kill: %+v, want pending", id, ri)
		}
	}
	testenv.Eventually(t, 30*time.Second, "the first publish consumed", func() bool { return col.Distinct() == len(ids) })

	if err := childCommand(ctx, schema, rb.URL, childDrainEnv+"=1").Run(); err != nil {
		t.Fatalf("restarted relay child: %v", err)
	}
	testenv.Eventually(t, 30*time.Second, "every message delivered twice", func() bool {
		for _, id := range ids {
			if col.Count(id) < 2 {
				return false
			}
		}
		return true
	})
	got := eff.counts(t)
	for _, id := range ids {
		if got[id] != 1 {
			t.Errorf("message %s applied %d times downstream, want once", id, got[id])
		}
		if ri := rowsByID(t, pool, ob)[id]; ri.state != 1 {
			t.Errorf("row %s after the restart: %+v, want published", id, ri)
		}
	}
	if len(got) != len(ids) {
		t.Errorf("%d messages applied, want %d", len(got), len(ids))
	}
	t.Logf("%d messages, each delivered twice (before the kill and after the restart), applied once", len(ids))
}

// enqueueStream enqueues n messages over keys keys from producers goroutines,
// txSize per transaction. Each payload is "<producer>/<n-th message of that
// producer for that key>", and every message carries its key. With think
// set, a transaction works up to that long after its Enqueue before it
// commits, so transactions commit in another order than they enqueued.
func enqueueStream(t testing.TB, pool *pgxpool.Pool, ob *pgoutbox.Outbox, topic string, n, keys, producers, txSize int, think time.Duration) []string {
	t.Helper()
	var (
		mu  sync.Mutex
		ids []string
		wg  sync.WaitGroup
	)
	errs := make(chan error, producers)
	per := n / producers
	for p := range producers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(p), 42))
			seq := map[string]int{}
			for sent := 0; sent < per; {
				batch := make([]outbox.Message, 0, txSize)
				for j := 0; j < txSize && sent < per; j++ {
					k := keyOf(rng.IntN(keys), keys)
					seq[k]++
					batch = append(batch, msg(topic, k, fmt.Sprintf("%d/%d", p, seq[k])))
					sent++
				}
				var got []string
				err := pgx.BeginFunc(context.Background(), pool, func(tx pgx.Tx) error {
					var err error
					got, err = ob.Enqueue(context.Background(), tx, batch...)
					if err == nil && think > 0 {
						time.Sleep(time.Duration(rng.Int64N(int64(think))))
					}
					return err
				})
				if err != nil {
					errs <- err
					return
				}
				mu.Lock()
				ids = append(ids, got...)
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	return ids
}

// orderReport checks the arrivals per key against the outbox's sequence
// (which is commit order per key): a key's first deliveries must come in
// increasing sequence. A re-publish of an earlier message arriving later is a
// duplicate (the consumer drops it), not a reordering. It also checks that
// each producer's messages of one key arrive in the order produced.
func orderReport(t testing.TB, pool *pgxpool.Pool, ob *pgoutbox.Outbox, arrivals []outboxtest.Arrival) (distinct, dups, violations int, examples []string) {
	t.Helper()
	rows := rowsByID(t, pool, ob)
	lastSeq := map[string]int64{}
	lastByProducer := map[string]int{}
	seen := map[string]bool{}
	for _, a := range arrivals {
		if seen[a.ID] {
			dups++
			continue
		}
		seen[a.ID] = true
		ri, ok := rows[a.ID]
		if !ok {
			t.Errorf("delivery of unknown message %s", a.ID)
			continue
		}
		if ri.seq <= lastSeq[a.Key] {
			violations++
			if violations <= 5 {
				examples = append(examples, fmt.Sprintf("key %s: message seq %d delivered after seq %d", a.Key, ri.seq, lastSeq[a.Key]))
			}
		}
		lastSeq[a.Key] = ri.seq
		producer, nth, _ := strings.Cut(string(a.Body), "/")
		k := a.Key + "@" + producer
		n, _ := strconv.Atoi(nth)
		if n <= lastByProducer[k] {
			violations++
			if violations <= 5 {
				examples = append(examples, fmt.Sprintf("key %s, producer %s: message %d delivered after %d", a.Key, producer, n, lastByProducer[k]))
			}
		}
		lastByProducer[k] = n
	}
	return len(seen), dups, violations, examples
}

// Three relays over 10,000 messages on 100 keys, enqueued by four
// concurrent producers (whose transactions commit in another order than they
// enqueue) while the relays run; one relay is stopped and restarted
// mid-stream (its shards handed over and back), another loses its database
// session. Nothing is lost, each key's messages arrive in commit order,
// duplicates are counted.
func TestThreeRelaysKeepPerKeyOrder(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 8)
	ob := newOutbox(t, pool, pgoutbox.Options{})
	rb := outboxtest.NewRabbit(t, "", false)
	col := rb.Collect(t, nil)

	const total, keys = 10000, 100
	relays := make([]*pgoutbox.Relay, 3)
	runs := make([]*running, 3)
	var lastPID atomic.Uint32 // relay 0's current session
	for i := range relays {
		r, err := pgoutbox.NewRelay(ob, newAMQPPublisher(t, rb.URL), fastRelay(pgoutbox.RelayOptions{
			Shards: 12, CleanupInterval: -1,
		}))
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 {
			pgoutbox.SetOnConnect(r, func(pid uint32) { lastPID.Store(pid) })
		}
		relays[i] = r
		runs[i] = start(t, r)
	}
	var ids []string
	produced := make(chan struct{})
	go func() {
		defer close(produced)
		ids = enqueueStream(t, pool, ob, rb.Exchange, total, keys, 4, 10, 2*time.Millisecond)
	}()
	testenv.Eventually(t, 60*time.Second, "a third delivered", func() bool { return col.Distinct() >= total/3 })
	runs[1].stop(t)
	testenv.Eventually(t, 60*time.Second, "half delivered", func() bool { return col.Distinct() >= total/2 })
	// Relay 0 loses its session (and with it its shards) abruptly, most
	// likely with a batch in flight.
	if _, err := pool.Exec(context.Background(), "SELECT pg_terminate_backend($1)", int32(lastPID.Load())); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 60*time.Second, "two thirds delivered", func() bool { return col.Distinct() >= 2*total/3 })
	runs[1] = start(t, relays[1])
	<-produced
	if len(ids) != total {
		t.Fatalf("enqueued %d, want %d", len(ids), total)
	}
	testenv.Eventually(t, 120*time.Second, "every message delivered", func() bool { return col.Distinct() == total })
	// The last batches' rows are marked right after their confirms.
	testenv.Eventually(t, 30*time.Second, "every row marked published", func() bool { return countState(t, pool, ob, 1) == total })
	distinct, dups, violations, examples := orderReport(t, pool, ob, col.Snapshot())
	t.Logf("3 relays, %d messages on %d keys: %d delivered, 0 lost, %d duplicates, %d order violations",
		total, keys, distinct, dups, violations)
	if violations > 0 {
		t.Errorf("%d per-key order violations, e.g. %s", violations, strings.Join(examples, "; "))
	}
}

// Each shard is owned by exactly one relay session; when a relay stops, the
// others take its shards over.
func TestShardsOwnedOnceAndHandedOver(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 6)
	ob := newOutbox(t, pool, pgoutbox.Options{})
	const shards = 8
	owners := func() map[int]int {
		rows, err := pool.Query(context.Background(), `SELECT objid::bigint & 65535, count(*) FROM pg_locks
			WHERE locktype = 'advisory' AND granted AND objsubid = 2 AND classid::bigint = $1 AND (objid::bigint & 65535) <> 65535
			GROUP BY 1`, int64(pgoutbox.RelayNS(ob)))
		if err != nil {
			t.Fatal(err)
		}
		out := map[int]int{}
		var s, n int
		if _, err := pgx.ForEachRow(rows, []any{&s, &n}, func() error { out[s] = n; return nil }); err != nil {
			t.Fatal(err)
		}
		return out
	}
	covered := func() bool {
		o := owners()
		if len(o) != shards {
			return false
		}
		for _, n := range o {
			if n != 1 {
				t.Fatalf("a shard has %d owners: %v", n, o)
			}
		}
		return true
	}
	var runs []*running
	for range 2 {
		r, err := pgoutbox.NewRelay(ob, &memPublisher{}, fastRelay(pgoutbox.RelayOptions{Shards: shards, Sessions: 2, CleanupInterval: -1}))
		if err != nil {
			t.Fatal(err)
		}
		runs = append(runs, start(t, r))
	}
	testenv.Eventually(t, 20*time.Second, "every shard owned once by 4 sessions", covered)
	runs[0].stop(t)
	testenv.Eventually(t, 20*time.Second, "every shard owned once after a relay stopped", covered)

	// A relay with another shard count makes the others give up their
	// shards, and takes none itself, until it is gone.
	bad, err := pgoutbox.NewRelay(ob, &memPublisher{}, fastRelay(pgoutbox.RelayOptions{Shards: shards * 2}))
	if err != nil {
		t.Fatal(err)
	}
	rbad := start(t, bad)
	testenv.Eventually(t, 20*time.Second, "no shard owned while shard counts differ", func() bool { return len(owners()) == 0 })
	rbad.stop(t)
	testenv.Eventually(t, 20*time.Second, "shards owned again", covered)
}

// The relays' PostgreSQL sessions are terminated (pg_terminate_backend)
// while batches are in flight — at a fixed point between publish and mark,
// and at random moments: the relays reconnect, nothing is lost.
func TestPostgresSessionsTerminatedMidBatch(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 8)
	ob := newOutbox(t, pool, pgoutbox.Options{})
	// A publish takes a moment, so that random kills also land while one
	// is in flight: the killed session's publish then completes after
	// another session took the shard over.
	pub := &memPublisher{delay: 2 * time.Millisecond}
	var (
		mu   sync.Mutex
		pids []uint32
	)
	killed := atomic.Int32{}
	// dead: the sessions terminated (pg_terminate_backend reports true
	// for a backend still exiting, so two kills can hit one session).
	dead := map[uint32]bool{}
	terminate := func(pid uint32) {
		var ok bool
		if err := pool.QueryRow(context.Background(), "SELECT pg_terminate_backend($1)", int32(pid)).Scan(&ok); err == nil && ok {
			killed.Add(1)
			mu.Lock()
			dead[pid] = true
			mu.Unlock()
		}
	}
	var batches atomic.Int32
	for range 2 {
		r, err := pgoutbox.NewRelay(ob, pub, fastRelay(pgoutbox.RelayOptions{Shards: 8, Sessions: 2, BatchSize: 50, CleanupInterval: -1}))
		if err != nil {
			t.Fatal(err)
		}
		var mine []uint32
		var mineMu sync.Mutex
		pgoutbox.SetOnConnect(r, func(pid uint32) {
			mu.Lock()
			pids = append(pids, pid)
			mu.Unlock()
			mineMu.Lock()
			mine = append(mine, pid)
			mineMu.Unlock()
		})
		pgoutbox.SetAfterPublish(r, func(msgs []*outbox.Message, err error) {
			// Every 15th batch: kill this relay's latest session between
			// publish and mark. (The batch may belong to that session or
			// to its sibling; either way a session dies mid-batch.)
			if err == nil && batches.Add(1)%15 == 0 {
				mineMu.Lock()
				pid := mine[len(mine)-1]
				mineMu.Unlock()
				mu.Lock()
				gone := dead[pid]
				mu.Unlock()
				if !gone {
					terminate(pid)
				}
			}
		})
		start(t, r)
	}
	stopKiller := make(chan struct{})
	killerDone := make(chan struct{})
	go func() {
		defer close(killerDone)
		for {
			select {
			case <-stopKiller:
				return
			case <-time.After(150 * time.Millisecond):
			}
			// A live session: a terminated backend's pid may be reused
			// by another test's backend.
			mu.Lock()
			var live []uint32
			for _, p := range pids {
				if !dead[p] {
					live = append(live, p)
				}
			}
			mu.Unlock()
			if len(live) == 0 { // no session connected yet: nothing to kill this round
				continue
			}
			terminate(live[rand.IntN(len(live))])
		}
	}()
	const total = 3000
	ids := enqueueStream(t, pool, ob, "t", total, 50, 3, 10, 0)
	testenv.Eventually(t, 90*time.Second, "every message published", func() bool { return countState(t, pool, ob, 1) == total })
	close(stopKiller)
	<-killerDone
	got := pub.publishedIDs()
	dups := 0
	for _, id := range ids {
		switch n := got[id]; {
		case n == 0:
			t.Errorf("message %s never published", id)
		case n > 1:
			dups += n - 1
		}
	}
	var arrivals []outboxtest.Arrival
	for _, m := range pub.published() {
		arrivals = append(arrivals, outboxtest.Arrival{ID: m.ID, Key: string(m.Key), Body: m.Payload})
	}
	_, _, violations, examples := orderReport(t, pool, ob, arrivals)
	mu.Lock()
	nDead := len(dead)
	mu.Unlock()
	t.Logf("%d messages, %d kills of %d sessions, %d re-published (duplicates), 0 lost, %d order violations",
		total, killed.Load(), nDead, dups, violations)
	if killed.Load() == 0 {
		t.Error("no session was terminated")
	}
	// Every terminated session was replaced: 2 relays × 2 sessions, plus
	// one connect per session terminated (the killer has stopped; one
	// killed by the last batches' hook may still be reconnecting).
	testenv.Eventually(t, 30*time.Second, "every terminated session to reconnect", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return len(pids) >= 4+len(dead)
	})
	if violations > 0 {
		t.Errorf("%d per-key order violations, e.g. %s", violations, strings.Join(examples, "; "))
	}
}

// RabbitMQ closes every connection of the test's virtual host
// (rabbitmqctl close_all_connections) twice mid-stream: the relay's
// publisher reconnects and nothing is lost.
func TestRabbitMQConnectionsClosedMidStream(t *testing.T) {
	t.Parallel()
	ctl := rabbitmqctl(t)
	vurl := vhost(t, ctl)
	pool := testenv.Pool(t, 6)
	ob := newOutbox(t, pool, pgoutbox.Options{})
	rb := outboxtest.NewRabbit(t, vurl, true)
	col := rb.Collect(t, nil)
	pub := &countingPublisher{Publisher: newAMQPPublisher(t, vurl)}
	r, err := pgoutbox.NewRelay(ob, pub, fastRelay(pgoutbox.RelayOptions{BatchSize: 100, CleanupInterval: -1}))
	if err != nil {
		t.Fatal(err)
	}
	start(t, r)

	const total = 4000
	var ids []string
	produced := make(chan struct{})
	go func() {
		defer close(produced)
		// A steady stream: 40 transactions of 100, paced.
		nth := map[string]int{}
		for range total / 100 {
			var batch []outbox.Message
			for j := range 100 {
				k := keyOf(j, 40)
				nth[k]++
				batch = append(batch, msg(rb.Exchange, k, fmt.Sprintf("0/%d", nth[k])))
			}
			ids = append(ids, enqueue(t, pool, ob, batch...)...)
			time.Sleep(5 * time.Millisecond)
		}
	}()
	for _, at := range []int{total / 4, total / 2} {
		testenv.Eventually(t, 60*time.Second, fmt.Sprint(at, " delivered"), func() bool { return col.Distinct() >= at })
		ctl("close_all_connections", "--vhost", strings.TrimPrefix(vurlPath(t, vurl), "/"), "idem test: connection kill mid-stream")
	}
	<-produced
	testenv.Eventually(t, 90*time.Second, "every message delivered", func() bool { return col.Distinct() == total })
	testenv.Eventually(t, 30*time.Second, "every row marked published", func() bool { return countState(t, pool, ob, 1) == total })
	// The consumer's connection is closed too, and its unacknowledged
	// deliveries come back: the broker's redelivery may reorder them, so
	// the order is reported, not asserted, here.
	distinct, dups, violations, _ := orderReport(t, pool, ob, col.Snapshot())
	t.Logf("%d messages: %d delivered, 0 lost, %d duplicates, %d out of order at the consumer across 2 close_all_connections; "+
		"%d of %d Publish calls failed as a whole and were retried", len(ids), distinct, dups, violations, pub.failures.Load(), pub.calls.Load())
}

// countingPublisher counts the Publish calls and their whole-batch
// failures.
type countingPublisher struct {
	outbox.Publisher
	calls, failures atomic.Int64
}

func (p *countingPublisher) Publish(ctx context.Context, msgs []*outbox.Message) error {
	p.calls.Add(1)
	err := p.Publisher.Publish(ctx, msgs)
	var pe *outbox.PublishError
	if err != nil && !errors.As(err, &pe) {
		p.failures.Add(1)
	}
	return err
}

func vurlPath(t testing.TB, raw string) string {
	t.Helper()
	i := strings.LastIndex(raw, "/")
	if i < 0 {
		t.Fatalf("no vhost in %s", raw)
	}
	return raw[i:]
}

// Consume-transform-produce: a handler claims the incoming message in
// pgtable and enqueues the outgoing one in the same transaction. A
// redelivery of the incoming message (a crash before its ACK) finds the
// claim and writes nothing, so the outbox holds each outgoing message once.
func TestConsumeTransformProduce(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 4)
	ob := newOutbox(t, pool, pgoutbox.Options{})
	store, err := pgtable.New(pool, pgtable.Options{Schema: ob.Options().Schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	h, err := consumer.Transactional(store, consumer.TxOptions{Scope: "invoices/from-orders"},
		func(ctx context.Context, tx pgx.Tx, in *consumer.Message) error {
			_, err := ob.Enqueue(ctx, tx, outbox.Message{Topic: "invoices", Key: in.Key, Payload: append([]byte("invoice for "), in.Payload...)})
			return err
		})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	for i := range 20 {
		in := &consumer.Message{ID: fmt.Sprint("order-event-", i), Key: []byte(keyOf(i, 5)), Payload: []byte(fmt.Sprint("order ", i))}
		for delivery := range 3 { // the broker delivers it three times
			res := consumer.Process(ctx, h, in)
			if res.Action != consumer.ActionAck || res.Duplicate != (delivery > 0) {
				t.Fatalf("delivery %d of %s: %+v", delivery, in.ID, res)
			}
		}
	}
	var rows, distinct int
	if err := pool.QueryRow(ctx, "SELECT count(*), count(DISTINCT payload) FROM "+ob.Table()).Scan(&rows, &distinct); err != nil {
		t.Fatal(err)
	}
	if rows != 20 || distinct != 20 {
		t.Fatalf("outbox holds %d rows (%d distinct) for 20 input messages delivered 3 times each; want 20", rows, distinct)
	}
}
