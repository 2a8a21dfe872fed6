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
	// Option slices built once: passing them with ... allocates nothing,
	// where a variadic call with a fresh option would.
	claimA  map[string][]metric.AddOption
	claimR  map[string][]metric.RecordOption
	handleR map[string][]metric.RecordOption
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
		claimA:  map[string][]metric.AddOption{},
		claimR:  map[string][]metric.RecordOption{},
		handleR: map[string][]metric.RecordOption{},
	}
	base := []attribute.KeyValue{AttrScope.String(scope), AttrStore.String(store)}
	for _, o := range []string{ClaimFirst, ClaimDuplicate, ClaimInFlight, ClaimFingerprintMismatch, ClaimInvalidKey, ClaimError} {
		set := metric.WithAttributeSet(attribute.NewSet(append(base[:2:2], AttrOutcome.String(o))...))
		d.claimA[o] = []metric.AddOption{set}
		d.claimR[o] = []metric.RecordOption{set}
	}
	for _, o := range []string{"completed", "released", "lease_lost", "complete_failed"} {
		d.handleR[o] = []metric.RecordOption{metric.WithAttributeSet(attribute.NewSet(append(base[:2:2], AttrOutcome.String(o))...))}
	}
	d.lostA = []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(base...))}
	return d
}

func (d *Dedup) opts(outcome string) ([]metric.AddOption, []metric.RecordOption) {
	if a, ok := d.claimA[outcome]; ok {
		return a, d.claimR[outcome]
	}
	return d.claimA[ClaimError], d.claimR[ClaimError]
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
	r, ok := d.handleR[outcome]
	if !ok {
		return
	}
	d.handleD.Record(ctx, took.Seconds(), r...)
	if outcome == "lease_lost" {
		d.lost.Add(ctx, 1, d.lostA...)
	}
}

// Scope is the scope the instruments report.
func (d *Dedup) Scope() string { return d.scope }

// Store is the store name the instruments report.
func (d *Dedup) Store() string { return d.store }
