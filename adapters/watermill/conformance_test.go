package idemwatermill_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/adapters/adaptertest"
	"github.com/idemkit/idem/adapters/watermill"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestConformance runs the adapter conformance suite on a router with
// Transactional (dedup/pgtable), Watermill's Retry middleware outside it
// and a poison queue outermost, over Watermill's in-process pub/sub
// (gochannel, persistent). gochannel hands each message to its
// subscribers on a goroutine of its own, so it promises no order. The
// crash and connection cases need a pub/sub outside the test process:
// TestConformanceSQL runs them on watermill-sql.
func TestConformance(t *testing.T) {
	t.Parallel()
	adaptertest.Run(t, &wmHarness{dests: map[string]*wmDest{}})
}

// inProcess is why the crash cases cannot run on gochannel.
const inProcess = "gochannel lives in the test process: a consumer process killed with SIGKILL takes the pub/sub and its messages along, so no other consumer can take over (TestConformanceSQL runs this case on watermill-sql)"

// wmHarness is the Watermill adapter's adaptertest.Harness on gochannel.
type wmHarness struct {
	mu    sync.Mutex
	dests map[string]*wmDest
}

// wmDest is one destination: a pub/sub of its own and what its poison
// topic received.
type wmDest struct {
	ps     *gochannel.GoChannel
	mu     sync.Mutex
	poison []*message.Message
}

func (h *wmHarness) Capabilities() adaptertest.Capabilities {
	return adaptertest.Capabilities{
		Ordering: adaptertest.OrderNone,
		Unsupported: map[adaptertest.Case]string{
			adaptertest.CaseAckRule:          inProcess,
			adaptertest.CaseDeadLetterResent: inProcess,
			adaptertest.CaseReconnect:        "gochannel is in process: a subscriber has no connection to lose (TestConformanceSQL runs this case on watermill-sql)",
		},
	}
}

func (h *wmHarness) dest(d adaptertest.Destination) *wmDest {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.dests[d.Name]
}

func (h *wmHarness) NewDestination(t testing.TB, _ adaptertest.ConsumerOptions) adaptertest.Destination {
	t.Helper()
	ps := gochannel.NewGoChannel(gochannel.Config{Persistent: true, OutputChannelBuffer: 64}, nopLogger)
	name := testenv.Name("conformance")
	d := adaptertest.Destination{Name: name, DeadLetter: name + ".poison"}
	wd := &wmDest{ps: ps}
	poison, err := ps.Subscribe(context.Background(), d.DeadLetter)
	if err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		for m := range poison {
			wd.mu.Lock()
			wd.poison = append(wd.poison, m)
			wd.mu.Unlock()
			m.Ack()
		}
	}()
	t.Cleanup(func() {
		_ = ps.Close()
		<-done
	})
	h.mu.Lock()
	h.dests[d.Name] = wd
	h.mu.Unlock()
	return d
}

func (h *wmHarness) Publish(_ context.Context, d adaptertest.Destination, msgs ...adaptertest.Message) error {
	return h.dest(d).ps.Publish(d.Name, conformanceMessages(msgs)...)
}

// conformanceMessages are the suite's messages as Watermill messages: the
// id is the UUID, the key travels in the "key" metadata field.
func conformanceMessages(msgs []adaptertest.Message) []*message.Message {
	out := make([]*message.Message, len(msgs))
	for i, m := range msgs {
		wm := message.NewMessage(m.ID, m.Payload)
		maps.Copy(wm.Metadata, m.Headers)
		if m.Key != nil {
			wm.Metadata.Set("key", string(m.Key))
		}
		out[i] = wm
	}
	return out
}

func (h *wmHarness) Start(ctx context.Context, d adaptertest.Destination, w adaptertest.Work, opts adaptertest.ConsumerOptions) (adaptertest.Consumer, error) {
	wd := h.dest(d)
	return startConformanceRouter(ctx, d, w, opts, keepOpen{wd.ps}, wd.ps)
}

// startConformanceRouter runs a router that consumes d from sub with the
// stack every harness of this package tests: the poison queue outermost
// (publishing to d.DeadLetter through pub whatever cannot succeed by
// Retryable), Watermill's Retry for the transient errors, and
// Transactional around the suite's effect. It returns once the router
// runs.
func startConformanceRouter(ctx context.Context, d adaptertest.Destination, w adaptertest.Work, opts adaptertest.ConsumerOptions, sub message.Subscriber, pub message.Publisher) (*wmConsumer, error) {
	r, err := message.NewRouter(message.RouterConfig{CloseTimeout: time.Minute}, nopLogger)
	if err != nil {
		return nil, err
	}
	pq, err := middleware.PoisonQueueWithFilter(pub, d.DeadLetter, func(err error) bool { return !idemwatermill.Retryable(err) })
	if err != nil {
		return nil, err
	}
	retry := middleware.Retry{
		MaxRetries:      opts.MaxAttempts - 1,
		InitialInterval: opts.Backoff.Initial,
		MaxInterval:     opts.Backoff.Max,
		Multiplier:      opts.Backoff.Factor,
		ShouldRetry:     func(p middleware.RetryParams) bool { return idemwatermill.Retryable(p.Err) },
	}
	tx, err := idemwatermill.Transactional(w.Store, idemwatermill.Options{
		Scope: w.Scope,
		Telemetry: consumer.Telemetry{OnOutcome: func(ctx context.Context, rep consumer.Report) {
			w.OnOutcome(ctx, rep)
			if rep.Outcome == consumer.OutcomeCompleted {
				w.AfterCommit(&consumer.Message{ID: rep.Key.ID})
			}
		}},
	})
	if err != nil {
		return nil, err
	}
	r.AddMiddleware(pq, retry.Middleware, tx)
	r.AddConsumerHandler("conformance", d.Name, sub, func(m *message.Message) error {
		msg := &consumer.Message{ID: m.UUID, Payload: m.Payload, Headers: maps.Clone(map[string]string(m.Metadata)), Topic: d.Name}
		if k, ok := m.Metadata["key"]; ok {
			msg.Key = []byte(k)
		}
		return w.Effect(m.Context(), idemwatermill.Tx[pgx.Tx](m.Context()), msg)
	})
	c := &wmConsumer{r: r, done: make(chan error, 1)}
	go func() { c.done <- r.Run(context.Background()) }()
	select {
	case <-r.Running():
		return c, nil
	case err := <-c.done:
		return nil, fmt.Errorf("the router stopped at once: %w", err)
	case <-ctx.Done():
		_ = r.Close()
		return nil, errors.Join(ctx.Err(), <-c.done)
	}
}

type wmConsumer struct {
	r    *message.Router
	done chan error
}

func (c *wmConsumer) Stop(ctx context.Context) error {
	if err := c.r.Close(); err != nil {
		return err
	}
	select {
	case err := <-c.done:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (c *wmConsumer) Interrupt(context.Context) error {
	return fmt.Errorf("%w: gochannel has no connection", adaptertest.ErrUnsupported)
}

func (h *wmHarness) DeadLetters(_ context.Context, d adaptertest.Destination) ([]adaptertest.DeadLetter, error) {
	wd := h.dest(d)
	wd.mu.Lock()
	defer wd.mu.Unlock()
	out := make([]adaptertest.DeadLetter, 0, len(wd.poison))
	for _, m := range wd.poison {
		out = append(out, adaptertest.DeadLetter{
			ID:      m.UUID,
			Reason:  m.Metadata.Get(idemwatermill.MetadataReason),
			Payload: slices.Clone([]byte(m.Payload)),
			Headers: maps.Clone(map[string]string(m.Metadata)),
		})
	}
	return out, nil
}

// keepOpen is a subscriber the router does not close when it stops, so the
// next consumer of the destination subscribes to the same pub/sub; the
// router's subscription ends with the router's context.
type keepOpen struct{ message.Subscriber }

func (keepOpen) Close() error { return nil }
