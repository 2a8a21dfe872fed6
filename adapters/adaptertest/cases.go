package adaptertest

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// wait bounds every wait of the suite; it measures nothing.
const wait = 2 * time.Minute

// ackRule: a consumer process SIGKILLed at each point of a delivery loses
// nothing and applies nothing twice, and the delivery killed after its
// commit comes back to the next consumer as a duplicate (so it was not
// acknowledged before the handler returned).
func (s *suite) ackRule(t *testing.T) {
	for _, point := range []string{killBefore, killInTx, killAfterCommit} {
		t.Run(point, func(t *testing.T) {
			o := newOracle(t, nil)
			d := s.h.NewDestination(t, options())
			ms := msgs("ack-"+point, 20, []byte("ack"))
			s.publish(t, d, ms...)
			first := s.startChild(t, childSpec{Dest: d, Schema: o.schema, Kill: point, KillAt: 5})
			first.waitKilled(t, wait)
			before := len(o.rows(t))
			next := s.startChild(t, childSpec{Dest: d, Schema: o.schema})
			eventually(t, wait, "every message applied by the consumer started after the kill", func() bool { return o.applied(t, ids(ms)...) })
			next.stop(t)
			t.Logf("killed at %s of the 5th message: %d of %d applied before the kill, %d duplicates caught by the next consumer",
				point, before, len(ms), next.dups.Load())
			o.check(t, ids(ms))
			if point == killAfterCommit && next.dups.Load() == 0 {
				t.Fatal("no delivery came back as a duplicate after a kill between the commit and the acknowledgement: the adapter acknowledged before the handler returned")
			}
			if dls := s.deadLetters(t, d); len(dls) > 0 {
				t.Fatalf("%d dead letters, want none: %+v", len(dls), dls)
			}
		})
	}
}

// duplicate: messages published again after their claims committed are
// acknowledged as duplicates without running the handler.
func (s *suite) duplicate(t *testing.T) {
	o := newOracle(t, nil)
	d := s.h.NewDestination(t, options())
	s.start(t, d, o.mustWork(t))
	ms := msgs("dup", 5, []byte("dup"))
	s.publish(t, d, ms...)
	eventually(t, wait, "the messages applied", func() bool { return o.applied(t, ids(ms)...) })
	s.publish(t, d, ms...)
	eventually(t, wait, "every message published again reported as a duplicate", func() bool {
		for _, m := range ms {
			if !slices.Contains(o.outcomesOf(m.ID), consumer.OutcomeDuplicate) {
				return false
			}
		}
		return true
	})
	for _, m := range ms {
		if n := o.runsOf(m.ID); n != 1 {
			t.Errorf("%s: the handler ran %d times, want 1: a duplicate must be acknowledged without running it", m.ID, n)
		}
	}
	o.check(t, ids(ms))
	if dls := s.deadLetters(t, d); len(dls) > 0 {
		t.Fatalf("%d dead letters, want none", len(dls))
	}
}

// transientRetry: a message failing with a transient error is retried and
// applied once; unrelated messages published after it are applied while it
// waits, unless the broker promises order across them.
func (s *suite) transientRetry(t *testing.T) {
	o := newOracle(t, nil)
	d := s.h.NewDestination(t, options())
	failing := msg("retry-failing", []byte("retry-failing"))
	others := msgs("retry-other", 5, []byte("retry-other"))
	var blocked atomic.Bool
	const giveUp = 60
	if s.caps.Ordering == OrderPerDestination {
		o.failWith(failing.ID, func(run int) error {
			if run <= 2 {
				return errTransient
			}
			return nil
		})
	} else {
		// It fails until the others are applied: if they wait for it,
		// it gives up failing after giveUp runs and the case fails.
		o.failWith(failing.ID, func(run int) error {
			if run >= giveUp {
				blocked.Store(true)
				return nil
			}
			if run > 1 && o.appliedNow(ids(others)...) {
				return nil
			}
			return errTransient
		})
	}
	s.start(t, d, o.mustWork(t))
	s.publish(t, d, failing)
	s.publish(t, d, others...)
	all := append([]string{failing.ID}, ids(others)...)
	eventually(t, wait, "every message applied", func() bool { return o.applied(t, all...) })
	runs := o.runsOf(failing.ID)
	t.Logf("ordering %v: the failing message ran %d times", s.caps.Ordering, runs)
	if blocked.Load() {
		t.Fatalf("unrelated messages (other key) waited for a message being retried, %d runs, though the harness promises ordering %v", giveUp, s.caps.Ordering)
	}
	if runs < 2 {
		t.Fatalf("the failing message ran %d times, want it retried", runs)
	}
	if s.caps.Ordering == OrderPerDestination {
		if runs != 3 {
			t.Errorf("the failing message ran %d times, want 3 (two transient failures)", runs)
		}
		if order := o.order(t); len(order) == 0 || order[0] != failing.ID {
			t.Errorf("applied in the order %v; the harness promises order per destination, so the retried message comes first", order)
		}
	}
	o.check(t, all)
	if dls := s.deadLetters(t, d); len(dls) > 0 {
		t.Fatalf("%d dead letters, want none: a transient error is retried", len(dls))
	}
}

// poison is one message that must be dead-lettered.
type poison struct {
	name   string
	msg    Message
	reason consumer.Outcome
	runs   int // effect runs expected on its id
}

// deadLetter: each kind of poison message is dead-lettered once, with its
// reason and an id, and the consumer goes on.
func (s *suite) deadLetter(t *testing.T) {
	o := newOracle(t, nil)
	d := s.h.NewDestination(t, options())
	key := []byte("dl")
	fpFirst := msg("dl-fingerprint", key)
	ps := []poison{
		{"permanent error", msg("dl-permanent", key), consumer.OutcomePermanent, 1},
		{"malformed payload", Message{ID: "dl-malformed", Key: key, Payload: []byte(`{"id": not json`)}, consumer.OutcomePermanent, 1},
		{"empty id", Message{ID: "", Key: key, Payload: []byte(`{"case":"empty id"}`)}, consumer.OutcomeInvalidKey, 0},
		{"oversized id", Message{ID: "dl-oversized-" + strings.Repeat("x", 300), Key: key, Payload: []byte(`{"case":"oversized id"}`)}, consumer.OutcomeInvalidKey, 0},
		{"fingerprint mismatch", Message{ID: fpFirst.ID, Key: key, Payload: []byte(`{"case":"other content"}`)}, consumer.OutcomeFingerprintMismatch, 1},
	}
	o.failWith(ps[0].msg.ID, func(int) error { return consumer.Permanent(errors.New("adaptertest: permanent failure")) })
	s.start(t, d, o.mustWork(t))
	s.publish(t, d, fpFirst)
	eventually(t, wait, "the first message of the fingerprint pair applied", func() bool { return o.applied(t, fpFirst.ID) })
	for _, p := range ps {
		s.publish(t, d, p.msg)
	}
	after := msgs("dl-after", 5, key)
	s.publish(t, d, after...)
	eventually(t, wait, "the messages after the poison applied and every poison message dead-lettered", func() bool {
		return o.applied(t, ids(after)...) && len(s.deadLetters(t, d)) >= len(ps)
	})
	dls := s.deadLetters(t, d)
	seen := map[string]string{} // dead-letter id -> poison
	for _, p := range ps {
		var mine []DeadLetter
		for _, dl := range dls {
			if string(dl.Payload) == string(p.msg.Payload) {
				mine = append(mine, dl)
			}
		}
		if len(mine) != 1 {
			t.Errorf("%s: %d dead letters, want exactly 1", p.name, len(mine))
			continue
		}
		dl := mine[0]
		t.Logf("%s: dead letter id %q, reason %q, attempts %d", p.name, short(dl.ID), dl.Reason, dl.Attempts)
		if dl.Reason != string(p.reason) {
			t.Errorf("%s: reason %q, want %q", p.name, dl.Reason, p.reason)
		}
		if dl.ID == "" {
			t.Errorf("%s: the dead letter has no id; a reader of the dead-letter destination cannot deduplicate it", p.name)
		} else if other, ok := seen[dl.ID]; ok {
			t.Errorf("%s: dead letter id %q is also the id of %s's", p.name, short(dl.ID), other)
		}
		seen[dl.ID] = p.name
		if n := o.runsOf(p.msg.ID); n != p.runs {
			t.Errorf("%s: the handler ran %d times on its id, want %d", p.name, n, p.runs)
		}
	}
	if len(dls) != len(ps) {
		t.Errorf("%d dead letters, want %d (one per poison message)", len(dls), len(ps))
	}
	o.check(t, append(ids(after), fpFirst.ID))
}

// deadLetterResent: a consumer killed after it dead-lettered a message,
// before that was settled, makes the next consumer dead-letter it again;
// every copy carries the same id, so the dead-letter reader can
// deduplicate them.
func (s *suite) deadLetterResent(t *testing.T) {
	o := newOracle(t, nil)
	d := s.h.NewDestination(t, options())
	key := []byte("resent")
	bad := Message{ID: "resent-malformed", Key: key, Payload: []byte(`{"id": not json`)}
	next := msg("resent-next", key)
	s.publish(t, d, bad, next)
	first := s.startChild(t, childSpec{Dest: d, Schema: o.schema, Kill: killBefore, KillAt: 1, KillID: next.ID})
	first.waitKilled(t, wait)
	again := s.startChild(t, childSpec{Dest: d, Schema: o.schema})
	eventually(t, wait, "the message after the poison applied", func() bool { return o.applied(t, next.ID) })
	again.stop(t)
	dls := s.deadLetters(t, d)
	if len(dls) == 0 {
		t.Fatal("the malformed message was never dead-lettered")
	}
	t.Logf("the malformed message was dead-lettered %d times (more than once when the kill came before its acknowledgement)", len(dls))
	for _, dl := range dls {
		if dl.ID == "" || dl.ID != dls[0].ID {
			t.Fatalf("dead letters of one message carry the ids %q and %q: want one non-empty id for every copy", dl.ID, dls[0].ID)
		}
		if dl.Reason != string(consumer.OutcomePermanent) {
			t.Fatalf("dead letter reason %q, want %q", dl.Reason, consumer.OutcomePermanent)
		}
	}
	o.check(t, []string{next.ID})
}

// order: where the broker promises order (per key, or per destination),
// messages are applied in the order they were published, retries
// included.
func (s *suite) order(t *testing.T) {
	if s.caps.Ordering == OrderNone {
		t.Skip("the harness declares that the broker promises no order (Capabilities.Ordering is OrderNone)")
	}
	o := newOracle(t, nil)
	d := s.h.NewDestination(t, options())
	keys := []string{"order-a", "order-b", "order-c"}
	var ms []Message
	for i := range 15 {
		for _, k := range keys {
			ms = append(ms, msg(fmt.Sprintf("%s-%03d", k, i), []byte(k)))
		}
	}
	// A retried message must keep its place.
	o.failWith(ms[9].ID, func(run int) error {
		if run <= 2 {
			return errTransient
		}
		return nil
	})
	s.start(t, d, o.mustWork(t))
	s.publish(t, d, ms...)
	eventually(t, wait, "every message applied", func() bool { return o.applied(t, ids(ms)...) })
	got := o.order(t)
	keyOf := func(id string) string { return id[:strings.LastIndexByte(id, '-')] }
	switch s.caps.Ordering {
	case OrderPerKey:
		for _, k := range keys {
			var want, have []string
			for _, m := range ms {
				if string(m.Key) == k {
					want = append(want, m.ID)
				}
			}
			for _, id := range got {
				if keyOf(id) == k {
					have = append(have, id)
				}
			}
			if !slices.Equal(have, want) {
				t.Errorf("key %s applied in the order %v, want %v", k, have, want)
			}
		}
	case OrderPerDestination:
		if !slices.Equal(got, ids(ms)) {
			t.Errorf("applied in the order %v, want %v", got, ids(ms))
		}
	}
	o.check(t, ids(ms))
}

// gracefulStop: a consumer stopped while it works settles or gives back
// every delivery it took: the next consumer applies the rest, none twice.
func (s *suite) gracefulStop(t *testing.T) {
	o := newOracle(t, nil)
	d := s.h.NewDestination(t, options())
	o.hook = func(*consumer.Message) { time.Sleep(10 * time.Millisecond) } // keeps deliveries in flight
	ms := msgs("stop", 60, []byte("stop"))
	c := s.start(t, d, o.mustWork(t))
	s.publish(t, d, ms...)
	eventually(t, wait, "a few messages applied", func() bool { return len(o.rows(t)) >= 5 })
	ctx, cancel := context.WithTimeout(context.Background(), wait)
	defer cancel()
	if err := c.Stop(ctx); err != nil {
		t.Fatalf("graceful stop: %v", err)
	}
	stopped := len(o.rows(t))
	s.start(t, d, o.mustWork(t))
	eventually(t, wait, "every message applied by the next consumer", func() bool { return o.applied(t, ids(ms)...) })
	t.Logf("%d of %d messages applied when the first consumer stopped", stopped, len(ms))
	o.check(t, ids(ms))
	if dls := s.deadLetters(t, d); len(dls) > 0 {
		t.Fatalf("%d dead letters, want none", len(dls))
	}
}

// reconnect: a consumer that loses its connection while it works
// reconnects and goes on; nothing is lost or applied twice.
func (s *suite) reconnect(t *testing.T) {
	o := newOracle(t, nil)
	d := s.h.NewDestination(t, options())
	o.hook = func(*consumer.Message) { time.Sleep(5 * time.Millisecond) }
	c := s.start(t, d, o.mustWork(t))
	a := msgs("reconnect-a", 10, []byte("reconnect"))
	s.publish(t, d, a...)
	eventually(t, wait, "the first messages applied", func() bool { return o.applied(t, ids(a)...) })
	b := msgs("reconnect-b", 20, []byte("reconnect"))
	s.publish(t, d, b...)
	err := c.Interrupt(testCtx(t))
	if errors.Is(err, ErrUnsupported) {
		cannot(t, fmt.Sprintf("the harness cannot cut the consumer's connection: %v", err))
	}
	if err != nil {
		t.Fatalf("Consumer.Interrupt: %v", err)
	}
	cm := msgs("reconnect-c", 10, []byte("reconnect"))
	s.publish(t, d, cm...)
	all := append(append(ids(a), ids(b)...), ids(cm)...)
	eventually(t, wait, "every message applied after the reconnect", func() bool { return o.applied(t, all...) })
	o.check(t, all)
	if dls := s.deadLetters(t, d); len(dls) > 0 {
		t.Fatalf("%d dead letters, want none", len(dls))
	}
}

// storeDown: while the claim store cannot be reached, a message is neither
// applied, nor acknowledged, nor dead-lettered; once it is back, the
// message is applied once.
func (s *suite) storeDown(t *testing.T) {
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		t.Fatal(err)
	}
	proxy, err := fault.NewProxy(net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port))))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = proxy.Close() })
	host, port, _ := net.SplitHostPort(proxy.Addr())
	p, _ := strconv.Atoi(port)
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = host, uint16(p)
	cfg.ConnConfig.ConnectTimeout = 2 * time.Second
	cfg.MaxConns = 4
	claims, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(claims.Close)
	o := newOracle(t, claims)
	d := s.h.NewDestination(t, options())
	s.start(t, d, o.mustWork(t))
	warm := msg("down-warm", []byte("down"))
	s.publish(t, d, warm)
	eventually(t, wait, "a message applied while the store is up", func() bool { return o.applied(t, warm.ID) })

	proxy.SetMode(fault.Reset, 0)
	proxy.ResetAll()
	down := make([]Message, 3)
	for i := range down {
		down[i] = msg(fmt.Sprintf("down-%d", i), []byte(fmt.Sprintf("down-%d", i)))
	}
	s.publish(t, d, down...)
	// Where the broker keeps one order per destination, the first message
	// holds up the others: only it is tried.
	tried := down
	if s.caps.Ordering == OrderPerDestination {
		tried = down[:1]
	}
	storeErrors := func(id string) int {
		n := 0
		for _, oc := range o.outcomesOf(id) {
			if oc == consumer.OutcomeStoreError {
				n++
			}
		}
		return n
	}
	eventually(t, wait, "the messages tried at least twice against the store that is down", func() bool {
		for _, m := range tried {
			if storeErrors(m.ID) < 2 {
				return false
			}
		}
		return true
	})
	if got := o.rows(t); got[down[0].ID]+got[down[1].ID]+got[down[2].ID] > 0 {
		t.Fatalf("a message was applied while the store was down: %v", got)
	}
	if dls := s.deadLetters(t, d); len(dls) > 0 {
		t.Fatalf("%d messages dead-lettered while the store was down, want none: a store error is transient", len(dls))
	}
	for _, m := range down {
		if n := o.runsOf(m.ID); n != 0 {
			t.Fatalf("%s: the handler ran %d times while the store was down, want 0", m.ID, n)
		}
	}
	proxy.SetMode(fault.Pass, 0)
	all := append([]string{warm.ID}, ids(down)...)
	eventually(t, wait, "the messages applied once the store is back", func() bool { return o.applied(t, all...) })
	t.Logf("store errors while down: %d, %d, %d", storeErrors(down[0].ID), storeErrors(down[1].ID), storeErrors(down[2].ID))
	o.check(t, all)
	if dls := s.deadLetters(t, d); len(dls) > 0 {
		t.Fatalf("%d dead letters, want none", len(dls))
	}
}
