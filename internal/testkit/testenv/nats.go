package testenv

import (
	"context"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// NATSURL is the URL of the test NATS server, which must have JetStream
// enabled.
func NATSURL() string { return env("IDEM_TEST_NATS_URL", "nats://127.0.0.1:4222") }

// NATS connects to the test NATS server (NATSURL) and checks that
// JetStream answers; the connection reconnects without limit and is closed
// when the test ends. An unreachable server, or one without JetStream,
// skips the test (fails it under CI=true).
func NATS(t testing.TB) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	return NATSAt(t, NATSURL())
}

// NATSAt is NATS for the server at url (a throwaway server a test
// started).
func NATSAt(t testing.TB, url string) (*nats.Conn, jetstream.JetStream) {
	t.Helper()
	nc, err := nats.Connect(url, nats.Timeout(3*time.Second), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond), nats.Name("idem-test"))
	if err != nil {
		unavailable(t, "NATS at "+url, err)
		return nil, nil
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatalf("NATS at %s: %v", url, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := js.AccountInfo(ctx); err != nil {
		unavailable(t, "JetStream at "+url, err)
		return nil, nil
	}
	return nc, js
}
