// Command amqp-worker is a notification worker on RabbitMQ: it sends an
// "e-mail" for each message of a queue, at most once per message id while
// the Redis lease holds, and passes the message id on to the e-mail provider
// as its idempotency key, so that even a resend after a lost lease or a
// crash is dropped by the provider.
//
// The demo publishes notifications (some of them twice, as a relay that
// crashed between publishing and marking would, one malformed), runs the
// worker until every message is settled, prints what happened and deletes
// its queues. See README.md.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/redisnx"
)

type config struct {
	amqpURL  string
	redisURL string
	queue    string
	n        int
	keep     bool
	out      *os.File
}

func main() {
	var cfg config
	flag.StringVar(&cfg.amqpURL, "amqp", "amqp://guest:guest@127.0.0.1:5672/", "RabbitMQ URL")
	flag.StringVar(&cfg.redisURL, "redis", "redis://127.0.0.1:6379/0", "Redis URL (redis://[user:password@]host:port/db, rediss:// for TLS) or host:port: the dedup leases")
	flag.StringVar(&cfg.queue, "queue", "", "work queue (default: a fresh notifications-<random> queue)")
	flag.IntVar(&cfg.n, "n", 50, "notifications to publish")
	flag.BoolVar(&cfg.keep, "keep", false, "keep the queues (and the dead-letter queue) and the Redis marks at the end")
	flag.Parse()
	cfg.out = os.Stdout
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	err := run(ctx, cfg)
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "amqp-worker:", err)
		os.Exit(1)
	}
}

// notification is the message body.
type notification struct {
	To      string `json:"to"`
	Subject string `json:"subject"`
}

// provider stands in for an e-mail API (Postmark, SES, SendGrid...) that
// accepts an idempotency key: a second send with the same key is accepted
// and dropped. It fails the first call for addresses ending in ".flaky", to
// show a retry through the retry queue.
type provider struct {
	mu      sync.Mutex
	sent    map[string]notification // by idempotency key
	dropped int
	flaky   map[string]bool
}

var errProviderDown = errors.New("provider: 503 service unavailable")

func (p *provider) Send(ctx context.Context, idempotencyKey string, n notification) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if strings.HasSuffix(n.To, ".flaky") && !p.flaky[idempotencyKey] {
		p.flaky[idempotencyKey] = true
		return errProviderDown
	}
	if _, ok := p.sent[idempotencyKey]; ok {
		p.dropped++
		return nil
	}
	p.sent[idempotencyKey] = n
	return nil
}

func run(ctx context.Context, cfg config) error {
	if cfg.queue == "" {
		cfg.queue = "notifications-" + strings.ToLower(fmt.Sprintf("%x", time.Now().UnixNano()&0xffffffff))
	}
	opt, err := redisOptions(cfg.redisURL)
	if err != nil {
		return fmt.Errorf("-redis: %w", err)
	}
	rdb := redis.NewClient(opt)
	defer func() { _ = rdb.Close() }()
	pctx, pcancel := context.WithTimeout(ctx, 5*time.Second)
	err = rdb.Ping(pctx).Err()
	pcancel()
	if err != nil {
		return fmt.Errorf("redis at %s is unreachable: %w", opt.Addr, err)
	}
	// The marks of this run live under their own prefix, deleted at the
	// end unless -keep; a service keeps one prefix for good.
	prefix := "idem-amqp-worker-" + cfg.queue
	if !cfg.keep {
		defer deleteKeys(rdb, prefix+":")
	}
	store, err := redisnx.New(rdb, redisnx.Options{
		Prefix: prefix,
		Lease:  30 * time.Second, // extended while the handler runs
		TTL:    24 * time.Hour,   // must outlive every redelivery
	})
	if err != nil {
		return err
	}
	dedupMW, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "notifications/email"})
	if err != nil {
		return err
	}
	prov := &provider{sent: map[string]notification{}, flaky: map[string]bool{}}
	send := consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		var n notification
		if err := json.Unmarshal(msg.Payload, &n); err != nil || n.To == "" {
			return consumer.Permanent(fmt.Errorf("malformed notification: %w", errors.Join(err, errors.New("no recipient"))))
		}
		// The message id is the provider's idempotency key: the provider
		// drops a resend that the lease could not prevent.
		return prov.Send(ctx, msg.ID, n)
	})
	h := consumer.Chain(send, consumer.Recover(), consumer.Timeout(20*time.Second), dedupMW)

	var settled atomic.Int64
	logger := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	c, err := idemamqp.NewConsumer(cfg.amqpURL, cfg.queue, h, idemamqp.ConsumerOptions{
		Prefetch:    100,
		Concurrency: 8,
		// Retry queues of 200ms, 1s and 5s.
		Backoff:     consumer.Backoff{Initial: 200 * time.Millisecond, Max: 5 * time.Second, Factor: 5},
		MaxAttempts: 5,
		// A quorum queue counts the deliveries that died unsettled (a
		// worker crashed mid-send): the 11th delivery of a message that
		// crashes every worker is dead-lettered (redelivery_limit) instead
		// of being redelivered forever.
		QuorumQueue:   true,
		MaxDeliveries: 10,
		Telemetry: consumer.Telemetry{
			Logger: logger,
			OnOutcome: func(_ context.Context, r consumer.Report) {
				if r.Result.Action != consumer.ActionRetry { // acknowledged or dead-lettered
					settled.Add(1)
				}
			},
		},
	})
	if err != nil {
		return err
	}
	rctx, cancel := context.WithCancel(ctx)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.Run(rctx) }()
	// halt stops the worker and joins err with Run's error.
	halt := func(err error) error {
		cancel()
		return errors.Join(err, <-done)
	}
	select {
	case <-c.Ready():
	case err := <-done:
		return err
	case <-time.After(30 * time.Second):
		return halt(errors.New("the consumer did not start in 30s: is RabbitMQ up?"))
	}
	if !cfg.keep {
		defer deleteTopology(cfg.amqpURL, cfg.queue)
	}

	msgs := demoMessages(cfg.n, cfg.queue)
	if err := publish(ctx, cfg.amqpURL, cfg.queue, msgs); err != nil {
		return halt(err)
	}
	_, _ = fmt.Fprintf(cfg.out, "published %d notifications to %s: %d of them twice, 1 malformed\n", cfg.n, cfg.queue, len(msgs)-cfg.n-1)
	deadline := time.After(60 * time.Second)
	for settled.Load() < int64(len(msgs)) {
		select {
		case <-deadline:
			return halt(fmt.Errorf("timed out: %d of %d messages settled", settled.Load(), len(msgs)))
		case err := <-done:
			return fmt.Errorf("consumer stopped: %w", err)
		case <-time.After(10 * time.Millisecond):
		}
	}
	cancel()
	if err := <-done; err != nil {
		return err
	}
	st := c.Stats()
	prov.mu.Lock()
	defer prov.mu.Unlock()
	_, _ = fmt.Fprintf(cfg.out, "sent %d e-mails (one per notification); %d duplicates acknowledged without sending, %d retried, %d dead-lettered to %s.dlq\n",
		len(prov.sent), st.Duplicates, st.Retried, st.DeadLettered, cfg.queue)
	if len(prov.sent) != cfg.n || prov.dropped != 0 {
		return fmt.Errorf("sent %d e-mails for %d notifications (%d resends dropped by the provider)", len(prov.sent), cfg.n, prov.dropped)
	}
	return nil
}

// demoMessages returns n notifications (every tenth published twice, the
// fifth to a flaky address) and one malformed message.
func demoMessages(n int, run string) []amqp091.Publishing {
	var out []amqp091.Publishing
	for i := range n {
		to := fmt.Sprintf("user%d@example.com", i)
		if i == 4 {
			to += ".flaky"
		}
		body, _ := json.Marshal(notification{To: to, Subject: "Your receipt"})
		p := amqp091.Publishing{MessageId: fmt.Sprintf("%s-%d", run, i), ContentType: "application/json", Body: body}
		out = append(out, p)
		if i%10 == 0 {
			out = append(out, p)
		}
	}
	return append(out, amqp091.Publishing{MessageId: run + "-bad", Body: []byte("{not json")})
}

func publish(ctx context.Context, url, queue string, msgs []amqp091.Publishing) error {
	conn, err := amqp091.Dial(url)
	if err != nil {
		return err
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	if err := ch.Confirm(false); err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	for _, m := range msgs {
		m.DeliveryMode = amqp091.Persistent
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, false, false, m)
		if err != nil {
			return err
		}
		ok, err := dc.WaitContext(ctx)
		if err != nil {
			return fmt.Errorf("publish %s: %w", m.MessageId, err)
		}
		if !ok {
			return fmt.Errorf("publish %s: nacked by the broker", m.MessageId)
		}
	}
	return nil
}

// redisOptions parses a Redis URL (redis://[user:password@]host:port[/db],
// rediss:// for TLS) or a bare host:port.
func redisOptions(s string) (*redis.Options, error) {
	if !strings.Contains(s, "://") {
		s = "redis://" + s
	}
	return redis.ParseURL(s)
}

// quietRedis drops go-redis's own log lines (a failed dial of its pool):
// the example reports Redis errors itself.
type quietRedis struct{}

func (quietRedis) Printf(context.Context, string, ...any) {}

func init() { redis.SetLogger(quietRedis{}) }

// deleteKeys deletes the keys that start with prefix.
func deleteKeys(rdb *redis.Client, prefix string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	iter := rdb.Scan(ctx, 0, prefix+"*", 500).Iterator()
	for iter.Next(ctx) {
		_ = rdb.Del(ctx, iter.Val()).Err()
	}
}

func deleteTopology(url, queue string) {
	conn, err := amqp091.Dial(url)
	if err != nil {
		return
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return
	}
	for _, q := range []string{queue, queue + ".dlq", queue + ".retry.200ms", queue + ".retry.1000ms", queue + ".retry.5000ms"} {
		_, _ = ch.QueueDelete(q, false, false, false)
	}
	_ = ch.ExchangeDelete(queue+".dlx", false, false)
}
