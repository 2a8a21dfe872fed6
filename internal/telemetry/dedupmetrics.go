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
	claimO  map[string]metric.MeasurementOption
	handleO map[string]metric.MeasurementOption
	lostO   metric.MeasurementOption
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
		claimO:  map[string]metric.MeasurementOption{},
		handleO: map[string]metric.MeasurementOption{},
	}
	base := []attribute.KeyValue{AttrScope.String(scope), AttrStore.String(store)}
	for _, o := range []string{ClaimFirst, ClaimDuplicate, ClaimInFlight, ClaimFingerprintMismatch, ClaimInvalidKey, ClaimError} {
		d.claimO[o] = metric.WithAttributeSet(attribute.NewSet(append(base[:2:2], AttrOutcome.String(o))...))
	}
	for _, o := range []string{"completed", "released", "lease_lost", "complete_failed"} {
		d.handleO[o] = metric.WithAttributeSet(attribute.NewSet(append(base[:2:2], AttrOutcome.String(o))...))
	}
	d.lostO = metric.WithAttributeSet(attribute.NewSet(base...))
	return d
}

func (d *Dedup) claimOpt(outcome string) metric.MeasurementOption {
	if o, ok := d.claimO[outcome]; ok {
		return o
	}
	return d.claimO[ClaimError]
}

// Claimed records one claim that took since start.
func (d *Dedup) Claimed(ctx context.Context, outcome string, took time.Duration) {
	o := d.claimOpt(outcome)
	d.claims.Add(ctx, 1, o)
	d.claimD.Record(ctx, took.Seconds(), o)
}

// ClaimedN records n claims of one outcome (a batch) that took took in all;
// the duration is recorded once per claim, as the batch's time.
func (d *Dedup) ClaimedN(ctx context.Context, outcome string, n int, took time.Duration) {
	if n <= 0 {
		return
	}
	o := d.claimOpt(outcome)
	d.claims.Add(ctx, int64(n), o)
	d.claimD.Record(ctx, took.Seconds(), o)
}

// Handled records how a handler run under a claim ended: completed,
// released, lease_lost or complete_failed.
func (d *Dedup) Handled(ctx context.Context, outcome string, took time.Duration) {
	o, ok := d.handleO[outcome]
	if !ok {
		return
	}
	d.handleD.Record(ctx, took.Seconds(), o)
	if outcome == "lease_lost" {
		d.lost.Add(ctx, 1, d.lostO)
	}
}

// Scope is the scope the instruments report.
func (d *Dedup) Scope() string { return d.scope }

// Store is the store name the instruments report.
func (d *Dedup) Store() string { return d.store }
