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
	n := env.Scale.Pick(800, 5000)
	rounds := env.Scale.Pick(15, 100)
	const exchange = "chaos" // srvProducers enqueue to topic "chaos"

	ctl, err := newRabbitCtl(env.AMQPURL)
	if err != nil {
		return res, err
	}
	vurl, delVhost, err := ctl.vhost(ctx, env.AMQPURL, fmt.Sprintf("idem-chaos-proxy-%d", env.Seed%1_000_000_007))
	if err != nil {
		return res, fmt.Errorf("vhost: %w", err)
	}
	defer delVhost()
	u, err := url.Parse(vurl)
	if err != nil {
		return res, err
	}
	px, err := fault.NewProxy(u.Host)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, px.Close()) }()
	proxied := *u
	proxied.Host = px.Addr()

	// The exchange is the producer's: declared once, before anyone binds.
	conn, err := amqp091.Dial(vurl)
	if err != nil {
		return res, err
	}
	ch, err := conn.Channel()
	if err == nil {
		err = ch.ExchangeDeclare(exchange, "fanout", true, false, false, false, nil)
	}
	_ = conn.Close()
	if err != nil {
		return res, fmt.Errorf("declare exchange: %w", err)
	}

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
	store, err := srvMigratedStore(ctx, shared, o.Schema())
	if err != nil {
		return res, err
	}

	pub, err := amqp.NewPublisher(proxied.String(), amqp.PublisherOptions{
		Logger: srvQuiet, ConfirmTimeout: 3 * time.Second,
		ReconnectBackoff: 20 * time.Millisecond, MaxReconnectBackoff: 200 * time.Millisecond,
		Config: &amqp091.Config{Heartbeat: 10 * time.Second, Dial: func(network, addr string) (net.Conn, error) {
			return net.DialTimeout(network, addr, 5*time.Second)
		}},
	})
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, pub.Close()) }()
	relay, err := pgoutbox.NewRelay(ob, pub, srvRelayOptions())
	if err != nil {
		return res, err
	}

	var outcomes srvCounts
	apply, err := consumer.Transactional(store, consumer.TxOptions{Scope: "chaos/" + name, OnOutcome: outcomes.outcome},
		func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			return o.Record(ctx, tx, m.ID, "consumer")
		})
	if err != nil {
		return res, err
	}
	var dups, acks atomic.Int64
	var deadMu sync.Mutex
	var dead []string
	c, err := amqp.NewConsumer(vurl, "chaos-work", consumer.Chain(apply, consumer.Recover()), amqp.ConsumerOptions{
		Bindings: []amqp.ConsumerBinding{{Exchange: exchange}},
		Prefetch: 64, Concurrency: 4, Logger: srvQuiet, RetryDelays: []time.Duration{100 * time.Millisecond},
		OnResult: func(_ context.Context, m *consumer.Message, r consumer.Result, out amqp.ConsumerOutcome) {
			switch {
			case out == amqp.OutcomeAcked:
				acks.Add(1)
				if r.Duplicate {
					dups.Add(1)
				}
			case r.Action == consumer.ActionDeadLetter:
				deadMu.Lock()
				dead = append(dead, fmt.Sprintf("%s (%s: %v)", m.ID, r.Reason, r.Err))
				deadMu.Unlock()
			}
		},
	})
	if err != nil {
		return res, err
	}
	exited, stopConsumer := srvStart(ctx, "amqp consumer", c.Run)
	select {
	case <-c.Ready():
	case err := <-exited:
		return res, fmt.Errorf("amqp consumer: %w", err)
	case <-time.After(60 * time.Second):
		return res, errors.Join(errors.New("the amqp consumer was not ready within 60s"), stopConsumer())
	}
	stopAll := srvStopAll(srvRelay(ctx, relay), stopConsumer)
	defer func() { err = errors.Join(err, stopAll()) }()

	bursts, runErr, verr := srvProxyOutboxWorkload(ctx, env, px, shared, ob, o, n, rounds, stopAll, &res)
	res.Redeliveries = int(dups.Load())
	res.Kills = srvProxyKills(px)
	deadMu.Lock()
	if len(dead) > 0 {
		verr = errors.Join(verr, fmt.Errorf("%d message(s) dead-lettered, first %s", len(dead), dead[0]))
	}
	deadMu.Unlock()
	res.Note = fmt.Sprintf("%d messages consumed, %d of them re-published duplicates; %s", acks.Load(), dups.Load(), srvProxyNote(px, bursts))
	return res, errors.Join(runErr, verr)
}
