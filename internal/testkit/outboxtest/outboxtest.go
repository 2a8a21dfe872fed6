// Package outboxtest holds the test helpers the outbox relays' tests
// (outbox/pgoutbox, outbox/sqloutbox, outbox/walrelay) share: a quiet
// logger, messages, a relay run for the length of a test, and a RabbitMQ
// exchange with a queue and a collector of its deliveries.
package outboxtest

import (
	"context"
	"log/slog"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/outbox"
)

// Quiet is the logger of the tests' outboxes and relays: warnings about
// killed sessions and connections are expected there. IDEM_TEST_VERBOSE=1
// shows them.
func Quiet() *slog.Logger {
	if os.Getenv("IDEM_TEST_VERBOSE") == "1" {
		return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
	}
	return slog.New(slog.DiscardHandler)
}

// Msg is a message with a string key (none when empty) and payload.
func Msg(topic, key, payload string) outbox.Message {
	m := outbox.Message{Topic: topic, Payload: []byte(payload)}
	if key != "" {
		m.Key = []byte(key)
	}
	return m
}

// Running is a relay started by Start.
type Running struct {
	cancel context.CancelFunc
	done   chan error
	once   sync.Once
}

// Start runs r until Stop (or the end of the test).
func Start(t testing.TB, r interface{ Run(context.Context) error }) *Running {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	rr := &Running{cancel: cancel, done: make(chan error, 1)}
	go func() { rr.done <- r.Run(ctx) }()
	t.Cleanup(func() { rr.Stop(t) })
	return rr
}

// Cancel ends the relay's context without waiting for Run to return.
func (rr *Running) Cancel() { rr.cancel() }

// Stop cancels the relay and waits for Run to return, failing the test
// when Run returns an error or does not return within 60s; it may be
// called more than once.
func (rr *Running) Stop(t testing.TB) {
	t.Helper()
	rr.once.Do(func() {
		rr.cancel()
		select {
		case err := <-rr.done:
			if err != nil {
				t.Errorf("Relay.Run: %v", err)
			}
		case <-time.After(60 * time.Second):
			t.Errorf("Relay.Run did not return within 60s of its context ending")
		}
	})
}
