package idemnats

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// testStream is a test's work stream, storing "<name>.work.>", deleted
// with its dead-letter stream when the test ends.
type testStream struct {
	js   jetstream.JetStream
	name string
}

// newStream creates a work stream with duplicate window dup (JetStream's
// default of 2 minutes when zero).
func newStream(t testing.TB, js jetstream.JetStream, dup time.Duration) *testStream {
	t.Helper()
	name := strings.ReplaceAll(testenv.UniqueID("idemtest"), "-", "_")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{name + ".work.>"}, Duplicates: dup, Storage: jetstream.FileStorage}); err != nil {
		t.Fatalf("create stream %s: %v", name, err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = js.DeleteStream(ctx, name)
		_ = js.DeleteStream(ctx, name+"-dlq")
	})
	return &testStream{js: js, name: name}
}

func (s *testStream) subject() string { return s.name + ".work.x" }

// publish publishes payload with Nats-Msg-Id id (none when id is empty)
// and returns the PubAck.
func (s *testStream) publish(t testing.TB, id string, payload []byte, hdr nats.Header) *jetstream.PubAck {
	t.Helper()
	m := &nats.Msg{Subject: s.subject(), Data: payload, Header: nats.Header{}}
	for k, v := range hdr {
		m.Header[k] = v
	}
	if id != "" {
		m.Header.Set(nats.MsgIdHdr, id)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ack, err := s.js.PublishMsg(ctx, m)
	if err != nil {
		t.Fatalf("publish %s: %v", id, err)
	}
	return ack
}

// publishN publishes ids prefix-0 ... prefix-(n-1) with payload "p-<id>"
// and returns them.
func (s *testStream) publishN(t testing.TB, prefix string, n int) []string {
	t.Helper()
	ids := make([]string, n)
	for i := range n {
		ids[i] = fmt.Sprintf("%s-%d", prefix, i)
		s.publish(t, ids[i], []byte("p-"+ids[i]), nil)
	}
	return ids
}

// deadLetters reads every message of the dead-letter stream.
func (s *testStream) deadLetters(t testing.TB) []jetstream.Msg {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := s.js.Stream(ctx, s.name+"-dlq")
	if err != nil {
		t.Fatalf("dead-letter stream: %v", err)
	}
	return readAll(t, st)
}

// readAll reads every message of st through an ephemeral consumer.
func readAll(t testing.TB, st jetstream.Stream) []jetstream.Msg {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	want := int(info.State.Msgs)
	if want == 0 {
		return nil
	}
	c, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{})
	if err != nil {
		t.Fatal(err)
	}
	var out []jetstream.Msg
	for len(out) < want {
		b, err := c.Fetch(want-len(out), jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			t.Fatal(err)
		}
		n := 0
		for m := range b.Messages() {
			out = append(out, m)
			n++
		}
		if n == 0 {
			t.Fatalf("read %d of %d messages of %s", len(out), want, info.Config.Name)
		}
	}
	return out
}

// pending is the durable consumer's count of messages not yet settled:
// delivered and unacknowledged, or not yet delivered.
func pending(t testing.TB, js jetstream.JetStream, stream, durable string) int {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := js.Consumer(ctx, stream, durable)
	if err != nil {
		t.Fatal(err)
	}
	info, err := c.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	return int(info.NumPending) + info.NumAckPending
}

// runConsumer runs c until the test ends (or stop is called) and waits
// for Ready.
func runConsumer(t testing.TB, c *Consumer) (stop func() error) {
	t.Helper()
	return testenv.StartRun(t, c.Run, c.Ready())
}

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

// testBackoff gives short retry delays for tests: 20ms, 40ms, then 50ms.
var testBackoff = consumer.Backoff{Initial: 20 * time.Millisecond, Max: 50 * time.Millisecond}
