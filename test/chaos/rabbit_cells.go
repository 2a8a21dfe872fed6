package chaos

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// RabbitMQ fault cells. Each starts a RabbitMQ node of its own
// (rabbitNode: own name, ports, data and cookie; the shared broker is
// never touched) with a durable queue and persistent messages, and while
// inputs flow it closes every client connection with `rabbitmqctl
// close_all_connections` several times, and between them stops and starts
// the node's application (`rabbitmqctl stop_app` / `start_app`: every
// connection dies, the queue and its messages come back from disk) and
// SIGKILLs the node and starts it again (a crash: what was confirmed is on
// disk, acknowledgements not yet written come back as redeliveries), in
// turn: one of each at small scale, two of each at full scale.
//
//   - rabbit/amqp/close-all+stop-app: two adapters/amqp Consumers in the
//     runner (pgtable Transactional), fed by adapters/amqp's Publisher,
//     which sends again every batch whose confirms it lost.
//   - rabbit/relay/close-all+stop-app: a pgoutbox Relay in the runner
//     publishing through adapters/amqp's Publisher to the same kind of
//     consumer.
//
// Both promise 0 duplicate effects and 0 lost.

// rabbitWork is how long the consumers' transactions take: deliveries are
// in flight when a fault hits.
const rabbitWork = 20 * time.Millisecond

// rabbitFaults is one run of the faults.
type rabbitFaults struct {
	closes, closed int // close_all_connections runs, connections they closed
	stops          int // stop_app / start_app cycles
	crashes        int // SIGKILLs of the node, each followed by a start
	down           time.Duration
}

func (f rabbitFaults) note() string {
	return fmt.Sprintf("%d close_all_connections closed %d connections; %d stop_app/start_app, %d SIGKILL/start of the node, broker down %v in all",
		f.closes, f.closed, f.stops, f.crashes, f.down.Round(100*time.Millisecond))
}

// faultLoop runs closes close_all_connections and stops outages of the
// node, spread in between (the outages in the middle), waiting a random
// 200ms–1.2s (env.Rand) before each, and closes over when done. The
// outages are stop_app/start_app and SIGKILL/start in turn, beginning with
// stop_app.
func faultLoop(ctx context.Context, env *Env, node *rabbitNode, closes, stops int, over chan<- struct{}) (rabbitFaults, error) {
	defer close(over)
	var f rabbitFaults
	total := closes + stops
	stopAt := map[int]int{} // fault index -> outage number
	for i := range stops {
		stopAt[(i+1)*total/(stops+1)] = i
	}
	for i := range total {
		if err := sleepCtx(ctx, 200*time.Millisecond+time.Duration(env.Rand.Int64N(int64(time.Second)))); err != nil {
			return f, err
		}
		outage, isOutage := stopAt[i]
		switch {
		case isOutage && outage%2 == 0:
			t0 := time.Now()
			_, stopErr := node.ctl.run(ctx, "--quiet", "stop_app")
			if stopErr == nil {
				f.stops++
				_ = sleepCtx(ctx, 500*time.Millisecond+time.Duration(env.Rand.Int64N(int64(time.Second))))
			}
			if err := startApp(ctx, node); err != nil {
				return f, err
			}
			if stopErr != nil {
				return f, stopErr
			}
			f.down += time.Since(t0)
			env.Logf("fault %d/%d: stop_app/start_app, down %v", i+1, total, time.Since(t0).Round(100*time.Millisecond))
		case isOutage:
			t0 := time.Now()
			node.kill()
			f.crashes++
			_ = sleepCtx(ctx, 200*time.Millisecond+time.Duration(env.Rand.Int64N(int64(500*time.Millisecond))))
			if err := node.restart(ctx); err != nil {
				return f, fmt.Errorf("the node was SIGKILLed and did not start again: %w", err)
			}
			f.down += time.Since(t0)
			env.Logf("fault %d/%d: SIGKILL/start of the node, down %v", i+1, total, time.Since(t0).Round(100*time.Millisecond))
		default:
			n, err := node.ctl.closeAll(ctx, "/")
			if err != nil {
				return f, err
			}
			f.closes++
			f.closed += n
			env.Logf("fault %d/%d: close_all_connections closed %d", i+1, total, n)
		}
	}
	return f, nil
}

// startApp starts the node's application and waits for it, trying three
// times, and as a last resort kills and starts the node: the cell goes on
// only with a running broker.
func startApp(ctx context.Context, node *rabbitNode) error {
	ctx = context.WithoutCancel(ctx)
	var err error
	for range 3 {
		// start_app returns once the application has started.
		if _, err = node.ctl.run(ctx, "--quiet", "start_app"); err == nil {
			return nil
		}
		time.Sleep(time.Second)
	}
	node.kill()
	if rerr := node.restart(ctx); rerr != nil {
		return fmt.Errorf("the node's application was stopped and did not start again (%w), nor did the node: %w", err, rerr)
	}
	return nil
}

// faultSpan is about how long faultLoop takes: rabbitmqctl itself needs
// about a second per command, and a node boots in several.
func faultSpan(closes, stops int) time.Duration {
	return time.Duration(closes)*1500*time.Millisecond + time.Duration(stops)*10*time.Second
}

// paced sends ids through send in small batches every 100ms, spread over
// span, and what is left at once when over is closed: a steady stream, so
// that the faults hit work in flight.
func paced(ctx context.Context, ids []string, span time.Duration, over <-chan struct{}, send func(context.Context, []string) error) error {
	const every = 100 * time.Millisecond
	per := max(1, int(int64(len(ids))*int64(every)/int64(span)))
	t := time.NewTicker(every)
	defer t.Stop()
	for len(ids) > 0 {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		case <-over:
			per = len(ids)
		}
		n := min(per, len(ids))
		if err := send(ctx, ids[:n]); err != nil {
			return err
		}
		ids = ids[n:]
	}
	return nil
}

// rabbitBroker starts the cell's RabbitMQ node and names its queue. The
// returned function stops the node.
func rabbitBroker(ctx context.Context, env *Env, b *cellBase) (*amqpQueue, *rabbitNode, func(), error) {
	node, err := startRabbitNode(ctx, filepath.Join(env.TempDir, "rabbitmq"))
	if err != nil {
		return nil, nil, nil, err
	}
	env.Logf("rabbitmq node %s on 127.0.0.1:%d", node.name, node.port)
	q := &amqpQueue{url: node.url(), vhost: "/", queue: "chaos." + b.suffix, exchange: "chaos." + b.suffix + ".in", durable: true, ctl: node.ctl}
	return q, node, node.close, nil
}

// rabbitDrain waits until sink caught up (and ready reports nothing
// pending), then stops and settles it.
func rabbitDrain(ctx context.Context, b *cellBase, sink *amqpSink, pending func(context.Context) (bool, error)) error {
	lastDone, lastAt := -1, time.Now()
	for {
		if err := sleepCtx(ctx, 300*time.Millisecond); err != nil {
			n, _ := b.distinctEffects(context.WithoutCancel(ctx))
			return fmt.Errorf("drain stalled: %d of %d inputs have an effect", n, len(b.ids))
		}
		n, err := b.distinctEffects(ctx)
		if err != nil {
			return err
		}
		if n != lastDone {
			lastDone, lastAt = n, time.Now()
		}
		if pending != nil {
			busy, err := pending(ctx)
			if err != nil {
				return err
			}
			if busy {
				continue
			}
		}
		ok, err := sink.caughtUp(ctx, time.Since(lastAt))
		if errors.Is(err, errDeadLettered) {
			return err
		}
		if err != nil {
			continue // the broker may be starting again
		}
		if ok {
			return sink.settle(ctx)
		}
	}
}

// rabbitResult finishes a rabbit cell: the oracle over every input.
func rabbitResult(ctx context.Context, b *cellBase, f rabbitFaults, runErr error) (Result, error) {
	res := Result{Messages: len(b.ids), Kills: f.closed + f.stops + f.crashes, Restarts: f.stops + f.crashes, Note: f.note()}
	deliveries, distinct, err := countDeliveries(b.env.TempDir, "deliveries")
	if err == nil {
		res.Redeliveries = deliveries - distinct
	}
	dups, lost, err := oracleVerdict(ctx, b, runErr)
	if err != nil && runErr == nil {
		runErr = err
	}
	res.Duplicates, res.Lost = dups, lost
	return res, runErr
}

// rabbitAMQPCell is rabbit/amqp/close-all+stop-app.
func rabbitAMQPCell(name string) Cell {
	return Cell{
		Name: name,
		Last: true,
		Run: func(ctx context.Context, env *Env) (Result, error) {
			n := env.Pick(1000, 10000)
			closes, stops := env.Pick(4, 12), env.Pick(2, 4)
			ctx, cancel := context.WithTimeout(ctx, time.Duration(env.Pick(600, 1200))*time.Second)
			defer cancel()
			return withBase(ctx, env, name, storePG, n, func(b *cellBase) (Result, error) {
				q, node, stopNode, err := rabbitBroker(ctx, env, b)
				if err != nil {
					return Result{}, err
				}
				defer stopNode()
				sink, cleanup, err := newAMQPSink(ctx, b, q, 2, rabbitWork)
				if err != nil {
					return Result{}, err
				}
				defer cleanup()
				pub, err := idemamqp.NewPublisher(q.url, idemamqp.PublisherOptions{
					ConnectionName: "idem-chaos-producer", ConfirmTimeout: 5 * time.Second,
					ReconnectBackoff: consumer.Backoff{Initial: 50 * time.Millisecond, Max: time.Second}, Logger: quietLogger(),
				})
				if err != nil {
					return Result{}, err
				}
				defer func() { _ = pub.Close() }()

				// The producer publishes a steady stream over the faults.
				step := make(chan struct{})
				var resent atomic.Int64
				prodDone := make(chan error, 1)
				go func() {
					prodDone <- paced(ctx, b.ids, faultSpan(closes, stops), step, func(ctx context.Context, ids []string) error {
						r, err := publishAll(ctx, pub, q.exchange, ids)
						resent.Add(int64(r))
						return err
					})
				}()
				f, err := faultLoop(ctx, env, node, closes, stops, step)
				if err == nil {
					select {
					case err = <-prodDone:
					case <-ctx.Done():
						err = fmt.Errorf("the producer did not finish: %w", ctx.Err())
					}
				}
				if err == nil {
					err = rabbitDrain(ctx, b, sink, nil)
				}
				res, err := rabbitResult(ctx, b, f, err)
				res.Note += fmt.Sprintf("; %d producer batches sent again, %d consumer reconnects", resent.Load(), sink.reconnects())
				return res, err
			})
		},
	}
}

// rabbitRelayCell is rabbit/relay/close-all+stop-app.
func rabbitRelayCell(name string) Cell {
	return Cell{
		Name: name,
		Last: true,
		Run: func(ctx context.Context, env *Env) (Result, error) {
			n := env.Pick(1000, 10000)
			closes, stops := env.Pick(4, 12), env.Pick(2, 4)
			ctx, cancel := context.WithTimeout(ctx, time.Duration(env.Pick(600, 1200))*time.Second)
			defer cancel()
			return withBase(ctx, env, name, storePG, n, func(b *cellBase) (Result, error) {
				ids, err := uuidIDs(n)
				if err != nil {
					return Result{}, err
				}
				b.ids = ids
				q, node, stopNode, err := rabbitBroker(ctx, env, b)
				if err != nil {
					return Result{}, err
				}
				defer stopNode()
				sink, cleanup, err := newAMQPSink(ctx, b, q, 1, rabbitWork)
				if err != nil {
					return Result{}, err
				}
				defer cleanup()
				ob, err := pgoutbox.New(b.pool, pgoutbox.Options{Schema: b.oracle.Schema(), Logger: quietLogger()})
				if err != nil {
					return Result{}, err
				}
				if err := ob.Migrate(ctx); err != nil {
					return Result{}, err
				}
				pub, err := idemamqp.NewPublisher(q.url, idemamqp.PublisherOptions{
					ConnectionName: "idem-chaos-relay", ConfirmTimeout: 5 * time.Second,
					ReconnectBackoff: consumer.Backoff{Initial: 50 * time.Millisecond, Max: time.Second}, Logger: quietLogger(),
				})
				if err != nil {
					return Result{}, err
				}
				defer func() { _ = pub.Close() }()
				var published, failed atomic.Int64
				counting := publisherFunc(func(ctx context.Context, msgs []*outbox.Message) error {
					err := pub.Publish(ctx, msgs)
					var pe *outbox.PublishError
					switch {
					case err == nil:
						published.Add(int64(len(msgs)))
					case errors.As(err, &pe):
						published.Add(int64(len(msgs) - len(pe.Failed)))
						failed.Add(1)
					default:
						failed.Add(1)
					}
					return err
				})
				relay, err := pgoutbox.NewRelay(ob, counting, relayOptions(quietLogger()))
				if err != nil {
					return Result{}, err
				}
				rctx, cancelRelay := context.WithCancel(ctx)
				relayDone := make(chan error, 1)
				go func() { relayDone <- relay.Run(rctx) }()
				var relayErr error
				var stopOnce sync.Once
				stopRelay := func() {
					stopOnce.Do(func() {
						cancelRelay()
						relayErr = <-relayDone
					})
				}
				defer stopRelay()

				step := make(chan struct{})
				prodDone := make(chan error, 1)
				next := 0
				go func() {
					prodDone <- paced(ctx, b.ids, faultSpan(closes, stops), step, func(ctx context.Context, ids []string) error {
						return enqueue(ctx, b.pool, ob, q.exchange, ids, &next)
					})
				}()
				f, err := faultLoop(ctx, env, node, closes, stops, step)
				if err == nil {
					err = <-prodDone
				}
				if err == nil {
					err = rabbitDrain(ctx, b, sink, func(ctx context.Context) (bool, error) {
						pending, _, err := ob.Backlog(ctx)
						return pending > 0, err
					})
				}
				stopRelay()
				if err == nil && relayErr != nil {
					err = fmt.Errorf("relay: %w", relayErr)
				}
				res, err := rabbitResult(ctx, b, f, err)
				res.Note += fmt.Sprintf("; the broker confirmed %d publishes of %d messages (%d publish calls failed and were sent again), %d consumer reconnects",
					published.Load(), n, failed.Load(), sink.reconnects())
				dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
				defer cancel()
				if dead, derr := deadRows(dctx, b.pool, ob); derr == nil && dead > 0 {
					res.Note += fmt.Sprintf("; %d outbox rows parked dead", dead)
				}
				return res, err
			})
		},
	}
}
