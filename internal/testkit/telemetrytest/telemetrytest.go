// Package telemetrytest reads idem's metrics and spans in tests: an
// in-memory metric reader and span recorder with lookups by name and
// attributes.
package telemetrytest

import (
	"bytes"
	"context"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/metric/noop"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/idemkit/idem/internal/telemetry"
)

// Metrics is a MeterProvider with a manual reader.
type Metrics struct {
	*sdkmetric.MeterProvider
	reader *sdkmetric.ManualReader
	t      testing.TB
}

// NewMetrics returns a MeterProvider whose data the test reads with Sum,
// Count and Points. It is shut down when the test ends.
func NewMetrics(t testing.TB) *Metrics {
	r := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(r))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	return &Metrics{MeterProvider: mp, reader: r, t: t}
}

// Point is one data point: its attributes and its value (a sum, a gauge's
// value, or a histogram's count).
type Point struct {
	Attrs attribute.Set
	Value float64
}

// Points returns every point of the metric name.
func (m *Metrics) Points(name string) []Point {
	m.t.Helper()
	var rm metricdata.ResourceMetrics
	if err := m.reader.Collect(context.Background(), &rm); err != nil {
		m.t.Fatalf("collect metrics: %v", err)
	}
	var out []Point
	for _, sm := range rm.ScopeMetrics {
		for _, md := range sm.Metrics {
			if md.Name != name {
				continue
			}
			switch d := md.Data.(type) {
			case metricdata.Sum[int64]:
				for _, p := range d.DataPoints {
					out = append(out, Point{p.Attributes, float64(p.Value)})
				}
			case metricdata.Sum[float64]:
				for _, p := range d.DataPoints {
					out = append(out, Point{p.Attributes, p.Value})
				}
			case metricdata.Gauge[int64]:
				for _, p := range d.DataPoints {
					out = append(out, Point{p.Attributes, float64(p.Value)})
				}
			case metricdata.Gauge[float64]:
				for _, p := range d.DataPoints {
					out = append(out, Point{p.Attributes, p.Value})
				}
			case metricdata.Histogram[float64]:
				for _, p := range d.DataPoints {
					out = append(out, Point{p.Attributes, float64(p.Count)})
				}
			default:
				m.t.Fatalf("metric %s: unexpected data %T", name, md.Data)
			}
		}
	}
	return out
}

// Names returns the names of every metric with data.
func (m *Metrics) Names() []string {
	m.t.Helper()
	var rm metricdata.ResourceMetrics
	if err := m.reader.Collect(context.Background(), &rm); err != nil {
		m.t.Fatalf("collect metrics: %v", err)
	}
	var out []string
	for _, sm := range rm.ScopeMetrics {
		for _, md := range sm.Metrics {
			out = append(out, md.Name)
		}
	}
	sort.Strings(out)
	return out
}

// Sum adds the values of the points of name whose attributes include every
// one of attrs (a counter's total, a histogram's count).
func (m *Metrics) Sum(name string, attrs ...attribute.KeyValue) float64 {
	m.t.Helper()
	var total float64
	for _, p := range m.Points(name) {
		if Has(p.Attrs, attrs...) {
			total += p.Value
		}
	}
	return total
}

// Has reports whether set holds every one of attrs.
func Has(set attribute.Set, attrs ...attribute.KeyValue) bool {
	for _, a := range attrs {
		v, ok := set.Value(a.Key)
		if !ok || v != a.Value {
			return false
		}
	}
	return true
}

// NoValueContains fails the test when any attribute value of any point of
// any metric contains one of the secrets (message ids, keys).
func (m *Metrics) NoValueContains(secrets ...string) {
	m.t.Helper()
	for _, name := range m.Names() {
		for _, p := range m.Points(name) {
			for _, kv := range p.Attrs.ToSlice() {
				for _, s := range secrets {
					if strings.Contains(kv.Value.String(), s) {
						m.t.Errorf("metric %s attribute %s=%q holds %q", name, kv.Key, kv.Value.String(), s)
					}
				}
			}
		}
	}
}

// Verdict is how many messages of a consumer ended with Result (ack, retry,
// dead_letter) and, for a dead letter, Reason.
type Verdict struct {
	Result, Reason string
	Want           float64
}

// CheckVerdicts checks a consumer's idem.messages and
// messaging.process.duration for one system and destination: each verdict's
// count in both, idem.reason on dead letters only, and total messages in all.
func (m *Metrics) CheckVerdicts(system, destination string, total float64, want ...Verdict) {
	m.t.Helper()
	// A verdict's duration is recorded right after its count, which the
	// caller waited for: wait for the durations too.
	for deadline := time.Now().Add(10 * time.Second); m.Sum(telemetry.MetricProcessDuration) < total && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	for _, w := range want {
		attrs := []attribute.KeyValue{telemetry.AttrSystem.String(system), telemetry.AttrDestination.String(destination), telemetry.AttrResult.String(w.Result)}
		if w.Reason != "" {
			attrs = append(attrs, telemetry.AttrReason.String(w.Reason))
		}
		if got := m.Sum(telemetry.MetricMessages, attrs...); got != w.Want {
			m.t.Errorf("%s{result=%s, reason=%s} = %v, want %v", telemetry.MetricMessages, w.Result, w.Reason, got, w.Want)
		}
		if got := m.Sum(telemetry.MetricProcessDuration, attrs...); got != w.Want {
			m.t.Errorf("%s{result=%s, reason=%s} count = %v, want %v", telemetry.MetricProcessDuration, w.Result, w.Reason, got, w.Want)
		}
	}
	for _, p := range m.Points(telemetry.MetricMessages) {
		r, _ := p.Attrs.Value(telemetry.AttrResult)
		if _, has := p.Attrs.Value(telemetry.AttrReason); has != (r.AsString() == "dead_letter") {
			m.t.Errorf("point %v: idem.reason only on dead letters", p.Attrs.ToSlice())
		}
	}
	if got := m.Sum(telemetry.MetricMessages); got != total {
		m.t.Errorf("%s in all = %v, want %v", telemetry.MetricMessages, got, total)
	}
}

// Reach returns a MeterProvider that closes the returned channel once the
// adds to the int64 counter name reach n in all, whatever their
// attributes; every other instrument is a no-op. Benchmarks wait on it for
// a count (messages published) without collecting metrics in a loop.
func Reach(name string, n int64) (metric.MeterProvider, <-chan struct{}) {
	c := &reachCounter{want: n, done: make(chan struct{})}
	return reachProvider{name: name, c: c}, c.done
}

type reachProvider struct {
	noop.MeterProvider
	name string
	c    *reachCounter
}

func (p reachProvider) Meter(string, ...metric.MeterOption) metric.Meter {
	return reachMeter{name: p.name, c: p.c}
}

type reachMeter struct {
	noop.Meter
	name string
	c    *reachCounter
}

func (m reachMeter) Int64Counter(name string, _ ...metric.Int64CounterOption) (metric.Int64Counter, error) {
	if name == m.name {
		return m.c, nil
	}
	return noop.Int64Counter{}, nil
}

type reachCounter struct {
	noop.Int64Counter
	n    atomic.Int64
	want int64
	once sync.Once
	done chan struct{}
}

func (c *reachCounter) Add(_ context.Context, incr int64, _ ...metric.AddOption) {
	if c.n.Add(incr) >= c.want {
		c.once.Do(func() { close(c.done) })
	}
}

func (c *reachCounter) Enabled(context.Context) bool { return true }

// Spans is a TracerProvider that records ended spans.
type Spans struct {
	*sdktrace.TracerProvider
	rec *tracetest.SpanRecorder
}

// NewSpans returns a TracerProvider that samples everything and records
// ended spans.
func NewSpans(t testing.TB) *Spans {
	rec := tracetest.NewSpanRecorder()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSampler(sdktrace.AlwaysSample()), sdktrace.WithSpanProcessor(rec))
	t.Cleanup(func() { _ = tp.Shutdown(context.Background()) })
	return &Spans{TracerProvider: tp, rec: rec}
}

// Ended returns the ended spans.
func (s *Spans) Ended() []sdktrace.ReadOnlySpan { return s.rec.Ended() }

// Named returns the ended spans called name.
func (s *Spans) Named(name string) []sdktrace.ReadOnlySpan {
	var out []sdktrace.ReadOnlySpan
	for _, sp := range s.rec.Ended() {
		if sp.Name() == name {
			out = append(out, sp)
		}
	}
	return out
}

// Wait waits up to 30 seconds until at least n spans called name ended, and
// returns them; the test fails if they do not.
func (s *Spans) Wait(t testing.TB, name string, n int) []sdktrace.ReadOnlySpan {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if got := s.Named(name); len(got) >= n {
			return got
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d spans %q ended within 30s, want %d", len(s.Named(name)), name, n)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// LogBuffer is a log sink safe for concurrent writes, for tests that read
// what a component logged.
type LogBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *LogBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// String returns everything written so far.
func (l *LogBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}
