package fault_test

import (
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testkit/fault"
)

// NewProxyOn listens where it is told and passes bytes both ways; when the
// client closes, the server side is closed too (the echo server's read
// ends), and nothing is dialled again.
func TestProxyOn(t *testing.T) {
	e := newEcho(t)
	p, err := fault.NewProxyOn("127.0.0.1:0", e.ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := p.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	}()
	if !strings.HasPrefix(p.Addr(), "127.0.0.1:") || p.Target() != e.ln.Addr().String() {
		t.Fatalf("Addr %s, Target %s", p.Addr(), p.Target())
	}
	c := dial(t, p.Addr())
	if got, err := roundTrip(c, "hello"); err != nil || got != "hello" {
		t.Fatalf("round trip: %q, %v", got, err)
	}
	_ = c.Close()
	deadline := time.Now().Add(5 * time.Second)
	for e.endedConns() != 1 {
		if time.Now().After(deadline) {
			t.Fatal("the server side stayed open after the client closed")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if s := p.Stats(); s.Accepted != 1 {
		t.Fatalf("stats %+v", s)
	}
	if _, err := fault.NewProxyOn("127.0.0.1:-1", e.ln.Addr().String()); err == nil {
		t.Fatal("a bad listen address was accepted")
	}
}
