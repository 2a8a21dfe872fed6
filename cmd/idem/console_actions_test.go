package main

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"

	idemamqp "github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// startAMQPConsumer runs a RabbitMQ Consumer of queue with the oracle's
// handler until the test ends.
func startAMQPConsumer(t *testing.T, url, queue string, oracle *poisonOracle, opts idemamqp.ConsumerOptions) {
	t.Helper()
	c, err := idemamqp.NewConsumer(url, queue, oracle.handler(t, "billing/charge"), opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("consumer: %v", err)
		}
	})
	select {
	case <-c.Ready():
	case <-time.After(30 * time.Second):
		t.Fatal("the consumer is not ready")
	}
}

// TestConsoleOutboxRequeue: "idem relay" publishes an outbox to RabbitMQ,
// and parks dead the messages whose routing key no queue is bound to. In
// Chromium, the outbox page lists them; once the binding exists, one is
// ticked, requeued and confirmed: the relay publishes it, the consumer
// applies it once, and the other stays dead.
func TestConsoleOutboxRequeue(t *testing.T) {
	requireRabbitMQ(t)
	b := newBrowser(t)
	url := testenv.AMQPURL()
	pool, schema, pg := migratedSchema(t, 4)
	conn, err := amqp091.DialConfig(url, amqp091.Config{Dial: amqp091.DefaultDial(5 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	admin, err := conn.Channel()
	if err != nil {
		t.Fatal(err)
	}
	exchange, queue := testenv.Name("idemcx"), testenv.Name("idemcq")
	if err := admin.ExchangeDeclare(exchange, amqp091.ExchangeDirect, true, false, false, false, nil); err != nil {
		t.Fatal(err)
	}
	opts := idemamqp.ConsumerOptions{Bindings: []idemamqp.ConsumerBinding{{Exchange: exchange, Key: "pay"}},
		Telemetry: consumer.Telemetry{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = idemamqp.DeleteTopology(ctx, conn, queue, opts)
		_ = admin.ExchangeDelete(exchange, false, false)
	})
	oracle := newPoisonOracle(t)
	oracle.fixed.Store(true)
	startAMQPConsumer(t, url, queue, oracle, opts)
	ctx, cancel := context.WithCancel(context.Background())
	relayDone := make(chan int, 1)
	go func() {
		code, _, _ := runCmd(ctx, t, append([]string{"relay", "--amqp", url, "--max-attempts", "2", "--poll", "100ms", "--log-level", "error"}, pg...)...)
		relayDone <- code
	}()
	t.Cleanup(func() {
		cancel()
		if code := <-relayDone; code != 0 {
			t.Errorf("relay exited %d", code)
		}
	})

	ob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	err = pgx.BeginFunc(testenv.Ctx(t), pool, func(tx pgx.Tx) error {
		ids, err = ob.Enqueue(testenv.Ctx(t), tx,
			outbox.Message{Topic: exchange, Key: []byte("pay"), Payload: []byte("ok-pay")},
			outbox.Message{Topic: exchange, Key: []byte("later"), Payload: []byte("ok-later-1")},
			outbox.Message{Topic: exchange, Key: []byte("later"), Payload: []byte("ok-later-2")})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	dead := func() int {
		var n int
		if err := pool.QueryRow(testenv.Ctx(t), "SELECT count(*) FROM "+ob.Table()+" WHERE state = 2").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	testenv.Eventually(t, 60*time.Second, "2 dead rows and 1 message applied", func() bool {
		return dead() == 2 && len(oracle.applied(t)) == 1
	})

	srv := startConsole(t, pg...)
	b.open(srv.URL + "/outbox")
	if n := b.text("#dead"); n != "2" {
		t.Errorf("dead: %q, want 2", n)
	}
	if n := b.text("#pending"); n != "0" {
		t.Errorf("pending: %q, want 0", n)
	}
	if body := b.text("table.list"); !strings.Contains(body, ids[1]) || !strings.Contains(body, "unroutable") {
		t.Errorf("the dead rows lack %s or its error:\n%s", ids[1], body)
	}
	b.screenshot("outbox")

	if err := admin.QueueBind(queue, "later", exchange, false, nil); err != nil {
		t.Fatal(err)
	}
	b.do(chromedpClick("#dead-" + ids[1]))
	b.submit("#requeue")
	if plan := b.text("#plan"); plan != ids[1] {
		t.Errorf("confirm page: %q, want the one id ticked", plan)
	}
	if n := dead(); n != 2 {
		t.Fatalf("%d dead rows before the confirmation, want 2", n)
	}
	b.screenshot("confirm")
	b.submit("#confirm")
	if out := b.text("#outcome"); !strings.HasPrefix(out, "requeued 1 of 1 messages") {
		t.Errorf("result: %q", out)
	}
	oracle.waitApplied(t, ids[:2])
	if n := dead(); n != 1 {
		t.Errorf("%d dead rows after the requeue, want 1 (the one not ticked)", n)
	}
	b.open(srv.URL + "/outbox")
	if n := b.text("#dead"); n != "1" {
		t.Errorf("dead after the requeue: %q, want 1", n)
	}
}

// TestConsoleDeadletterReplay: a RabbitMQ Consumer claims in pgtable and
// applies in the claim's transaction. One message is dead-lettered (a
// permanent error), and a copy of a message it applied already lands in
// the dead-letter queue too. In Chromium, the dead-letter page groups
// them, one is shown with its headers and payload, and all are replayed
// after a confirmation: the consumer applies the dead one and drops the
// copy on its claim, so each message is applied exactly once.
func TestConsoleDeadletterReplay(t *testing.T) {
	requireRabbitMQ(t)
	b := newBrowser(t)
	url := testenv.AMQPURL()
	conn, err := amqp091.DialConfig(url, amqp091.Config{Dial: amqp091.DefaultDial(5 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	queue := testenv.Name("idemcdl")
	opts := idemamqp.ConsumerOptions{Telemetry: consumer.Telemetry{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))}}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := idemamqp.DeleteTopology(ctx, conn, queue, opts); err != nil {
			t.Errorf("delete topology: %v", err)
		}
	})
	oracle := newPoisonOracle(t)
	startAMQPConsumer(t, url, queue, oracle, opts)
	okID, badID := testenv.UniqueID("ok"), testenv.UniqueID("bad")
	amqpPublish(t, conn, queue,
		amqp091.Publishing{MessageId: okID, DeliveryMode: amqp091.Persistent, Body: []byte("ok-" + okID)},
		amqp091.Publishing{MessageId: badID, DeliveryMode: amqp091.Persistent, Body: []byte("bad-" + badID)})
	dlq := queue + ".dlq"
	testenv.Eventually(t, 60*time.Second, "1 dead letter and 1 message applied", func() bool {
		return amqpDepth(t, conn, dlq) == 1 && len(oracle.applied(t)) == 1
	})
	// A copy of the applied message, dead-lettered by a worker that died
	// after its effect committed and before its ack.
	amqpPublish(t, conn, dlq, amqp091.Publishing{MessageId: okID, DeliveryMode: amqp091.Persistent, Body: []byte("ok-" + okID),
		Headers: amqp091.Table{consumer.HeaderID: okID, consumer.HeaderReason: "timeout", consumer.HeaderSource: queue,
			consumer.HeaderError: "handler timed out", consumer.HeaderAttempts: int32(1), idemamqp.HeaderAttempt: int32(1)}})

	srv := startConsole(t, "--amqp", url, "--queue", dlq)
	b.open(srv.URL + "/deadletters")
	groups := b.text("table.list")
	if !strings.Contains(groups, "permanent\t"+queue+"\t1") || !strings.Contains(groups, "timeout\t"+queue+"\t1") {
		t.Errorf("groups: want one permanent and one timeout letter from %s:\n%s", queue, groups)
	}
	b.screenshot("deadletters")
	if n := amqpDepth(t, conn, dlq); n != 2 {
		t.Fatalf("%d letters in the queue after the page, want 2: the page returns what it read", n)
	}
	b.open(srv.URL + "/deadletters/show?dest=amqp&id=" + badID)
	if p := b.text("#payload"); p != `"bad-`+badID+`"` {
		t.Errorf("payload: %q", p)
	}
	if h := b.text("#headers"); !strings.Contains(h, consumer.HeaderReason+"\tpermanent") || !strings.Contains(h, consumer.HeaderError+"\tcannot parse bad-"+badID) {
		t.Errorf("headers lack the reason and the error:\n%s", h)
	}
	b.screenshot("letter")

	oracle.fixed.Store(true)
	b.open(srv.URL + "/deadletters")
	b.do(chromedpClick("#all"))
	b.submit("#replay")
	if plan := b.text("#plan"); !strings.Contains(plan, "would replay 2") {
		t.Errorf("confirm page: want a dry run that would replay 2:\n%s", plan)
	}
	if n := amqpDepth(t, conn, dlq); n != 2 {
		t.Fatalf("%d letters before the confirmation, want 2", n)
	}
	b.submit("#confirm")
	if out := b.text("#outcome"); !strings.Contains(out, ": 2 replayed, 0 copies removed, 0 not replayed") {
		t.Errorf("result:\n%s", out)
	}
	oracle.waitApplied(t, []string{okID, badID})
	testenv.Eventually(t, 30*time.Second, "the replayed copy delivered", func() bool { return oracle.delivered(okID) >= 2 })
	oracle.check(t, []string{okID, badID})
	if n := amqpDepth(t, conn, dlq); n != 0 {
		t.Errorf("%d letters after the replay, want 0", n)
	}
}

// TestConsoleCrossSiteForm: a page of another origin, in the same
// Chromium, posts a form to the console's requeue action: the console
// refuses it (403) on its Origin, before it reads the form.
func TestConsoleCrossSiteForm(t *testing.T) {
	b := newBrowser(t)
	console := startConsole(t)
	evil := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/html")
		_, _ = io.WriteString(w, `<!doctype html><form method="post" action="`+console.URL+`/outbox/requeue">
<input type="hidden" name="id" value="00000000-0000-0000-0000-000000000000"><input type="hidden" name="confirm" value="yes">
<button type="submit" id="go">Win a prize</button></form>`)
	}))
	t.Cleanup(evil.Close)
	b.open(evil.URL)
	if res := b.load(chromedpClick("#go")); res.Status != http.StatusForbidden {
		t.Errorf("cross-site POST: %d, want 403", res.Status)
	}
	if body := b.text("body"); !strings.Contains(body, "cross-site request refused") {
		t.Errorf("body: %q", body)
	}
}
