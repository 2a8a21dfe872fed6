package fault_test

import (
	"bytes"
	"errors"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// echoServer answers every chunk it reads with the same bytes and keeps a
// copy of everything it received.
type echoServer struct {
	ln    net.Listener
	wg    sync.WaitGroup
	mu    sync.Mutex
	got   bytes.Buffer
	ended int // connections whose reads ended: all they carried was received
}

func newEcho(t *testing.T) *echoServer {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	e := &echoServer{ln: ln}
	var conns []net.Conn
	var cmu sync.Mutex
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			cmu.Lock()
			conns = append(conns, c)
			cmu.Unlock()
			e.wg.Add(1)
			go func() {
				defer e.wg.Done()
				defer func() {
					e.mu.Lock()
					e.ended++
					e.mu.Unlock()
				}()
				buf := make([]byte, 4096)
				for {
					n, err := c.Read(buf)
					if n > 0 {
						e.mu.Lock()
						e.got.Write(buf[:n])
						e.mu.Unlock()
						if _, err := c.Write(buf[:n]); err != nil {
							return
						}
					}
					if err != nil {
						return
					}
				}
			}()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		cmu.Lock()
		for _, c := range conns {
			_ = c.Close()
		}
		cmu.Unlock()
		e.wg.Wait()
	})
	return e
}

// endedConns returns how many connections' reads ended.
func (e *echoServer) endedConns() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.ended
}

func (e *echoServer) received() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.got.String()
}

func newProxy(t *testing.T, target string) *fault.Proxy {
	t.Helper()
	p, err := fault.NewProxy(target)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := p.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return p
}

func dial(t *testing.T, addr string) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	return c
}

// roundTrip writes msg and reads len(msg) bytes back.
func roundTrip(c net.Conn, msg string) (string, error) {
	if _, err := c.Write([]byte(msg)); err != nil {
		return "", err
	}
	buf := make([]byte, len(msg))
	_, err := io.ReadFull(c, buf)
	return string(buf), err
}

func TestProxyPass(t *testing.T) {
	e := newEcho(t)
	p := newProxy(t, e.ln.Addr().String())
	c := dial(t, p.Addr())
	for _, msg := range []string{"hello", "world", string(bytes.Repeat([]byte("x"), 100_000))} {
		got, err := roundTrip(c, msg)
		if err != nil || got != msg {
			t.Fatalf("round trip of %d bytes: %v (got %d bytes)", len(msg), err, len(got))
		}
	}
	if s := p.Stats(); s.Accepted != 1 || s.Resets != 0 || s.Cuts != 0 {
		t.Fatalf("stats %+v", s)
	}
}

// A mode switch applies to a connection that is already open, from its next
// chunk on: delay, then pass again.
func TestProxyDelaySwitchAtRunTime(t *testing.T) {
	e := newEcho(t)
	p := newProxy(t, e.ln.Addr().String())
	c := dial(t, p.Addr())
	if _, err := roundTrip(c, "a"); err != nil {
		t.Fatal(err)
	}
	const d = 150 * time.Millisecond
	p.SetMode(fault.Delay, d)
	start := time.Now()
	if got, err := roundTrip(c, "b"); err != nil || got != "b" {
		t.Fatalf("delayed round trip: %q, %v", got, err)
	}
	// Held d on the way in and d on the way out.
	if took := time.Since(start); took < 2*d {
		t.Fatalf("delayed round trip took %v, want at least %v", took, 2*d)
	}
	if n := p.Stats().Delayed; n != 2 {
		t.Fatalf("%d chunks delayed, want 2 (the request and its echo)", n)
	}
	p.SetMode(fault.Pass, 0)
	if m, _ := p.Mode(); m != fault.Pass {
		t.Fatalf("mode %v", m)
	}
	if got, err := roundTrip(c, "c"); err != nil || got != "c" {
		t.Fatalf("round trip after pass: %q, %v", got, err)
	}
}

// Reset mode: the request never reaches the server and the client's
// connection is reset.
func TestProxyReset(t *testing.T) {
	e := newEcho(t)
	p := newProxy(t, e.ln.Addr().String())
	c := dial(t, p.Addr())
	if _, err := roundTrip(c, "before"); err != nil {
		t.Fatal(err)
	}
	p.SetMode(fault.Reset, 0)
	if _, err := roundTrip(c, "lost"); err == nil {
		t.Fatal("round trip through a resetting proxy succeeded")
	}
	// Once the server's read of the connection ended, whatever the proxy
	// relayed has been received.
	testenv.Eventually(t, 5*time.Second, "the server's connection to end", func() bool { return e.endedConns() == 1 })
	if got := e.received(); got != "before" {
		t.Fatalf("server received %q, want only %q", got, "before")
	}
	// The reset is counted once both sockets are closed, which the client
	// may see first.
	testenv.Eventually(t, 5*time.Second, "the reset to be counted", func() bool { return p.Stats().Resets == 1 })
	// New connections are reset too while the mode holds; Pass heals.
	c2 := dial(t, p.Addr())
	if _, err := roundTrip(c2, "lost2"); err == nil {
		t.Fatal("a new connection passed in Reset mode")
	}
	p.SetMode(fault.Pass, 0)
	c3 := dial(t, p.Addr())
	if got, err := roundTrip(c3, "after"); err != nil || got != "after" {
		t.Fatalf("after pass: %q, %v", got, err)
	}
}

// Cut mode: the server receives the request and answers, the client never
// sees the answer: its connection is closed.
func TestProxyCutAfterRequest(t *testing.T) {
	e := newEcho(t)
	p := newProxy(t, e.ln.Addr().String())
	c := dial(t, p.Addr())
	if _, err := roundTrip(c, "ok;"); err != nil {
		t.Fatal(err)
	}
	p.SetMode(fault.Cut, 0)
	_, err := roundTrip(c, "commit;")
	if err == nil {
		t.Fatal("the reply reached the client in Cut mode")
	}
	if !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) {
		t.Logf("client error: %v", err)
	}
	testenv.Eventually(t, 5*time.Second, "the server to receive the request", func() bool { return e.received() == "ok;commit;" })
	testenv.Eventually(t, 5*time.Second, "the cut to be counted", func() bool { return p.Stats().Cuts == 1 })
}

// ResetAll resets idle connections at once, whatever the mode.
func TestProxyResetAll(t *testing.T) {
	e := newEcho(t)
	p := newProxy(t, e.ln.Addr().String())
	c1, c2 := dial(t, p.Addr()), dial(t, p.Addr())
	for _, c := range []net.Conn{c1, c2} {
		if _, err := roundTrip(c, "x"); err != nil {
			t.Fatal(err)
		}
	}
	if n := p.ResetAll(); n != 2 {
		t.Fatalf("ResetAll reset %d connections, want 2", n)
	}
	for _, c := range []net.Conn{c1, c2} {
		buf := make([]byte, 1)
		if _, err := c.Read(buf); err == nil {
			t.Fatal("a reset connection still reads")
		}
	}
	// The proxy still accepts.
	if got, err := roundTrip(dial(t, p.Addr()), "y"); err != nil || got != "y" {
		t.Fatalf("after ResetAll: %q, %v", got, err)
	}
}

// A target that refuses connections: the client's connection is closed.
func TestProxyTargetDown(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	_ = ln.Close()
	p := newProxy(t, dead)
	c := dial(t, p.Addr())
	buf := make([]byte, 1)
	if _, err := c.Read(buf); err == nil {
		t.Fatal("read through a proxy to a dead target succeeded")
	}
}

// Close with connections open and a delayed chunk in flight returns (and
// the goroutines are gone: TestMain's leak check).
func TestProxyCloseWhileDelayed(t *testing.T) {
	e := newEcho(t)
	p, err := fault.NewProxy(e.ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	c := dial(t, p.Addr())
	p.SetMode(fault.Delay, time.Hour)
	if _, err := c.Write([]byte("held")); err != nil {
		t.Fatal(err)
	}
	testenv.Eventually(t, 5*time.Second, "the proxy to hold the chunk", func() bool { return p.Stats().Delayed == 1 })
	done := make(chan error, 1)
	go func() { done <- p.Close() }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Close did not return")
	}
	if _, err := net.DialTimeout("tcp", p.Addr(), time.Second); err == nil {
		t.Fatal("the proxy accepts after Close")
	}
}
