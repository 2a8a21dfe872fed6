package idemnats

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/backoff"
	"github.com/idemkit/idem/internal/telemetry"
)

// system is the messaging.system attribute of the Consumer's metrics and
// spans.
const system = "nats"

// Consumer runs an idem handler chain (consumer.Handler, usually built with
// consumer.Chain, consumer.Dedup or consumer.Transactional) over the
// messages of a durable JetStream pull consumer, and settles each delivery
// by idem's ACK rule:
//
//   - ActionAck (the effect committed, or the message is a completed
//     duplicate): acknowledged with AckSync, which waits for the server
//     to confirm the acknowledgement.
//   - ActionRetry (a transient error, a key in flight elsewhere, a lost
//     lease, a timeout): NakWithDelay with ConsumerOptions.Backoff's delay
//     for the delivery count, or the store's hint when that is longer. A transient failure on the MaxAttempts-th
//     delivery dead-letters the message with reason retries_exhausted
//     instead.
//   - ActionDeadLetter (Permanent, a panic, a fingerprint mismatch, an
//     invalid or missing id): a copy is published to
//     ConsumerOptions.DeadLetterSubject and stored (its PubAck came back),
//     then the delivery is terminated (Term). See the package
//     documentation, "Dead letters".
//
// A handler that runs longer than the consumer's AckWait is kept alive:
// every message pulled and not yet settled gets InProgress every third of
// AckWait, so JetStream does not deliver it to another worker meanwhile.
//
// Reconnects are nats.go's: the Consumer keeps pulling through them (a
// pull that fails is tried again with backoff). A settlement that fails
// (the connection was down, the AckSync timed out) leaves the message to
// JetStream, which delivers it again after AckWait; the dedup store then
// answers "duplicate". Run returns ErrConnectionClosed when the connection
// is closed for good: give the nats.Conn nats.MaxReconnects(-1) to keep a
// worker alive through any outage.
//
// Telemetry: each delivery has an OpenTelemetry consumer span, "process
// <stream>", whose parent is the trace context in the message's headers,
// read through ConsumerOptions.Propagator and HeaderCarrier. Each verdict
// is counted in idem.messages (idem.result ack, retry or dead_letter,
// idem.reason for dead letters) and timed in messaging.process.duration,
// with messaging.system "nats" and the stream as
// messaging.destination.name: never a subject, an id or a key.
type Consumer struct {
	js      jetstream.JetStream
	stream  string
	durable string
	h       consumer.Handler
	opts    ConsumerOptions
	msgOpts MessageOptions
	tel     *telemetry.Adapter

	running   atomic.Bool
	ready     chan struct{}
	readyOnce sync.Once
	stats     consStats
}

// ConsumerStats are counters since the Consumer was created.
type ConsumerStats struct {
	// Delivered counts deliveries pulled; Redelivered those among them
	// that JetStream had delivered before (NumDelivered above 1).
	Delivered, Redelivered int64
	// Acked counts deliveries acknowledged (AckSync confirmed) after
	// success or as duplicates; Duplicates those acknowledged as
	// duplicates.
	Acked, Duplicates int64
	// Retried counts deliveries nacked with a retry delay; DeadLettered
	// those whose copy was stored on the dead-letter subject before they
	// were terminated.
	Retried, DeadLettered int64
	// Requeued counts deliveries nacked without running: pulled when the
	// Consumer stopped, or returned deliveries put back to run alone (see
	// the package documentation).
	Requeued int64
	// Abandoned counts deliveries whose acknowledgement, nack or
	// dead-letter copy failed: JetStream delivers them again after
	// AckWait.
	Abandoned int64
}

type consStats struct {
	delivered, redelivered, acked, duplicates, retried, deadLettered, requeued, abandoned atomic.Int64
}

// NewConsumer returns a Consumer of the durable pull consumer durable on
// stream, through js, that runs h on each message. It does not talk to the
// server: Run creates or updates the durable consumer (from
// ConsumerOptions.Config) and the dead-letter stream, or checks them under
// ConsumerOptions.NoDeclare. The stream is the producer's and must exist.
func NewConsumer(js jetstream.JetStream, stream, durable string, h consumer.Handler, opts ConsumerOptions) (*Consumer, error) {
	if js == nil {
		return nil, errors.New("nats: NewConsumer: js is nil")
	}
	if h == nil {
		return nil, errors.New("nats: NewConsumer: handler is nil")
	}
	if err := checkName("NewConsumer: stream", stream); err != nil {
		return nil, err
	}
	if err := checkName("NewConsumer: durable", durable); err != nil {
		return nil, err
	}
	if opts.Config.Durable != "" && opts.Config.Durable != durable {
		return nil, fmt.Errorf("nats: NewConsumer: ConsumerOptions.Config.Durable is %q but durable is %q; leave Config.Durable empty", opts.Config.Durable, durable)
	}
	if err := opts.setDefaults(stream); err != nil {
		return nil, err
	}
	opts.Config.Durable = durable
	return &Consumer{js: js, stream: stream, durable: durable, h: h, opts: opts,
		msgOpts: MessageOptions{IDFunc: opts.IDFunc, MaxIDLen: opts.MaxIDLen},
		tel:     telemetry.NewAdapter(opts.MeterProvider, opts.TracerProvider, system), ready: make(chan struct{})}, nil
}

// Ready is closed once the Consumer first pulls: the durable consumer and
// the dead-letter stream exist. It is never closed if Run returns before
// (a configuration the server refused): wait for Run's return too.
func (c *Consumer) Ready() <-chan struct{} { return c.ready }

// Stats returns the counters.
func (c *Consumer) Stats() ConsumerStats {
	s := &c.stats
	return ConsumerStats{
		Delivered: s.delivered.Load(), Redelivered: s.redelivered.Load(),
		Acked: s.acked.Load(), Duplicates: s.duplicates.Load(),
		Retried: s.retried.Load(), DeadLettered: s.deadLettered.Load(),
		Requeued: s.requeued.Load(), Abandoned: s.abandoned.Load(),
	}
}

// ErrConnectionClosed is returned by Run (wrapped) when the NATS
// connection was closed for good (nats.go gave up reconnecting, or the
// application closed it).
var ErrConnectionClosed = errors.New("nats: the connection is closed")

// ErrSettledByHandler is returned (wrapped) by the Ack, Nak, Term and
// InProgress methods of the message MsgFrom returns: only the Consumer
// settles its deliveries.
var ErrSettledByHandler = errors.New("nats: the Consumer settles its deliveries; a handler must not ack, nak or term them")

// ErrDeadLetterStream is wrapped by Run's error when no stream can take
// the dead letters: none stores ConsumerOptions.DeadLetterSubject (under
// NoDeclare), or the work stream itself does.
var ErrDeadLetterStream = errors.New("nats: no dead-letter stream")

type msgKey struct{}

// guardedMsg is the jetstream.Msg a handler sees through MsgFrom: it
// refuses settlements.
type guardedMsg struct{ jetstream.Msg }

func (guardedMsg) Ack() error { return fmt.Errorf("ack: %w", ErrSettledByHandler) }
func (guardedMsg) DoubleAck(context.Context) error {
	return fmt.Errorf("double ack: %w", ErrSettledByHandler)
}
func (guardedMsg) Nak() error { return fmt.Errorf("nak: %w", ErrSettledByHandler) }
func (guardedMsg) NakWithDelay(time.Duration) error {
	return fmt.Errorf("nak: %w", ErrSettledByHandler)
}
func (guardedMsg) InProgress() error { return fmt.Errorf("in progress: %w", ErrSettledByHandler) }
func (guardedMsg) Term() error       { return fmt.Errorf("term: %w", ErrSettledByHandler) }
func (guardedMsg) TermWithReason(string) error {
	return fmt.Errorf("term: %w", ErrSettledByHandler)
}

// MsgFrom returns the JetStream message being handled, for handlers that
// need what idem does not map (its reply subject, all values of a
// repeated header). The Consumer settles every delivery itself and keeps
// it alive with InProgress: the returned message's Ack, DoubleAck, Nak,
// NakWithDelay, InProgress, Term and TermWithReason do nothing and return
// an error wrapping ErrSettledByHandler.
func MsgFrom(ctx context.Context) (jetstream.Msg, bool) {
	m, ok := ctx.Value(msgKey{}).(jetstream.Msg)
	return m, ok
}

// delivery is one pulled message.
type delivery struct {
	m    jetstream.Msg
	md   *jetstream.MsgMetadata
	n    uint64        // NumDelivered
	done chan struct{} // closed once it is settled
}

// run is the state of one Run.
type run struct {
	c    *Consumer
	cons jetstream.Consumer
	// slots holds a token per message pulled and not yet settled.
	slots chan struct{}
	work  chan *delivery
	// pending are the deliveries pulled and not yet settled, kept alive
	// with InProgress; nacked maps the stream sequence of each message
	// this process nacked to its delivery count then.
	mu      sync.Mutex
	pending map[*delivery]struct{}
	nacked  map[uint64]uint64
}

// Run declares (or checks) the durable consumer and the dead-letter
// stream, then pulls and handles messages until ctx ends, and stops
// gracefully: it stops pulling, nacks the pulled messages no handler
// started (JetStream delivers them again at once), lets the running
// handlers finish (their context is cancelled ShutdownTimeout after ctx
// ended) and settles them, never dead-lettering one while it stops, and
// returns nil.
//
// Run returns an error at once when the server refuses the configuration
// (a durable of another kind, a MaxDeliver too low, a dead-letter subject
// the work stream stores); while JetStream cannot be reached it tries
// again with backoff. A Consumer runs once.
func (c *Consumer) Run(ctx context.Context) error {
	if !c.running.CompareAndSwap(false, true) {
		return errors.New("nats: Consumer.Run called twice")
	}
	cons, ackWait, err := c.setup(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("nats: consumer %s/%s: %w", c.stream, c.durable, err)
	}
	r := &run{c: c, cons: cons, slots: make(chan struct{}, c.opts.Prefetch),
		work: make(chan *delivery, c.opts.Prefetch), pending: map[*delivery]struct{}{}, nacked: map[uint64]uint64{}}

	// Handlers run under hctx: it outlives ctx by ShutdownTimeout, so a
	// graceful stop lets them finish and be acknowledged.
	hctx, hcancel := context.WithCancel(context.WithoutCancel(ctx))
	defer hcancel()
	stopAfter := context.AfterFunc(ctx, func() {
		t := time.AfterFunc(c.opts.ShutdownTimeout, hcancel)
		context.AfterFunc(hctx, func() { t.Stop() })
	})
	defer stopAfter()

	var workers sync.WaitGroup
	for range c.opts.Concurrency {
		workers.Add(1)
		go func() {
			defer workers.Done()
			for d := range r.work {
				r.handle(ctx, hctx, d)
			}
		}()
	}
	keepCtx, stopKeep := context.WithCancel(context.Background())
	keepDone := make(chan struct{})
	go func() {
		defer close(keepDone)
		r.keepAlive(keepCtx, max(ackWait/3, 10*time.Millisecond))
	}()

	c.readyOnce.Do(func() { close(c.ready) })
	err = r.pull(ctx)
	close(r.work)
	// The messages pulled and not started go back now, while the running
	// handlers finish.
	for d := range r.work {
		r.requeue(ctx, d)
	}
	workers.Wait()
	stopKeep()
	<-keepDone
	if err != nil {
		return fmt.Errorf("nats: consumer %s/%s: %w", c.stream, c.durable, err)
	}
	return nil
}

// pull fetches messages until ctx ends.
//
// A delivery JetStream returned after a crash or an expired AckWait (a
// returned delivery: NumDelivered above 1, and not the next delivery of a
// message this process nacked itself) runs with no other delivery of the
// process unsettled, so that if it kills the process again only its own
// count grows. The pull loop is careful at start and after a pull brought
// a returned delivery: it waits until nothing is in flight, pulls one
// message and runs it; a returned one keeps it careful, any other ends
// that and the loop pulls up to Prefetch again. Returned deliveries that
// come in a pull with others are held (kept alive with InProgress) until
// the others settled, then run one after another, each alone; one past
// MaxDeliveries is dead-lettered at once, without running.
func (r *run) pull(ctx context.Context) error {
	c := r.c
	careful := true
	fails := 0
	for ctx.Err() == nil {
		n := 1
		if careful {
			// Every slot: nothing of this process is in flight.
			if !r.acquireN(ctx, cap(r.slots)) {
				return nil
			}
			r.release(cap(r.slots) - 1)
		} else {
			// Wait until half the room is free, so that a pull brings a
			// batch rather than one message per settled one.
			n = max(cap(r.slots)/2, 1)
			if !r.acquireN(ctx, n) {
				return nil
			}
		more:
			for n < cap(r.slots) {
				select {
				case r.slots <- struct{}{}:
					n++
				default:
					break more
				}
			}
		}
		batch, err := r.cons.Fetch(n, jetstream.FetchMaxWait(c.opts.FetchWait))
		if err != nil {
			r.release(n)
			if c.js.Conn().IsClosed() {
				return fmt.Errorf("%w: %w", ErrConnectionClosed, err)
			}
			fails++
			c.opts.Logger.LogAttrs(ctx, slog.LevelWarn, "nats: pull failed; retrying",
				slog.String("stream", c.stream), slog.String("durable", c.durable), slog.Int("try", fails), slog.Any("err", err))
			backoff.Sleep(ctx, backoff.Spread(min(50*time.Millisecond<<min(fails, 7), 5*time.Second)))
			continue
		}
		got := 0
		returned := false
		var held []*delivery
		for m := range batch.Messages() {
			got++
			d := r.take(m)
			switch {
			case ctx.Err() != nil:
				r.requeue(ctx, d)
			case !r.returned(d):
				r.work <- d
			case careful || c.overDelivered(d):
				returned = true
				r.work <- d
			default:
				returned = true
				held = append(held, d)
			}
		}
		r.release(n - got)
		r.runHeld(ctx, held)
		if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) && !errors.Is(err, context.DeadlineExceeded) {
			if c.js.Conn().IsClosed() {
				return fmt.Errorf("%w: %w", ErrConnectionClosed, err)
			}
			fails++
			c.opts.Logger.LogAttrs(ctx, slog.LevelWarn, "nats: pull ended with an error; retrying",
				slog.String("stream", c.stream), slog.String("durable", c.durable), slog.Int("try", fails), slog.Any("err", err))
			backoff.Sleep(ctx, backoff.Spread(min(50*time.Millisecond<<min(fails, 7), 5*time.Second)))
			continue
		}
		fails = 0
		switch {
		case returned:
			careful = true
		case got > 0:
			careful = false
		}
	}
	return nil
}

// runHeld runs the held returned deliveries one after another, each once
// nothing else of the process is in flight. When ctx ends first, the
// rest are nacked.
func (r *run) runHeld(ctx context.Context, held []*delivery) {
	for i, d := range held {
		// Each held delivery keeps its slot: once the others are
		// acquired, only held ones are in flight.
		if !r.acquireN(ctx, cap(r.slots)-(len(held)-i)) {
			for _, d := range held[i:] {
				r.requeue(ctx, d)
			}
			return
		}
		r.release(cap(r.slots) - (len(held) - i))
		r.work <- d
		select {
		case <-d.done:
		case <-ctx.Done():
		}
	}
}

// returned reports whether JetStream delivered d before without this
// process nacking it: a worker died with it, or its AckWait expired.
func (r *run) returned(d *delivery) bool {
	if d.n <= 1 {
		return false
	}
	seq := uint64(0)
	if d.md != nil {
		seq = d.md.Sequence.Stream
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	last, ok := r.nacked[seq]
	delete(r.nacked, seq)
	return !ok || last+1 != d.n
}

// nackedHere records that this process nacked d, so that its next
// delivery is not taken for a returned one.
func (r *run) nackedHere(d *delivery) {
	if d.md == nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.nacked) >= maxNacked {
		clear(r.nacked) // forgetting only makes a delivery run alone
	}
	r.nacked[d.md.Sequence.Stream] = d.n
}

// maxNacked bounds the record of nacked messages.
const maxNacked = 1 << 16

// acquireN takes n slots, or returns false (holding none) when ctx ended
// first.
func (r *run) acquireN(ctx context.Context, n int) bool {
	for i := range n {
		if !r.acquire(ctx) {
			r.release(i)
			return false
		}
	}
	return true
}

// acquire takes a slot, or returns false when ctx ended first.
func (r *run) acquire(ctx context.Context) bool {
	select {
	case r.slots <- struct{}{}:
		return true
	case <-ctx.Done():
		return false
	}
}

func (r *run) release(n int) {
	for range n {
		<-r.slots
	}
}

// take registers a pulled message as pending.
func (r *run) take(m jetstream.Msg) *delivery {
	d := &delivery{m: m, n: 1, done: make(chan struct{})}
	if md, err := m.Metadata(); err == nil {
		d.md, d.n = md, md.NumDelivered
	}
	r.c.stats.delivered.Add(1)
	if d.n > 1 {
		r.c.stats.redelivered.Add(1)
	}
	r.mu.Lock()
	r.pending[d] = struct{}{}
	r.mu.Unlock()
	return d
}

// done unregisters a settled delivery and frees its slot.
func (r *run) done(d *delivery) {
	r.mu.Lock()
	delete(r.pending, d)
	r.mu.Unlock()
	close(d.done)
	<-r.slots
}

// keepAlive sends InProgress for every pending delivery every interval,
// until ctx ends.
func (r *run) keepAlive(ctx context.Context, every time.Duration) {
	t := time.NewTicker(every)
	defer t.Stop()
	var ds []*delivery
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		r.mu.Lock()
		ds = ds[:0]
		for d := range r.pending {
			ds = append(ds, d)
		}
		r.mu.Unlock()
		for _, d := range ds {
			_ = d.m.InProgress() // a settled message refuses it: harmless
		}
	}
}

// settlement is how a delivery was settled.
type settlement int8

const (
	settledAcked settlement = iota + 1
	settledRetried
	settledDeadLettered
	settledRequeued
	settledAbandoned
)

// requeue nacks a delivery that did not run, without delay: the
// Consumer stops.
func (r *run) requeue(ctx context.Context, d *delivery) {
	c := r.c
	defer r.done(d)
	out := settledRequeued
	err := d.m.Nak()
	if err != nil {
		out = c.abandoned(ctx, d, "nak", err)
	} else {
		c.stats.requeued.Add(1)
	}
	msg, _ := toMessage(d.m, d.md, &c.msgOpts)
	c.report(ctx, msg, consumer.Result{Action: consumer.ActionRetry, Reason: consumer.OutcomeTransient, Err: errStopped}, out, time.Time{}, noEnd)
}

// errStopped is the Report.Err of a delivery nacked unrun because the
// Consumer stopped.
var errStopped = errors.New("nats: the Consumer stopped before the handler ran; the message was nacked")

func noEnd(string, error) {}

// handle runs the chain on one delivery and settles it.
func (r *run) handle(ctx, hctx context.Context, d *delivery) {
	c := r.c
	if ctx.Err() != nil {
		r.requeue(hctx, d)
		return
	}
	defer r.done(d)
	var start time.Time
	if c.tel.Timed(hctx) {
		start = time.Now()
	}
	hdr := d.m.Headers()
	mctx, end := c.tel.StartConsumer(hctx, c.opts.Propagator, (*HeaderCarrier)(&hdr), c.stream)
	msg, idErr := toMessage(d.m, d.md, &c.msgOpts)
	var res consumer.Result
	switch {
	case c.overDelivered(d):
		res = consumer.Result{Action: consumer.ActionDeadLetter, Reason: ReasonRedeliveryLimit,
			Err: fmt.Errorf("nats: the message was delivered %d times (MaxDeliveries %d) without being settled: it crashed or stalled every worker that took it", d.n, c.opts.MaxDeliveries)}
	case idErr != nil:
		res = consumer.Result{Action: consumer.ActionDeadLetter, Reason: consumer.OutcomeInvalidKey, Err: idErr}
	default:
		res = consumer.Process(&msgCtx{Context: mctx, m: guardedMsg{d.m}}, c.h, msg)
	}
	if res.Action == consumer.ActionDeadLetter && ctx.Err() != nil {
		// Never dead-letter while stopping: the error may be the stop's.
		res = consumer.Result{Action: consumer.ActionRetry, Reason: consumer.OutcomeTransient, Err: res.Err}
	}
	if res.Action == consumer.ActionRetry && !owned(res) && int(min(d.n, 1<<30)) >= c.opts.MaxAttempts && ctx.Err() == nil {
		err := res.Err
		if err == nil {
			err = errors.New("retry requested")
		}
		res = consumer.Result{Action: consumer.ActionDeadLetter, Reason: consumer.OutcomeRetriesExhausted,
			Err: &consumer.RetriesExhaustedError{Attempts: msg.Attempt, Err: err}}
	}
	out := c.settle(mctx, ctx, d, msg, res)
	if out == settledRetried || out == settledRequeued {
		r.nackedHere(d)
	}
	c.report(mctx, msg, res, out, start, end)
}

// owned reports whether r retries a message because another owner holds
// its key: a wait, not a failure.
func owned(r consumer.Result) bool {
	return r.Reason == consumer.OutcomeInFlight || r.Reason == consumer.OutcomeLeaseLost
}

// overDelivered reports whether d is past MaxDeliveries.
func (c *Consumer) overDelivered(d *delivery) bool {
	return c.opts.MaxDeliveries >= 0 && d.n > uint64(c.opts.MaxDeliveries)
}

// msgCtx carries the delivery for MsgFrom without another allocation of
// context.WithValue's kind.
type msgCtx struct {
	context.Context
	m jetstream.Msg
}

func (c *msgCtx) Value(key any) any {
	if _, ok := key.(msgKey); ok {
		return c.m
	}
	return c.Context.Value(key)
}

// settle carries out res on d.
func (c *Consumer) settle(mctx, runCtx context.Context, d *delivery, msg *consumer.Message, res consumer.Result) settlement {
	switch res.Action {
	case consumer.ActionAck:
		actx, cancel := context.WithTimeout(context.WithoutCancel(mctx), c.opts.PublishTimeout)
		err := d.m.DoubleAck(actx)
		cancel()
		if err != nil {
			return c.abandoned(mctx, d, "ack", err)
		}
		c.stats.acked.Add(1)
		if res.Duplicate {
			c.stats.duplicates.Add(1)
		}
		return settledAcked
	case consumer.ActionDeadLetter:
		return c.deadLetter(mctx, runCtx, d, msg, res)
	}
	delay := time.Duration(0)
	if runCtx.Err() == nil {
		delay = c.opts.retryDelay(int(min(d.n, 1<<30)), res.RetryAfter)
	}
	var err error
	if delay > 0 {
		err = d.m.NakWithDelay(delay)
	} else {
		err = d.m.Nak()
	}
	if err != nil {
		return c.abandoned(mctx, d, "nak", err)
	}
	c.stats.retried.Add(1)
	return settledRetried
}

// abandoned counts and logs a settlement that failed: JetStream delivers
// the message again after AckWait.
func (c *Consumer) abandoned(ctx context.Context, d *delivery, what string, err error) settlement {
	c.stats.abandoned.Add(1)
	c.opts.Logger.LogAttrs(ctx, slog.LevelWarn, "nats: settling a message failed; JetStream delivers it again after AckWait",
		slog.String("stream", c.stream), slog.String("durable", c.durable), slog.String("settlement", what),
		slog.String("message", where(d.md)), slog.Any("err", err))
	return settledAbandoned
}

// deadLetter publishes d's copy to the dead-letter subject, waits for its
// PubAck, then terminates d. A copy that is not stored leaves d nacked
// with the first retry delay (Backoff.Initial).
func (c *Consumer) deadLetter(mctx, runCtx context.Context, d *delivery, msg *consumer.Message, res consumer.Result) settlement {
	out := c.deadLetterMsg(d, res)
	pctx, cancel := context.WithTimeout(context.WithoutCancel(mctx), c.opts.PublishTimeout)
	_, err := c.js.PublishMsg(pctx, out)
	cancel()
	if err != nil {
		c.opts.Logger.LogAttrs(mctx, slog.LevelError, "nats: publishing a dead letter failed; the message comes back",
			slog.String("stream", c.stream), slog.String("durable", c.durable), slog.String("dead_letter_subject", c.opts.DeadLetterSubject),
			slog.String("message", where(d.md)), slog.Any("err", err))
		delay := c.opts.Backoff.Initial
		if runCtx.Err() != nil {
			delay = 0
		}
		if nerr := d.m.NakWithDelay(delay); nerr != nil {
			return c.abandoned(mctx, d, "nak", nerr)
		}
		return settledRequeued
	}
	c.opts.Logger.LogAttrs(mctx, slog.LevelWarn, "nats: message dead-lettered",
		slog.String("stream", c.stream), slog.String("durable", c.durable), slog.String("message", where(d.md)),
		slog.String("message_id_hash", dedup.HashKey("", msg.ID)), slog.String("reason", string(res.Reason)),
		slog.Uint64("deliveries", d.n), slog.Any("err", res.Err))
	c.stats.deadLettered.Add(1)
	if err := d.m.Term(); err != nil {
		// The copy is stored: a second one, from the next delivery,
		// carries the same Nats-Msg-Id and is dropped within the
		// stream's duplicate window.
		c.abandoned(mctx, d, "term", err)
	}
	return settledDeadLettered
}

// report records a settled delivery's verdict (metrics, its span) and
// calls OnOutcome.
func (c *Consumer) report(mctx context.Context, msg *consumer.Message, res consumer.Result, out settlement, start time.Time, end func(string, error)) {
	v := res
	switch out {
	case settledAbandoned, settledRequeued:
		v = consumer.Result{Action: consumer.ActionRetry, Reason: consumer.OutcomeTransient, Err: res.Err}
	case settledRetried:
		v.Action = consumer.ActionRetry
	}
	result, reason := "retry", ""
	switch {
	case out == settledDeadLettered, v.DeadLettered:
		result, reason = "dead_letter", string(v.Reason)
	case out == settledAcked:
		result = "ack"
	}
	var took time.Duration
	if !start.IsZero() {
		took = time.Since(start)
	}
	c.tel.Result(mctx, c.stream, result, reason, took)
	end(result, v.Err)
	if c.opts.OnOutcome != nil {
		c.opts.OnOutcome(mctx, consumer.Report{Outcome: v.Outcome(), Message: msg, Result: v, Err: v.Err})
	}
}

// seqString is a stream sequence in decimal.
func seqString(md *jetstream.MsgMetadata) string {
	if md == nil {
		return "0"
	}
	return strconv.FormatUint(md.Sequence.Stream, 10)
}
