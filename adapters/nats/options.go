package idemnats

import (
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/propagation"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/defaults"
	"github.com/idemkit/idem/internal/telemetry"
)

// ConsumerOptions configure a Consumer. The zero value is usable.
type ConsumerOptions struct {
	// Config is the durable consumer Run creates on the stream, or updates
	// to match, on start. Run sets Durable to NewConsumer's durable and
	// AckPolicy to jetstream.AckExplicitPolicy (another AckPolicy is an
	// error), AckWait to 30s when it is zero, and MaxDeliver to -1 (no
	// bound: the Consumer bounds deliveries itself, see MaxDeliveries)
	// when it is zero. A MaxDeliver of its own must be above
	// MaxDeliveries, or JetStream would stop delivering a message that
	// kills every worker before the Consumer could dead-letter it. BackOff
	// must be empty: retry delays are ConsumerOptions.Backoff's, sent with
	// each NakWithDelay. FilterSubject picks the stream's subjects the Consumer
	// takes. Defaults to the zero ConsumerConfig: every subject of the
	// stream, from its first message.
	Config jetstream.ConsumerConfig
	// NoDeclare says the durable consumer and the dead-letter stream are
	// declared elsewhere: Run creates and updates nothing, and checks on
	// start that the durable exists with explicit acks and a MaxDeliver
	// above MaxDeliveries (or -1), and that a stream other than the work
	// stream stores DeadLetterSubject. Config is then not used. Defaults to
	// false: Run declares both.
	NoDeclare bool

	// IDFunc, if set, returns the id of a message that has no Nats-Msg-Id
	// header: for an id carried in another header or in the payload. An
	// error, an empty or a malformed id dead-letters the message with
	// consumer.OutcomeInvalidKey. It must be safe for concurrent use.
	// Defaults to nil: a message without Nats-Msg-Id has no id and is
	// dead-lettered with consumer.OutcomeInvalidKey by consumer.Dedup and
	// consumer.Transactional.
	IDFunc func(m jetstream.Msg) (string, error)
	// MaxIDLen limits the id, in bytes; a longer one is dead-lettered with
	// consumer.OutcomeInvalidKey. Defaults to dedup.DefaultMaxKeyLen.
	MaxIDLen int

	// Concurrency is how many handlers run at once. Defaults to 1, which
	// handles the messages in the order the stream delivers them (retries
	// aside).
	Concurrency int
	// Prefetch bounds the messages pulled and not yet settled: each pull
	// asks for what is free below it. Every pulled message is a delivery
	// JetStream counts (NumDelivered) and holds for its AckWait, so a
	// large Prefetch makes a crash return, and count, more messages.
	// Defaults to 4 × Concurrency; it must be at least Concurrency.
	Prefetch int

	// Backoff gives the delay before the 2nd, 3rd, ... delivery of a
	// message whose handler failed with a transient error: after its n-th
	// delivery the message is nacked with Backoff.Delay(n)
	// (NakWithDelay), without jitter. A message whose key another owner
	// holds (in_flight) waits at least as long as the store says the
	// owner's lease has left (at most 24h). Initial must be at least 1ms
	// and Max at most 24h. Defaults to Initial 1s, Max 2m, Factor 5: 1s,
	// 5s, 25s, 2m, then 2m.
	Backoff consumer.Backoff
	// MaxAttempts bounds the deliveries of a message that keeps failing
	// with a transient error: a failure on the MaxAttempts-th delivery
	// (NumDelivered) dead-letters it with reason retries_exhausted.
	// JetStream counts every delivery, including those after a crash of a
	// worker. A delivery that found its key held by another owner is not
	// a failure and never exhausts the attempts (MaxDeliveries bounds it).
	// It must not exceed MaxDeliveries (unless that is -1): a message
	// delivered more than MaxDeliveries times is dead-lettered with reason
	// redelivery_limit before its attempts could run out. Defaults to 5;
	// 1 means no retry.
	MaxAttempts int
	// MaxDeliveries bounds the deliveries of a message: one delivered more
	// than MaxDeliveries times (NumDelivered above MaxDeliveries) is
	// dead-lettered with reason redelivery_limit (ReasonRedeliveryLimit)
	// without running the handler. It is what stops a message that kills
	// (or stalls past AckWait) every worker that takes it. Deliveries
	// returned to the stream run without any other message of the process
	// unsettled, so that such a message does not charge its neighbours
	// (see the package documentation). Defaults to 10; -1 means no bound.
	MaxDeliveries int

	// DeadLetterSubject receives the dead-lettered copies. Defaults to
	// "<stream>.dlq". A stream other than the work stream must store it:
	// Run creates DeadLetterStream for it when no stream does (unless
	// NoDeclare is set) and refuses to start when the work stream itself
	// stores it.
	DeadLetterSubject string
	// DeadLetterStream is the name of the stream Run creates for
	// DeadLetterSubject when no stream stores that subject yet (file
	// storage, JetStream's default limits and 2 minute duplicate window).
	// Defaults to "<stream>-dlq".
	DeadLetterStream string

	// PublishTimeout bounds the publish of a dead letter (up to its
	// PubAck) and each acknowledgement (AckSync). Defaults to 10s.
	PublishTimeout time.Duration
	// ShutdownTimeout is how long running handlers may take after Run's
	// context ended before their context is cancelled too. Defaults to
	// 30s.
	ShutdownTimeout time.Duration
	// FetchWait is how long one pull waits for messages when the stream
	// has none. A stop waits at most this long for the pull in flight.
	// Defaults to 1s.
	FetchWait time.Duration

	// Telemetry: the Consumer's metrics, spans, logs and outcome reports
	// (consumer's block, shared by every adapter).
	//
	// Logger receives warnings (dead letters, failed acknowledgements,
	// pulls that failed), with the context of the message's span when
	// there is one. Message ids appear only hashed (message_id_hash,
	// dedup.HashKey with an empty scope), subjects and payloads never.
	// Defaults to slog.Default().
	//
	// OnOutcome, if set, is called once per delivery, after it was
	// settled, with its consumer.Report: Result is the verdict the
	// Consumer carried out and Outcome is Result's (Result.Outcome).
	// Result.Action is ActionAck (acknowledged with AckSync: its effect
	// committed, it was a duplicate, or a consumer.DeadLetter middleware
	// parked it), ActionDeadLetter (a copy was published to
	// DeadLetterSubject and stored, then the delivery was terminated;
	// Reason says why, retries_exhausted and redelivery_limit included)
	// or ActionRetry (the message comes back: nacked with a delay, nacked
	// at a stop, or its acknowledgement or dead-letter copy failed). Key
	// is zero: consumer.Dedup's and consumer.Transactional's own
	// OnOutcome report the key. It must be fast and safe for concurrent
	// use.
	//
	// MeterProvider receives idem.messages (each delivery's verdict: ack,
	// retry or dead_letter, with the dead-letter reason) and
	// messaging.process.duration, with the attributes messaging.system
	// "nats" and messaging.destination.name the stream (docs/operating.md).
	// Defaults to the OpenTelemetry global, a no-op until the application
	// installs a provider.
	//
	// TracerProvider starts a consumer span "process <stream>" for each
	// delivery, continuing the trace found in its headers (the
	// traceparent the outbox stored at Enqueue time). The handler chain
	// runs in that span's context. Defaults to the OpenTelemetry global,
	// a no-op until the application installs a provider.
	consumer.Telemetry

	// Propagator reads the trace context from the message's headers (see
	// HeaderCarrier). Defaults to W3C Trace Context (traceparent,
	// tracestate), what the outbox stores.
	Propagator propagation.TextMapPropagator
}

// ReasonRedeliveryLimit is the dead-letter reason (HeaderReason, and
// Result.Reason in the OnOutcome report) of a message delivered more than
// ConsumerOptions.MaxDeliveries times: it crashed or stalled every worker
// that took it.
const ReasonRedeliveryLimit consumer.Outcome = "redelivery_limit"

// defaultBackoff is ConsumerOptions.Backoff's default.
var defaultBackoff = consumer.Backoff{Initial: time.Second, Max: 2 * time.Minute, Factor: 5}

// maxRetryDelay caps every retry delay: Backoff.Max and a store's hint.
const maxRetryDelay = 24 * time.Hour

func (o *ConsumerOptions) setDefaults(stream string) error {
	c := defaults.New("nats: ConsumerOptions")
	c.Int("MaxIDLen", &o.MaxIDLen, dedup.DefaultMaxKeyLen)
	c.Int("Concurrency", &o.Concurrency, 1)
	c.Int("MaxAttempts", &o.MaxAttempts, 5)
	c.Duration("PublishTimeout", &o.PublishTimeout, 10*time.Second)
	c.Duration("ShutdownTimeout", &o.ShutdownTimeout, 30*time.Second)
	c.Duration("FetchWait", &o.FetchWait, time.Second)
	var err error
	o.Backoff, err = o.Backoff.WithDefaults(defaultBackoff)
	c.Wrap("Backoff", err)
	if c.Err() == nil {
		switch {
		case o.Prefetch == 0:
			o.Prefetch = 4 * o.Concurrency
		case o.Prefetch < o.Concurrency:
			c.Fail("Prefetch", "is %d; it must be at least Concurrency (%d)", o.Prefetch, o.Concurrency)
		}
	}
	if c.Err() == nil {
		switch {
		case o.MaxDeliveries == 0:
			o.MaxDeliveries = 10
		case o.MaxDeliveries < -1:
			c.Fail("MaxDeliveries", "is %d; it must be positive, 0 (the default, 10) or -1 (no bound)", o.MaxDeliveries)
		}
	}
	if c.Err() == nil && o.MaxDeliveries >= 0 && o.MaxAttempts > o.MaxDeliveries {
		c.Fail("MaxAttempts", "(%d) is greater than MaxDeliveries (%d): JetStream counts every delivery, so the message would be "+
			"dead-lettered with reason redelivery_limit before its attempts run out; lower MaxAttempts, or raise MaxDeliveries "+
			"(and the durable consumer's MaxDeliver, which must stay above it)", o.MaxAttempts, o.MaxDeliveries)
	}
	if c.Err() == nil {
		switch b := o.Backoff; {
		case b.Initial < time.Millisecond:
			c.Fail("Backoff.Initial", "is %v; it must be at least 1ms (NakWithDelay's delay is in milliseconds)", b.Initial)
		case b.Max > maxRetryDelay:
			c.Fail("Backoff.Max", "is %v; it must be at most 24h", b.Max)
		}
	}
	if err := c.Err(); err != nil {
		return err
	}
	if o.DeadLetterSubject == "" {
		o.DeadLetterSubject = stream + ".dlq"
	}
	if strings.ContainsAny(o.DeadLetterSubject, "*> \t\r\n") {
		return fmt.Errorf("nats: ConsumerOptions.DeadLetterSubject %q must be a literal subject (no wildcards or spaces)", o.DeadLetterSubject)
	}
	if o.DeadLetterStream == "" {
		o.DeadLetterStream = stream + "-dlq"
	}
	if err := checkName("ConsumerOptions.DeadLetterStream", o.DeadLetterStream); err != nil {
		return err
	}
	if err := o.checkConfig(); err != nil {
		return err
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.Propagator == nil {
		o.Propagator = telemetry.DefaultPropagator
	}
	return nil
}

// checkConfig checks and completes Config.
func (o *ConsumerOptions) checkConfig() error {
	c := &o.Config
	if c.AckPolicy != jetstream.AckExplicitPolicy {
		return fmt.Errorf("nats: ConsumerOptions.Config.AckPolicy is %v; the Consumer acknowledges each message on its own, after its effect committed: use jetstream.AckExplicitPolicy", c.AckPolicy)
	}
	if len(c.BackOff) > 0 {
		return errors.New("nats: ConsumerOptions.Config.BackOff is set; the Consumer sets each retry's delay with NakWithDelay: use ConsumerOptions.Backoff")
	}
	if c.AckWait < 0 {
		return fmt.Errorf("nats: ConsumerOptions.Config.AckWait is %v; it must not be negative", c.AckWait)
	}
	if c.AckWait == 0 {
		c.AckWait = 30 * time.Second
	}
	if c.MaxDeliver == 0 {
		c.MaxDeliver = -1
	}
	return checkMaxDeliver(c.MaxDeliver, o.MaxDeliveries)
}

// checkMaxDeliver returns an error when JetStream would stop delivering a
// message before the Consumer sees the delivery past maxDeliveries.
func checkMaxDeliver(maxDeliver, maxDeliveries int) error {
	if maxDeliver < 0 {
		return nil
	}
	if maxDeliveries < 0 || maxDeliver <= maxDeliveries {
		return fmt.Errorf("nats: the durable consumer's MaxDeliver is %d, but ConsumerOptions.MaxDeliveries is %d: JetStream would stop delivering a message that kills every worker before the Consumer dead-letters it; set MaxDeliver to -1 or above MaxDeliveries", maxDeliver, maxDeliveries)
	}
	return nil
}

// checkName returns an error when name cannot be a stream or consumer
// name.
func checkName(what, name string) error {
	if name == "" {
		return fmt.Errorf("nats: %s is required", what)
	}
	if strings.ContainsAny(name, ".*> \t\r\n/\\") {
		return fmt.Errorf("nats: %s %q must not contain '.', '*', '>', '/', '\\' or whitespace", what, name)
	}
	return nil
}

// retryDelay is the delay before the delivery after delivery n:
// Backoff.Delay(n), or the hint when it is longer (capped at 24h).
func (o *ConsumerOptions) retryDelay(n int, hint time.Duration) time.Duration {
	return min(max(o.Backoff.Delay(n), hint), maxRetryDelay)
}
