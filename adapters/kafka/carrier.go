package idemkafka

import (
	kafkago "github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/propagation"

	"github.com/idemkit/idem/internal/telemetry"
)

// HeaderCarrier adapts a record's headers to OpenTelemetry's
// propagation.TextMapCarrier, for the Consumer's ConsumerOptions.Propagator and for
// producers that inject a trace context themselves:
//
//	prop.Inject(ctx, (*idemkafka.HeaderCarrier)(&rec.Headers))
//
// Header names are matched exactly (Kafka's are case-sensitive). A name
// that appears more than once reads as its last value, as in
// consumer.Message.Headers; Set replaces every occurrence with one header at
// the end. A value longer than 8 KiB reads as absent, so a hostile header
// never reaches a propagator's parser: a 1 MB traceparent starts a new
// trace instead.
type HeaderCarrier []kafkago.Header

var _ propagation.TextMapCarrier = (*HeaderCarrier)(nil)

// Get returns the last value of key, or "" when there is none or it is
// longer than 8 KiB.
func (c *HeaderCarrier) Get(key string) string {
	hs := *c
	for i := len(hs) - 1; i >= 0; i-- {
		if hs[i].Key == key {
			if len(hs[i].Value) > telemetry.MaxHeaderValue {
				return ""
			}
			return string(hs[i].Value)
		}
	}
	return ""
}

// Set replaces the headers named key with one header key: value, appended
// at the end. It builds a new slice: a slice shared with another record is
// not modified.
func (c *HeaderCarrier) Set(key, value string) {
	hs := make([]kafkago.Header, 0, len(*c)+1)
	for _, h := range *c {
		if h.Key != key {
			hs = append(hs, h)
		}
	}
	hs = append(hs, kafkago.Header{Key: key, Value: []byte(value)})
	*c = hs
}

// Keys returns the header names, each once, in the order they first
// appear.
func (c *HeaderCarrier) Keys() []string {
	out := make([]string, 0, len(*c))
	seen := make(map[string]struct{}, len(*c))
	for _, h := range *c {
		if _, ok := seen[h.Key]; !ok {
			seen[h.Key] = struct{}{}
			out = append(out, h.Key)
		}
	}
	return out
}
