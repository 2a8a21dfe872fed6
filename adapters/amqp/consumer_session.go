package idemamqp

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
)

// consSession is one connection generation: the connection, the consuming
// channel, and the confirm-mode channel retried and dead-lettered copies
// are published on. dead is closed as soon as any of them closes.
type consSession struct {
	gen    uint64
	conn   *amqp091.Connection
	shared bool // conn is the caller's: close only the channels
	ch     *amqp091.Channel
	pub    *amqp091.Channel
	// returns counts the copies returned unroutable on pub.
	returns *returnWatch
	// rpc serialises the synchronous methods workers and the stop send on
	// ch while deliveries run (basic.qos, basic.cancel): amqp091 matches a
	// reply to whichever call reads it first.
	rpc sync.Mutex
	// prefetch is the window of the current round's consumer (see serve).
	prefetch atomic.Int32

	dead     chan struct{}
	deadOnce sync.Once
	deadErr  error
}

func (s *consSession) isDead() bool {
	select {
	case <-s.dead:
		return true
	default:
		return false
	}
}

func (s *consSession) kill(err error) {
	s.deadOnce.Do(func() {
		s.deadErr = err
		close(s.dead)
	})
	s.close()
}

// close closes the connection, or only the session's channels when the
// connection is the caller's.
func (s *consSession) close() {
	if !s.shared {
		_ = s.conn.CloseDeadline(time.Now().Add(2 * time.Second))
		return
	}
	for _, ch := range []*amqp091.Channel{s.ch, s.pub} {
		if ch != nil {
			_ = ch.Close()
		}
	}
}

func (c *Consumer) connect(ctx context.Context, wg *sync.WaitGroup) (*consSession, error) {
	conn, err := c.dial(ctx)
	if err != nil {
		if c.shared {
			return nil, err // ErrConnectionClosed: nothing was dialled
		}
		return nil, fmt.Errorf("dial: %w", err)
	}
	if conn == nil {
		return nil, errors.New("dial: ConsumerOptions.Dial returned no connection and no error")
	}
	s := &consSession{conn: conn, shared: c.shared, dead: make(chan struct{})}
	ok := false
	defer func() {
		if !ok {
			s.close()
		}
	}()
	if s.ch, err = conn.Channel(); err != nil {
		return nil, c.channelErr(conn, err)
	}
	if c.opts.NoDeclare {
		err = c.check(conn, s.ch)
	} else {
		err = c.declare(s.ch)
	}
	if err != nil {
		return nil, err
	}
	if err := s.ch.Qos(c.opts.Prefetch, 0, false); err != nil {
		return nil, fmt.Errorf("qos: %w", err)
	}
	if s.pub, err = conn.Channel(); err != nil {
		return nil, c.channelErr(conn, err)
	}
	if err := s.pub.Confirm(false); err != nil {
		return nil, fmt.Errorf("confirm mode: %w", err)
	}
	s.returns = watchReturns(s.pub)
	wg.Go(s.returns.loop)
	s.gen = c.gen.Add(1)
	// Buffered: the library sends at most one error on each, then closes
	// them all when the connection (or the channel) shuts down. A
	// connection the caller owns is not watched: its death closes the
	// channels, which are.
	var connCloses chan *amqp091.Error
	if !s.shared {
		connCloses = conn.NotifyClose(make(chan *amqp091.Error, 1))
	}
	chCloses := s.ch.NotifyClose(make(chan *amqp091.Error, 1))
	pubCloses := s.pub.NotifyClose(make(chan *amqp091.Error, 1))
	wg.Go(func() {
		var e *amqp091.Error
		select {
		case e = <-connCloses:
		case e = <-chCloses:
		case e = <-pubCloses:
		}
		err := error(amqp091.ErrClosed)
		if e != nil {
			err = e
		}
		s.kill(err)
		// Wait for the connection (or the channels) to be gone, so the
		// watcher outlives no library goroutine of it.
		if s.shared {
			for range chCloses {
			}
			for range pubCloses {
			}
			return
		}
		for range connCloses {
		}
	})
	ok = true
	c.stats.connects.Add(1)
	return s, nil
}

// serve consumes on s until ctx ends (graceful stop, nil) or s dies (the
// reason). Workers of a dead generation are left to finish on their own;
// wg tracks them.
//
// It consumes in rounds: a round ends, and the next one consumes again on
// the same channel, when a returned delivery had to run alone (see
// take).
func (c *Consumer) serve(ctx, hctx context.Context, s *consSession, wg *sync.WaitGroup) error {
	// A basic.cancel from the broker is announced here before the
	// deliveries close (amqp091-go notifies, then closes).
	cancelled := s.ch.NotifyCancel(make(chan string, 1))
	careful := false
	for round := 0; ; round++ {
		tag := fmt.Sprintf("%s-%d", c.opts.ConnectionName, s.gen)
		if round > 0 {
			tag = fmt.Sprintf("%s.%d", tag, round)
		}
		next, err := c.round(ctx, hctx, s, tag, careful, cancelled, wg)
		if next == roundDone {
			return err
		}
		careful = next == roundCareful
	}
}

// What follows a round.
const (
	roundDone    = iota // the session stops or died
	roundNormal         // consume again with the window of Prefetch
	roundCareful        // consume again with a window of one
)

// round consumes on s with consumer tag tag until ctx ends (graceful stop,
// nil), s dies (the reason), or the round stopped its flow (see take):
// then it says how the next round consumes.
func (c *Consumer) round(ctx, hctx context.Context, s *consSession, tag string, careful bool, cancelled <-chan string, wg *sync.WaitGroup) (next int, err error) {
	prefetch := c.opts.Prefetch
	if careful {
		prefetch = 1
	}
	s.prefetch.Store(int32(prefetch))
	s.rpc.Lock()
	err = s.ch.Qos(prefetch, 0, false)
	s.rpc.Unlock()
	if err != nil {
		s.kill(err)
		return roundDone, fmt.Errorf("qos: %w", err)
	}
	deliveries, err := s.ch.Consume(c.queue, tag, false, false, false, false, nil)
	if err != nil {
		s.kill(err)
		return roundDone, fmt.Errorf("consume %q: %w", c.queue, err)
	}
	c.readyOnce.Do(func() { close(c.ready) })
	a := newConsAcker(c, s)
	a.tag, a.careful = tag, careful
	wg.Go(a.loop)
	// wctx tells the workers to stop starting deliveries: only once the
	// broker confirmed the cancel, so that what they give back is not
	// delivered to this consumer again (and counted again in
	// x-delivery-count) while it stops. The workers of a session that
	// died go on (their settlements fail and count as abandoned).
	wctx, stopWorkers := context.WithCancel(context.WithoutCancel(ctx))
	seats, workers := c.startWorkers(wctx, hctx, s, a, deliveries, wg)
	// The deliveries close without ctx ending or the channel closing when
	// the broker cancels the consumer (basic.cancel: the queue was
	// deleted, or a quorum queue lost its leader): then the workers all
	// return, and the session is given up so that Run redeclares the
	// topology and consumes again. They close too when the round stopped
	// its flow (see take): then the next round consumes again.
	drained := make(chan struct{})
	wg.Go(func() { workers.Wait(); close(drained) })
	select {
	case <-ctx.Done():
	case <-s.dead:
	case <-drained:
		if ctx.Err() == nil && brokerCancelled(cancelled) {
			a.drain()
			stopWorkers()
			s.kill(errBrokerCancel)
			return roundDone, errBrokerCancel
		}
		if ctx.Err() == nil && !s.isDead() && (a.chosen.Load() != nil || a.ending.Load()) {
			a.drain()
			stopWorkers()
			if a.chosen.Load() != nil {
				return roundCareful, nil
			}
			return roundNormal, nil
		}
		// Closed by the stop, or by the channel's death, whose close
		// error (which may be fatal) comes through s.dead.
		select {
		case <-ctx.Done():
		case <-s.dead:
		}
	}
	if ctx.Err() == nil {
		s.kill(s.deadErr)
		// Nothing of this session can be settled any more: deliveries
		// waiting for a handler slot give way instead of running.
		seats.stop()
		wg.Go(func() { workers.Wait(); stopWorkers() })
		return roundDone, fmt.Errorf("%w: %w", errSessionLost, s.deadErr)
	}
	c.stopSession(s, a, tag, stopWorkers, seats, workers)
	return roundDone, nil
}

// stopSession ends a session gracefully once Run's context ended: it cancels the
// consumer, stops the workers and the gate, waits for the handlers, sends
// the acks still waiting in the acker and closes the session.
func (c *Consumer) stopSession(s *consSession, a *consAcker, tag string, stopWorkers func(), seats *gate, workers *sync.WaitGroup) {
	// Stop the flow; the library then hands over what it buffered
	// (requeued by handle, since wctx is done) and closes deliveries.
	// Deliveries that claimed but wait for a handler slot give way too
	// (their chain returns errStopped; settle requeues them).
	s.rpc.Lock()
	err := s.ch.Cancel(tag, false)
	s.rpc.Unlock()
	if err != nil {
		s.kill(err)
	}
	stopWorkers()
	seats.stop()
	if c.workersStopped != nil {
		c.workersStopped()
	}
	workers.Wait()
	// Every handler returned: send the acks still waiting in the acker
	// before the connection closes.
	a.drain()
	s.kill(amqp091.ErrClosed)
}

// startWorkers starts the InFlight workers that take s's deliveries and
// run the chain on them, and returns the gate that bounds their handlers
// (nil when InFlight is Concurrency) and the group that tracks them. The
// workers stop starting deliveries when wctx ends.
func (c *Consumer) startWorkers(wctx, hctx context.Context, s *consSession, a *consAcker, deliveries <-chan amqp091.Delivery, wg *sync.WaitGroup) (*gate, *sync.WaitGroup) {
	// InFlight workers run the chain; when they outnumber Concurrency, a
	// gate of Concurrency seats bounds the handlers among them (see
	// ConsumerOptions.InFlight and seat).
	var seats *gate
	if c.opts.InFlight > c.opts.Concurrency {
		seats = newGate(c.opts.Concurrency)
	}
	workers := new(sync.WaitGroup)
	a.live.Store(int32(c.opts.InFlight))
	for range c.opts.InFlight {
		workers.Add(1)
		wg.Go(func() {
			defer workers.Done()
			for {
				cd := new(consDelivery)
				if !a.take(deliveries, &cd.d) {
					break
				}
				cd.d.Acknowledger = consGuard{ch: cd.d.Acknowledger}
				c.take(wctx, hctx, s, a, seats, cd, workers)
			}
			if a.live.Add(-1) == 0 {
				c.finishRound(wctx, hctx, s, a, seats)
			}
		})
	}
	return seats, workers
}

// brokerCancelled reports whether the broker cancelled the consumer: a
// consumer tag came on the NotifyCancel channel (which is closed, not
// written, when the channel closes).
func brokerCancelled(cancelled <-chan string) bool {
	select {
	case _, ok := <-cancelled:
		return ok
	default:
		return false
	}
}

// errSessionLost wraps the error that closed a channel or the connection of
// a session that was consuming: Run opens a new session, whatever the
// error (a channel error such as PRECONDITION_FAILED for an acknowledgement
// timeout included); only a refusal while it sets the session up, or a
// session killed with ErrTopologyMissing (see unroutable), ends Run.
var errSessionLost = errors.New("the consumer's channel or connection closed")

// errBrokerCancel is the error of a session whose consumer the broker
// cancelled.
var errBrokerCancel = errors.New("the broker cancelled the consumer (was the queue deleted?)")
