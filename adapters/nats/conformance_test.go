package idemnats_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/adapters/adaptertest"
	idemnats "github.com/idemkit/idem/adapters/nats"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestConformance runs the adapter conformance suite on the Consumer, on
// the test NATS server: each destination is a stream of its own with one
// subject and a durable pull consumer, and the Consumer creates its
// dead-letter stream.
//
// The Consumer promises no order: here it runs four handlers at once over
// up to eight pulled messages, and even with one handler a transient
// failure naks its message with a delay (NakWithDelay) while the durable
// consumer goes on delivering the messages published after it, as it does
// past a delivery whose AckWait expired. A NATS message has no key to
// keep an order by either: the suite's keys travel only as the subject's
// last token.
func TestConformance(t *testing.T) {
	t.Parallel()
	h := &natsHarness{}
	t.Cleanup(h.close)
	adaptertest.Run(t, h)
}

// natsDuplicateWindow is each work stream's duplicate window. JetStream
// drops a message whose Nats-Msg-Id it stored within the window; the
// suite publishes messages again on purpose (a copy the Consumer must
// acknowledge as a duplicate, a fingerprint mismatch), so the window is
// short and Publish sends a dropped copy again once it has passed.
const natsDuplicateWindow = 100 * time.Millisecond

// natsAckWait is the durable consumer's AckWait: how long a delivery of a
// killed consumer, or one whose acknowledgement was lost with the
// connection, stays with it before JetStream delivers it again.
const natsAckWait = 2 * time.Second

// natsHarness is the NATS adapter's adaptertest.Harness.
type natsHarness struct {
	mu sync.Mutex
	nc *nats.Conn // Publish's and DeadLetters', opened on first use
	js jetstream.JetStream
}

func (h *natsHarness) Capabilities() adaptertest.Capabilities {
	return adaptertest.Capabilities{Ordering: adaptertest.OrderNone, ChildProcess: true, Parallel: true}
}

// conn returns the harness's own connection to the server at rawURL.
func (h *natsHarness) conn(rawURL string) (jetstream.JetStream, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.js != nil {
		return h.js, nil
	}
	nc, err := nats.Connect(rawURL, nats.Timeout(3*time.Second), nats.MaxReconnects(-1),
		nats.ReconnectWait(50*time.Millisecond), nats.Name("idem-conformance"))
	if err != nil {
		return nil, err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		nc.Close()
		return nil, err
	}
	h.nc, h.js = nc, js
	return js, nil
}

func (h *natsHarness) close() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.nc != nil {
		h.nc.Close()
		h.nc, h.js = nil, nil
	}
}

func (h *natsHarness) NewDestination(t testing.TB, _ adaptertest.ConsumerOptions) adaptertest.Destination {
	t.Helper()
	_, js := testenv.NATS(t)
	stream := strings.ReplaceAll(testenv.UniqueID("idemconf"), "-", "_")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{
		Name:       stream,
		Subjects:   []string{stream + ".work.>"},
		Duplicates: natsDuplicateWindow,
		Storage:    jetstream.FileStorage,
	}); err != nil {
		t.Fatalf("create stream %s: %v", stream, err)
	}
	d := adaptertest.Destination{
		Name:       stream + ".work",
		DeadLetter: stream + ".dlq",
		Params: map[string]string{
			"url":        testenv.NATSURL(),
			"stream":     stream,
			"durable":    "conformance",
			"dlq_stream": stream + "-dlq",
		},
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = js.DeleteStream(ctx, stream)
		_ = js.DeleteStream(ctx, d.Params["dlq_stream"])
	})
	return d
}

// natsSubject is the subject of a message with key: the destination's,
// with the key as its last token ("none" without one).
func natsSubject(d adaptertest.Destination, key []byte) string {
	tok := "none"
	if len(key) > 0 {
		tok = strings.Map(func(r rune) rune {
			if r <= ' ' || r > '~' || r == '.' || r == '*' || r == '>' {
				return '_'
			}
			return r
		}, string(key))
	}
	return d.Name + "." + tok
}

func (h *natsHarness) Publish(ctx context.Context, d adaptertest.Destination, msgs ...adaptertest.Message) error {
	js, err := h.conn(d.Params["url"])
	if err != nil {
		return err
	}
	for _, m := range msgs {
		for {
			nm := &nats.Msg{Subject: natsSubject(d, m.Key), Data: m.Payload, Header: nats.Header{}}
			for k, v := range m.Headers {
				nm.Header.Set(k, v)
			}
			if m.ID != "" {
				nm.Header.Set(nats.MsgIdHdr, m.ID)
			}
			ack, err := js.PublishMsg(ctx, nm)
			if err != nil {
				return fmt.Errorf("publish %s: %w", m.ID, err)
			}
			if !ack.Duplicate {
				break
			}
			// The stream dropped it as a copy within its duplicate
			// window: send it again once the window has passed.
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(natsDuplicateWindow):
			}
		}
	}
	return nil
}

// Start runs a Consumer whose connection goes through a fault proxy, so
// that Interrupt can cut it.
func (h *natsHarness) Start(ctx context.Context, d adaptertest.Destination, w adaptertest.Work, opts adaptertest.ConsumerOptions) (adaptertest.Consumer, error) {
	u, err := url.Parse(d.Params["url"])
	if err != nil {
		return nil, err
	}
	port := u.Port()
	if port == "" {
		port = "4222"
	}
	proxy, err := fault.NewProxy(net.JoinHostPort(u.Hostname(), port))
	if err != nil {
		return nil, err
	}
	u.Host = proxy.Addr()
	nc, err := nats.Connect(u.String(), nats.Timeout(3*time.Second), nats.MaxReconnects(-1),
		nats.ReconnectWait(20*time.Millisecond), nats.ReconnectJitter(0, 0), nats.Name("idem-conformance-consumer"))
	if err != nil {
		_ = proxy.Close()
		return nil, err
	}
	fail := func(err error) (adaptertest.Consumer, error) {
		nc.Close()
		_ = proxy.Close()
		return nil, err
	}
	js, err := jetstream.New(nc)
	if err != nil {
		return fail(err)
	}
	c, err := idemnats.NewConsumer(js, d.Params["stream"], d.Params["durable"], w.Handler, idemnats.ConsumerOptions{
		Config:      jetstream.ConsumerConfig{AckPolicy: jetstream.AckExplicitPolicy, AckWait: natsAckWait},
		Concurrency: 4,
		Prefetch:    8,
		Backoff:     opts.Backoff,
		MaxAttempts: opts.MaxAttempts,
		// A message nacked more than MaxDeliveries times is dead-lettered
		// (redelivery_limit) whatever MaxAttempts says: keep the two
		// bounds equal, so the suite's MaxAttempts is the one that holds.
		MaxDeliveries:     opts.MaxAttempts,
		DeadLetterSubject: d.DeadLetter,
		DeadLetterStream:  d.Params["dlq_stream"],
		FetchWait:         200 * time.Millisecond,
		Telemetry:         consumer.Telemetry{Logger: slog.New(slog.DiscardHandler)},
	})
	if err != nil {
		return fail(err)
	}
	rctx, cancel := context.WithCancel(context.Background())
	nsc := &natsConsumer{c: c, nc: nc, proxy: proxy, cancel: cancel, done: make(chan error, 1)}
	go func() { nsc.done <- c.Run(rctx) }()
	select {
	case <-c.Ready():
		return nsc, nil
	case err := <-nsc.done:
		cancel()
		return fail(fmt.Errorf("Run returned before consuming: %w", err))
	case <-ctx.Done():
		cancel()
		return fail(errors.Join(ctx.Err(), <-nsc.done))
	}
}

type natsConsumer struct {
	c      *idemnats.Consumer
	nc     *nats.Conn
	proxy  *fault.Proxy // between the Consumer and the server
	cancel context.CancelFunc
	done   chan error
}

func (c *natsConsumer) Stop(ctx context.Context) error {
	c.cancel()
	select {
	case err := <-c.done:
		c.nc.Close()
		_ = c.proxy.Close()
		return err
	case <-ctx.Done():
		return fmt.Errorf("the consumer did not stop: %w", ctx.Err())
	}
}

// Interrupt resets the Consumer's connection in the proxy and waits until
// nats.go reconnected.
func (c *natsConsumer) Interrupt(ctx context.Context) error {
	before := c.nc.Stats().Reconnects
	if c.proxy.ResetAll() == 0 {
		return errors.New("the proxy had no connection to reset")
	}
	for c.nc.Stats().Reconnects <= before || !c.nc.IsConnected() {
		select {
		case <-ctx.Done():
			return fmt.Errorf("the consumer did not reconnect: %w", ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
	return nil
}

// DeadLetters reads every message of the dead-letter stream, by sequence.
// The stream is the Consumer's to create: until one started there is
// none, and no dead letter.
func (h *natsHarness) DeadLetters(ctx context.Context, d adaptertest.Destination) ([]adaptertest.DeadLetter, error) {
	js, err := h.conn(d.Params["url"])
	if err != nil {
		return nil, err
	}
	st, err := js.Stream(ctx, d.Params["dlq_stream"])
	if errors.Is(err, jetstream.ErrStreamNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	info, err := st.Info(ctx)
	if err != nil {
		return nil, err
	}
	var out []adaptertest.DeadLetter
	if info.State.Msgs == 0 {
		return nil, nil
	}
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		m, err := st.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			return nil, err
		}
		dl := adaptertest.DeadLetter{Payload: m.Data, Headers: map[string]string{}}
		for k, vs := range m.Header {
			if len(vs) > 0 {
				dl.Headers[k] = vs[0]
			}
		}
		dl.ID = dl.Headers[idemnats.HeaderID]
		dl.Reason = dl.Headers[idemnats.HeaderReason]
		dl.Attempts, _ = strconv.Atoi(dl.Headers[idemnats.HeaderAttempts])
		out = append(out, dl)
	}
	return out, nil
}
