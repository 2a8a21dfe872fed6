// Package telemetry holds idem's OpenTelemetry instruments, metric names and
// attribute keys in one place, so every component reports the same names
// and the README list, the dashboard and the tests check against one source.
//
// Everything here is cheap when nobody listens: with the default providers
// (the OpenTelemetry globals, no-ops until the application installs real
// ones) a record is a few atomic loads, and spans start only under a
// recording parent span.
package telemetry

import (
	"context"
	"reflect"
	"strings"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// InstrumentationName names idem's meter and tracer.
const InstrumentationName = "github.com/idemkit/idem"

// The metric names idem exports. Prometheus sees them with dots turned into
// underscores, the unit appended (_seconds) and _total on counters.
const (
	// Claims by outcome: first, duplicate, in_flight,
	// fingerprint_mismatch, invalid_key, error. Attributes: idem.scope,
	// idem.store, idem.outcome.
	MetricClaims = "idem.claims"
	// Time a claim took, seconds. Attributes as MetricClaims.
	MetricClaimDuration = "idem.claim.duration"
	// Time the handler ran under a claim, and how it ended (idem.outcome:
	// completed, released, lease_lost, complete_failed). Attributes:
	// idem.scope, idem.store, idem.outcome.
	MetricHandlerDuration = "idem.handler.duration"
	// Time spent waiting because another owner held the key (Retry's
	// backoff on ErrInFlight, the HTTP middleware's wait). Attributes:
	// idem.scope (when known), idem.wait.outcome.
	MetricLeaseWait = "idem.lease.wait.duration"
	// Leases lost while the handler ran. Attributes: idem.scope, idem.store.
	MetricLeaseLost = "idem.lease.lost"
	// Messages an adapter handled, by result: ack, retry, dead_letter.
	// Attributes: messaging.system, messaging.destination.name,
	// idem.result, idem.reason (dead letters only).
	MetricMessages = "idem.messages"
	// OpenTelemetry's messaging convention: time an adapter spent on one
	// message, from delivery to its verdict. Attributes: messaging.system,
	// messaging.destination.name, messaging.operation.name, idem.result.
	MetricProcessDuration = "messaging.process.duration"
	// Outbox rows not yet published (gauge). Attribute: idem.outbox.table.
	// The WAL relay reports the messages it received from its slot and
	// has not yet published or parked, with idem.outbox.slot too.
	MetricOutboxBacklog = "idem.outbox.backlog"
	// Age of the oldest unpublished row, seconds (gauge). Attribute:
	// idem.outbox.table.
	MetricOutboxOldestAge = "idem.outbox.oldest_age"
	// Rows published, retried, parked as dead. Attributes:
	// idem.outbox.table, messaging.destination.name.
	MetricOutboxPublished = "idem.outbox.published"
	MetricOutboxRetried   = "idem.outbox.retried"
	MetricOutboxDead      = "idem.outbox.dead"
	// Time the relay's publisher took to confirm a batch, seconds.
	// Attributes: idem.outbox.table, idem.result (ok, error).
	MetricOutboxPublishDuration = "idem.outbox.publish.duration"
	// Time from a row's commit (its available time) to the publisher's
	// confirmation, seconds: the relay latency users feel. Attribute:
	// idem.outbox.table.
	MetricOutboxDelay = "idem.outbox.delay"
	// The WAL relay's replication slot (gauges). Attributes:
	// idem.outbox.table, idem.outbox.slot. Lag is the WAL written since the
	// slot's confirmed position, bytes: what the relay has not confirmed
	// yet. Retained is the WAL PostgreSQL keeps for the slot, bytes: the
	// disk a stopped relay costs. Lag age is the time since the commit of
	// the oldest transaction the relay received and has not confirmed,
	// seconds (0 when it confirmed everything it received).
	MetricSlotLag      = "idem.outbox.slot.lag"
	MetricSlotRetained = "idem.outbox.slot.retained"
	MetricSlotLagAge   = "idem.outbox.slot.lag_age"
	// Process calls of a two-level store (dedup/twolevel), by the level
	// that answered. Attribute: idem.source (the Source* values).
	MetricTwoLevelAnswers = "idem.twolevel.answers"
)

// Metrics lists every metric name above, for documentation checks.
var Metrics = []string{
	MetricClaims, MetricClaimDuration, MetricHandlerDuration, MetricLeaseWait,
	MetricLeaseLost, MetricMessages, MetricProcessDuration,
	MetricOutboxBacklog, MetricOutboxOldestAge, MetricOutboxPublished,
	MetricOutboxRetried, MetricOutboxDead, MetricOutboxPublishDuration,
	MetricOutboxDelay, MetricTwoLevelAnswers,
}

// SlotMetrics lists the WAL relay's slot gauges, for documentation checks;
// they are apart from Metrics because only a relay streaming a logical
// replication slot reports them.
var SlotMetrics = []string{MetricSlotLag, MetricSlotRetained, MetricSlotLagAge}

// Attribute keys. None of them ever carries a message id or a key.
const (
	AttrScope       = attribute.Key("idem.scope")
	AttrStore       = attribute.Key("idem.store")
	AttrOutcome     = attribute.Key("idem.outcome")
	AttrResult      = attribute.Key("idem.result")
	AttrReason      = attribute.Key("idem.reason")
	AttrWaitOutcome = attribute.Key("idem.wait.outcome")
	AttrKeyHash     = attribute.Key("idem.key.hash") // spans only
	AttrTable       = attribute.Key("idem.outbox.table")
	AttrSystem      = attribute.Key("messaging.system")
	AttrDestination = attribute.Key("messaging.destination.name")
	AttrOperation   = attribute.Key("messaging.operation.name")
	AttrMessageID   = attribute.Key("messaging.message.id") // spans only
	AttrSource      = attribute.Key("idem.source")
)

// Two-level store sources (AttrSource of MetricTwoLevelAnswers): which
// level answered a Process call.
const (
	SourceCacheDuplicate    = "cache_duplicate"   // completed mark in the cache
	SourceCacheInFlight     = "cache_in_flight"   // live lease in the cache
	SourceCacheMismatch     = "cache_mismatch"    // fingerprint mismatch in the cache
	SourceCacheUnavailable  = "cache_unavailable" // cache failed; the database decided alone
	SourceDatabaseFirst     = "db_first"          // the database claim won
	SourceDatabaseDuplicate = "db_duplicate"      // duplicate the cache did not know
	SourceDatabaseOther     = "db_other"          // mismatch, error or a failed fn
)

// Claim outcomes (AttrOutcome of MetricClaims).
const (
	ClaimFirst               = "first"
	ClaimDuplicate           = "duplicate"
	ClaimInFlight            = "in_flight"
	ClaimFingerprintMismatch = "fingerprint_mismatch"
	ClaimInvalidKey          = "invalid_key"
	ClaimError               = "error"
)

// Handler outcomes (AttrOutcome of MetricHandlerDuration): how a handler
// that ran under a claim ended.
const (
	HandledCompleted      = "completed"       // the key was completed (or the transaction committed)
	HandledReleased       = "released"        // the handler failed; the key was released (or rolled back)
	HandledLeaseLost      = "lease_lost"      // the lease ran out while the handler ran
	HandledCompleteFailed = "complete_failed" // Complete (or the commit) failed after the handler succeeded
)

// durations are histograms in seconds with buckets from 0.5 ms to 60 s.
var durationBuckets = []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}

// Meter returns idem's meter from mp, or from the global provider when mp
// is nil.
func Meter(mp metric.MeterProvider) metric.Meter {
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	return mp.Meter(InstrumentationName)
}

// Tracer returns idem's tracer from tp, or from the global provider when tp
// is nil.
func Tracer(tp trace.TracerProvider) trace.Tracer {
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	return tp.Tracer(InstrumentationName)
}

// Counter creates a counter; an error from the SDK (a bad name) gives a
// no-op, since metrics must never stop message processing.
func Counter(m metric.Meter, name, unit, desc string) metric.Int64Counter {
	c, err := m.Int64Counter(name, metric.WithUnit(unit), metric.WithDescription(desc))
	if err != nil {
		otel.Handle(err)
	}
	return c
}

// Histogram creates a duration histogram in seconds.
func Histogram(m metric.Meter, name, desc string) metric.Float64Histogram {
	h, err := m.Float64Histogram(name, metric.WithUnit("s"), metric.WithDescription(desc),
		metric.WithExplicitBucketBoundaries(durationBuckets...))
	if err != nil {
		otel.Handle(err)
	}
	return h
}

// StoreName names a store for the idem.store attribute: the last element of
// its package path (memstore, pgtable, redisnx, twolevel), or "custom".
func StoreName(store any) string {
	t := reflect.TypeOf(store)
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t == nil || t.PkgPath() == "" {
		return "custom"
	}
	p := t.PkgPath()
	return p[strings.LastIndexByte(p, '/')+1:]
}

// Seconds converts a duration for a histogram.
func Seconds(d time.Duration) float64 { return d.Seconds() }

// Recording reports whether ctx carries a recording span: the condition
// under which StartSpan and RecordSpan do anything. Callers use it to skip
// building span attributes nobody will see.
func Recording(ctx context.Context) bool { return trace.SpanFromContext(ctx).IsRecording() }

// StartSpan starts a span only when ctx already carries a recording span,
// so a consumer nobody traces pays nothing. The returned end function
// records err (if any) and ends the span; it is never nil.
func StartSpan(ctx context.Context, t trace.Tracer, name string, attrs ...attribute.KeyValue) (context.Context, func(err error, more ...attribute.KeyValue)) {
	if !trace.SpanFromContext(ctx).IsRecording() {
		return ctx, func(error, ...attribute.KeyValue) {}
	}
	ctx, span := t.Start(ctx, name, trace.WithAttributes(attrs...))
	return ctx, func(err error, more ...attribute.KeyValue) {
		if len(more) > 0 {
			span.SetAttributes(more...)
		}
		if err != nil {
			span.RecordError(err)
			span.SetStatus(codes.Error, err.Error())
		}
		span.End()
	}
}

// RecordSpan records a span that already happened, from start to end, under
// the recording span in ctx (nothing otherwise): used for the claim and
// commit phases of a store call that runs them around a callback.
func RecordSpan(ctx context.Context, t trace.Tracer, name string, start, end time.Time, err error, attrs ...attribute.KeyValue) {
	if !trace.SpanFromContext(ctx).IsRecording() {
		return
	}
	_, span := t.Start(ctx, name, trace.WithTimestamp(start), trace.WithAttributes(attrs...))
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End(trace.WithTimestamp(end))
}
