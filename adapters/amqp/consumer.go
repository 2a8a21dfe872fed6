package idemamqp

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/backoff"
	"github.com/idemkit/idem/internal/telemetry"
)

// Consumer runs an idem handler chain (consumer.Handler, usually built with
// consumer.Chain, consumer.Dedup or consumer.Transactional) over the
// deliveries of one RabbitMQ queue, and acts on consumer.Process's Result
// with the ACK rule of idem's design:
//
//   - ActionAck (the effect committed, or the message is a completed
//     duplicate): the delivery is acknowledged.
//   - ActionRetry (a transient error, dedup.ErrInFlight, a lost lease, a
//     timeout): a copy is published, with publisher confirms, to a retry
//     queue whose messages expire after the delay and are dead-lettered by
//     the broker back to the work queue; then the delivery is acknowledged.
//     The copy carries the attempt in HeaderAttempt. Nothing is requeued
//     in a hot loop. After MaxAttempts failed attempts the message is
//     dead-lettered with reason retries_exhausted instead. A key owned
//     elsewhere (in_flight, lease_lost) is a wait, not a failed attempt:
//     the copy keeps its HeaderAttempt and counts the wait in HeaderWaits;
//     the waits are bounded in time by MaxWait (reason wait_limit).
//   - ActionDeadLetter (Permanent, a panic, a fingerprint mismatch, an
//     invalid key such as a message without id): a copy with
//     consumer.HeaderReason, HeaderAttempts and HeaderError, HeaderAttempt,
//     and a deterministic message id (see
//     the package documentation, "Dead letters"), is published to the
//     dead-letter exchange, confirmed, and then the delivery is
//     acknowledged.
//
// A delivery is never acknowledged before its copy is confirmed; if the
// copy cannot be published the delivery is nacked with requeue after a
// pause, so that it is neither lost nor spun.
//
// ACKs are coalesced per channel. The deliveries acknowledged on ActionAck
// are "finished" when their chain returns, and acknowledged together: a
// run of finished deliveries that starts at the channel's lowest unsettled
// delivery tag, with no delivery below its highest tag still in flight or
// waiting to be nacked, retried or dead-lettered, is acknowledged with one
// basic.ack, multiple=true, for that highest tag, as soon as the run is a
// quarter of Prefetch long or its oldest delivery finished 1ms before. A
// finished delivery behind one still in flight is never covered by a
// multiple ack: it waits for the gap to close, 20ms at most (1ms when half
// of Prefetch wait so, so a slow handler never stalls the prefetch
// window), and is then acknowledged on its own. Retried and dead-lettered
// deliveries (after their copy was confirmed) and requeued ones are
// settled on their own tag, and a settled tag no longer holds back the
// ones above it. Workers take deliveries in the broker's order, so no tag
// the broker sent is unknown when a multiple ack is decided. An ack that
// waits on a channel that closed is never sent, on it or on the next
// channel: the broker redelivers the message and the dedup store answers
// "duplicate". A graceful stop sends every waiting ack before it closes
// the connection. Coalescing changes neither the ACK rule nor the counts:
// Stats.Acked, the span, the metrics and OnOutcome of a delivery are
// recorded once its ack was written, or given up because its channel
// closed.
//
// Concurrency bounds the handlers running at once, not the deliveries in
// flight: with Concurrency above 1, InFlight workers (8 × Concurrency by
// default) take deliveries, and consumer.Dedup gives its handler slot to
// another delivery while it waits for the store's claim, Complete or
// Release. A store a round trip away (redisnx) then keeps the handlers
// busy instead of idle in the round trips. consumer.Transactional keeps its
// slot: its handler runs inside the store's transaction.
//
// Topology is declared on every connect, idempotently: the work queue (with
// QueueArgs and Bindings), one retry queue "<queue>.retry.<ms>ms" per
// distinct retry delay (x-message-ttl, dead-lettering to the default
// exchange with the work queue's name as routing key), the dead-letter
// exchange and queue ("<queue>.dlx" and "<queue>.dlq" by default). With
// ConsumerOptions.NoDeclare, nothing is declared: Run checks that what it
// needs exists, and that the retry queues bring their copies back, and
// fails at start if not (ErrTopologyMissing). Retry and dead-letter copies
// are published mandatory: one the broker returns because no queue took
// it is not acknowledged (see ConsumerOptions.NoDeclare). DeleteTopology
// deletes the topology.
//
// Reconnect: the connection and both channels (consuming, and publishing in
// confirm mode) are watched with NotifyClose; when one closes, the
// connection is closed and redialled (ConsumerOptions.Dial) with
// exponential backoff and jitter. On a connection the caller owns
// (NewConsumerConn) only the channels are closed and reopened; when that
// connection closes, Run returns ErrConnectionClosed.
// Each connection is a generation: a handler still running on a dead
// generation settles nothing (its delivery tag died with the channel and is
// never used on the new one); the broker redelivers the message, and the
// dedup store decides. So handlers of the old and the new generation may
// briefly overlap.
//
// The redelivered flag is exposed as consumer.Message.Redelivered and
// counted in Stats; nothing decides on it.
//
// Crash redeliveries (a message that kills the worker process, or whose
// channel closes, every time) are bounded only on quorum queues
// (ConsumerOptions.QuorumQueue): the broker counts them in x-delivery-count.
// A returned delivery runs with nothing else of the process unsettled (the
// consumer stops its flow first, and consumes with a window of one while
// returned deliveries come), so that a crash returns, and counts, only the
// message that caused it; a returned delivery past
// ConsumerOptions.MaxDeliveries is dead-lettered with reason
// redelivery_limit before the handler runs (see the package documentation,
// "A message that crashes the worker every time"). A classic queue keeps no
// such count, and there such a message is redelivered forever.
//
// Telemetry: each delivery has an OpenTelemetry consumer span, "process
// <queue>", whose parent is the trace context in the delivery's headers (the
// W3C traceparent the outbox stored at Enqueue time and the Publisher sent;
// retried and dead-lettered copies keep it), read through
// ConsumerOptions.Propagator and TableCarrier. The handler chain runs in the
// span's context, so consumer.Dedup's and consumer.Transactional's spans are
// its children. Each verdict is counted in idem.messages (idem.result ack,
// retry or dead_letter, idem.reason for dead letters) and timed in
// messaging.process.duration, with messaging.system "rabbitmq" and the queue
// as messaging.destination.name: never an id or a key.
type Consumer struct {
	// dial opens a connection: amqp091.DialConfig, ConsumerOptions.Dial,
	// or the caller's connection (NewConsumerConn, shared set).
	dial   func(ctx context.Context) (*amqp091.Connection, error)
	shared bool
	queue  string
	h      consumer.Handler
	opts   ConsumerOptions
	delays []time.Duration // distinct retry delays, ascending
	tel    *telemetry.Adapter

	running   atomic.Bool
	ready     chan struct{}
	readyOnce sync.Once
	gen       atomic.Uint64
	stats     consStats
	// consAckLinger and consAckDelay; tests change them.
	ackLinger, ackDelay time.Duration
	// workersStopped, when set (by tests), is called during a graceful
	// stop once the broker confirmed the cancel and the workers were told
	// to stop (a worker past that check with a free seat may still start
	// its delivery's handler).
	workersStopped func()
}

// ConsumerStats are counters since the Consumer was created.
type ConsumerStats struct {
	// Delivered counts deliveries handed to the handler chain; Redelivered
	// those among them with the broker's redelivered flag.
	Delivered, Redelivered int64
	// Acked counts deliveries acknowledged after success or as duplicates
	// (each delivery a coalesced ack covered counts, once its frame was
	// written); Duplicates those acknowledged as duplicates.
	Acked, Duplicates int64
	// Retried and DeadLettered count deliveries whose copy went to a retry
	// queue or the dead-letter exchange (and which were then acked).
	Retried, DeadLettered int64
	// Requeued counts deliveries given back to the queue: nacked with
	// requeue, or, for a returned delivery that could not run alone yet,
	// published again to the work queue (with its count of returns in
	// HeaderReturns) and acknowledged. Abandoned counts those left
	// unsettled because their channel closed.
	Requeued, Abandoned int64
	// Connects counts successful connections (1 plus the reconnects).
	Connects int64
}

type consStats struct {
	delivered, redelivered, acked, duplicates, retried, deadLettered, requeued, abandoned, connects atomic.Int64
}

// NewConsumer returns a Consumer of queue on the broker at url (amqp:// or
// amqps://) that runs h on each delivery. It does not connect: Run does,
// and it owns its connections: it redials one that fails and closes it
// when Run returns. With ConsumerOptions.Dial set, url is not used (it
// may be empty) and Dial opens the connections instead.
//
// Nor does it declare anything: Run declares the queues, and Ready is
// closed once Run consumes. A message published to queue before then may
// find no queue and be dropped, so start the producers (and report the
// worker ready) after Ready.
func NewConsumer(url, queue string, h consumer.Handler, opts ConsumerOptions) (*Consumer, error) {
	var dial func(context.Context) (*amqp091.Connection, error)
	if opts.Dial == nil {
		if _, err := amqp091.ParseURI(url); err != nil {
			return nil, fmt.Errorf("amqp: NewConsumer: %w (or set ConsumerOptions.Dial)", err)
		}
		cfg := dialConfig(opts.Config, opts.ConnectionName)
		dial = func(context.Context) (*amqp091.Connection, error) { return amqp091.DialConfig(url, cfg) }
	}
	return newConsumer("NewConsumer", dial, false, queue, h, opts)
}

// ErrConnectionClosed is returned by Run (wrapped) when the connection a
// Consumer was given by NewConsumerConn closed: the Consumer cannot redial
// a connection it does not own.
var ErrConnectionClosed = errors.New("amqp: the connection given to the consumer is closed")

// NewConsumerConn returns a Consumer of queue, like NewConsumer, that runs
// on conn, a connection the caller opened and owns (a service hands over
// the connection it already has). Run opens its two channels on conn
// (consuming, and publishing with confirms) and closes only them, never
// conn: the caller closes conn, after Run returned.
//
// When a channel of the Consumer closes while it consumes (a channel
// error, the broker cancelling the consumer) and conn stays open, Run opens
// new channels on conn, with the same backoff as a reconnect; a refusal
// while it sets them up (see Run) ends Run. When conn itself closes,
// Run returns an error wrapping ErrConnectionClosed: reconnecting is the
// owner's job; make a new Consumer on the new connection (the
// deliveries of the dead one come back from the broker, and the dedup
// store decides). ConsumerOptions.Dial, Config and ConnectionName do not
// apply.
func NewConsumerConn(conn *amqp091.Connection, queue string, h consumer.Handler, opts ConsumerOptions) (*Consumer, error) {
	if conn == nil {
		return nil, errors.New("amqp: NewConsumerConn: conn is nil")
	}
	if opts.Dial != nil {
		return nil, errors.New("amqp: NewConsumerConn: ConsumerOptions.Dial is set; use NewConsumer for a Consumer that dials")
	}
	dial := func(context.Context) (*amqp091.Connection, error) {
		if conn.IsClosed() {
			return nil, ErrConnectionClosed
		}
		return conn, nil
	}
	return newConsumer("NewConsumerConn", dial, true, queue, h, opts)
}

func newConsumer(name string, dial func(context.Context) (*amqp091.Connection, error), shared bool, queue string, h consumer.Handler, opts ConsumerOptions) (*Consumer, error) {
	if queue == "" {
		return nil, fmt.Errorf("amqp: %s: queue is required (server-named queues would change on every reconnect)", name)
	}
	if h == nil {
		return nil, fmt.Errorf("amqp: %s: handler is nil", name)
	}
	if err := opts.consSetDefaults(queue); err != nil {
		return nil, err
	}
	if dial == nil {
		dial = opts.Dial
	}
	delays := opts.retryDelays()
	return &Consumer{dial: dial, shared: shared, queue: queue, h: h, opts: opts, delays: delays, ready: make(chan struct{}),
		tel: telemetry.NewAdapter(opts.MeterProvider, opts.TracerProvider, system), ackLinger: consAckLinger, ackDelay: consAckDelay}, nil
}

// Ready is closed once the Consumer first consumes: its topology is
// declared (or, with ConsumerOptions.NoDeclare, checked), so messages
// published to the work queue from then on are routed. It is never closed
// if Run returns before consuming (the broker refused the topology or the
// credentials): wait for Run's return too.
func (c *Consumer) Ready() <-chan struct{} { return c.ready }

// Stats returns the counters.
func (c *Consumer) Stats() ConsumerStats {
	s := &c.stats
	return ConsumerStats{
		Delivered: s.delivered.Load(), Redelivered: s.redelivered.Load(),
		Acked: s.acked.Load(), Duplicates: s.duplicates.Load(),
		Retried: s.retried.Load(), DeadLettered: s.deadLettered.Load(),
		Requeued: s.requeued.Load(), Abandoned: s.abandoned.Load(),
		Connects: s.connects.Load(),
	}
}

type consDeliveryKey struct{}

// consDelivery is what a worker needs for one delivery besides its
// consumer.Message, in one allocation: the delivery, the context that
// carries it (DeliveryFrom), its handler seat and, once its chain
// acknowledged it, what the acker reports.
type consDelivery struct {
	d    amqp091.Delivery
	ctx  consDeliveryCtx
	st   seat
	done consDone
}

// consDeliveryCtx is context.WithValue(parent, consDeliveryKey{}, d),
// embedded in consDelivery instead of allocated.
type consDeliveryCtx struct {
	context.Context
	d *amqp091.Delivery
}

func (c *consDeliveryCtx) Value(key any) any {
	if _, ok := key.(consDeliveryKey); ok {
		return c.d
	}
	return c.Context.Value(key)
}

// DeliveryFrom returns the raw delivery of the message being handled, for
// handlers that need AMQP properties idem does not map (x-death, reply-to).
// The Consumer settles every delivery itself, by the ACK rule, possibly in
// one multiple ack with its neighbours: a handler does not acknowledge,
// nack or reject it. If it tries, the call does nothing on the channel and
// returns an error wrapping ErrSettledByHandler, and the Consumer settles
// the delivery as its chain's verdict says.
func DeliveryFrom(ctx context.Context) (*amqp091.Delivery, bool) {
	d, ok := ctx.Value(consDeliveryKey{}).(*amqp091.Delivery)
	return d, ok
}

// ErrSettledByHandler is returned (wrapped) by Ack, Nack and Reject of a
// delivery a Consumer handed to a handler (DeliveryFrom): only the
// Consumer settles its deliveries.
var ErrSettledByHandler = errors.New("amqp: the Consumer settles its deliveries; a handler must not ack, nack or reject them")

// consGuard is the Acknowledger of a delivery while the Consumer's chain
// runs on it: it refuses the handler's settlements (see DeliveryFrom).
// The Consumer settles on the channel itself.
type consGuard struct{ ch amqp091.Acknowledger }

func (consGuard) Ack(tag uint64, _ bool) error {
	return fmt.Errorf("ack of delivery %d: %w", tag, ErrSettledByHandler)
}

func (consGuard) Nack(tag uint64, _, _ bool) error {
	return fmt.Errorf("nack of delivery %d: %w", tag, ErrSettledByHandler)
}

func (consGuard) Reject(tag uint64, _ bool) error {
	return fmt.Errorf("reject of delivery %d: %w", tag, ErrSettledByHandler)
}

// Run connects, declares the topology, consumes and reconnects until ctx
// ends, then stops gracefully: it cancels the consumer, nacks with requeue
// the prefetched deliveries no handler started (and puts back, uncounted,
// the returned ones waiting to run alone), lets the running handlers
// finish (their context is cancelled ShutdownTimeout after ctx ended),
// settles them, sends the acknowledgements still being coalesced, closes
// the connection and returns nil.
//
// Run returns an error at once when the broker refuses the topology or the
// credentials while it sets a session up (PRECONDITION_FAILED,
// ACCESS_REFUSED, NOT_FOUND: a configuration mistake that redialling would
// not fix). A channel error while it consumes (a delivery acknowledgement
// timeout, say) makes it reconnect. Under NoDeclare, a retry or
// dead-letter copy the broker returns unroutable while it consumes ends
// Run with an error wrapping ErrTopologyMissing. A Consumer runs once.
func (c *Consumer) Run(ctx context.Context) error {
	if !c.running.CompareAndSwap(false, true) {
		return errors.New("amqp: Consumer.Run called twice")
	}
	// Handlers run under hctx: it outlives ctx by ShutdownTimeout, so that
	// a graceful stop lets them finish and be acknowledged.
	hctx, hcancel := context.WithCancel(context.WithoutCancel(ctx))
	defer hcancel()
	var (
		tmu   sync.Mutex
		timer *time.Timer
	)
	stopAfter := context.AfterFunc(ctx, func() {
		tmu.Lock()
		timer = time.AfterFunc(c.opts.ShutdownTimeout, hcancel)
		tmu.Unlock()
	})
	defer func() {
		stopAfter()
		tmu.Lock()
		if timer != nil {
			timer.Stop()
		}
		tmu.Unlock()
	}()

	var wg sync.WaitGroup // every worker and watcher of every generation
	defer wg.Wait()
	fails := 0 // failed connects in a row
	for ctx.Err() == nil {
		s, err := c.connect(ctx, &wg)
		if err != nil {
			if consFatal(err) || errors.Is(err, ErrConnectionClosed) {
				return fmt.Errorf("amqp: consumer of %q: %w", c.queue, err)
			}
			fails++
			delay := c.opts.ReconnectBackoff.Delay(fails)
			msg := "amqp: consumer cannot connect; retrying"
			if c.shared {
				msg = "amqp: consumer cannot open its channels on the given connection; retrying"
			}
			c.opts.Logger.Warn(msg, "queue", c.queue, "in", delay, "err", err)
			backoff.Sleep(ctx, backoff.Spread(delay))
			continue
		}
		fails = 0
		if err := c.serve(ctx, hctx, s, &wg); err != nil {
			// A lost channel reconnects, whatever the broker said; a
			// topology found missing under NoDeclare (a copy the broker
			// returned) ends Run, however it reached the session.
			if errors.Is(err, ErrTopologyMissing) || (consFatal(err) && !errors.Is(err, errSessionLost)) {
				return fmt.Errorf("amqp: consumer of %q: %w", c.queue, err)
			}
			c.opts.Logger.Warn("amqp: consumer lost its channel; reconnecting", "queue", c.queue, "err", err)
			backoff.Sleep(ctx, backoff.Spread(c.opts.ReconnectBackoff.Initial))
		}
	}
	return nil
}

// consFatal reports whether err is a broker refusal that redialling will
// not fix.
func consFatal(err error) bool {
	if errors.Is(err, ErrTopologyMissing) {
		return true
	}
	var ae *amqp091.Error
	if !errors.As(err, &ae) {
		return false
	}
	switch ae.Code {
	case amqp091.PreconditionFailed, amqp091.AccessRefused, amqp091.NotFound:
		return true
	}
	return false
}

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

// handle runs the chain on one delivery and settles it on its own
// generation: a delivery the chain acknowledges (ActionAck) goes to the
// session's acker, which coalesces its ack with others (see consAcker) and
// reports it once the ack is written; every other delivery is settled
// here, on its own tag, and reported at once. The chain runs in the
// delivery's consumer span (see ConsumerOptions.TracerProvider), which ends
// with the verdict.
//
// A delivery that runs alone (excl, see runAlone) is the only one of its
// channel not settled: before its chain runs, the acks of the deliveries
// finished before it are written and their receipt confirmed; its own ack
// is written at once, not coalesced, and confirmed too.
func (c *Consumer) handle(ctx, hctx context.Context, s *consSession, a *consAcker, seats *gate, cd *consDelivery, excl bool) {
	d := &cd.d
	// A delivery that runs alone needs no seat: no other chain of the
	// session runs meanwhile.
	var st *seat
	if seats != nil && !excl && ctx.Err() == nil {
		st = &cd.st
		if seats.take(ctx, st) == nil {
			defer st.leave()
		}
	}
	if !excl && ctx.Err() != nil {
		// Prefetched but not started before the stop: give it back.
		out := c.requeue(s, d)
		a.settled(d.DeliveryTag, out == settledAbandoned)
		return
	}
	start := time.Now()
	msg, merr := c.message(d, s.gen)
	c.stats.delivered.Add(1)
	if d.Redelivered {
		c.stats.redelivered.Add(1)
	}
	// mctx only adds the delivery to hctx's values: it is cancelled with
	// hctx.
	cd.ctx = consDeliveryCtx{Context: hctx, d: d}
	var mctx context.Context = &cd.ctx
	if st != nil {
		msg.Slot = st
	}
	mctx, end := c.tel.StartConsumer(mctx, c.opts.Propagator, (*TableCarrier)(&d.Headers), c.queue)
	var (
		r   consumer.Result
		out settlement
	)
	switch n, over := c.overDelivered(d); {
	case over:
		// Returned MaxDeliveries times or more. A returned delivery
		// runs with nothing else of the process unsettled (see take), so
		// the returns counted after its first one are, but for the few
		// cases the package documentation lists, deaths of workers that
		// ran it. Running the handler again would only kill another
		// worker.
		r = consumer.Result{Action: consumer.ActionDeadLetter, Reason: ReasonRedeliveryLimit,
			Err: fmt.Errorf("delivered %d times without being settled (MaxDeliveries %d)", n+1, c.opts.MaxDeliveries)}
		out = c.deadLetter(mctx, s, d, msg, r.Reason, r.Err)
	case merr != nil:
		r = consumer.Result{Action: consumer.ActionDeadLetter, Reason: consumer.OutcomeInvalidKey, Err: merr}
		out = c.deadLetter(mctx, s, d, msg, r.Reason, r.Err)
	default:
		if excl {
			a.flushAll(false)
			c.confirmAcks(s)
		}
		r = consumer.Process(mctx, c.h, msg)
		if r.Action == consumer.ActionAck {
			if !excl {
				cd.done = consDone{tag: d.DeliveryTag, at: time.Now(), start: start, ctx: mctx, msg: msg, r: r, end: end}
				a.finished(&cd.done)
				return
			}
			if out = c.ack(s, d); out == settledAcked {
				c.confirmAcks(s)
				c.stats.acked.Add(1)
				if r.Duplicate {
					c.stats.duplicates.Add(1)
				}
			}
			break
		}
		out = c.settle(mctx, s, d, msg, r)
	}
	a.settled(d.DeliveryTag, out == settledAbandoned)
	c.report(mctx, msg, r, out, start, end)
}

// alone reports whether d must run alone: it carries an x-delivery-count
// (a quorum queue returned it unsettled before: a worker died or its
// channel closed while it was delivered, or it was requeued), or it is a
// copy that carries such a count in HeaderReturns (see take).
func (c *Consumer) alone(d *amqp091.Delivery) bool {
	return c.opts.MaxDeliveries >= 0 && consReturns(d) > 0
}

// take acts on a delivery a worker of round a received. A delivery that
// must run alone (see alone) may be the message that kills workers, and a
// worker it kills returns every delivery not settled in the process, each
// counted in x-delivery-count as if it had killed the worker too. So it
// runs with no other delivery of the process unsettled:
//
//   - in a round with the window of Prefetch, the first such delivery is
//     chosen. The deliveries received after it are held, not started, until
//     every other one is settled and the window is full (or no delivery
//     came for consQuietFlow); then the consumer is cancelled (with the window
//     full the broker has no delivery of it in flight that the cancel
//     could lose). Then the held deliveries run, those that must run alone
//     among them are put back (see putBack), the chosen one runs alone
//     (runAlone), and the next round consumes with a window of one.
//   - in a round with a window of one (careful), each delivery is alone by
//     construction. The first one that need not run alone ends the round:
//     with the window full, the consumer is cancelled, the delivery runs,
//     and the next round consumes with the window of Prefetch again.
//
// So a message returned once is counted again only for a death while it
// ran alone, or while it waited for the flow to stop behind deliveries
// whose worker died running a message for the first time, or when a stop
// or a failed publish gave it back.
func (c *Consumer) take(wctx, hctx context.Context, s *consSession, a *consAcker, seats *gate, cd *consDelivery, workers *sync.WaitGroup) {
	d := &cd.d
	switch alone := c.alone(d); {
	case a.careful && alone:
		c.handle(wctx, hctx, s, a, nil, cd, true)
	case a.careful:
		a.ending.Store(true)
		c.stopFlow(s, a)
		c.handle(wctx, hctx, s, a, seats, cd, false)
	case a.chosen.Load() != nil:
		a.hold(cd)
	case alone && wctx.Err() == nil && a.chosen.CompareAndSwap(nil, cd):
		workers.Go(func() { c.stopFlowWhenStill(wctx, s, a) })
	case alone:
		// The consumer stops: give it back without counting a return.
		out := c.putBack(hctx, s, d)
		a.settled(d.DeliveryTag, out == settledAbandoned)
	default:
		c.handle(wctx, hctx, s, a, seats, cd, false)
	}
}

// consQuietFlow is how long a round waits for a delivery to fill its window
// before it stops its flow with the window not full (see take).
const consQuietFlow = 100 * time.Millisecond

// stopFlowWhenStill cancels round a's consumer once every unsettled
// delivery of the round is the chosen one or held, and the window is full
// or no delivery came for consQuietFlow.
func (c *Consumer) stopFlowWhenStill(wctx context.Context, s *consSession, a *consAcker) {
	t := time.NewTicker(consQuietFlow / 50)
	defer t.Stop()
	seen, since := a.arrivals.Load(), time.Now()
	for {
		if n := a.arrivals.Load(); n != seen {
			seen, since = n, time.Now()
		}
		if still, n := a.still(); still && (n >= int(s.prefetch.Load()) || time.Since(since) >= consQuietFlow) {
			break
		}
		select {
		case <-t.C:
		case <-s.dead:
			return
		case <-wctx.Done():
			// The stop cancels the consumer.
			return
		}
	}
	c.stopFlow(s, a)
}

// stopFlow cancels round a's consumer: its deliveries end, and the round
// with them.
func (c *Consumer) stopFlow(s *consSession, a *consAcker) {
	a.stopFlow.Do(func() {
		s.rpc.Lock()
		err := s.ch.Cancel(a.tag, false)
		s.rpc.Unlock()
		if err != nil {
			s.kill(err)
		}
	})
}

// finishRound runs, once round a's deliveries ended and its workers
// stopped taking them, the deliveries held behind the chosen one (those
// that must run alone are put back), then the chosen one alone.
func (c *Consumer) finishRound(wctx, hctx context.Context, s *consSession, a *consAcker, seats *gate) {
	cd := a.chosen.Load()
	if cd == nil {
		return
	}
	a.mu.Lock()
	held := a.held
	a.held = nil
	a.mu.Unlock()
	var running sync.WaitGroup
	slots := make(chan struct{}, c.opts.Concurrency)
	for _, h := range held {
		if c.alone(&h.d) {
			out := c.putBack(hctx, s, &h.d)
			a.settled(h.d.DeliveryTag, out == settledAbandoned)
			continue
		}
		slots <- struct{}{}
		running.Go(func() {
			defer func() { <-slots }()
			c.handle(wctx, hctx, s, a, seats, h, false)
		})
	}
	running.Wait()
	c.runAlone(wctx, hctx, s, a, cd)
}

// runAlone runs the round's chosen delivery (see take), once every other
// delivery of the round was settled: no other one is in flight, and the
// flow stopped. A graceful stop that came first puts it back instead, and
// a dead session leaves it to the broker.
func (c *Consumer) runAlone(wctx, hctx context.Context, s *consSession, a *consAcker, cd *consDelivery) {
	switch {
	case s.isDead():
		c.abandon()
		a.settled(cd.d.DeliveryTag, true)
	case wctx.Err() != nil:
		out := c.putBack(hctx, s, &cd.d)
		a.settled(cd.d.DeliveryTag, out == settledAbandoned)
	default:
		c.handle(wctx, hctx, s, a, nil, cd, true)
	}
}

// putBack gives a returned delivery that did not run back to the work
// queue without one more count in x-delivery-count: a copy, with the
// count carried in HeaderReturns, is published to the work queue (through
// the default exchange) and confirmed, then the delivery is acknowledged.
// It counts as requeued. A copy that cannot be published is requeued
// after a pause (see publishFailed).
func (c *Consumer) putBack(hctx context.Context, s *consSession, d *amqp091.Delivery) settlement {
	if s.isDead() {
		return c.abandon()
	}
	attempt := 1
	if n, ok := consHeaderInt(d.Headers[HeaderAttempt]); ok && n > 1 {
		attempt = int(min(n, 1<<30))
	}
	p := c.copyOf(d, attempt)
	if n := consReturns(d); n > 0 {
		p.Headers[HeaderReturns] = n
	}
	// Nothing ran: a wait for a held key goes on from where it was.
	if v, ok := d.Headers[HeaderWaitingSince]; ok {
		p.Headers[HeaderWaitingSince] = v
	}
	if err := c.publishCopy(s, "", c.queue, p); err != nil {
		return c.publishFailed(hctx, s, d, "work queue", err)
	}
	out := c.ack(s, d)
	if out == settledAcked {
		c.stats.requeued.Add(1)
		return settledRequeued
	}
	return out
}

// confirmAcks waits until the broker processed every frame written on s's
// consuming channel so far, acks included: a synchronous method (basic.qos
// with the channel's settings, which changes nothing) is answered only
// after the frames before it. A worker that dies after confirmAcks
// returned leaves those deliveries settled.
func (c *Consumer) confirmAcks(s *consSession) {
	s.rpc.Lock()
	defer s.rpc.Unlock()
	if !s.isDead() {
		_ = s.ch.Qos(int(s.prefetch.Load()), 0, false)
	}
}

// settlement is what the Consumer did with a delivery.
type settlement int8

const (
	// settledAcked: acknowledged (success, a completed duplicate, or a
	// dead letter a consumer.DeadLetter middleware parked); the ack,
	// possibly coalesced with others, was written.
	settledAcked settlement = iota + 1
	// settledRetried: a copy went to a retry queue, then the delivery was
	// acknowledged.
	settledRetried
	// settledDeadLettered: a copy went to the dead-letter exchange, then
	// the delivery was acknowledged.
	settledDeadLettered
	// settledRequeued: nacked with requeue, because a copy could not be
	// published or the consumer is stopping.
	settledRequeued
	// settledAbandoned: the delivery's channel closed before it could be
	// settled (or while its ack was being coalesced); the broker
	// redelivers it.
	settledAbandoned
	// settledUnpublished: nacked with requeue because its retry or
	// dead-letter copy was not confirmed.
	settledUnpublished
)

// errUnpublished is the Report.Err of a delivery requeued because its
// retry or dead-letter copy was not confirmed.
var errUnpublished = errors.New("amqp: the delivery's retry or dead-letter copy was not confirmed; the delivery was requeued")

// errAbandoned is the Report.Err of a delivery whose channel closed before
// it was settled.
var errAbandoned = fmt.Errorf("amqp: the delivery's channel closed before it was settled; the broker redelivers it: %w", amqp091.ErrClosed)

// reportDone counts and reports a delivery the acker acknowledged
// (settledAcked) or abandoned.
func (c *Consumer) reportDone(p *consDone, out settlement) {
	if out == settledAcked {
		c.stats.acked.Add(1)
		if p.r.Duplicate {
			c.stats.duplicates.Add(1)
		}
	} else {
		c.abandon()
	}
	c.report(p.ctx, p.msg, p.r, out, p.start, p.end)
}

// report records a settled delivery's verdict (metrics, its span) and
// calls OnOutcome.
func (c *Consumer) report(mctx context.Context, msg *consumer.Message, r consumer.Result, out settlement, start time.Time, end func(string, error)) {
	v := applied(r, out)
	result, reason := verdictOf(v)
	c.tel.Result(mctx, c.queue, result, reason, time.Since(start))
	end(result, v.Err)
	if c.opts.OnOutcome != nil {
		err := v.Err
		if out == settledAbandoned {
			err = errAbandoned
		}
		c.opts.OnOutcome(mctx, consumer.Report{Outcome: v.Outcome(), Message: msg, Result: v, Err: err})
	}
}

// system is the messaging.system attribute of the Consumer's metrics and
// spans.
const system = "rabbitmq"

// applied is the verdict the Consumer carried out on a delivery whose chain
// returned r and that it settled with out: r itself when it was
// acknowledged or dead-lettered as r said; a dead letter with reason
// wait_limit or retries_exhausted for a retry the Consumer dead-lettered
// instead; a retry for every delivery that comes back (a retry copy, a
// requeue, an abandoned delivery), with r's reason and error.
func applied(r consumer.Result, out settlement) consumer.Result {
	switch out {
	case settledAcked:
		return r
	case settledUnpublished:
		// Not the verdict r asked for (a dead letter, maybe): the copy
		// that carries it out was not confirmed, and the message comes
		// back.
		return consumer.Result{Action: consumer.ActionRetry, Reason: consumer.OutcomeTransient, Err: errUnpublished}
	case settledDeadLettered:
		if r.Action == consumer.ActionRetry {
			reason := consumer.OutcomeRetriesExhausted
			if consOwned(r) {
				reason = ReasonWaitLimit
			}
			return consumer.Result{Action: consumer.ActionDeadLetter, Reason: reason, Err: r.Err}
		}
		return r
	}
	return consumer.Result{Action: consumer.ActionRetry, Reason: r.Reason, Err: r.Err, RetryAfter: r.RetryAfter}
}

// verdictOf is the idem.result and idem.reason of a verdict the Consumer
// carried out (see applied): ack, retry, or dead_letter with the reason
// the copy carries (or the consumer.DeadLetter middleware gave).
func verdictOf(v consumer.Result) (result, reason string) {
	switch {
	case v.DeadLettered, v.Action == consumer.ActionDeadLetter:
		return "dead_letter", string(v.Reason)
	case v.Action == consumer.ActionAck:
		return "ack", ""
	}
	return "retry", ""
}

// overDelivered reports whether d is past MaxDeliveries, with its
// x-delivery-count.
func (c *Consumer) overDelivered(d *amqp091.Delivery) (int64, bool) {
	if c.opts.MaxDeliveries < 0 {
		return 0, false
	}
	n := consReturns(d)
	return n, n > 0 && n >= int64(c.opts.MaxDeliveries)
}

// consReturns is how many deliveries of d's message were returned
// unsettled: its x-delivery-count, plus those of the earlier copies that
// waited for a held key (HeaderReturns).
func consReturns(d *amqp091.Delivery) int64 {
	n, _ := consHeaderInt(d.Headers[HeaderDeliveryCount])
	carried, _ := consHeaderInt(d.Headers[HeaderReturns])
	return max(n, 0) + max(carried, 0)
}

// settle settles a delivery whose chain did not return ActionAck (those go
// to the acker) on its own tag: a dead-letter or retry copy then an ack, or
// a nack with requeue.
func (c *Consumer) settle(hctx context.Context, s *consSession, d *amqp091.Delivery, msg *consumer.Message, r consumer.Result) settlement {
	if r.Action == consumer.ActionDeadLetter {
		return c.deadLetter(hctx, s, d, msg, r.Reason, r.Err)
	}
	// ActionRetry, and anything unknown.
	if hctx.Err() != nil || errors.Is(r.Err, errStopped) {
		// The shutdown timeout cut the handler short, or the stop came
		// before the handler started: not the message's fault, so no
		// attempt is spent; the broker redelivers it.
		return c.requeue(s, d)
	}
	var p amqp091.Publishing
	var delay time.Duration
	if consOwned(r) {
		// Another owner holds the key: the handler did not fail, so no
		// attempt is spent; the waits are bounded on their own.
		now := time.Now()
		waits, _ := consHeaderInt(d.Headers[HeaderWaits])
		since, ok := consHeaderInt(d.Headers[HeaderWaitingSince])
		if !ok || waits <= 0 {
			since = now.UnixMilli()
		}
		if waited := now.Sub(time.UnixMilli(since)); c.opts.MaxWait > 0 && waited > c.opts.MaxWait {
			return c.deadLetter(hctx, s, d, msg, ReasonWaitLimit,
				fmt.Errorf("the key was held by another owner for %v, on %d deliveries (MaxWait %v): %w",
					waited.Round(time.Millisecond), waits+1, c.opts.MaxWait, r.Err))
		}
		waits = min(max(waits, 0)+1, 1<<30)
		delay = c.retryDelay(int(waits), r.RetryAfter)
		p = c.copyOf(d, msg.Attempt)
		p.Headers[HeaderWaits] = int32(waits)
		p.Headers[HeaderWaitingSince] = since
		// A worker that died holding the key (its lease runs until it
		// expires) is what this copy may be waiting for: it keeps the
		// count of such deaths, or a message that kills every worker
		// would start from zero after each wait and never reach
		// MaxDeliveries.
		if n := consReturns(d); n > 0 {
			p.Headers[HeaderReturns] = n
		}
	} else {
		if msg.Attempt >= c.opts.MaxAttempts {
			err := r.Err
			if err == nil {
				err = errors.New("retry requested")
			}
			return c.deadLetter(hctx, s, d, msg, consumer.OutcomeRetriesExhausted,
				&consumer.RetriesExhaustedError{Attempts: msg.Attempt, Err: err})
		}
		delay = c.retryDelay(msg.Attempt, r.RetryAfter)
		p = c.copyOf(d, msg.Attempt+1)
	}
	p.Expiration = strconv.FormatInt(delay.Milliseconds(), 10)
	if r.Err != nil {
		p.Headers[consumer.HeaderError] = consTruncate(r.Err.Error())
	}
	if s.isDead() {
		return c.abandon()
	}
	if err := c.publishCopy(s, "", consRetryQueue(c.queue, delay), p); err != nil {
		return c.publishFailed(hctx, s, d, "retry queue", err)
	}
	out := c.ack(s, d)
	if out == settledAcked {
		c.stats.retried.Add(1)
		return settledRetried
	}
	return out
}

// consOwned reports whether r retries a message because another owner
// holds its key (in_flight, lease_lost): a wait, not a failure.
func consOwned(r consumer.Result) bool {
	return r.Reason == consumer.OutcomeInFlight || r.Reason == consumer.OutcomeLeaseLost
}

// retryDelay is the delay before the attempt after attempt: the Backoff's
// one, or the shortest of its delays that covers the hint (the longest
// when none does).
func (c *Consumer) retryDelay(attempt int, hint time.Duration) time.Duration {
	ds := c.delays
	d := ds[min(max(attempt, 1), len(ds))-1]
	if hint > d {
		d = c.delays[len(c.delays)-1]
		for _, x := range c.delays {
			if x >= hint {
				d = x
				break
			}
		}
	}
	return d
}

func (c *Consumer) deadLetter(hctx context.Context, s *consSession, d *amqp091.Delivery, msg *consumer.Message, reason consumer.Outcome, cause error) settlement {
	p := c.copyOf(d, msg.Attempt)
	p.MessageId = c.deadLetterID(d, msg)
	p.Headers[consumer.HeaderID] = p.MessageId
	p.Headers[consumer.HeaderReason] = string(reason)
	attempts := msg.Attempt
	if exhausted := (*consumer.RetriesExhaustedError)(nil); errors.As(cause, &exhausted) {
		attempts = max(attempts, exhausted.Attempts)
	}
	p.Headers[consumer.HeaderAttempts] = int32(min(attempts, 1<<30))
	if cause != nil {
		p.Headers[consumer.HeaderError] = consTruncate(cause.Error())
	}
	if s.isDead() {
		return c.abandon()
	}
	if err := c.publishCopy(s, c.opts.DeadLetterExchange, c.queue, p); err != nil {
		return c.publishFailed(hctx, s, d, "dead-letter exchange", err)
	}
	c.opts.Logger.LogAttrs(hctx, slog.LevelWarn, "amqp: message dead-lettered", slog.String("queue", c.queue),
		slog.String("message_id_hash", dedup.HashKey("", msg.ID)), slog.String("reason", string(reason)),
		slog.Int("attempt", msg.Attempt), slog.Any("err", cause))
	out := c.ack(s, d)
	if out == settledAcked {
		c.stats.deadLettered.Add(1)
		return settledDeadLettered
	}
	return out
}

// deadLetterID is the message id of d's dead letter, the same for every
// delivery of the same message: d's message-id; else the id it was
// handled under (from IDHeader); else "idem-dl-" and a digest of the work
// queue and of what the producer sent (exchange, routing key, properties,
// headers but the broker's delivery count, body).
func (c *Consumer) deadLetterID(d *amqp091.Delivery, msg *consumer.Message) string {
	if d.MessageId != "" {
		return d.MessageId
	}
	if msg.ID != "" && len(msg.ID) <= 255 {
		return msg.ID
	}
	h := sha256.New()
	headers := make(amqp091.Table, len(d.Headers))
	for k, v := range d.Headers {
		if k != HeaderDeliveryCount {
			headers[k] = v
		}
	}
	// fmt prints maps sorted by key: the same table, the same text.
	_, _ = fmt.Fprintf(h, "%q\x00%q\x00%q\x00%q %q %q %q %q %q %q %d %d\x00%v\x00", c.queue,
		msg.Metadata["exchange"], msg.Metadata["routing_key"],
		d.ContentType, d.ContentEncoding, d.CorrelationId, d.ReplyTo, d.Type, d.AppId, d.UserId,
		d.Priority, d.Timestamp.UnixNano(), headers)
	h.Write(d.Body)
	return "idem-dl-" + hex.EncodeToString(h.Sum(nil)[:16])
}

// publishFailed handles a copy that was not confirmed: the delivery goes
// back to the queue, after a pause so a broken publish path is not spun.
func (c *Consumer) publishFailed(hctx context.Context, s *consSession, d *amqp091.Delivery, where string, err error) settlement {
	if s.isDead() {
		return c.abandon()
	}
	c.opts.Logger.WarnContext(hctx, "amqp: publishing a copy failed; requeueing the delivery", "queue", c.queue, "to", where, "err", err)
	t := time.NewTimer(backoff.Spread(time.Second))
	defer t.Stop()
	select {
	case <-t.C:
	case <-s.dead:
	case <-hctx.Done():
	}
	if out := c.requeue(s, d); out != settledRequeued {
		return out
	}
	return settledUnpublished
}

// publishCopy publishes p, mandatory, on s's confirm channel and waits for
// the broker's confirm; a copy the broker returned is an error (see
// returnWatch).
func (c *Consumer) publishCopy(s *consSession, exchange, key string, p amqp091.Publishing) error {
	ctx, cancel := context.WithTimeout(context.Background(), c.opts.PublishTimeout)
	defer cancel()
	returned := s.returns.count(exchange, key)
	dc, err := s.pub.PublishWithDeferredConfirmWithContext(ctx, exchange, key, true, false, p)
	if err != nil {
		return err
	}
	if dc == nil {
		return errors.New("the channel is not in confirm mode")
	}
	acked, err := dc.WaitContext(ctx)
	if err != nil {
		return err
	}
	if !acked {
		return ErrUnconfirmed
	}
	if s.returns.count(exchange, key) != returned {
		return c.unroutable(s, exchange, key)
	}
	return nil
}

// copyOf is the publishing that carries d to a retry queue or the
// dead-letter exchange: same body, id and properties, headers kept, the
// attempt and origin set.
func (c *Consumer) copyOf(d *amqp091.Delivery, attempt int) amqp091.Publishing {
	h := make(amqp091.Table, len(d.Headers)+6)
	for k, v := range d.Headers {
		h[k] = v
	}
	// The count is the work queue's, of this delivery; a copy is a new
	// message there (and a replayed dead letter must not come back
	// poisoned).
	delete(h, HeaderDeliveryCount)
	delete(h, HeaderReturns)
	// A wait for a held key starts its clock afresh after a handler ran:
	// only wait copies carry its start (set by settle). HeaderWaits goes
	// on counting every wait of the message.
	delete(h, HeaderWaitingSince)
	h[HeaderAttempt] = int32(min(attempt, 1<<30))
	h[consumer.HeaderSource] = c.queue
	if _, ok := h[HeaderExchange]; !ok {
		h[HeaderExchange] = d.Exchange
		h[HeaderRoutingKey] = d.RoutingKey
	}
	mode := amqp091.Persistent
	if c.opts.NotDurable {
		mode = amqp091.Transient
	}
	return amqp091.Publishing{
		Headers:         h,
		ContentType:     d.ContentType,
		ContentEncoding: d.ContentEncoding,
		DeliveryMode:    mode,
		Priority:        d.Priority,
		CorrelationId:   d.CorrelationId,
		ReplyTo:         d.ReplyTo,
		MessageId:       d.MessageId,
		Timestamp:       d.Timestamp,
		Type:            d.Type,
		AppId:           d.AppId,
		Body:            d.Body,
	}
}

func (c *Consumer) ack(s *consSession, d *amqp091.Delivery) settlement {
	// The tag belongs to s's channel: on a dead
	// generation it must not, and cannot, be used.
	if s.isDead() {
		return c.abandon()
	}
	if err := s.ch.Ack(d.DeliveryTag, false); err != nil {
		return c.abandon()
	}
	return settledAcked
}

func (c *Consumer) requeue(s *consSession, d *amqp091.Delivery) settlement {
	if s.isDead() {
		return c.abandon()
	}
	if err := s.ch.Nack(d.DeliveryTag, false, true); err != nil {
		return c.abandon()
	}
	c.stats.requeued.Add(1)
	return settledRequeued
}

func (c *Consumer) abandon() settlement {
	c.stats.abandoned.Add(1)
	return settledAbandoned
}

// message maps a delivery to a consumer.Message (see NewMessage), with the
// connection generation in its Metadata; err is NewMessage's.
func (c *Consumer) message(d *amqp091.Delivery, gen uint64) (*consumer.Message, error) {
	msg, err := NewMessage(d, MessageOptions{IDHeader: c.opts.IDHeader, Queue: c.queue})
	msg.Metadata["channel_generation"] = strconv.FormatUint(gen, 10)
	return msg, err
}

func consHeaderString(v any) (string, bool) {
	switch x := v.(type) {
	case string:
		return x, true
	case []byte:
		return string(x), true
	}
	return "", false
}

func consHeaderInt(v any) (int64, bool) {
	switch x := v.(type) {
	case int8:
		return int64(x), true
	case int16:
		return int64(x), true
	case int32:
		return int64(x), true
	case int64:
		return x, true
	case int:
		return int64(x), true
	case uint8:
		return int64(x), true
	case uint16:
		return int64(x), true
	case uint32:
		return int64(x), true
	}
	return 0, false
}

func consTruncate(s string) string {
	const limit = 1024
	if len(s) <= limit {
		return s
	}
	return s[:limit] + "..."
}
