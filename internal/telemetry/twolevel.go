package telemetry

import (
	"context"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
)

// twoLevelSources are the AttrSource values, in the order of their option
// sets in TwoLevel.
var twoLevelSources = [...]string{
	SourceCacheDuplicate, SourceCacheInFlight, SourceCacheMismatch, SourceCacheUnavailable,
	SourceDatabaseFirst, SourceDatabaseDuplicate, SourceDatabaseOther,
}

// TwoLevel is the instrument of a two-level store: MetricTwoLevelAnswers.
// Attribute sets are built once, so a record allocates nothing.
type TwoLevel struct {
	answers metric.Int64Counter
	opts    map[string][]metric.AddOption
}

// NewTwoLevel creates it on mp (nil: the global provider).
func NewTwoLevel(mp metric.MeterProvider) *TwoLevel {
	t := &TwoLevel{
		answers: Counter(Meter(mp), MetricTwoLevelAnswers, "{call}", "Process calls of a two-level store, by the level that answered (idem.source)."),
		opts:    make(map[string][]metric.AddOption, len(twoLevelSources)),
	}
	for _, s := range twoLevelSources {
		t.opts[s] = []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(AttrSource.String(s)))}
	}
	return t
}

// Answered counts one Process call answered by source (a Source* value).
func (t *TwoLevel) Answered(ctx context.Context, source string) {
	o, ok := t.opts[source]
	if !ok {
		o = []metric.AddOption{metric.WithAttributes(AttrSource.String(source))}
	}
	t.answers.Add(ctx, 1, o...)
}
