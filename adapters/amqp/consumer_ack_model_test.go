package idemamqp

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// consBrokerModel is the broker's side of one channel, as far as
// acknowledgements go: the outstanding (delivered, unsettled) tags, and for
// each whether the consumer's work on it is done. It checks every frame
// the acker writes against the ACK rule: a basic.ack (multiple or not)
// settles only finished deliveries, and its tag is outstanding (RabbitMQ
// closes the channel on an unknown tag).
type consBrokerModel struct {
	mu          sync.Mutex
	cond        sync.Cond
	next        uint64
	outstanding map[uint64]bool // tag -> finished
	acked       map[uint64]bool
	frames      int
	violations  []string
}

func newConsBrokerModel() *consBrokerModel {
	m := &consBrokerModel{next: 1, outstanding: map[uint64]bool{}, acked: map[uint64]bool{}}
	m.cond.L = &m.mu
	return m
}

func (m *consBrokerModel) violate(format string, args ...any) {
	m.violations = append(m.violations, fmt.Sprintf(format, args...))
}

// deliver hands out the next tag once fewer than prefetch are outstanding.
func (m *consBrokerModel) deliver(prefetch int) uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	for len(m.outstanding) >= prefetch {
		m.cond.Wait()
	}
	t := m.next
	m.next++
	m.outstanding[t] = false
	return t
}

// finish records that the work on tag is done (the effect committed):
// from now on an ack may cover it.
func (m *consBrokerModel) finish(tag uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.outstanding[tag] = true
}

// ack is the acker's frame.
func (m *consBrokerModel) ack(tag uint64, multiple bool) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	defer m.cond.Broadcast()
	m.frames++
	fin, ok := m.outstanding[tag]
	if !ok {
		m.violate("ack(%d, multiple=%v): unknown delivery tag (channel error)", tag, multiple)
		return nil
	}
	if !fin {
		m.violate("ack(%d, multiple=%v) covers an unfinished delivery", tag, multiple)
	}
	if !multiple {
		delete(m.outstanding, tag)
		m.acked[tag] = true
		return nil
	}
	for t, fin := range m.outstanding {
		if t > tag {
			continue
		}
		if !fin {
			m.violate("ack(%d, multiple) covers unfinished tag %d", tag, t)
		}
		delete(m.outstanding, t)
		m.acked[t] = true
	}
	return nil
}

// nack is a worker's own frame for an unfinished delivery (a requeue, or an
// ack after a confirmed copy): it settles exactly that tag.
func (m *consBrokerModel) nack(tag uint64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	defer m.cond.Broadcast()
	m.frames++
	if _, ok := m.outstanding[tag]; !ok {
		m.violate("nack(%d): unknown delivery tag (channel error)", tag)
	}
	delete(m.outstanding, tag)
}

// consModelAcker returns an acker of a session that never connected, its
// frames going to m.
func consModelAcker(t *testing.T, prefetch, concurrency int, linger, delay time.Duration, m *consBrokerModel) (*Consumer, *consSession, *consAcker) {
	t.Helper()
	h := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	c, err := NewConsumer(testenv.AMQPURL(), "model", h, ConsumerOptions{Prefetch: prefetch, Concurrency: concurrency, Telemetry: consumer.Telemetry{Logger: consQuiet()}})
	if err != nil {
		t.Fatal(err)
	}
	c.ackLinger, c.ackDelay = linger, delay
	s := &consSession{gen: 1, dead: make(chan struct{})}
	a := newConsAcker(c, s)
	a.ack = m.ack
	return c, s, a
}

func consModelDone(tag uint64) *consDone {
	now := time.Now()
	return &consDone{tag: tag, at: now, start: now, ctx: context.Background(), msg: &consumer.Message{},
		r: consumer.Result{Action: consumer.ActionAck}, end: func(string, error) {}}
}

// Many workers finish, nack and stall deliveries in random order against
// the broker model: no frame ever covers an unfinished or unknown tag,
// every finished delivery is acknowledged exactly once by the end (Stats
// agree), and the acks are coalesced (far fewer frames than deliveries).
func TestAckerModelRandom(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name                    string
		prefetch, concurrency   int
		linger, delay           time.Duration
		slowEvery, nackEvery, n int
		// coalesce expects at most one ack frame per 4 deliveries. Only
		// with time limits too long to expire during the run: then runs
		// go out when they are a quarter of the window long, however slow
		// the machine (with the 1ms default linger, a machine loaded
		// enough to take over 1ms between two finishes sends a frame per
		// delivery or two, which is right but not what this checks).
		coalesce bool
	}{
		{"defaults", 100, 8, consAckLinger, consAckDelay, 0, 0, 20000, false},
		{"defaults with nacks", 100, 8, consAckLinger, consAckDelay, 0, 7, 10000, false},
		{"batches", 100, 8, time.Hour, time.Hour, 0, 0, 20000, true},
		{"batches with nacks", 100, 8, time.Hour, time.Hour, 0, 7, 10000, true},
		{"slow ones", 100, 8, 200 * time.Microsecond, 2 * time.Millisecond, 97, 0, 10000, false},
		{"slow ones and nacks", 50, 8, 200 * time.Microsecond, 2 * time.Millisecond, 41, 7, 10000, false},
		{"small window", 4, 4, time.Hour, time.Hour, 13, 11, 5000, false},
		{"one worker", 100, 1, consAckLinger, consAckDelay, 0, 5, 5000, false},
		{"more workers than window", 8, 32, 100 * time.Microsecond, time.Millisecond, 31, 9, 5000, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m := newConsBrokerModel()
			c, _, a := consModelAcker(t, tc.prefetch, tc.concurrency, tc.linger, tc.delay, m)
			var wg sync.WaitGroup
			wg.Go(a.loop)
			ds := make(chan amqp091.Delivery)
			wg.Go(func() {
				defer close(ds)
				for range tc.n {
					ds <- amqp091.Delivery{DeliveryTag: m.deliver(tc.prefetch)}
				}
			})
			var finished, nacked atomic.Int64
			var workers sync.WaitGroup
			for range tc.concurrency {
				workers.Go(func() {
					for {
						d, ok := a.next(ds)
						if !ok {
							return
						}
						tag := d.DeliveryTag
						switch {
						case tc.slowEvery > 0 && tag%uint64(tc.slowEvery) == 0:
							time.Sleep(time.Duration(1+rand.N(5)) * time.Millisecond)
						case rand.N(4) == 0:
							time.Sleep(time.Duration(rand.N(50)) * time.Microsecond)
						}
						if tc.nackEvery > 0 && tag%uint64(tc.nackEvery) == 0 {
							m.nack(tag)
							nacked.Add(1)
							a.settled(tag, false)
							continue
						}
						m.finish(tag)
						finished.Add(1)
						a.finished(consModelDone(tag))
					}
				})
			}
			workers.Wait()
			a.drain()
			wg.Wait()
			m.mu.Lock()
			defer m.mu.Unlock()
			for _, v := range m.violations[:min(len(m.violations), 10)] {
				t.Error(v)
			}
			if len(m.outstanding) != 0 {
				t.Errorf("%d deliveries left unsettled after drain", len(m.outstanding))
			}
			st := c.Stats()
			if st.Acked != finished.Load() || int64(len(m.acked)) != finished.Load() || st.Abandoned != 0 {
				t.Errorf("finished %d, Stats.Acked %d, acked by the broker %d, abandoned %d", finished.Load(), st.Acked, len(m.acked), st.Abandoned)
			}
			ackFrames := m.frames - int(nacked.Load())
			t.Logf("%d deliveries: %d finished in %d ack frames, %d nacked", tc.n, finished.Load(), ackFrames, nacked.Load())
			if tc.coalesce && ackFrames*4 > int(finished.Load()) {
				t.Errorf("%d ack frames for %d finished deliveries: not coalesced", ackFrames, finished.Load())
			}
		})
	}
}

// A finished delivery behind a slow one is acknowledged on its own once it
// waited delay, while the slow one is not; when the slow one finishes, the
// rest goes in one multiple ack.
func TestAckerModelStuckBound(t *testing.T) {
	t.Parallel()
	m := newConsBrokerModel()
	const delay = 30 * time.Millisecond
	c, _, a := consModelAcker(t, 100, 4, time.Millisecond, delay, m)
	var wg sync.WaitGroup
	wg.Go(a.loop)
	ds := make(chan amqp091.Delivery, 10)
	for range 10 {
		ds <- amqp091.Delivery{DeliveryTag: m.deliver(100)}
	}
	close(ds)
	var got []uint64
	for range 10 {
		d, _ := a.next(ds)
		got = append(got, d.DeliveryTag)
	}
	// Tag 1 is slow; 2..10 finish.
	start := time.Now()
	for _, tag := range got[1:] {
		m.finish(tag)
		a.finished(consModelDone(tag))
	}
	testenv.Eventually(t, 5*time.Second, "the stuck deliveries to be acknowledged", func() bool { return c.Stats().Acked == 9 })
	if waited := time.Since(start); waited < delay {
		t.Errorf("stuck deliveries acknowledged after %v, before the %v bound", waited, delay)
	}
	m.mu.Lock()
	if _, ok := m.outstanding[1]; !ok || m.acked[1] {
		t.Error("the slow delivery was acknowledged while it ran")
	}
	frames := m.frames
	m.mu.Unlock()
	if frames != 9 {
		t.Errorf("%d frames for 9 stuck deliveries, want 9 single acks", frames)
	}
	m.finish(1)
	a.finished(consModelDone(1))
	testenv.Eventually(t, 5*time.Second, "the slow delivery to be acknowledged", func() bool { return c.Stats().Acked == 10 })
	a.drain()
	wg.Wait()
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.violations) > 0 {
		t.Error(m.violations)
	}
}

// On a dead session nothing is written: the finished deliveries waiting
// for their ack are abandoned, and counted so.
func TestAckerModelDeadSession(t *testing.T) {
	t.Parallel()
	m := newConsBrokerModel()
	c, s, a := consModelAcker(t, 100, 4, time.Hour, time.Hour, m)
	var wg sync.WaitGroup
	wg.Go(a.loop)
	ds := make(chan amqp091.Delivery, 5)
	for range 5 {
		ds <- amqp091.Delivery{DeliveryTag: m.deliver(100)}
	}
	close(ds)
	for range 5 {
		d, _ := a.next(ds)
		if d.DeliveryTag == 3 {
			continue // in flight when the session dies
		}
		m.finish(d.DeliveryTag)
		a.finished(consModelDone(d.DeliveryTag))
	}
	if st := c.Stats(); st.Acked != 0 {
		t.Fatalf("Acked = %d before any flush was due", st.Acked)
	}
	s.deadOnce.Do(func() { s.deadErr = errors.New("gone"); close(s.dead) })
	wg.Wait() // the timer goroutine abandons what waits
	m.finish(3)
	a.finished(consModelDone(3)) // a handler of the dead generation ends
	st := c.Stats()
	if st.Acked != 0 || st.Abandoned != 5 {
		t.Errorf("Acked %d, Abandoned %d; want 0 and 5", st.Acked, st.Abandoned)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.frames != 0 {
		t.Errorf("%d frames written on a dead session", m.frames)
	}
}
