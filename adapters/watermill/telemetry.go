package idemwatermill

import (
	"context"
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/telemetry"
)

// MetadataCarrier reads and writes trace context in Watermill metadata, for
// an OpenTelemetry propagator: propagation.MapCarrier, except that a value
// longer than 8 KiB reads as absent, so that a hostile or corrupt header
// (a megabyte "traceparent") is never handed to a propagator's parser. The
// middleware extracts the producer's trace context with it; a producer
// that does not go through idem's outbox can inject with it:
//
//	otel.GetTextMapPropagator().Inject(ctx, idemwatermill.MetadataCarrier(msg.Metadata))
type MetadataCarrier message.Metadata

var _ propagation.TextMapCarrier = MetadataCarrier(nil)

// Get returns the value of key, or "" when it is absent or too long.
func (c MetadataCarrier) Get(key string) string {
	v := c[key]
	if len(v) > telemetry.MaxHeaderValue {
		return ""
	}
	return v
}

// Set stores value under key. The metadata must not be nil.
func (c MetadataCarrier) Set(key, value string) { c[key] = value }

// Keys lists the metadata keys.
func (c MetadataCarrier) Keys() []string {
	keys := make([]string, 0, len(c))
	for k := range c {
		keys = append(keys, k)
	}
	return keys
}

// scopeOf is the scope of msg's key, for a message whose key could not be
// built: Options.Scope or the handler name.
func (c *config) scopeOf(msg *message.Message) string {
	if c.Scope != "" {
		return c.Scope
	}
	return message.HandlerNameFromCtx(msg.Context())
}

// Message verdicts (idem.result of idem.messages).
const (
	resultAck        = "ack"
	resultRetry      = "retry"
	resultDeadLetter = "dead_letter"
)

var errPanicked = errors.New("watermill: the handler panicked")

// delivery is one message's trip through the middleware, for telemetry:
// its consumer span and the verdict. It lives on the middleware's stack.
type delivery struct {
	c      *config
	msg    *message.Message
	orig   context.Context // the message's context as it came
	ctx    context.Context // with the consumer span
	topic  string
	timed  bool                           // messaging.process.duration records
	start  time.Time                      // when timed
	end    func(result string, err error) // ends the consumer span
	poison consumer.Outcome               // the middleware found msg poison
	done   bool
	// The message's consumer.Report, sent to Options.OnOutcome once the
	// middleware's answer is final (verdict, or finish after a panic).
	outcome consumer.Outcome // "" until the outcome is known
	key     dedup.Key
	err     error
}

// begin starts msg's delivery: the consumer span, continuing the trace in
// the metadata, becomes msg's context — unless the context already holds a
// recording span, which then is the parent of idem's spans, or no tracer
// provider is installed. The clock is read only when a meter provider
// records the process duration.
func (c *config) begin(msg *message.Message) delivery {
	ctx := msg.Context()
	d := delivery{c: c, msg: msg, orig: ctx, ctx: ctx, topic: message.SubscribeTopicFromCtx(ctx), end: noEnd}
	if d.timed = c.msgs.Timed(ctx); d.timed {
		d.start = time.Now()
	}
	if c.tracing() && !trace.SpanFromContext(ctx).IsRecording() {
		d.ctx, d.end = c.msgs.StartConsumer(ctx, c.Propagator, MetadataCarrier(msg.Metadata), d.topic)
		msg.SetContext(d.ctx)
	}
	return d
}

// tracing reports whether a consumer span may record (telemetry.Tracing):
// not while Options.TracerProvider is nil and the application installed no
// global provider, nor with OpenTelemetry's no-op provider. Then the
// consumer span is not started at all, sparing its extraction and
// allocations on every message.
func (c *config) tracing() bool { return telemetry.Tracing(c.TracerProvider) }

func noEnd(string, error) {}

// verdict records the middleware's answer on the message.
func (d *delivery) verdict(out []*message.Message, err error) ([]*message.Message, error) {
	d.done = true
	result, reason := resultAck, consumer.Outcome("")
	switch {
	case d.poison != "" && err == nil:
		// A poison queue took the message.
		result, reason = resultDeadLetter, d.poison
	case err != nil:
		switch r := consumer.Decide(err); r.Action {
		case consumer.ActionRetry:
			result = resultRetry
		case consumer.ActionDeadLetter:
			result, reason = resultDeadLetter, r.Reason
			if d.poison == "" {
				// The handler's error: the poison queue further out
				// publishes the message with its reason.
				if d.msg.Metadata == nil {
					d.msg.Metadata = make(message.Metadata)
				}
				d.msg.Metadata.Set(MetadataReason, string(reason))
			}
		}
	}
	d.c.msgs.Result(d.ctx, d.topic, result, string(reason), d.took())
	d.end(result, err)
	if d.poison != "" && err != nil && d.c.PoisonQueue != nil {
		// The poison queue did not take the message: err says why,
		// next to the poison error.
		d.err = err
	}
	d.sendReport()
	return out, err
}

// report keeps msg's outcome for the report sent when the middleware's
// answer is final.
func (d *delivery) report(key dedup.Key, o consumer.Outcome, err error) {
	d.key, d.outcome, d.err = key, o, err
}

// sendReport calls Options.OnOutcome with the outcome kept by report, once.
func (d *delivery) sendReport() {
	if d.outcome == "" || d.c.OnOutcome == nil {
		return
	}
	o := d.outcome
	d.outcome = ""
	d.c.OnOutcome(d.ctx, consumer.Report{Outcome: o, Key: d.key, Err: d.err})
}

// took is the time since the delivery began, or 0 when not timed.
func (d *delivery) took() time.Duration {
	if !d.timed {
		return 0
	}
	return time.Since(d.start)
}

// finish runs last (deferred): after a panic it records a retry (the
// message was not acknowledged; Recoverer or the router decides), and it
// gives the message its own context back.
func (d *delivery) finish() {
	if !d.done {
		d.c.msgs.Result(d.ctx, d.topic, resultRetry, "", d.took())
		d.end(resultRetry, errPanicked)
		d.sendReport()
	}
	d.msg.SetContext(d.orig)
}

// spanEnd ends a span started by telemetry.StartSpan.
type spanEnd = func(err error, more ...attribute.KeyValue)

// startClaim starts the idem.claim span; call it only under a recording
// span (telemetry.Recording), so that the key's hash and the attributes are
// computed only then.
func startClaim(ctx context.Context, tel *telemetry.Dedup, key dedup.Key) (context.Context, spanEnd) {
	return telemetry.StartSpan(ctx, tel.Tracer, "idem.claim", tel.SpanAttrs(key.Hash())...)
}

// endClaim ends a claim span (when there is one) with its outcome.
func endClaim(end spanEnd, err error, outcome string) {
	if end != nil {
		end(err, telemetry.AttrOutcome.String(outcome))
	}
}
