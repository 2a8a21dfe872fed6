package redisnx_test

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// replyDropper hands go-redis connections to the test Redis whose next
// script call, once armed, reaches Redis and runs there, but whose reply
// never arrives: the connection reads the reply, closes, and reports EOF,
// as when the server dies between running a command and answering it.
type replyDropper struct {
	armed   atomic.Bool
	dropped atomic.Int32
}

func (d *replyDropper) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	var nd net.Dialer
	c, err := nd.DialContext(ctx, network, addr)
	if err != nil {
		return nil, err
	}
	return &droppingConn{Conn: c, d: d}, nil
}

type droppingConn struct {
	net.Conn
	d        *replyDropper
	mu       sync.Mutex
	dropping bool
}

func (c *droppingConn) Write(b []byte) (int, error) {
	if bytes.Contains(bytes.ToLower(b), []byte("evalsha")) && c.d.armed.CompareAndSwap(true, false) {
		c.mu.Lock()
		c.dropping = true
		c.mu.Unlock()
	}
	return c.Conn.Write(b)
}

func (c *droppingConn) Read(b []byte) (int, error) {
	c.mu.Lock()
	dropping := c.dropping
	c.mu.Unlock()
	if !dropping {
		return c.Conn.Read(b)
	}
	// Wait for the reply, which proves the script ran, then lose it.
	_, err := c.Conn.Read(make([]byte, 64<<10))
	_ = c.Close()
	if err == nil {
		c.d.dropped.Add(1)
	}
	return 0, io.EOF
}

// TestLostReplyIsNotLeaseLost: a Complete or Release that ran on Redis and
// whose reply was lost answers dedup.ErrOutcomeUnknown, never
// dedup.ErrLeaseLost, with go-redis's automatic retries on (the default);
// its effect is there. An Extend whose reply was lost is sent again and
// succeeds: a second run of it finds its own lease.
func TestLostReplyIsNotLeaseLost(t *testing.T) {
	t.Parallel()
	testenv.Redis(t) // skips (or fails under CI) when Redis is down
	d := &replyDropper{}
	c := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr(), Dialer: d.dial})
	t.Cleanup(func() { _ = c.Close() })
	prefix := testenv.Name("lostreply")
	s, err := redisnx.New(c, redisnx.Options{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { deletePrefix(t, testenv.Redis(t), prefix) })
	ctx := testenv.Ctx(t)

	calls := []struct {
		name string
		call func(*dedup.Lease) error
		// after checks the key's state: a claim of it answers this.
		after func(*dedup.Lease, error) bool
		// unknown: the call must answer ErrOutcomeUnknown (else nil).
		unknown bool
	}{
		{
			name:    "Release",
			call:    func(l *dedup.Lease) error { return s.Release(ctx, l) },
			after:   func(l *dedup.Lease, err error) bool { return err == nil && l != nil },
			unknown: true,
		},
		{
			name:    "Complete",
			call:    func(l *dedup.Lease) error { return s.Complete(ctx, l, []byte("r")) },
			after:   func(_ *dedup.Lease, err error) bool { return errors.Is(err, dedup.ErrDuplicate) },
			unknown: true,
		},
		{
			name:  "Extend",
			call:  func(l *dedup.Lease) error { return s.Extend(ctx, l) },
			after: func(_ *dedup.Lease, err error) bool { return errors.Is(err, dedup.ErrInFlight) },
		},
	}
	for _, tc := range calls {
		t.Run(tc.name, func(t *testing.T) {
			k := dedup.Key{Scope: "lost", ID: testenv.UniqueID(tc.name)}
			l, err := s.Claim(ctx, k)
			if err != nil {
				t.Fatal(err)
			}
			before := d.dropped.Load()
			d.armed.Store(true)
			err = tc.call(l)
			d.armed.Store(false)
			if d.dropped.Load() != before+1 {
				t.Fatalf("%s: the reply to its script was not dropped (the fault did not fire)", tc.name)
			}
			switch {
			case errors.Is(err, dedup.ErrLeaseLost):
				t.Fatalf("%s whose script ran and whose reply was lost = %v: lease lost for a call that took effect", tc.name, err)
			case tc.unknown && !errors.Is(err, dedup.ErrOutcomeUnknown):
				t.Fatalf("%s whose reply was lost = %v, want an error wrapping dedup.ErrOutcomeUnknown", tc.name, err)
			case !tc.unknown && err != nil:
				t.Fatalf("%s whose reply was lost = %v, want nil (sent again, it finds its own lease)", tc.name, err)
			}
			l2, err := s.Claim(ctx, k)
			if !tc.after(l2, err) {
				t.Fatalf("%s took effect, yet a claim of its key answers (%v, %v)", tc.name, l2, err)
			}
		})
	}
}
