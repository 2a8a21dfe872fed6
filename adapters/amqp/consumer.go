package idemamqp

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/consumer"
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
				c.stats.acked.Add(1)
				if r.Duplicate {
					c.stats.duplicates.Add(1)
				}
			}
			break
		}
		out = c.settle(mctx, s, d, msg, r)
	}
	if excl && out != settledAbandoned {
		// The broker has processed the settlement (an ack, or a dead
		// letter's or retry copy's ack, or a requeue) before the held
		// deliveries start: one of them may kill the worker, and an ack
		// written but not yet processed when the connection drops is
		// lost. The returned delivery would then come back and be
		// dead-lettered (or retried) a second time.
		c.confirmAcks(s)
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
