package idemamqp

import (
	"cmp"
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/consumer"
)

// consAckLinger is how long a run of finished deliveries may wait for more
// to join it before its ack is sent; consAckDelay how long, at most, a
// finished delivery waits for the unfinished deliveries below it before it
// is acknowledged on its own (see consAcker).
const (
	consAckLinger = time.Millisecond
	consAckDelay  = 20 * time.Millisecond
)

// consAcker coalesces the acknowledgements of one session's consuming
// channel. A delivery whose chain returned ActionAck is "finished": it is
// handed to the acker (finished), which acknowledges the finished
// deliveries in as few frames as it can. Every other settlement (a nack
// with requeue, the ack after a retried or dead-lettered copy was
// confirmed) is written by the delivery's own worker, one tag at a time,
// and then reported to the acker (settled).
//
// The invariant that keeps the ACK rule: a basic.ack with multiple=true
// for tag N is sent only when N itself is unsettled and every delivery of
// the channel with a tag up to N that is not settled yet is finished. The
// acker knows every delivery the broker sent up to N because workers
// receive and register deliveries one at a time (recv), in the order the
// broker sent them, so the registered tags are exactly the delivered ones
// up to the highest.
// ents holds the registered deliveries not settled yet, in tag order; a
// delivery in flight, or one its worker is about to nack, retry or
// dead-letter, stays in ents, unfinished, until that worker's own frame
// was written. So the multiple ack never covers such a tag, and no frame
// of the acker is written for a tag that another frame settled before.
//
// Flush policy:
//
//   - a run of finished deliveries at the head of ents (no unfinished one
//     below them) goes in one basic.ack, multiple=true, for the highest of
//     them, once the run is batch long (a quarter of the prefetch window)
//     or its oldest delivery finished linger (consAckLinger) ago.
//   - a finished delivery behind an unfinished one ("stuck") waits for the
//     gap to close, at most delay (consAckDelay); then it is acknowledged
//     on its own (multiple=false), with the stuck deliveries that waited
//     half as long. When the stuck deliveries are maxStuck (half the
//     prefetch window) or more, they wait only linger, then all are
//     acknowledged on their own, so a slow delivery never starves the
//     window for long (a worker descheduled for less than linger still
//     closes the gap in time for one multiple ack).
//   - frames are written by whoever finds one due and no flush under way:
//     the worker that finished the delivery that made a run long enough,
//     or the session's timer goroutine (loop) for the time limits. The
//     flush role is exclusive, so the acker's frames go out one at a time,
//     in the order they were decided.
//   - a graceful stop (drain), after the last handler returned, sends the
//     acks of all finished deliveries before the connection closes.
//   - once the session is dead, or a write on its channel failed, nothing
//     more is written: finished deliveries are abandoned (the broker
//     redelivers them; the dedup store decides). The acker belongs to one
//     session, and a tag is only ever sent on that session's channel.
//
// Stats, telemetry and OnOutcome of a finished delivery are reported once
// its ack was written (or abandoned), by the goroutine that wrote it.
type consAcker struct {
	c        *Consumer
	s        *consSession
	linger   time.Duration
	delay    time.Duration
	batch    int
	maxStuck int

	// recv serializes receive-and-register, so tags register in the
	// order the broker delivered them.
	recv sync.Mutex

	// The round the acker belongs to (see Consumer.serve): its consumer
	// tag; careful when its prefetch is one. chosen is the returned
	// delivery a round with the window of Prefetch runs alone, once the
	// flow stopped and every other delivery of the round was settled (see
	// Consumer.take), nil while none was chosen; held are the
	// deliveries received after it, which wait for the flow to stop
	// (guarded by mu); ending is set when the round stopped its flow for
	// another reason (a careful round met a delivery never returned).
	// arrivals counts the deliveries received; live the round's workers
	// still taking deliveries: the last one to stop finishes the round.
	tag      string
	careful  bool
	chosen   atomic.Pointer[consDelivery]
	held     []*consDelivery
	ending   atomic.Bool
	arrivals atomic.Int64
	live     atomic.Int32
	stopFlow sync.Once

	mu       sync.Mutex
	idle     sync.Cond   // on mu; broadcast when a flush ends
	ents     []consEnt   // registered, unsettled deliveries, ascending tags
	nfin     int         // finished entries in ents
	flushing bool        // a goroutine holds the flush role: it alone writes the acker's frames
	draining bool        // drain: everything finished goes now
	wakeAt   time.Time   // when the timer goroutine flushes next; zero when idle
	work     consAckWork // scratch of the flush role

	broken atomic.Bool // a write on the channel failed
	arm    chan struct{}
	stop   chan struct{}

	// ack writes a basic.ack on the session's channel: s.ch.Ack (tests
	// replace it with a model of the broker).
	ack func(tag uint64, multiple bool) error
}

// consEnt is a registered delivery: in flight while done is nil, finished
// (waiting for its ack) otherwise.
type consEnt struct {
	tag  uint64
	done *consDone
}

// consDone is a finished delivery: its chain returned ActionAck. What it
// holds is what is reported once the ack is written.
type consDone struct {
	tag   uint64
	at    time.Time // when it finished
	start time.Time // when its handling began
	ctx   context.Context
	msg   *consumer.Message
	r     consumer.Result
	end   func(result string, err error)
}

// consAckWork is one flush step: one frame covering dones (upTo > 0,
// multiple=true), one frame per done (single), or none (abandon).
type consAckWork struct {
	upTo    uint64
	single  bool
	abandon bool
	dones   []*consDone
}

func newConsAcker(c *Consumer, s *consSession) *consAcker {
	p := c.opts.Prefetch
	a := &consAcker{
		c: c, s: s, linger: c.ackLinger, delay: c.ackDelay, batch: max(1, p/4), maxStuck: max(1, p/2),
		ents: make([]consEnt, 0, p+c.opts.Concurrency),
		arm:  make(chan struct{}, 1), stop: make(chan struct{}),
		ack: s.ch.Ack,
	}
	a.idle.L = &a.mu
	return a
}

// next receives the next delivery and registers it in flight; false when
// deliveries is closed.
func (a *consAcker) next(deliveries <-chan amqp091.Delivery) (amqp091.Delivery, bool) {
	var d amqp091.Delivery
	ok := a.take(deliveries, &d)
	return d, ok
}

// take is next, receiving into d.
func (a *consAcker) take(deliveries <-chan amqp091.Delivery, d *amqp091.Delivery) bool {
	a.recv.Lock()
	defer a.recv.Unlock()
	var ok bool
	*d, ok = <-deliveries
	if !ok {
		return false
	}
	a.mu.Lock()
	a.register(d.DeliveryTag)
	a.mu.Unlock()
	a.arrivals.Add(1)
	return true
}

// hold keeps cd, received after the round's chosen delivery, for when the
// flow stopped.
func (a *consAcker) hold(cd *consDelivery) {
	a.mu.Lock()
	a.held = append(a.held, cd)
	a.mu.Unlock()
}

// still reports whether every unsettled delivery of the round is the
// chosen one or held (none in flight, none finished and waiting for its
// ack), and how many there are.
func (a *consAcker) still() (ok bool, unsettled int) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.ents) == len(a.held)+1 && a.nfin == 0, len(a.ents)
}

// flushAll writes the acks of every finished delivery now. Called by a
// delivery that runs alone, before its handler: no other delivery is in
// flight then, so the finished ones form one run. With final (drain),
// everything finished later goes at once too.
func (a *consAcker) flushAll(final bool) {
	a.mu.Lock()
	for a.flushing {
		a.idle.Wait()
	}
	a.draining = true
	a.flushLocked()
	a.draining = final
	a.mu.Unlock()
}

func (a *consAcker) register(tag uint64) {
	if n := len(a.ents); n == 0 || a.ents[n-1].tag < tag {
		a.ents = append(a.ents, consEnt{tag: tag})
		return
	}
	// The broker's tags grow on a channel; keep the order even if not.
	if i, found := a.find(tag); !found {
		a.ents = slices.Insert(a.ents, i, consEnt{tag: tag})
	}
}

func (a *consAcker) find(tag uint64) (int, bool) {
	return slices.BinarySearchFunc(a.ents, tag, func(e consEnt, t uint64) int { return cmp.Compare(e.tag, t) })
}

// finished hands over a delivery whose chain returned ActionAck. It
// returns at once unless the caller becomes the flush leader.
func (a *consAcker) finished(p *consDone) {
	a.mu.Lock()
	i, ok := a.find(p.tag)
	if !ok || a.ents[i].done != nil {
		// Not a registered delivery in flight: never acknowledge a tag
		// the acker does not track. (Every delivery is registered by
		// next, so this does not happen.)
		a.mu.Unlock()
		a.c.reportDone(p, settledAbandoned)
		return
	}
	a.ents[i].done = p
	a.nfin++
	if !a.flushing {
		a.flushLocked()
	}
	a.mu.Unlock()
}

// settled reports a delivery its worker settled on its own (its frame was
// written, or it was abandoned: failed), so it no longer holds back the
// finished deliveries above it.
func (a *consAcker) settled(tag uint64, failed bool) {
	if failed {
		a.broken.Store(true)
	}
	a.mu.Lock()
	if i, ok := a.find(tag); ok && a.ents[i].done == nil {
		a.ents = slices.Delete(a.ents, i, i+1)
	}
	if !a.flushing && a.nfin > 0 {
		a.flushLocked()
	}
	a.mu.Unlock()
}

// flushLocked takes the flush role and writes until nothing is left to
// write now. Called with mu held and the role free; returns with mu held.
func (a *consAcker) flushLocked() {
	a.flushing = true
	w := &a.work
	for a.takeLocked(w) {
		a.mu.Unlock()
		a.write(w)
		a.mu.Lock()
	}
	a.flushing = false
	a.idle.Broadcast()
}

// takeLocked moves the next flush step that is due from ents into w;
// false when none is. Deliveries left waiting get the timer armed.
func (a *consAcker) takeLocked(w *consAckWork) bool {
	clear(w.dones)
	*w = consAckWork{dones: w.dones[:0]}
	if a.nfin == 0 {
		return false
	}
	if a.broken.Load() || a.s.isDead() {
		a.takeFinished(func(*consDone) bool { return true }, w)
		w.abandon = true
		return true
	}
	now := time.Now()
	// The run at the head: k finished deliveries, the oldest at run.
	k := 0
	var run time.Time
	for k < len(a.ents) && a.ents[k].done != nil {
		if at := a.ents[k].done.at; k == 0 || at.Before(run) {
			run = at
		}
		k++
	}
	// The stuck ones: finished after the first unfinished delivery.
	stuck := a.nfin - k
	var first time.Time
	if stuck > 0 {
		for _, e := range a.ents[k:] {
			if e.done != nil && (first.IsZero() || e.done.at.Before(first)) {
				first = e.done.at
			}
		}
	}
	stuckDue := stuck > 0 && (a.draining || !now.Before(first.Add(a.delay)) ||
		stuck >= a.maxStuck && !now.Before(first.Add(a.linger)))
	if k > 0 && (stuckDue || a.draining || k >= a.batch || !now.Before(run.Add(a.linger))) {
		for _, e := range a.ents[:k] {
			w.dones = append(w.dones, e.done)
		}
		w.upTo = a.ents[k-1].tag
		a.ents = slices.Delete(a.ents, 0, k)
		a.nfin -= k
		return true
	}
	if stuckDue {
		// k is 0: every finished delivery is stuck.
		all := a.draining || stuck >= a.maxStuck
		ripe := now.Add(-a.delay / 2)
		a.takeFinished(func(p *consDone) bool { return all || !p.at.After(ripe) }, w)
		w.single = true
		return true
	}
	var next time.Time
	if k > 0 {
		next = run.Add(a.linger)
	}
	if stuck > 0 {
		d := first.Add(a.delay)
		if stuck >= a.maxStuck {
			d = first.Add(a.linger)
		}
		if next.IsZero() || d.Before(next) {
			next = d
		}
	}
	if a.wakeAt.IsZero() || next.Before(a.wakeAt) {
		a.wakeAt = next
		select {
		case a.arm <- struct{}{}:
		default:
		}
	}
	return false
}

// takeFinished moves the finished deliveries that pass take from ents to
// w.dones, in tag order.
func (a *consAcker) takeFinished(take func(*consDone) bool, w *consAckWork) {
	j := 0
	for _, e := range a.ents {
		if e.done != nil && take(e.done) {
			w.dones = append(w.dones, e.done)
			continue
		}
		a.ents[j] = e
		j++
	}
	clear(a.ents[j:])
	a.ents = a.ents[:j]
	a.nfin -= len(w.dones)
}

// write sends w's frames on the session's channel (never another) and
// reports the deliveries. Only the holder of the flush role calls it.
func (a *consAcker) write(w *consAckWork) {
	out := settledAcked
	switch {
	case w.abandon:
		out = settledAbandoned
	case w.single:
		for _, p := range w.dones {
			o := settledAcked
			if !a.send(p.tag, false) {
				o = settledAbandoned
			}
			a.c.reportDone(p, o)
		}
		return
	default:
		if !a.send(w.upTo, true) {
			out = settledAbandoned
		}
	}
	for _, p := range w.dones {
		a.c.reportDone(p, out)
	}
}

// send writes one basic.ack, unless the channel is known to be unusable.
func (a *consAcker) send(tag uint64, multiple bool) bool {
	if a.broken.Load() || a.s.isDead() {
		return false
	}
	if err := a.ack(tag, multiple); err != nil {
		a.broken.Store(true)
		return false
	}
	return true
}

// loop is the session's ack timer: it flushes what waited linger or
// delay, and abandons the finished deliveries when the session dies. It
// returns when drain or the session's death stops it.
func (a *consAcker) loop() {
	t := time.NewTimer(time.Hour)
	t.Stop()
	defer t.Stop()
	for {
		select {
		case <-a.stop:
			return
		case <-a.s.dead:
			a.mu.Lock()
			for a.flushing {
				a.idle.Wait()
			}
			a.flushLocked()
			a.mu.Unlock()
			return
		case <-a.arm:
		case <-t.C:
			a.mu.Lock()
			a.wakeAt = time.Time{}
			if !a.flushing {
				a.flushLocked() // re-arms wakeAt for what is left
			}
			a.mu.Unlock()
		}
		a.mu.Lock()
		at := a.wakeAt
		a.mu.Unlock()
		if at.IsZero() {
			t.Stop()
		} else {
			t.Reset(time.Until(at))
		}
	}
}

// drain acknowledges every finished delivery and stops the timer. Called
// on a graceful stop once no handler of the session runs any more, before
// the connection is closed.
func (a *consAcker) drain() {
	// No delivery is in flight now: the finished ones form one run.
	a.flushAll(true)
	close(a.stop)
}
