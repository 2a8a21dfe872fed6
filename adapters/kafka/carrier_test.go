package idemkafka_test

import (
	"context"
	"slices"
	"strings"
	"testing"

	kafkago "github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/internal/telemetry"
)

const validTP = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"

var w3c = propagation.NewCompositeTextMapPropagator(propagation.TraceContext{}, propagation.Baggage{})

func TestHeaderCarrier(t *testing.T) {
	hs := []kafkago.Header{
		{Key: "traceparent", Value: []byte("00-first")},
		{Key: "other", Value: []byte("x")},
		{Key: "traceparent", Value: []byte(validTP)},
		{Key: "Tracestate", Value: []byte("a=b")},
	}
	c := (*idemkafka.HeaderCarrier)(&hs)
	if got := c.Get("traceparent"); got != validTP {
		t.Errorf("Get of a repeated header = %q, want the last one", got)
	}
	if got := c.Get("tracestate"); got != "" {
		t.Errorf("Get is case-sensitive; got %q", got)
	}
	if got := c.Keys(); !slices.Equal(got, []string{"traceparent", "other", "Tracestate"}) {
		t.Errorf("Keys = %v", got)
	}
	sc := trace.SpanContextFromContext(w3c.Extract(context.Background(), c))
	if sc.TraceID().String() != "4bf92f3577b34da6a3ce929d0e0e4736" {
		t.Errorf("extracted trace %v", sc.TraceID())
	}

	shared := hs[:2:4]
	sc2 := (*idemkafka.HeaderCarrier)(&shared)
	sc2.Set("traceparent", "00-new")
	if len(shared) != 2 || shared[1].Key != "traceparent" || string(shared[1].Value) != "00-new" || shared[0].Key != "other" {
		t.Errorf("after Set: %v", shared)
	}
	if string(hs[0].Value) != "00-first" || string(hs[1].Value) != "x" {
		t.Errorf("Set modified the slice it came from: %v", hs)
	}

	var none []kafkago.Header
	nc := (*idemkafka.HeaderCarrier)(&none)
	if nc.Get("traceparent") != "" || len(nc.Keys()) != 0 {
		t.Error("an empty carrier is not empty")
	}
	w3c.Inject(trace.ContextWithSpanContext(context.Background(), sc), nc)
	if nc.Get("traceparent") != validTP {
		t.Errorf("Inject then Get = %q", nc.Get("traceparent"))
	}
}

// A 1 MB header value reads as absent: the extracted context is empty and
// the consumer span starts a new trace.
func TestHeaderCarrierHugeValue(t *testing.T) {
	huge := validTP + strings.Repeat(" ", 1<<20)
	hs := []kafkago.Header{
		{Key: "traceparent", Value: []byte(huge)},
		{Key: "baggage", Value: []byte(strings.Repeat("k=v,", 1<<18))},
		{Key: "tracestate", Value: nil},
	}
	c := (*idemkafka.HeaderCarrier)(&hs)
	if got := c.Get("traceparent"); got != "" {
		t.Errorf("Get of a 1 MB value = %d bytes, want none", len(got))
	}
	ctx := w3c.Extract(context.Background(), c)
	if trace.SpanContextFromContext(ctx).IsValid() {
		t.Error("a span context was extracted from a 1 MB header")
	}
	exact := []kafkago.Header{{Key: "x", Value: []byte(strings.Repeat("a", telemetry.MaxHeaderValue))}}
	if got := (*idemkafka.HeaderCarrier)(&exact).Get("x"); len(got) != telemetry.MaxHeaderValue {
		t.Errorf("a value of exactly MaxHeaderValue bytes reads as %d bytes", len(got))
	}
}

// FuzzHeaderCarrier: any headers, any lookup; Get returns the last value of
// the name when it is short enough, and extracting never panics.
func FuzzHeaderCarrier(f *testing.F) {
	f.Add("traceparent", []byte(validTP), "traceparent", []byte("00-x"), "traceparent")
	f.Add("baggage", []byte("a=b;c"), "tracestate", []byte{0, 0xff}, "baggage")
	f.Add("", []byte(nil), "", []byte(""), "")
	f.Fuzz(func(t *testing.T, k1 string, v1 []byte, k2 string, v2 []byte, get string) {
		hs := []kafkago.Header{{Key: k1, Value: v1}, {Key: k2, Value: v2}}
		c := (*idemkafka.HeaderCarrier)(&hs)
		want := ""
		for _, h := range hs {
			if h.Key == get {
				want = string(h.Value)
			}
		}
		if len(want) > telemetry.MaxHeaderValue {
			want = ""
		}
		if got := c.Get(get); got != want {
			t.Fatalf("Get(%q) = %q, want %q", get, got, want)
		}
		_ = w3c.Extract(context.Background(), c)
		_ = c.Keys()
		c.Set(get, "v")
		if c.Get(get) != "v" {
			t.Fatalf("Set then Get(%q) = %q", get, c.Get(get))
		}
	})
}
