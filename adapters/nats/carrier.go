package idemnats

import (
	"github.com/nats-io/nats.go"
	"go.opentelemetry.io/otel/propagation"

	"github.com/idemkit/idem/internal/telemetry"
)

// HeaderCarrier adapts NATS message headers to OpenTelemetry's
// propagation.TextMapCarrier, for ConsumerOptions.Propagator and for
// producers that inject a trace context themselves:
//
//	prop.Inject(ctx, (*idemnats.HeaderCarrier)(&msg.Header))
//
// Get returns the first value of a header, read as absent when longer
// than 8 KiB, so that a hostile header never reaches a propagator's
// parser. Names are matched exactly, as JetStream matches Nats-Msg-Id.
// Set replaces the header's values, making the header map when it is nil.
type HeaderCarrier nats.Header

var _ propagation.TextMapCarrier = (*HeaderCarrier)(nil)

// Get returns the first value of key when it is at most 8 KiB long, else
// "".
func (c *HeaderCarrier) Get(key string) string {
	if vs := (*c)[key]; len(vs) > 0 && len(vs[0]) <= telemetry.MaxHeaderValue {
		return vs[0]
	}
	return ""
}

// Set replaces the values of key with value.
func (c *HeaderCarrier) Set(key, value string) {
	if *c == nil {
		*c = HeaderCarrier{}
	}
	(*c)[key] = []string{value}
}

// Keys returns the header names.
func (c *HeaderCarrier) Keys() []string {
	out := make([]string, 0, len(*c))
	for k := range *c {
		out = append(out, k)
	}
	return out
}
