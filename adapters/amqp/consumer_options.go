package idemamqp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"time"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/defaults"
	"github.com/idemkit/idem/internal/telemetry"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/propagation"
)

// Headers the Consumer sets on the copies it publishes to its retry queues
// and to its dead-letter exchange, besides consumer's dead-letter headers:
// consumer.HeaderSource (the work queue the copy was consumed from) on
// every copy, consumer.HeaderError (the handler's error, at most 1 KiB: on
// a retried copy the last error) on every copy of a failed delivery, and
// on a dead letter consumer.HeaderReason, consumer.HeaderAttempts (an
// int32) and consumer.HeaderID (its message id).
const (
	// HeaderAttempt is the delivery attempt, 1-based, of the copy: absent
	// on a message as the producer sent it (attempt 1), then 2, 3, ... on
	// each copy of a failed attempt sent through a retry queue (a wait for
	// a key another owner holds is counted in HeaderWaits instead). It is what Message.Attempt
	// reports and what ConsumerOptions.MaxAttempts bounds. RabbitMQ's own
	// x-death header is not used for this: it counts per queue and per
	// reason, so with several retry queues no single entry is the attempt.
	// A broker redelivery (a worker crashed, a channel closed) does not
	// change it: only a retry the consumer decided counts.
	HeaderAttempt = "idem-attempt"
	// HeaderWaits counts the retries of a message whose key another owner
	// held (in_flight, lease_lost): absent on a message as the producer
	// sent it, then 1, 2, ... on each such copy; those retries leave
	// HeaderAttempt alone. HeaderWaitingSince is when the first of them
	// happened (Unix milliseconds): what ConsumerOptions.MaxWait bounds.
	HeaderWaits        = "idem-waits"
	HeaderWaitingSince = "idem-waiting-since"
	// HeaderExchange and HeaderRoutingKey keep the exchange and routing key
	// of the original delivery on the retried and dead-lettered copies,
	// which travel through the default exchange.
	HeaderExchange   = consumer.HeaderPrefix + "exchange"
	HeaderRoutingKey = consumer.HeaderPrefix + "routing-key"

	// HeaderDeliveryCount is the header in which quorum queues report how
	// many earlier deliveries of a message were returned unsettled. The
	// Consumer reads it (ConsumerOptions.MaxDeliveries) and strips it from
	// the copies it publishes.
	HeaderDeliveryCount = "x-delivery-count"
	// HeaderReturns carries, on a copy retried because another owner held
	// the key (in_flight, lease_lost), or put back while it waited to run
	// alone, the x-delivery-count of the delivery it copies plus its own
	// HeaderReturns: the deliveries of the message returned unsettled so
	// far. MaxDeliveries bounds their
	// sum with the copy's own x-delivery-count, so a message that kills
	// its worker while holding a lease (the next delivery waits for the
	// lease, on a fresh copy) is still bounded. Copies for other reasons
	// drop it.
	HeaderReturns = "idem-returns"
)

// ReasonRedeliveryLimit is the consumer.HeaderReason (and the Result.Reason in the
// OnOutcome report) of a message dead-lettered because the broker delivered it more
// than ConsumerOptions.MaxDeliveries times without it being settled: it
// crashed or stalled every worker that took it.
const ReasonRedeliveryLimit consumer.Outcome = "redelivery_limit"

// ReasonWaitLimit is the consumer.HeaderReason (and the Result.Reason in the
// OnOutcome report, and the verdict's idem.reason) of a message
// dead-lettered because its key was held by another owner (in_flight,
// lease_lost) for longer than ConsumerOptions.MaxWait.
const ReasonWaitLimit consumer.Outcome = "wait_limit"

// ConsumerBinding binds the work queue to an exchange. The exchange must
// exist (it is the producer's); the binding is declared on every connect.
type ConsumerBinding struct {
	Exchange string
	Key      string
	Args     amqp091.Table
}

// ConsumerOptions configure a Consumer. The zero value is usable.
type ConsumerOptions struct {
	// Config is passed to amqp091.DialConfig. Defaults to a 10s heartbeat,
	// a 10s dial timeout and the connection name below.
	Config *amqp091.Config
	// ConnectionName is the connection_name client property. Defaults to
	// "idem-consumer".
	ConnectionName string
	// Dial, when set, opens the Consumer's connections instead of
	// amqp091.DialConfig with the URL, Config and ConnectionName: for a
	// service that builds its connections itself (its TLS, its
	// credentials provider, its dialer). Run calls it for the first
	// connection and for each reconnect, with Run's context; the
	// connections it returns are the Consumer's, which closes them when
	// they fail and when Run returns, so return a new connection each
	// time. To run on one connection the service keeps, use
	// NewConsumerConn. Defaults to nil: NewConsumer's url is dialled.
	Dial func(ctx context.Context) (*amqp091.Connection, error)

	// Prefetch is the channel's QoS prefetch count: how many unacknowledged
	// deliveries the broker hands over at once. Defaults to 100. It also
	// sizes the ACK coalescing (see Consumer): a run of a quarter of
	// Prefetch finished deliveries is acknowledged at once, and finished
	// deliveries waiting behind a slow one wait only 1ms when they are half
	// of Prefetch.
	Prefetch int
	// Concurrency is how many handlers run at once. Defaults to 1, which
	// keeps the queue's order (retries aside) unless InFlight is set above
	// 1.
	Concurrency int
	// InFlight is how many deliveries the chain works on at once, counting
	// those waiting on the dedup store. consumer.Dedup gives its handler
	// slot to another delivery while it waits for its claim, Complete or
	// Release, so a store a round trip away (redisnx) does not hold the
	// Concurrency handlers idle: up to InFlight deliveries are in a store
	// round trip or a handler, and at most Concurrency of them in a
	// handler. Defaults to 8 × Concurrency (at most Prefetch) when
	// Concurrency is above 1, else 1 (in queue order). It must lie between
	// Concurrency and Prefetch; above 1, deliveries may finish out of
	// order even with one handler.
	//
	// A consumer.Timeout outside Dedup also bounds the wait for a handler
	// slot after the claim.
	InFlight int

	// IDHeader, when set, names an application header that carries the
	// message id. A delivery with that header takes its id from it;
	// others fall back to the message-id property. The id is
	// Message.ID, the id half of the dedup key. A delivery with neither
	// has an empty id and is dead-lettered with reason invalid_key by
	// consumer.Dedup or consumer.Transactional (unless their KeyFunc
	// builds a key some other way).
	IDHeader string

	// NotDurable declares the work, retry and dead-letter queues and the
	// dead-letter exchange transient, and sends retried and dead-lettered
	// copies non-persistent: for tests and throw-away queues. By default
	// they are durable and persistent.
	NotDurable bool
	// QueueArgs are the work queue's declare arguments, for example
	// {"x-max-length": 100000}. They must match the queue's if it exists,
	// or Run fails with PRECONDITION_FAILED.
	QueueArgs amqp091.Table
	// QuorumQueue declares the work queue as a quorum queue
	// ("x-queue-type": "quorum", added to QueueArgs). A quorum queue
	// counts the deliveries of each message that were not acknowledged
	// and reports the count in the x-delivery-count header, which bounds
	// crash redeliveries (see MaxDeliveries). It requires durable queues:
	// NotDurable must be false. An existing classic queue of the same name
	// cannot be turned into a quorum queue: Run fails with
	// PRECONDITION_FAILED; delete it or use a new name.
	QuorumQueue bool
	// MaxDeliveries bounds the broker deliveries of a message whose
	// handler never settles it: a message that crashes the worker process
	// (or closes its channel) every time is redelivered by the broker with
	// HeaderAttempt unchanged, so MaxAttempts does not stop it. A delivery
	// carrying x-delivery-count (set by quorum queues: the number of
	// earlier deliveries of this message that were returned, by a crash, a
	// closed channel or a nack with requeue) of MaxDeliveries or more —
	// that is, the (MaxDeliveries+1)th delivery — is dead-lettered with
	// reason redelivery_limit (ReasonRedeliveryLimit) without running the
	// handler. Every returned delivery (x-delivery-count above 0) runs
	// with no other delivery of the process unsettled, so that a crash
	// counts against the message that caused it and not against the
	// deliveries prefetched with it (see the package documentation).
	// Defaults to 10; -1 means no bound.
	//
	// Classic queues do not count deliveries: on a classic queue a message
	// that kills every worker that takes it is redelivered forever (the
	// redelivered flag is only a hint, and the consumer keeps no state
	// across crashes). Use QuorumQueue, or a quorum queue declared
	// elsewhere, where that matters.
	//
	// Deliveries the consumer itself requeues count too: a prefetched
	// delivery requeued by a graceful stop, or one requeued because its
	// retry or dead-letter copy could not be published. A returned
	// delivery that waits to run alone is put back without a count: a
	// copy carrying its count in HeaderReturns is published to the work
	// queue, then the delivery is acknowledged. Retried copies start
	// again at zero (the consumer strips x-delivery-count from the copies
	// it publishes), except those that waited for a key another owner
	// held, which carry the count over in HeaderReturns.
	MaxDeliveries int
	// Bindings bind the work queue to the producer's exchanges.
	Bindings []ConsumerBinding
	// NoDeclare says the topology is declared elsewhere (by the service's
	// own code, a definitions file, an operator): Run declares nothing —
	// no queue, retry queue, exchange or binding, so QueueArgs,
	// QuorumQueue, Bindings, NotDurable's effect on the queues and
	// DeadLetterQueue are not used for that — and instead checks, on each
	// connect, what the Consumer needs:
	//
	//   - the work queue, each retry queue ("<queue>.retry.<ms>ms", one
	//     per delay of Backoff) and DeadLetterExchange exist
	//     (passive declares);
	//   - each retry queue dead-letters expired messages to the default
	//     exchange with the work queue's name as routing key: it has the
	//     queue arguments x-dead-letter-exchange "" and
	//     x-dead-letter-routing-key <queue> (the copies carry their own
	//     per-message expiration, so x-message-ttl is optional). AMQP
	//     0-9-1 cannot read a queue's arguments: the check declares the
	//     queue again with these two on a throwaway channel, which the
	//     broker refuses with PRECONDITION_FAILED when they differ and
	//     which changes nothing when they match; the queue's durability
	//     and its other arguments are taken over from the broker's
	//     refusal. Dead-lettering set by a policy instead of arguments is
	//     not seen, and refused.
	//
	// If one is missing or differs, Run returns an error wrapping
	// ErrTopologyMissing that names it. DeadLetterExchange must also
	// route the work queue's name to a queue. Bindings cannot be read, so
	// that is checked on the dead letters themselves, which are published
	// mandatory: the first one the broker returns, unrouted, is not
	// acknowledged (its delivery goes back to the queue) and Run returns
	// an error wrapping ErrTopologyMissing that names the exchange and
	// routing key. A retry copy returned because its retry queue was
	// deleted does the same. Defaults to false: Run declares it all (and
	// declares it again after a returned copy).
	NoDeclare bool

	// Backoff gives the delays before the 2nd, 3rd, ... attempt:
	// Backoff.Delay(1), Delay(2), ... in whole milliseconds, up to the
	// first that reaches Backoff.Max, which then repeats. Each delay gets
	// its own retry queue ("<queue>.retry.<ms>ms"), because RabbitMQ
	// expires messages only at the head of a queue: in one shared queue a
	// short delay would wait behind a long one. Initial must be at least
	// 1ms, Max at most 24h, and the delays at most 32 retry queues.
	// Defaults to Initial 1s, Max 2m, Factor 5: 1s, 5s, 25s, 2m.
	Backoff consumer.Backoff
	// MaxAttempts bounds the attempts of a message that keeps failing with
	// a transient error, the first included; the next failure
	// dead-letters it with reason retries_exhausted. Only the deliveries
	// whose handler ran and failed count (HeaderAttempt): a delivery
	// retried because another owner holds its key (in_flight,
	// lease_lost) did not fail: MaxWait bounds those.
	// Defaults to 5; 1 means no retry.
	MaxAttempts int
	// MaxWait bounds how long a message may wait for a key another owner
	// holds (in_flight: a copy still running elsewhere, or a lease a dead
	// worker left until it expires; lease_lost). Such a message waits in
	// the retry queues (the delay is Backoff's by wait count, or longer
	// when the store says how long the lease has left), without spending
	// attempts; it counts its waits in HeaderWaits and the time of the
	// first in HeaderWaitingSince. A wait more than MaxWait after the
	// first dead-letters the message instead, with reason wait_limit
	// (ReasonWaitLimit) and the other owner's error: a key held that long
	// is a stuck owner, not a busy one, and the dead letter says so
	// instead of the message circling forever. Keep it well above the
	// store's lease. It is compared across workers' clocks. Defaults to
	// 1h; negative means no bound.
	MaxWait time.Duration

	// DeadLetterExchange and DeadLetterQueue receive dead messages.
	// Defaults to "<queue>.dlx" (a direct exchange) and "<queue>.dlq"
	// bound to it with the work queue's name as routing key.
	DeadLetterExchange, DeadLetterQueue string

	// PublishTimeout bounds the confirm of a retried or dead-lettered copy.
	// Defaults to 10s.
	PublishTimeout time.Duration
	// ShutdownTimeout is how long in-flight handlers may run after Run's
	// context ended before their context is cancelled too. Defaults to
	// 30s.
	ShutdownTimeout time.Duration
	// ReconnectBackoff spaces the redials after a lost or refused
	// connection (ReconnectBackoff.Delay, spread ±20%). Defaults to
	// Initial 100ms, Max 10s, Factor 2.
	ReconnectBackoff consumer.Backoff

	// Telemetry: the Consumer's metrics, spans, logs and outcome reports
	// (consumer's block, shared by every adapter).
	//
	// Logger receives warnings (reconnects, dead letters, failed copies),
	// with the context of the delivery's span when there is one. Message
	// ids appear only hashed (message_id_hash, dedup.HashKey with an empty
	// scope), routing keys and bodies never. Defaults to slog.Default().
	//
	// OnOutcome, if set, is called once per delivery, after it was
	// settled, with its consumer.Report: Result is the verdict the
	// Consumer carried out, Outcome is Result's (Result.Outcome), and
	// Message the delivery's message. Result.Action is ActionAck (the
	// delivery was acknowledged: its effect committed, it was a duplicate,
	// or a consumer.DeadLetter middleware parked it), ActionDeadLetter (a
	// copy went to the dead-letter exchange and was confirmed, then the
	// delivery was acknowledged; Reason says why, retries_exhausted,
	// wait_limit and redelivery_limit included) or ActionRetry (the
	// message comes back: a copy went to a retry queue, or the delivery
	// was nacked with requeue because the consumer stopped, or its channel
	// closed before it was settled). A delivery whose retry or dead-letter
	// copy was not confirmed is nacked with requeue and reported as
	// ActionRetry, reason transient, whatever its chain asked for: only
	// the delivery whose copy was confirmed reports the dead letter.
	// Result.Err and Err are the chain's error, except for a delivery
	// whose channel closed before it was settled (the broker redelivers
	// it), where Err wraps amqp091.ErrClosed, and one whose copy was not
	// confirmed, where they say so. Key is zero: consumer.Dedup's and
	// consumer.Transactional's own OnOutcome report the key.
	//
	// For a delivery acknowledged on ActionAck it is called once the
	// (coalesced) ack was written, or given up, possibly from another
	// handler's goroutine or the consumer's own; its ctx is the
	// delivery's. It must be fast and safe for concurrent use.
	//
	// MeterProvider receives idem.messages (each delivery's verdict: ack,
	// retry or dead_letter, with the dead-letter reason) and
	// messaging.process.duration, with the attributes messaging.system
	// "rabbitmq" and messaging.destination.name the queue (README,
	// "Operating idem"). Defaults to the OpenTelemetry global, a no-op
	// until the application installs a provider.
	//
	// TracerProvider starts a consumer span "process <queue>" for each
	// delivery, continuing the trace found in its headers (the traceparent
	// the outbox stored at Enqueue time; retried copies keep it). The
	// handler chain runs in that span's context, so consumer.Dedup's and
	// consumer.Transactional's spans are its children. Defaults to the
	// OpenTelemetry global, a no-op until the application installs a
	// provider: until then (and with OpenTelemetry's noop provider) no span
	// is started and the headers are not read.
	consumer.Telemetry

	// Propagator reads the trace context from the delivery's headers (see
	// TableCarrier). Defaults to W3C Trace Context (traceparent,
	// tracestate), what the outbox stores.
	Propagator propagation.TextMapPropagator
}

func (o *ConsumerOptions) consSetDefaults(queue string) error {
	c := defaults.New("amqp: ConsumerOptions")
	c.Int("Prefetch", &o.Prefetch, 100)
	c.Int("Concurrency", &o.Concurrency, 1)
	c.NotNegative("InFlight", o.InFlight)
	c.Int("MaxAttempts", &o.MaxAttempts, 5)
	c.Duration("PublishTimeout", &o.PublishTimeout, 10*time.Second)
	c.Duration("ShutdownTimeout", &o.ShutdownTimeout, 30*time.Second)
	var err error
	o.ReconnectBackoff, err = o.ReconnectBackoff.WithDefaults(defaultReconnectBackoff)
	c.Wrap("ReconnectBackoff", err)
	o.Backoff, err = o.Backoff.WithDefaults(defaultRetryBackoff)
	c.Wrap("Backoff", err)
	if err := c.Err(); err != nil {
		return err
	}
	if err := o.setQueueDefaults(); err != nil {
		return err
	}
	if err := o.setFlowDefaults(); err != nil {
		return err
	}
	if err := o.setRetryDefaults(); err != nil {
		return err
	}
	if o.DeadLetterExchange == "" {
		o.DeadLetterExchange = queue + ".dlx"
	}
	if o.DeadLetterQueue == "" {
		o.DeadLetterQueue = queue + ".dlq"
	}
	if o.ConnectionName == "" {
		o.ConnectionName = "idem-consumer"
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.Propagator == nil {
		o.Propagator = telemetry.DefaultPropagator
	}
	for _, n := range []string{queue, o.DeadLetterExchange, o.DeadLetterQueue, consRetryQueue(queue, o.Backoff.Max)} {
		if len(n) > 255 {
			return fmt.Errorf("amqp: queue or exchange name %.40q... is longer than 255 bytes", n)
		}
	}
	return nil
}

// setQueueDefaults checks and completes MaxDeliveries and the quorum queue
// settings.
func (o *ConsumerOptions) setQueueDefaults() error {
	switch {
	case o.MaxDeliveries == 0:
		o.MaxDeliveries = 10
	case o.MaxDeliveries < -1:
		return fmt.Errorf("amqp: ConsumerOptions.MaxDeliveries is %d; it must be positive, 0 (the default) or -1 (no bound)", o.MaxDeliveries)
	}
	if !o.QuorumQueue {
		return nil
	}
	if o.NotDurable {
		return errors.New("amqp: ConsumerOptions: QuorumQueue requires durable queues, but NotDurable is set")
	}
	if t, ok := o.QueueArgs[consQueueTypeArg]; ok && t != "quorum" {
		return fmt.Errorf("amqp: ConsumerOptions: QuorumQueue is set but QueueArgs has %s %v", consQueueTypeArg, t)
	}
	args := make(amqp091.Table, len(o.QueueArgs)+1)
	maps.Copy(args, o.QueueArgs)
	args[consQueueTypeArg] = "quorum"
	o.QueueArgs = args
	return nil
}

// setFlowDefaults completes InFlight from Prefetch and Concurrency, and
// checks it.
func (o *ConsumerOptions) setFlowDefaults() error {
	switch {
	case o.InFlight == 0 && o.Concurrency > 1:
		o.InFlight = min(8*o.Concurrency, max(o.Prefetch, o.Concurrency))
	case o.InFlight == 0:
		o.InFlight = 1
	case o.InFlight < o.Concurrency || o.InFlight > max(o.Prefetch, o.Concurrency):
		return fmt.Errorf("amqp: ConsumerOptions.InFlight is %d; it must lie between Concurrency (%d) and Prefetch (%d)", o.InFlight, o.Concurrency, o.Prefetch)
	}
	return nil
}

// setRetryDefaults completes MaxWait and checks the retry queues Backoff
// makes.
func (o *ConsumerOptions) setRetryDefaults() error {
	if o.MaxWait == 0 {
		o.MaxWait = time.Hour
	}
	switch b := o.Backoff; {
	case b.Initial < time.Millisecond:
		return fmt.Errorf("amqp: ConsumerOptions.Backoff.Initial is %v; it must be at least 1ms (a retry queue's message TTL is in milliseconds)", b.Initial)
	case b.Max > 24*time.Hour:
		return fmt.Errorf("amqp: ConsumerOptions.Backoff.Max is %v; it must be at most 24h", b.Max)
	case len(o.retryDelays()) > maxRetryQueues:
		return fmt.Errorf("amqp: ConsumerOptions.Backoff (Initial %v, Max %v, Factor %v) makes more than %d retry queues; raise Initial or Factor, or lower Max", b.Initial, b.Max, b.Factor, maxRetryQueues)
	}
	return nil
}

// Backoff defaults.
var (
	defaultRetryBackoff     = consumer.Backoff{Initial: time.Second, Max: 2 * time.Minute, Factor: 5}
	defaultReconnectBackoff = consumer.Backoff{Initial: 100 * time.Millisecond, Max: 10 * time.Second, Factor: 2}
)

// maxRetryQueues bounds the retry queues one Backoff makes.
const maxRetryQueues = 32

// retryDelays returns the delays of Backoff, one per retry queue, in
// increasing order: Delay(1), Delay(2), ... rounded to the millisecond, up
// to the first that reaches Max (or stops growing), at most
// maxRetryQueues+1 of them.
func (o *ConsumerOptions) retryDelays() []time.Duration {
	var ds []time.Duration
	prev := time.Duration(-1)
	for n := 1; len(ds) <= maxRetryQueues; n++ {
		raw := o.Backoff.Delay(n)
		if raw == prev {
			break
		}
		prev = raw
		if d := raw.Round(time.Millisecond); len(ds) == 0 || d > ds[len(ds)-1] {
			ds = append(ds, d)
		}
		if raw >= o.Backoff.Max {
			break
		}
	}
	return ds
}

const consQueueTypeArg = "x-queue-type"

// consRetryQueue names the retry queue of delay d.
func consRetryQueue(queue string, d time.Duration) string {
	return fmt.Sprintf("%s.retry.%dms", queue, d.Milliseconds())
}
