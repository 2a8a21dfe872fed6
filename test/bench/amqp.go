package bench

import (
	"context"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"

	idemamqp "github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/redisnx"
)

// The RabbitMQ rows: both sides take deliveries with the same prefetch on
// the same number of concurrent handlers.
const amqpPrefetch, amqpConcurrency = 100, 8

// amqpSide publishes a round's deliveries to a fresh queue (untimed) and
// times consume on it.
func amqpSide(e *env, consume func(ctx context.Context, queue string, n int) (float64, error)) side {
	return func(ctx context.Context, warm bool) (float64, error) {
		q, err := e.queue()
		if err != nil {
			return 0, err
		}
		n := warmed(e.size.deliveries, warm)
		if err := e.publish(ctx, q, e.id("m")+"-", n, payload); err != nil {
			return 0, err
		}
		return consume(ctx, q, n)
	}
}

// amqpBare is the worker a user writes with amqp091-go: one channel with
// the prefetch, amqpConcurrency goroutines reading its deliveries, each
// running work and acknowledging the delivery on its own.
func amqpBare(ctx context.Context, e *env, queue string, n int, work func(ctx context.Context, d *amqp091.Delivery) error) (float64, error) {
	conn, err := amqp091.Dial(e.amqpURL)
	if err != nil {
		return 0, err
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return 0, err
	}
	if err := ch.Qos(amqpPrefetch, 0, false); err != nil {
		return 0, err
	}
	ds, err := ch.Consume(queue, "", false, false, false, false, nil)
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	m := newMeter(n)
	errc := make(chan error, amqpConcurrency)
	for range amqpConcurrency {
		go func() {
			for {
				select {
				case <-ctx.Done():
					return
				case d, ok := <-ds:
					if !ok {
						errc <- errors.New("deliveries closed")
						return
					}
					if err := work(ctx, &d); err != nil {
						errc <- err
						return
					}
					if err := d.Ack(false); err != nil {
						errc <- err
						return
					}
					m.tick()
				}
			}
		}()
	}
	return m.wait(ctx, errc)
}

// amqpIdem runs idem's Consumer with h until n deliveries are acknowledged.
func amqpIdem(ctx context.Context, e *env, queue string, n int, h consumer.Handler) (float64, error) {
	m := newMeter(n)
	c, err := idemamqp.NewConsumer(e.amqpURL, queue, h, idemamqp.ConsumerOptions{
		Prefetch: amqpPrefetch, Concurrency: amqpConcurrency, Backoff: consumer.Backoff{Initial: time.Second, Max: time.Second},
		Telemetry: consumer.Telemetry{
			Logger: e.log,
			OnOutcome: func(_ context.Context, r consumer.Report) {
				if r.Result.Action == consumer.ActionAck {
					m.tick()
				}
			},
		},
	})
	if err != nil {
		return 0, err
	}
	ctx, cancel := context.WithCancel(ctx)
	errc := make(chan error, 1)
	go func() { errc <- c.Run(ctx) }()
	rate, err := m.wait(ctx, errc)
	cancel()
	if rerr := <-errc; err == nil && rerr != nil && !errors.Is(rerr, context.Canceled) {
		err = rerr
	}
	return rate, err
}

func amqpTxRow() row {
	return row{
		path:     "RabbitMQ, transactional claim (consumer.Transactional)",
		baseline: "amqp091-go worker, prefetch 100, 8 goroutines, one tx per delivery, manual ACK",
		target:   0.90, unit: "msg/s", floor: txFloor,
		build: func(ctx context.Context, e *env) (side, side, error) {
			bareInsert, h, err := e.txSides(ctx, "amqp_tx", "bench/amqp")
			if err != nil {
				return nil, nil, err
			}
			bare := amqpSide(e, func(ctx context.Context, q string, n int) (float64, error) {
				return amqpBare(ctx, e, q, n, func(ctx context.Context, d *amqp091.Delivery) error {
					return pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
						_, err := tx.Exec(ctx, bareInsert, d.MessageId, d.Body)
						return err
					})
				})
			})
			idem := amqpSide(e, func(ctx context.Context, q string, n int) (float64, error) { return amqpIdem(ctx, e, q, n, h) })
			return bare, idem, nil
		},
	}
}

func amqpLeaseRow() row {
	return row{
		path:     "RabbitMQ, redisnx lease (consumer.Dedup)",
		baseline: "amqp091-go worker, prefetch 100, 8 goroutines, same work (decode the order), manual ACK",
		target:   0.70, unit: "msg/s",
		build: func(_ context.Context, e *env) (side, side, error) {
			store, err := redisnx.New(e.rdb, redisnx.Options{Prefix: e.redisPrefix("amqp"), TTL: redisTTL})
			if err != nil {
				return nil, nil, err
			}
			dd, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "bench/amqp"})
			if err != nil {
				return nil, nil, err
			}
			h := consumer.Chain(consumer.HandlerFunc(func(_ context.Context, m *consumer.Message) error { return decodeOrder(m.Payload) }), dd)
			bare := amqpSide(e, func(ctx context.Context, q string, n int) (float64, error) {
				return amqpBare(ctx, e, q, n, func(_ context.Context, d *amqp091.Delivery) error { return decodeOrder(d.Body) })
			})
			idem := amqpSide(e, func(ctx context.Context, q string, n int) (float64, error) { return amqpIdem(ctx, e, q, n, h) })
			return bare, idem, nil
		},
		// The baseline worker sending, per delivery, what consumer.Dedup
		// on redisnx sends: the claim pipeline (the key of the delivery's
		// MessageId, a record with the body's fingerprint), then, after
		// the work, the complete script with an empty result.
		byHand: func(_ context.Context, e *env) (side, error) {
			h := newHandRedis(e.rdb, e.redisPrefix("amqphand"))
			return amqpSide(e, func(ctx context.Context, q string, n int) (float64, error) {
				return amqpBare(ctx, e, q, n, func(ctx context.Context, d *amqp091.Delivery) error {
					key, old := h.keys("bench/amqp", d.MessageId)
					token := handToken()
					fp := fingerprint(d.Body)
					if err := h.claimNew(ctx, key, old, inFlight(&fp, token)); err != nil {
						return err
					}
					if err := decodeOrder(d.Body); err != nil {
						return err
					}
					return h.complete(ctx, key, token, nil)
				})
			}), nil
		},
	}
}
