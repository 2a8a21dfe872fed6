//go:build unix

package chaos

// nats/ cells: adapters/nats Consumer children on a durable pull consumer
// of a JetStream stream, fed by the runner through adapters/nats's outbox
// Publisher (Nats-Msg-Id = the input id; PubAcks awaited).
//
//   - nats/pgtable/sigkill: the shared NATS server; the children are
//     SIGKILLed at random and at the named points (before the transaction,
//     after the effect before the commit, after the commit before the
//     acknowledgement).
//   - nats/pgtable/server-kill: a throwaway nats-server (-js, its own store
//     directory and port) SIGKILLed and restarted on its store while the
//     children consume; nats.go reconnects them.
//
// Promise of both: 0 duplicate effects, 0 lost, nothing dead-lettered.

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	idemnats "github.com/idemkit/idem/adapters/nats"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/outbox"
)

func init() {
	RegisterChild("nats-consumer", natsChild)
	Register(natsKillCell("nats/" + storePG + "/sigkill"))
	Register(natsServerCell("nats/" + storePG + "/server-kill"))
}

// natsDurable is the durable consumer the children share.
const natsDurable = "chaos"

// natsWorkload feeds a stream consumed by nats-consumer children.
type natsWorkload struct {
	b      *cellBase
	url    string
	nc     *nats.Conn
	js     jetstream.JetStream
	stream string
	pub    *idemnats.Publisher
}

func newNATSWorkload(b *cellBase, url string) (*natsWorkload, func(), error) {
	nc, err := nats.Connect(url, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond), nats.Name("idem-chaos-runner"))
	if err != nil {
		return nil, nil, fmt.Errorf("NATS at %s: %w", url, err)
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	w := &natsWorkload{b: b, url: url, nc: nc, js: js, stream: "CHAOS_" + strings.ToUpper(b.suffix)}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: w.stream, Subjects: []string{w.stream + ".in"}, Storage: jetstream.FileStorage}); err != nil {
		nc.Close()
		return nil, nil, err
	}
	// The durable exists before the inputs, so none is missed.
	if _, err := js.CreateOrUpdateConsumer(ctx, w.stream, natsConsumerOptions("").Config); err != nil {
		nc.Close()
		return nil, nil, err
	}
	w.pub, err = idemnats.NewPublisher(js, idemnats.PublisherOptions{ExpectStream: w.stream})
	if err != nil {
		nc.Close()
		return nil, nil, err
	}
	return w, func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_ = js.DeleteStream(ctx, w.stream)
		_ = js.DeleteStream(ctx, w.stream+"-dlq")
		nc.Close()
	}, nil
}

func (w *natsWorkload) child() string { return "nats-consumer" }

func (w *natsWorkload) config(int) childConfig {
	c := w.b.config()
	c.NATSURL, c.Stream = w.url, w.stream
	return c
}

// produce publishes ids until JetStream confirmed every one, sending again
// what failed or whose outcome is unknown (the stream's duplicate window,
// then the consumers' claim, drop a second copy).
func (w *natsWorkload) produce(ctx context.Context, ids []string) error {
	ctx, cancel := context.WithTimeout(ctx, 120*time.Second)
	defer cancel()
	const batch = 200
	for len(ids) > 0 {
		n := min(batch, len(ids))
		msgs := make([]*outbox.Message, n)
		for i, id := range ids[:n] {
			msgs[i] = &outbox.Message{ID: id, Topic: w.stream + ".in", Payload: []byte("payload-" + id)}
		}
		backoff := 50 * time.Millisecond
		for len(msgs) > 0 {
			perr := w.pub.Publish(ctx, msgs)
			if perr == nil {
				break
			}
			var pe *outbox.PublishError
			if errors.As(perr, &pe) {
				left := make([]*outbox.Message, 0, len(pe.Failed))
				for i := range msgs {
					if _, failed := pe.Failed[i]; failed {
						left = append(left, msgs[i])
					}
				}
				msgs = left
			}
			if err := sleepCtx(ctx, backoff); err != nil {
				return fmt.Errorf("publish: %w (last error: %w)", err, perr)
			}
			backoff = min(2*backoff, time.Second)
		}
		ids = ids[n:]
	}
	return nil
}

func (w *natsWorkload) progress(ctx context.Context) (int, error) { return w.b.distinctEffects(ctx) }

// left describes what the durable consumer has not settled, or returns ""
// when nothing; a dead letter is an error.
func (w *natsWorkload) left(ctx context.Context) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if st, err := w.js.Stream(ctx, w.stream+"-dlq"); err == nil {
		if n := st.CachedInfo().State.Msgs; n > 0 {
			return "", fmt.Errorf("%w: %d in %s-dlq", errDeadLettered, n, w.stream)
		}
	} else if !errors.Is(err, jetstream.ErrStreamNotFound) {
		return "", err
	}
	c, err := w.js.Consumer(ctx, w.stream, natsDurable)
	if err != nil {
		return "", err
	}
	info, err := c.Info(ctx)
	if err != nil {
		return "", err
	}
	if info.NumPending+uint64(info.NumAckPending) > 0 {
		return fmt.Sprintf("%d not delivered and %d unacknowledged in %s", info.NumPending, info.NumAckPending, w.stream), nil
	}
	return "", nil
}

// drained: every input has an effect (or nothing moved for 3s, so that an
// input acknowledged without an effect shows as lost rather than as a
// stall), and the durable consumer has nothing left.
func (w *natsWorkload) drained(ctx context.Context, idle time.Duration) (bool, error) {
	done, err := w.progress(ctx)
	if err != nil {
		return false, err
	}
	if done < len(w.b.ids) && idle < 3*time.Second {
		return false, nil
	}
	left, err := w.left(ctx)
	if err != nil && !errors.Is(err, errDeadLettered) {
		return false, nil // the server may be restarting
	}
	return left == "" && err == nil, err
}

func (w *natsWorkload) settle(ctx context.Context) error {
	left, err := w.left(ctx)
	if err != nil {
		return err
	}
	if left != "" {
		return errors.New(left + " after the consumers stopped")
	}
	return nil
}

// natsChild is the nats-consumer child: an adapters/nats Consumer with the
// cell's handler.
func natsChild(ctx context.Context) error {
	r, err := newChildRun(ctx)
	if err != nil {
		return err
	}
	defer r.quit()
	pool, err := childPool(r.ctx, r.cfg.PGURL, 5)
	if err != nil {
		return err
	}
	defer pool.Close()
	h, closer, err := brokerHandler(r, pool)
	if err != nil {
		return err
	}
	defer closer()
	nc, err := nats.Connect(r.cfg.NATSURL, nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond), nats.Name(r.cfg.Name))
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return err
	}
	c, err := idemnats.NewConsumer(js, r.cfg.Stream, natsDurable, h, natsConsumerOptions(r.cfg.Stream))
	if err != nil {
		return err
	}
	r.ready()
	return r.done(c.Run(r.ctx))
}

// natsConsumerOptions are the options of every NATS consumer of the cells:
// a short AckWait, so that the messages of a killed child come back soon.
func natsConsumerOptions(string) idemnats.ConsumerOptions {
	return idemnats.ConsumerOptions{
		Config:          jetstream.ConsumerConfig{Durable: natsDurable, AckWait: 2 * time.Second},
		Concurrency:     4,
		Prefetch:        16,
		Backoff:         consumer.Backoff{Initial: 100 * time.Millisecond, Max: 500 * time.Millisecond, Factor: 5},
		MaxAttempts:     10,
		MaxDeliveries:   50,
		ShutdownTimeout: 5 * time.Second,
		PublishTimeout:  5 * time.Second,
		Telemetry:       consumer.Telemetry{Logger: childLogger()},
	}
}

// natsKillCell is the NATS consumer SIGKILL cell on the shared server.
func natsKillCell(name string) Cell {
	return Cell{
		Name: name,
		Run: func(ctx context.Context, env *Env) (Result, error) {
			n, kills := env.Pick(1000, 20000), env.Pick(8, 40)
			return withBase(ctx, env, name, storePG, n, func(b *cellBase) (Result, error) {
				w, cleanup, err := newNATSWorkload(b, env.NATSURL)
				if err != nil {
					return Result{}, err
				}
				defer cleanup()
				return killCell(ctx, b, w, killSpec{
					kills: kills, workers: 2, points: consumerPoints,
					named: 8 * time.Second, limit: time.Duration(env.Pick(120, 900)) * time.Second,
				})
			})
		},
	}
}

// natsServerCell SIGKILLs and restarts a throwaway nats-server while two
// children consume from it.
func natsServerCell(name string) Cell {
	return Cell{
		Name: name,
		Run: func(ctx context.Context, env *Env) (Result, error) {
			n, rounds := env.Pick(1000, 20000), env.Pick(3, 15)
			srv, err := fault.StartNATS(ctx, fault.NATSOptions{})
			if err != nil {
				return Result{}, err
			}
			defer func() { _ = srv.Close() }()
			return withBase(ctx, env, name, storePG, n, func(b *cellBase) (Result, error) {
				w, cleanup, err := newNATSWorkload(b, srv.URL())
				if err != nil {
					return Result{}, err
				}
				defer cleanup()
				fctx, stopFaults := context.WithCancel(ctx)
				faults := make(chan error, 1)
				serverKills := 0
				go func() {
					faults <- natsServerFaults(fctx, env, srv, w, rounds, &serverKills)
				}()
				res, err := killCell(ctx, b, w, killSpec{workers: 2, limit: time.Duration(env.Pick(180, 900)) * time.Second})
				stopFaults()
				if ferr := <-faults; err == nil && ferr != nil {
					err = ferr
				}
				res.Kills += serverKills
				res.Restarts += serverKills
				res.Note = fmt.Sprintf("%d nats-server SIGKILLs and restarts on its store", serverKills)
				return res, err
			})
		},
	}
}

// natsServerFaults SIGKILLs the server and restarts it on its store, rounds
// times, each once the consumers made progress since the last restart.
func natsServerFaults(ctx context.Context, env *Env, srv *fault.NATS, w *natsWorkload, rounds int, kills *int) error {
	last := 0
	for i := range rounds {
		for {
			done, err := w.progress(ctx)
			if ctx.Err() != nil {
				return nil
			}
			if err != nil {
				return err
			}
			if done >= len(w.b.ids) {
				return nil // nothing left to crash into
			}
			if done >= last+max(len(w.b.ids)/(2*rounds), 10) {
				last = done
				break
			}
			if !srvSleep(ctx, 20*time.Millisecond) {
				return nil
			}
		}
		if err := srv.Kill(); err != nil {
			return err
		}
		*kills++
		srvSleep(ctx, srvBetween(env.Rand, 50*time.Millisecond, 500*time.Millisecond))
		if err := srv.Restart(context.WithoutCancel(ctx)); err != nil {
			return fmt.Errorf("round %d: %w", i+1, err)
		}
		env.Logf("nats-server killed and restarted (%d/%d)", i+1, rounds)
	}
	return nil
}
