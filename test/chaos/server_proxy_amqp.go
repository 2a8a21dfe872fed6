//go:build unix

package chaos

// proxy/outbox-amqp: the RabbitMQ twin of proxy/outbox-kafka. A pgoutbox
// Relay on the shared PostgreSQL publishes, with adapters/amqp's Publisher
// and publisher confirms, to a fanout exchange in a vhost of the cell's own
// on the shared broker, through the fault proxy: a publish whose confirm is
// cut or whose connection is reset is unconfirmed, and the relay sends it
// again. An adapters/amqp Consumer (direct, not through the proxy) applies
// each message with consumer.Transactional on dedup/pgtable. Promise: every
// committed message applied exactly once.

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

func init() {
	Register(Cell{Name: "proxy/outbox-amqp", Run: srvProxyOutboxAMQP})
}

func srvProxyOutboxAMQP(ctx context.Context, env *Env) (res Result, err error) {
	const name = "proxy/outbox-amqp"
	n := env.Pick(800, 5000)
	rounds := env.Pick(15, 100)

	shared, err := srvPool(ctx, env.PGURL, 6)
	if err != nil {
		return res, err
	}
	defer shared.Close()
	o, err := NewOracle(ctx, shared, name, env.Seed)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, o.Drop(context.WithoutCancel(ctx))) }()
	ob, err := srvMigratedOutbox(ctx, shared, o.Schema())
	if err != nil {
		return res, err
	}
	br, err := srvStartAMQPBroker(ctx, env, name, shared, o)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, br.close()) }()
	relay, err := pgoutbox.NewRelay(ob, br.pub, srvRelayOptions())
	if err != nil {
		return res, err
	}
	stopAll := srvStopAll(srvRelay(ctx, relay), br.stopConsumer)
	defer func() { err = errors.Join(err, stopAll()) }()

	bursts, runErr, verr := srvProxyOutboxWorkload(ctx, env, br.px, shared, ob, o, n, rounds, stopAll, &res)
	verr = errors.Join(verr, br.verdict(&res))
	res.Note = fmt.Sprintf("%d messages consumed, %d of them re-published duplicates; %s", br.acks.Load(), br.dups.Load(), srvProxyNote(br.px, bursts))
	return res, errors.Join(runErr, verr)
}

// srvAMQPBroker is the RabbitMQ side of a proxy/outbox cell: a vhost of
// the cell's own with a fanout exchange (the outbox messages' topic
// "chaos"), the fault proxy in front of it, adapters/amqp's Publisher
// (publisher confirms) through the proxy for the relay, and an
// adapters/amqp Consumer (direct) that applies each message with
// consumer.Transactional on dedup/pgtable in the oracle's schema.
type srvAMQPBroker struct {
	px           *fault.Proxy
	pub          *idemamqp.Publisher
	stopConsumer func() error // once
	dups, acks   atomic.Int64
	deadMu       sync.Mutex
	dead         []string
	closers      []func() error
}

// close stops the consumer and removes everything, in reverse order.
func (b *srvAMQPBroker) close() error {
	var err error
	if b.stopConsumer != nil {
		err = b.stopConsumer()
	}
	for i := len(b.closers) - 1; i >= 0; i-- {
		err = errors.Join(err, b.closers[i]())
	}
	return err
}

// verdict sets the cell's redeliveries and kills and fails on
// dead-lettered messages.
func (b *srvAMQPBroker) verdict(res *Result) error {
	res.Redeliveries = int(b.dups.Load())
	res.Kills = srvProxyKills(b.px)
	b.deadMu.Lock()
	defer b.deadMu.Unlock()
	if len(b.dead) > 0 {
		return fmt.Errorf("%d message(s) dead-lettered, first %s", len(b.dead), b.dead[0])
	}
	return nil
}

// srvStartAMQPBroker sets up the broker side and starts the consumer; the
// caller closes it.
func srvStartAMQPBroker(ctx context.Context, env *Env, name string, shared *pgxpool.Pool, o *Oracle) (b *srvAMQPBroker, err error) {
	const exchange = "chaos" // srvProducers enqueue to topic "chaos"
	b = &srvAMQPBroker{}
	defer func() {
		if err != nil {
			err = errors.Join(err, b.close())
		}
	}()
	ctl, err := newRabbitCtl(env.AMQPURL)
	if err != nil {
		return b, err
	}
	vurl, delVhost, err := ctl.vhost(ctx, env.AMQPURL, fmt.Sprintf("idem-chaos-%s-%d", sanitize(name), env.Seed%1_000_000_007))
	if err != nil {
		return b, fmt.Errorf("vhost: %w", err)
	}
	b.closers = append(b.closers, func() error { delVhost(); return nil })
	u, err := url.Parse(vurl)
	if err != nil {
		return b, err
	}
	b.px, err = fault.NewProxy(u.Host)
	if err != nil {
		return b, err
	}
	b.closers = append(b.closers, b.px.Close)
	proxied := *u
	proxied.Host = b.px.Addr()

	// The exchange is the producer's: declared once, before anyone binds.
	conn, err := amqp091.Dial(vurl)
	if err != nil {
		return b, err
	}
	ch, err := conn.Channel()
	if err == nil {
		err = ch.ExchangeDeclare(exchange, "fanout", true, false, false, false, nil)
	}
	_ = conn.Close()
	if err != nil {
		return b, fmt.Errorf("declare exchange: %w", err)
	}

	store, err := srvMigratedStore(ctx, shared, o.Schema())
	if err != nil {
		return b, err
	}
	b.pub, err = idemamqp.NewPublisher(proxied.String(), idemamqp.PublisherOptions{
		Logger: srvQuiet, ConfirmTimeout: 3 * time.Second,
		ReconnectBackoff: consumer.Backoff{Initial: 20 * time.Millisecond, Max: 200 * time.Millisecond},
		Config: &amqp091.Config{Heartbeat: 10 * time.Second, Dial: func(network, addr string) (net.Conn, error) {
			return net.DialTimeout(network, addr, 5*time.Second)
		}},
	})
	if err != nil {
		return b, err
	}
	b.closers = append(b.closers, b.pub.Close)

	var outcomes srvCounts
	apply, err := consumer.Transactional(store, consumer.TxOptions{Scope: "chaos/" + name, Telemetry: consumer.Telemetry{OnOutcome: outcomes.outcome}},
		func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			return o.Record(ctx, tx, m.ID, "consumer")
		})
	if err != nil {
		return b, err
	}
	c, err := idemamqp.NewConsumer(vurl, "chaos-work", consumer.Chain(apply, consumer.Recover()), idemamqp.ConsumerOptions{
		Bindings: []idemamqp.ConsumerBinding{{Exchange: exchange}},
		Prefetch: 64, Concurrency: 4, Backoff: consumer.Backoff{Initial: 100 * time.Millisecond, Max: 100 * time.Millisecond},
		Telemetry: consumer.Telemetry{
			Logger: srvQuiet,
			OnOutcome: func(_ context.Context, rep consumer.Report) {
				switch r := rep.Result; r.Action {
				case consumer.ActionAck:
					b.acks.Add(1)
					if r.Duplicate {
						b.dups.Add(1)
					}
				case consumer.ActionDeadLetter:
					b.deadMu.Lock()
					b.dead = append(b.dead, fmt.Sprintf("%s (%s: %v)", rep.Message.ID, r.Reason, r.Err))
					b.deadMu.Unlock()
				}
			},
		},
	})
	if err != nil {
		return b, err
	}
	exited, stopConsumer := srvStart(ctx, "amqp consumer", c.Run)
	b.stopConsumer = srvStopAll(stopConsumer)
	select {
	case <-c.Ready():
		return b, nil
	case err := <-exited:
		b.stopConsumer = nil
		return b, fmt.Errorf("amqp consumer: %w", err)
	case <-time.After(60 * time.Second):
		return b, errors.New("the amqp consumer was not ready within 60s")
	}
}
