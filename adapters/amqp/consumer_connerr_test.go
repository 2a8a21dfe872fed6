package idemamqp

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// connErrLog keeps the messages and errors of the records logged to it.
type connErrLog struct {
	mu   sync.Mutex
	msgs []string
}

func (l *connErrLog) Enabled(context.Context, slog.Level) bool { return true }
func (l *connErrLog) WithAttrs([]slog.Attr) slog.Handler       { return l }
func (l *connErrLog) WithGroup(string) slog.Handler            { return l }
func (l *connErrLog) Handle(_ context.Context, r slog.Record) error {
	var b strings.Builder
	b.WriteString(r.Message)
	r.Attrs(func(a slog.Attr) bool {
		b.WriteString(" " + a.Key + "=" + a.Value.String())
		return true
	})
	l.mu.Lock()
	l.msgs = append(l.msgs, b.String())
	l.mu.Unlock()
	return nil
}

func (l *connErrLog) find(sub string) (string, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, m := range l.msgs {
		if strings.Contains(m, sub) {
			return m, true
		}
	}
	return "", false
}

// A Consumer on a connection the caller owns dials nothing, and its errors
// say what happened to that connection: closed, or no channel could be
// opened on it.
func TestConsumerConnErrors(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })

	// The caller closed its connection before Run.
	conn := consDial(t, url)
	c, err := NewConsumerConn(conn, q, h, consOpts(ConsumerOptions{}))
	if err != nil {
		t.Fatal(err)
	}
	_ = conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err = c.Run(ctx)
	if !errors.Is(err, ErrConnectionClosed) || strings.Contains(err.Error(), "dial") {
		t.Errorf("Run on a closed connection returned %v; want ErrConnectionClosed, without a dial", err)
	}
	t.Logf("closed: %v", err)

	// The connection is open, but has no channel left for the Consumer:
	// Run says so, and retries until channels are free.
	conn, err = amqp091.DialConfig(url, amqp091.Config{ChannelMax: 2})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	var held []*amqp091.Channel
	for range 2 {
		ch, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, ch)
	}
	log := new(connErrLog)
	c, err = NewConsumerConn(conn, q, h, consOpts(ConsumerOptions{}))
	if err != nil {
		t.Fatal(err)
	}
	c.opts.Logger = slog.New(log)
	ctx, cancel = context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	const want = "open a channel on the connection given to the consumer"
	testenv.Eventually(t, 30*time.Second, "a warning that no channel could be opened", func() bool {
		_, ok := log.find(want)
		return ok
	})
	m, _ := log.find(want)
	if strings.Contains(m, "dial") || strings.Contains(m, "cannot connect") {
		t.Errorf("the warning speaks of a dial: %s", m)
	}
	t.Logf("no channel: %s", m)
	for _, ch := range held {
		_ = ch.Close()
	}
	select {
	case <-c.Ready():
	case err := <-done:
		t.Fatalf("Run returned %v; want it to consume once channels are free", err)
	case <-time.After(30 * time.Second):
		t.Fatal("the Consumer did not consume in 30s once channels were free")
	}
	cancel()
	if err := <-done; err != nil {
		t.Errorf("Run: %v", err)
	}
	if conn.IsClosed() {
		t.Error("the Consumer closed the caller's connection")
	}
}
