package idemamqp

import (
	amqp091 "github.com/rabbitmq/amqp091-go"
	"go.opentelemetry.io/otel/propagation"

	"github.com/idemkit/idem/internal/telemetry"
)

// TableCarrier adapts AMQP headers to OpenTelemetry's
// propagation.TextMapCarrier, for the Consumer's ConsumerOptions.Propagator
// and for producers that inject a trace context themselves:
//
//	prop.Inject(ctx, (*idemamqp.TableCarrier)(&publishing.Headers))
//
// A header table holds values of any field type, and a producer may send
// anything: Get returns a value only when it is a string or a []byte of at
// most 8 KiB. Any other type (numbers, booleans, decimals, times, nested
// tables, arrays, nil) and any longer value read as absent, so a hostile
// header never reaches a propagator's parser: the trace starts anew. Names
// are matched exactly. Set stores a string, making the table when it is
// nil.
type TableCarrier amqp091.Table

var _ propagation.TextMapCarrier = (*TableCarrier)(nil)

// Get returns the value of key when it is a string or []byte of at most
// 8 KiB, else "".
func (c *TableCarrier) Get(key string) string {
	switch v := (*c)[key].(type) {
	case string:
		if len(v) <= telemetry.MaxHeaderValue {
			return v
		}
	case []byte:
		if len(v) <= telemetry.MaxHeaderValue {
			return string(v)
		}
	}
	return ""
}

// Set stores value as the string header key.
func (c *TableCarrier) Set(key, value string) {
	if *c == nil {
		*c = TableCarrier{}
	}
	(*c)[key] = value
}

// Keys returns the header names, whatever their values' types.
func (c *TableCarrier) Keys() []string {
	out := make([]string, 0, len(*c))
	for k := range *c {
		out = append(out, k)
	}
	return out
}
