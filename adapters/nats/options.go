package idemnats

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
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
	// must be empty: retry delays are RetryDelays, sent with each
	// NakWithDelay. FilterSubject picks the stream's subjects the Consumer
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

	// RetryDelays are the delays before the 2nd, 3rd, ... delivery of a
	// message whose handler failed with a transient error (sent with
	// NakWithDelay); the last one repeats. A message whose key another
	// owner holds (in_flight) waits at least as long as the store says
	// the owner's lease has left. Defaults to 1s, 5s, 30s, 2m.
	RetryDelays []time.Duration
	// MaxAttempts bounds the deliveries of a message that keeps failing
	// with a transient error: a failure on the MaxAttempts-th delivery
	// (NumDelivered) dead-letters it with reason retries_exhausted.
	// JetStream counts every delivery, including those after a crash of a
	// worker. A delivery that found its key held by another owner is not
	// a failure and never exhausts the attempts (MaxDeliveries bounds it).
	// Defaults to 5; 1 means no retry.
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

	// Logger receives warnings (dead letters, failed acknowledgements,
	// pulls that failed), with the context of the message's span when
	// there is one. Message ids appear only hashed (message_id_hash,
	// dedup.HashKey with an empty scope), subjects and payloads never.
	// Defaults to slog.Default().
	Logger *slog.Logger
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
	OnOutcome func(ctx context.Context, r consumer.Report)

	// MeterProvider receives idem.messages (each delivery's verdict: ack,
	// retry or dead_letter, with the dead-letter reason) and
	// messaging.process.duration, with the attributes messaging.system
	// "nats" and messaging.destination.name the stream (docs/operating.md).
	// Defaults to the OpenTelemetry global, a no-op until the application
	// installs a provider.
	MeterProvider metric.MeterProvider
	// TracerProvider starts a consumer span "process <stream>" for each
	// delivery, continuing the trace found in its headers (the
	// traceparent the outbox stored at Enqueue time). The handler chain
	// runs in that span's context. Defaults to the OpenTelemetry global,
	// a no-op until the application installs a provider.
	TracerProvider trace.TracerProvider
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

func (o *ConsumerOptions) setDefaults(stream string) error {
	ints := []struct {
		name string
		v    *int
		def  int
	}{
		{"MaxIDLen", &o.MaxIDLen, dedup.DefaultMaxKeyLen},
		{"Concurrency", &o.Concurrency, 1},
		{"MaxAttempts", &o.MaxAttempts, 5},
	}
	for _, f := range ints {
		if *f.v < 0 {
			return fmt.Errorf("nats: ConsumerOptions.%s is %d; it must be positive (or zero for %d)", f.name, *f.v, f.def)
		}
		if *f.v == 0 {
			*f.v = f.def
		}
	}
	switch {
	case o.Prefetch == 0:
		o.Prefetch = 4 * o.Concurrency
	case o.Prefetch < o.Concurrency:
		return fmt.Errorf("nats: ConsumerOptions.Prefetch is %d; it must be at least Concurrency (%d)", o.Prefetch, o.Concurrency)
	}
	switch {
	case o.MaxDeliveries == 0:
		o.MaxDeliveries = 10
	case o.MaxDeliveries < -1:
		return fmt.Errorf("nats: ConsumerOptions.MaxDeliveries is %d; it must be positive, 0 (the default, 10) or -1 (no bound)", o.MaxDeliveries)
	}
	durs := []struct {
		name string
		v    *time.Duration
		def  time.Duration
	}{
		{"PublishTimeout", &o.PublishTimeout, 10 * time.Second},
		{"ShutdownTimeout", &o.ShutdownTimeout, 30 * time.Second},
		{"FetchWait", &o.FetchWait, time.Second},
	}
	for _, f := range durs {
		if *f.v < 0 {
			return fmt.Errorf("nats: ConsumerOptions.%s is %v; it must not be negative (zero means %v)", f.name, *f.v, f.def)
		}
		if *f.v == 0 {
			*f.v = f.def
		}
	}
	if len(o.RetryDelays) == 0 {
		o.RetryDelays = []time.Duration{time.Second, 5 * time.Second, 30 * time.Second, 2 * time.Minute}
	}
	o.RetryDelays = slices.Clone(o.RetryDelays)
	for _, d := range o.RetryDelays {
		if d < time.Millisecond || d > 24*time.Hour {
			return fmt.Errorf("nats: ConsumerOptions.RetryDelays: %v is out of range [1ms, 24h]", d)
		}
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
		return errors.New("nats: ConsumerOptions.Config.BackOff is set; the Consumer sets each retry's delay with NakWithDelay: use ConsumerOptions.RetryDelays")
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

// retryDelay is the delay before the delivery after delivery n: the
// configured one, or the hint when it is longer (capped at 24h).
func (o *ConsumerOptions) retryDelay(n int, hint time.Duration) time.Duration {
	d := o.RetryDelays[min(max(n, 1), len(o.RetryDelays))-1]
	return min(max(d, hint), 24*time.Hour)
}
