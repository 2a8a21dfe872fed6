package walrelay_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/walrelay"
)

// Messages of committed transactions are published once each, with their
// ids, topics, keys, payloads and headers (the trace context of Enqueue's
// ctx among them); messages of rolled-back transactions never are. A
// sentinel committed after the rollbacks proves it: the stream is in commit
// order, so a rolled-back message would have come before it.
func TestCommitAndRollback(t *testing.T) {
	t.Parallel()
	sources(t, func(t *testing.T, src walrelay.Source) {
		pool := logicalPool(t)
		ob := newWAL(t, pool, walrelay.Options{Source: src})
		pub := newMemPublisher()
		start(t, newRelay(t, ob, pub, walrelay.RelayOptions{}))

		ctx := traceCtx("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
		var want []string
		for i := range 20 {
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			ids, err := ob.Enqueue(ctx, tx, msg("orders", fmt.Sprintf("k%d", i%3), fmt.Sprintf("p%d", i)),
				outbox.Message{Topic: "audit", Payload: []byte("a"), Headers: map[string]string{"h": "v"}})
			if err != nil {
				t.Fatal(err)
			}
			if i%4 == 3 {
				if err := tx.Rollback(ctx); err != nil {
					t.Fatal(err)
				}
				continue
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			want = append(want, ids...)
		}
		sentinel := enqueue(t, pool, ob, msg("orders", "", "sentinel"))
		pub.waitIDs(t, append(want, sentinel...))

		got := pub.published()
		if len(got) != len(want)+1 {
			t.Fatalf("published %d messages, want %d (committed) + 1 (sentinel)", len(got), len(want))
		}
		// Per key, commit order; keyless messages have no order.
		wantByKey, gotByKey := map[string][]string{}, map[string][]string{}
		pos := map[string]int{}
		for i, id := range want {
			pos[id] = i
		}
		for i, m := range got {
			if string(m.Payload) == "sentinel" {
				continue
			}
			if _, ok := pos[m.ID]; !ok {
				t.Fatalf("message %d: id %s was not committed", i, m.ID)
			}
			gotByKey[string(m.Key)] = append(gotByKey[string(m.Key)], m.ID)
			if m.Headers[outbox.HeaderTraceParent] != "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01" {
				t.Fatalf("message %d: traceparent %q", i, m.Headers[outbox.HeaderTraceParent])
			}
			if m.Attempt != 1 || m.CreatedAt.IsZero() {
				t.Fatalf("message %d: attempt %d, created %v", i, m.Attempt, m.CreatedAt)
			}
			switch m.Topic {
			case "orders":
				if len(m.Key) == 0 || len(m.Payload) < 2 {
					t.Fatalf("message %d: key %q payload %q", i, m.Key, m.Payload)
				}
			case "audit":
				if m.Key != nil || string(m.Payload) != "a" || m.Headers["h"] != "v" {
					t.Fatalf("message %d: key %q payload %q headers %v", i, m.Key, m.Payload, m.Headers)
				}
			default:
				t.Fatalf("message %d: topic %q", i, m.Topic)
			}
		}
		for _, id := range want {
			for _, m := range got {
				if m.ID == id && len(m.Key) > 0 {
					wantByKey[string(m.Key)] = append(wantByKey[string(m.Key)], id)
				}
			}
		}
		for k, ids := range wantByKey {
			if !slices.Equal(gotByKey[k], ids) {
				t.Fatalf("key %s: published %v, committed %v", k, gotByKey[k], ids)
			}
		}
	})
}

// The write-ahead log is in commit order, not in Enqueue order: a
// transaction that enqueues first and commits second has its message
// published second. No per-key lock makes the second transaction wait.
func TestCommitOrderNotEnqueueOrder(t *testing.T) {
	t.Parallel()
	sources(t, func(t *testing.T, src walrelay.Source) {
		pool := logicalPool(t)
		ob := newWAL(t, pool, walrelay.Options{Source: src})
		pub := newMemPublisher()
		start(t, newRelay(t, ob, pub, walrelay.RelayOptions{}))
		ctx := context.Background()

		first, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = first.Rollback(ctx) }()
		late, err := ob.Enqueue(ctx, first, msg("t", "k", "enqueued first, committed second"))
		if err != nil {
			t.Fatal(err)
		}
		early := enqueue(t, pool, ob, msg("t", "k", "enqueued second, committed first"))
		if err := first.Commit(ctx); err != nil {
			t.Fatal(err)
		}
		want := slices.Concat(early, late)
		pub.waitIDs(t, want)
		var got []string
		for _, m := range pub.published() {
			got = append(got, m.ID)
		}
		if !slices.Equal(got, want) {
			t.Fatalf("published %v, want commit order %v", got, want)
		}
	})
}

// Per key, the first publication of each message follows commit order even
// when the broker refuses messages now and then, and fails whole batches
// now and then: a key's later message waits until the earlier one's retry
// was confirmed, while other keys go on, also with several Publish calls
// in flight. Producers commit concurrently; each owns its keys and commits
// one transaction at a time, so a key's commit order is its producer's
// order.
func TestOrderPerKeyWithRetries(t *testing.T) {
	t.Parallel()
	sources(t, func(t *testing.T, src walrelay.Source) {
		for _, inFlight := range []int{1, 4} {
			t.Run(fmt.Sprintf("PublishesInFlight=%d", inFlight), func(t *testing.T) {
				orderPerKeyWithRetries(t, src, inFlight)
			})
		}
	})
}

func orderPerKeyWithRetries(t *testing.T, src walrelay.Source, inFlight int) {
	pool := logicalPool(t)
	ob := newWAL(t, pool, walrelay.Options{Source: src})
	pub := newMemPublisher()
	refused := map[string]bool{}
	pub.setFail(func(m *outbox.Message) error {
		// Every fifth message is refused on its first two attempts.
		if m.Payload[len(m.Payload)-1] == '0' || m.Payload[len(m.Payload)-1] == '5' {
			if m.Attempt <= 2 {
				refused[m.ID] = true
				return errBoom
			}
		}
		return nil
	})
	calls, downs := 0, 0
	pub.setDown(func() error {
		// Every seventh call fails as a whole.
		if calls++; calls%7 == 3 {
			downs++
			return errors.New("broker unreachable")
		}
		return nil
	})
	start(t, newRelay(t, ob, pub, walrelay.RelayOptions{BatchSize: 50, PublishesInFlight: inFlight}))

	// Each producer owns its keys and commits its messages one
	// transaction at a time: per key, commit order is the producer's
	// order.
	const producers, perProducer, keysPer = 4, 60, 3
	ctx := context.Background()
	want := map[string][]string{} // key -> ids in commit order
	errs := make(chan error, producers)
	results := make([]map[string][]string, producers)
	for p := range producers {
		results[p] = map[string][]string{}
		go func() {
			for i := range perProducer {
				key := fmt.Sprintf("p%dk%d", p, i%keysPer)
				err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
					ids, err := ob.Enqueue(ctx, tx, msg("t", key, fmt.Sprintf("%d/%d", p, i)))
					if err == nil {
						results[p][key] = append(results[p][key], ids[0])
					}
					return err
				})
				if err != nil {
					errs <- err
					return
				}
			}
			errs <- nil
		}()
	}
	var all []string
	for range producers {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	for _, r := range results {
		for k, ids := range r {
			want[k] = ids
			all = append(all, ids...)
		}
	}
	pub.waitIDs(t, all)

	firstSeen := map[string][]string{}
	seen := map[string]bool{}
	for _, m := range pub.published() {
		if !seen[m.ID] {
			seen[m.ID] = true
			firstSeen[string(m.Key)] = append(firstSeen[string(m.Key)], m.ID)
		}
	}
	for k, ids := range want {
		if !slices.Equal(firstSeen[k], ids) {
			t.Fatalf("key %s: published in order %v, committed in order %v", k, firstSeen[k], ids)
		}
	}
	pub.mu.Lock()
	defer pub.mu.Unlock()
	if len(refused) == 0 || downs == 0 {
		t.Fatalf("%d messages refused, %d calls failed as a whole: the test did not exercise both kinds of retry", len(refused), downs)
	}
}

// With PublishesInFlight 2 the relay sends the next batch while the broker
// has not answered the one before, and a key with a message in that batch
// waits for its outcome: while key k's first message is held at the
// broker, the other call carries key j's message, not k's next one.
func TestPublishesInFlight(t *testing.T) {
	t.Parallel()
	pool := logicalPool(t)
	ob := newWAL(t, pool, walrelay.Options{})
	pub := &gatePublisher{memPublisher: newMemPublisher(), held: make(chan struct{}),
		others: make(chan []string, 8), release: make(chan struct{})}
	r := newRelay(t, ob, pub, walrelay.RelayOptions{BatchSize: 1, PublishesInFlight: 2})
	ids := enqueue(t, pool, ob, msg("t", "k", "k first"), msg("t", "k", "k second"), msg("t", "j", "j first"))
	pub.hold = ids[0]
	start(t, r)

	timeout := time.After(60 * time.Second)
	select {
	case <-pub.held:
	case <-timeout:
		t.Fatal("key k's first message never reached the broker")
	}
	select {
	case got := <-pub.others:
		if !slices.Equal(got, ids[2:]) {
			t.Fatalf("the other call carried %v, want only key j's message %v (key k's next message must wait for the first)", got, ids[2:])
		}
	case <-timeout:
		t.Fatal("no other Publish call while key k's first message was held at the broker")
	}
	close(pub.release)
	pub.waitIDs(t, ids)
	var k []string
	for _, m := range pub.published() {
		if string(m.Key) == "k" {
			k = append(k, m.ID)
		}
	}
	if !slices.Equal(k, ids[:2]) {
		t.Fatalf("key k published in order %v, committed in order %v", k, ids[:2])
	}
}

// gatePublisher holds the call that carries the message hold until release
// is closed (closing held when it arrives), and hands the ids of every
// other call made before the release to others.
type gatePublisher struct {
	*memPublisher
	hold     string
	held     chan struct{}
	heldOnce sync.Once
	others   chan []string
	release  chan struct{}
}

func (g *gatePublisher) Publish(ctx context.Context, msgs []*outbox.Message) error {
	ids := make([]string, len(msgs))
	for i, m := range msgs {
		ids[i] = m.ID
	}
	select {
	case <-g.release:
	default:
		if !slices.Contains(ids, g.hold) {
			select {
			case g.others <- ids:
			default:
			}
			break
		}
		g.heldOnce.Do(func() { close(g.held) })
		select {
		case <-g.release:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return g.memPublisher.Publish(ctx, msgs)
}

// A message the broker keeps refusing is retried with backoff, then parked
// in the dead table (with its id, topic, key, payload, headers, attempts
// and last error), and the relay moves on: the key's later messages follow
// it, other keys never wait for it, and the slot's position passes it.
// RequeueDead publishes it again with its id.
func TestPoisonParked(t *testing.T) {
	t.Parallel()
	sources(t, func(t *testing.T, src walrelay.Source) {
		pool := logicalPool(t)
		ob := newWAL(t, pool, walrelay.Options{Source: src})
		pub := newMemPublisher()
		pub.setFail(func(m *outbox.Message) error {
			if string(m.Payload) == "poison" {
				return fmt.Errorf("refused: %w", errBoom)
			}
			return nil
		})
		const maxAttempts = 4
		start(t, newRelay(t, ob, pub, walrelay.RelayOptions{MaxAttempts: maxAttempts}))

		before := enqueue(t, pool, ob, msg("t", "k", "before"), msg("t", "other", "o1"))
		poison := enqueue(t, pool, ob, outbox.Message{Topic: "t", Key: []byte("k"), Payload: []byte("poison"), Headers: map[string]string{"x": "y"}})
		after := enqueue(t, pool, ob, msg("t", "k", "after"), msg("t", "other", "o2"))
		end := walEnd(t, pool)
		pub.waitIDs(t, append(before, after...))

		var (
			topic, lastErr string
			key, payload   []byte
			headers        string
			attempts       int
		)
		if err := pool.QueryRow(context.Background(), "SELECT topic, key, payload, headers::text, attempts, last_error FROM "+ob.DeadTable()+" WHERE id = $1",
			poison[0]).Scan(&topic, &key, &payload, &headers, &attempts, &lastErr); err != nil {
			t.Fatalf("the poison message is not in the dead table: %v", err)
		}
		if topic != "t" || string(key) != "k" || string(payload) != "poison" || headers != `{"x": "y"}` || attempts != maxAttempts || lastErr != "refused: boom" {
			t.Fatalf("dead row: topic %q key %q payload %q headers %s attempts %d error %q", topic, key, payload, headers, attempts, lastErr)
		}
		pub.mu.Lock()
		tries := pub.tries[poison[0]]
		pub.mu.Unlock()
		if tries != maxAttempts {
			t.Fatalf("the poison message was tried %d times, want %d", tries, maxAttempts)
		}
		// The key's later message came after the poison was parked.
		got := pub.published()
		if i := slices.IndexFunc(got, func(m outbox.Message) bool { return m.ID == after[0] }); i < 0 {
			t.Fatal("the key's later message was not published")
		}
		confirmedPast(t, pool, ob, end)

		// Requeued once the broker takes it: published with its id.
		pub.setFail(nil)
		n, err := ob.RequeueDead(context.Background(), poison[0])
		if err != nil || n != 1 {
			t.Fatalf("RequeueDead: %d, %v", n, err)
		}
		pub.waitIDs(t, poison)
		var left int
		if err := pool.QueryRow(context.Background(), "SELECT count(*) FROM "+ob.DeadTable()).Scan(&left); err != nil || left != 0 {
			t.Fatalf("dead rows left after requeue: %d, %v", left, err)
		}
	})
}

// Only one relay streams a slot. A second one waits, and takes over when
// the first stops; nothing is lost across the hand-over.
func TestSecondRelayTakesOver(t *testing.T) {
	t.Parallel()
	pool := logicalPool(t)
	ob := newWAL(t, pool, walrelay.Options{})
	pubA, pubB := newMemPublisher(), newMemPublisher()
	ra := newRelay(t, ob, pubA, walrelay.RelayOptions{})
	streamingA := make(chan struct{}, 10)
	walrelay.SetOnStreaming(ra, func() { streamingA <- struct{}{} })
	a := start(t, ra)
	<-streamingA

	rb := newRelay(t, ob, pubB, walrelay.RelayOptions{})
	streamingB := make(chan struct{}, 10)
	busyB := make(chan struct{}, 100)
	walrelay.SetOnStreaming(rb, func() { streamingB <- struct{}{} })
	walrelay.SetOnSlotBusy(rb, func() { busyB <- struct{}{} })
	start(t, rb)
	<-busyB // B tried, and found the slot in use
	<-busyB // and keeps trying

	first := enqueue(t, pool, ob, msg("t", "k", "1"), msg("t", "k", "2"))
	pubA.waitIDs(t, first)
	select {
	case <-streamingB:
		t.Fatal("the second relay streams while the first one does")
	default:
	}
	a.stop(t)
	select {
	case <-streamingB:
	case <-time.After(60 * time.Second):
		t.Fatal("the second relay did not take over")
	}
	second := enqueue(t, pool, ob, msg("t", "k", "3"))
	pubB.waitIDs(t, second)
	if n := len(pubB.publishedIDs()); n != 1 {
		t.Fatalf("the second relay published %d messages, want only the one committed after the hand-over (the first relay confirmed the others when it stopped)", n)
	}
}

// QueueEnqueue rides in the caller's batch: published when the
// transaction that sent the batch commits, never when it rolls back; it
// needs the logical messages source.
func TestQueueEnqueue(t *testing.T) {
	t.Parallel()
	pool := logicalPool(t)
	ob := newWAL(t, pool, walrelay.Options{Source: walrelay.SourceMessages})
	pub := newMemPublisher()
	start(t, newRelay(t, ob, pub, walrelay.RelayOptions{}))
	ctx := context.Background()
	send := func(commit bool) []string {
		tx, err := pool.Begin(ctx)
		if err != nil {
			t.Fatal(err)
		}
		defer func() { _ = tx.Rollback(ctx) }()
		b := &pgx.Batch{}
		b.Queue("SELECT 1")
		ids, err := ob.QueueEnqueue(ctx, b, msg("t", "k", "batched"))
		if err != nil {
			t.Fatal(err)
		}
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			t.Fatal(err)
		}
		if commit {
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
		}
		return ids
	}
	rolledBack := send(false)
	committed := send(true)
	sentinel := enqueue(t, pool, ob, msg("t", "k", "sentinel"))
	pub.waitIDs(t, append(committed, sentinel...))
	if n := pub.publishedIDs()[rolledBack[0]]; n != 0 {
		t.Fatal("a message queued in a rolled-back transaction was published")
	}
	tob, err := walrelay.New(nil, walrelay.Options{Source: walrelay.SourceTable})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tob.QueueEnqueue(ctx, &pgx.Batch{}, msg("t", "", "x")); !errors.Is(err, walrelay.ErrBatchNeedsMessages) {
		t.Fatalf("QueueEnqueue with the table source: %v", err)
	}
}

// A clean stop confirms the batch that finished during the shutdown even
// when the transaction's commit reached the publishing side only after the
// stop began: the next relay publishes nothing of it again.
func TestCleanStopConfirmsFinishedBatch(t *testing.T) {
	t.Parallel()
	pool := logicalPool(t)
	ob := newWAL(t, pool, walrelay.Options{})
	pubA := newMemPublisher()
	ra := newRelay(t, ob, pubA, walrelay.RelayOptions{})
	var (
		publishedOnce, commitOnce sync.Once
		published                 = make(chan struct{}) // the batch is confirmed by the broker
		stopping                  = make(chan struct{}) // the relay was told to stop
	)
	// The reader holds the commit back until the batch was published and
	// the relay told to stop; the engine records the batch only then.
	walrelay.SetBeforeCommit(ra, func() { commitOnce.Do(func() { <-stopping }) })
	walrelay.SetAfterPublish(ra, func(_ []*outbox.Message, err error) {
		if err == nil {
			publishedOnce.Do(func() {
				close(published)
				<-stopping
			})
		}
	})
	streaming := make(chan struct{}, 10)
	walrelay.SetOnStreaming(ra, func() { streaming <- struct{}{} })
	a := start(t, ra)
	<-streaming
	// Another outbox's transaction on the same database reaches the
	// reader first, with nothing of this relay's: it is not held back.
	other := newWAL(t, pool, walrelay.Options{})
	enqueue(t, pool, other, msg("t", "k", "other"))
	first := enqueue(t, pool, ob, msg("t", "k", "1"), msg("t", "j", "2"))
	<-published
	a.Cancel()
	close(stopping)
	a.stop(t)
	if got := pubA.publishedIDs(); len(got) != len(first) {
		t.Fatalf("the first relay published %d messages, want %d", len(got), len(first))
	}

	onlyNewAfterStop(t, pool, ob, "the stop did not confirm the finished batch")
}

// onlyNewAfterStop starts the next relay of ob after a clean stop and
// checks that it publishes only a message committed after the stop, none
// of those the stopped relay had published: why says what it means when
// it does.
func onlyNewAfterStop(t *testing.T, pool *pgxpool.Pool, ob *walrelay.Outbox, why string) {
	t.Helper()
	pub := newMemPublisher()
	start(t, newRelay(t, ob, pub, walrelay.RelayOptions{}))
	after := enqueue(t, pool, ob, msg("t", "k", "after the stop"))
	pub.waitIDs(t, after)
	if got := pub.publishedIDs(); len(got) != 1 {
		t.Fatalf("the next relay published %d messages, want only the one committed after the stop: %s", len(got), why)
	}
}

// A clean stop with two Publish calls in flight waits for both: once the
// broker confirms them after the stop began, the final position covers
// them and the next relay publishes nothing of them again.
func TestCleanStopConfirmsCallsInFlight(t *testing.T) {
	t.Parallel()
	pool := logicalPool(t)
	ob := newWAL(t, pool, walrelay.Options{})
	pubA := &holdPublisher{memPublisher: newMemPublisher(), arrived: make(chan struct{}, 2), release: make(chan struct{})}
	a := start(t, newRelay(t, ob, pubA, walrelay.RelayOptions{BatchSize: 1, PublishesInFlight: 2}))
	first := enqueue(t, pool, ob, msg("t", "k", "1"), msg("t", "j", "2"))
	timeout := time.After(60 * time.Second)
	for range 2 {
		select {
		case <-pubA.arrived:
		case <-timeout:
			t.Fatal("the two messages never were in two calls at once")
		}
	}
	a.Cancel()
	close(pubA.release)
	a.stop(t)
	if got := pubA.publishedIDs(); len(got) != len(first) {
		t.Fatalf("the first relay published %d messages, want %d", len(got), len(first))
	}

	onlyNewAfterStop(t, pool, ob, "the stop did not wait for the calls in flight")
}

// holdPublisher holds every call until release is closed, telling arrived
// of each.
type holdPublisher struct {
	*memPublisher
	arrived chan struct{}
	release chan struct{}
}

func (h *holdPublisher) Publish(ctx context.Context, msgs []*outbox.Message) error {
	select {
	case h.arrived <- struct{}{}:
	default:
	}
	<-h.release
	return h.memPublisher.Publish(ctx, msgs)
}
