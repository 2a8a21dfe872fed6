package telemetry

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// Dedup is the instrument set of one claiming component (a Dedup or
// Transactional handler, the Watermill or HTTP middleware): one scope, one
// store. Attribute sets are built once, so a record allocates nothing.
type Dedup struct {
	Tracer  trace.Tracer
	scope   string
	store   string
	claims  metric.Int64Counter
	claimD  metric.Float64Histogram
	handleD metric.Float64Histogram
	lost    metric.Int64Counter
	// Option slices built once, indexed by outcome (claimIndex,
	// handledIndex): passing them with ... allocates nothing, where a
	// variadic call with a fresh option would.
	claimA  [len(claimOutcomes)][]metric.AddOption
	claimR  [len(claimOutcomes)][]metric.RecordOption
	handleR [len(handledOutcomes)][]metric.RecordOption
	lostA   []metric.AddOption
}

// NewDedup creates the instruments for scope and store on mp and tp (nil:
// the globals).
func NewDedup(mp metric.MeterProvider, tp trace.TracerProvider, scope, store string) *Dedup {
	m := Meter(mp)
	d := &Dedup{
		Tracer:  Tracer(tp),
		scope:   scope,
		store:   store,
		claims:  Counter(m, MetricClaims, "{claim}", "Claims of an idempotency key, by outcome."),
		claimD:  Histogram(m, MetricClaimDuration, "Time a claim of an idempotency key took."),
		handleD: Histogram(m, MetricHandlerDuration, "Time the handler ran under a claim, by how it ended."),
		lost:    Counter(m, MetricLeaseLost, "{lease}", "Leases lost while the handler ran."),
	}
	base := []attribute.KeyValue{AttrScope.String(scope), AttrStore.String(store)}
	for i, o := range claimOutcomes {
		set := metric.WithAttributeSet(attribute.NewSet(append(base[:2:2], AttrOutcome.String(o))...))
		d.claimA[i] = []metric.AddOption{set}
		d.claimR[i] = []metric.RecordOption{set}
	}
	for i, o := range handledOutcomes {
		d.handleR[i] = []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(append(base[:2:2], AttrOutcome.String(o))...))}
	}
	d.lostA = []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(base...))}
	return d
}

// claimOutcomes are the idem.claims outcomes, in claimIndex order.
var claimOutcomes = [...]string{ClaimFirst, ClaimDuplicate, ClaimInFlight, ClaimFingerprintMismatch, ClaimInvalidKey, ClaimError}

// claimIndex is outcome's place in claimOutcomes; an unknown outcome counts
// as an error.
func claimIndex(outcome string) int {
	switch outcome {
	case ClaimFirst:
		return 0
	case ClaimDuplicate:
		return 1
	case ClaimInFlight:
		return 2
	case ClaimFingerprintMismatch:
		return 3
	case ClaimInvalidKey:
		return 4
	}
	return 5
}

// handledOutcomes are how a handler under a claim ends, in handledIndex
// order.
var handledOutcomes = [...]string{HandledCompleted, HandledReleased, HandledLeaseLost, HandledCompleteFailed}

// handledIndex is outcome's place in handledOutcomes, or -1.
func handledIndex(outcome string) int {
	switch outcome {
	case HandledCompleted:
		return 0
	case HandledReleased:
		return 1
	case HandledLeaseLost:
		return 2
	case HandledCompleteFailed:
		return 3
	}
	return -1
}

func (d *Dedup) opts(outcome string) ([]metric.AddOption, []metric.RecordOption) {
	i := claimIndex(outcome)
	return d.claimA[i], d.claimR[i]
}

// Timed reports whether the duration histograms record anything for ctx:
// callers read the clock only then.
func (d *Dedup) Timed(ctx context.Context) bool {
	return d.claimD.Enabled(ctx) || d.handleD.Enabled(ctx)
}

// Claimed records one claim that took took.
func (d *Dedup) Claimed(ctx context.Context, outcome string, took time.Duration) {
	a, r := d.opts(outcome)
	d.claims.Add(ctx, 1, a...)
	d.claimD.Record(ctx, took.Seconds(), r...)
}

// ClaimedN records n claims of one outcome (a batch) that took took in all;
// the duration is recorded once, as the batch's time.
func (d *Dedup) ClaimedN(ctx context.Context, outcome string, n int, took time.Duration) {
	if n <= 0 {
		return
	}
	a, r := d.opts(outcome)
	d.claims.Add(ctx, int64(n), a...)
	d.claimD.Record(ctx, took.Seconds(), r...)
}

// Handled records how a handler run under a claim ended: completed,
// released, lease_lost or complete_failed.
func (d *Dedup) Handled(ctx context.Context, outcome string, took time.Duration) {
	i := handledIndex(outcome)
	if i < 0 {
		return
	}
	d.handleD.Record(ctx, took.Seconds(), d.handleR[i]...)
	if outcome == "lease_lost" {
		d.lost.Add(ctx, 1, d.lostA...)
	}
}

// LeaseLost counts a lease lost before its handler ran (while the
// delivery waited for a handler slot): idem.lease.lost without a handler
// duration.
func (d *Dedup) LeaseLost(ctx context.Context) {
	d.lost.Add(ctx, 1, d.lostA...)
}

// Scope is the scope the instruments report.
func (d *Dedup) Scope() string { return d.scope }

// Store is the store name the instruments report.
func (d *Dedup) Store() string { return d.store }
