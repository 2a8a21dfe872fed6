package bench

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	idemnats "github.com/idemkit/idem/adapters/nats"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// The NATS JetStream rows: both sides pull with the same number of
// messages in flight on the same number of concurrent handlers, and both
// acknowledge with AckSync.
const natsPrefetch, natsConcurrency = 32, 8

// natsJS connects to the test NATS server once per run.
func (e *env) natsJS() (jetstream.JetStream, error) {
	e.natsOnce.Do(func() {
		nc, err := nats.Connect(testenv.NATSURL(), nats.MaxReconnects(-1))
		if err != nil {
			e.natsErr = fmt.Errorf("NATS at %s: %w (make up starts it)", testenv.NATSURL(), err)
			return
		}
		e.onClose(func(context.Context) { nc.Close() })
		e.js, e.natsErr = jetstream.New(nc)
	})
	return e.js, e.natsErr
}

// natsStream creates a fresh stream, deleted at the end with the
// dead-letter stream idem's consumer creates beside it, and publishes n
// messages with Nats-Msg-Ids to it.
func (e *env) natsStream(ctx context.Context, n int) (jetstream.JetStream, string, error) {
	js, err := e.natsJS()
	if err != nil {
		return nil, "", err
	}
	name := strings.ToUpper(testenv.Name("idembench"))
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{name + ".in"}}); err != nil {
		return nil, "", err
	}
	e.onClose(func(ctx context.Context) {
		_ = js.DeleteStream(ctx, name)
		_ = js.DeleteStream(ctx, name+"-dlq")
	})
	prefix := e.id("m") + "-"
	futures := make([]jetstream.PubAckFuture, 0, 500)
	for i := range n {
		f, err := js.PublishMsgAsync(&nats.Msg{Subject: name + ".in", Data: payload,
			Header: nats.Header{nats.MsgIdHdr: []string{prefix + strconv.Itoa(i)}}})
		if err != nil {
			return nil, "", err
		}
		if futures = append(futures, f); len(futures) == cap(futures) || i == n-1 {
			for _, f := range futures {
				select {
				case <-f.Ok():
				case err := <-f.Err():
					return nil, "", err
				case <-ctx.Done():
					return nil, "", ctx.Err()
				}
			}
			futures = futures[:0]
		}
	}
	return js, name, nil
}

// natsSide publishes a round's messages to a fresh stream (untimed) and
// times consume on it.
func natsSide(e *env, consume func(ctx context.Context, js jetstream.JetStream, stream string, n int) (float64, error)) side {
	return func(ctx context.Context, warm bool) (float64, error) {
		n := warmed(e.size.deliveries, warm)
		js, stream, err := e.natsStream(ctx, n)
		if err != nil {
			return 0, err
		}
		return consume(ctx, js, stream, n)
	}
}

// natsBare is the worker a user writes with the jetstream package: a
// durable pull consumer read through Messages with natsPrefetch messages
// buffered, natsConcurrency goroutines running work and acknowledging
// each message with AckSync.
func natsBare(ctx context.Context, js jetstream.JetStream, stream string, n int, work func(ctx context.Context, m jetstream.Msg) error) (float64, error) {
	cons, err := js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{Durable: "bare", AckPolicy: jetstream.AckExplicitPolicy})
	if err != nil {
		return 0, err
	}
	it, err := cons.Messages(jetstream.PullMaxMessages(natsPrefetch))
	if err != nil {
		return 0, err
	}
	defer it.Stop()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	m := newMeter(n)
	errc := make(chan error, natsConcurrency+1)
	msgs := make(chan jetstream.Msg)
	var wg sync.WaitGroup
	defer wg.Wait()
	defer cancel()
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer close(msgs)
		for {
			msg, err := it.Next()
			if err != nil {
				if !errors.Is(err, jetstream.ErrMsgIteratorClosed) {
					errc <- err
				}
				return
			}
			select {
			case msgs <- msg:
			case <-ctx.Done():
				return
			}
		}
	}()
	for range natsConcurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for msg := range msgs {
				if err := work(ctx, msg); err != nil {
					errc <- err
					return
				}
				if err := msg.DoubleAck(ctx); err != nil {
					errc <- err
					return
				}
				m.tick()
			}
		}()
	}
	rate, err := m.wait(ctx, errc)
	it.Stop()
	return rate, err
}

// natsIdem runs idem's Consumer with h until n messages are acknowledged.
func natsIdem(ctx context.Context, e *env, js jetstream.JetStream, stream string, n int, h consumer.Handler) (float64, error) {
	m := newMeter(n)
	c, err := idemnats.NewConsumer(js, stream, "idem", h, idemnats.ConsumerOptions{
		Prefetch: natsPrefetch, Concurrency: natsConcurrency,
		Telemetry: consumer.Telemetry{Logger: e.log, OnOutcome: func(_ context.Context, r consumer.Report) {
			if r.Result.Action == consumer.ActionAck {
				m.tick()
			}
		}},
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

func natsTxRow() row {
	return row{
		path:     "NATS JetStream, transactional claim (consumer.Transactional)",
		baseline: "jetstream pull consumer (Messages, 32 buffered), 8 goroutines, one tx per message, AckSync",
		target:   0.90, unit: "msg/s", floor: txFloor,
		build: func(ctx context.Context, e *env) (side, side, error) {
			bareInsert, h, err := e.txSides(ctx, "nats_tx", "bench/nats")
			if err != nil {
				return nil, nil, err
			}
			bare := natsSide(e, func(ctx context.Context, js jetstream.JetStream, stream string, n int) (float64, error) {
				return natsBare(ctx, js, stream, n, func(ctx context.Context, m jetstream.Msg) error {
					return pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
						_, err := tx.Exec(ctx, bareInsert, m.Headers().Get(nats.MsgIdHdr), m.Data())
						return err
					})
				})
			})
			idem := natsSide(e, func(ctx context.Context, js jetstream.JetStream, stream string, n int) (float64, error) {
				return natsIdem(ctx, e, js, stream, n, h)
			})
			return bare, idem, nil
		},
	}
}
