package consumer

import (
	"context"
	"log/slog"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"
)

// Telemetry is the block of observability settings that idem's options
// structs embed: the adapters' (idemkafka.ConsumerOptions,
// idemamqp.ConsumerOptions, idemnats.ConsumerOptions,
// idemwatermill.Options, httpidem.Options), DedupOptions, TxOptions,
// kafkapg.BatchOptions and the outbox relays' RelayOptions: the same four
// fields with the same meaning everywhere. The options struct that embeds
// it says which metrics, spans and log lines its component gives, what
// its Logger defaults to, and which fields it does not use (a relay
// settles no consumer message and refuses an OnOutcome). The zero value
// is usable.
type Telemetry struct {
	// MeterProvider receives the adapter's metrics. Defaults to the
	// OpenTelemetry global, a no-op until the application installs a
	// provider.
	MeterProvider metric.MeterProvider
	// TracerProvider starts the adapter's spans. Defaults to the
	// OpenTelemetry global, a no-op until the application installs a
	// provider.
	TracerProvider trace.TracerProvider
	// Logger receives the adapter's warnings. Message ids and keys
	// appear in it only hashed, payloads never. Defaults to what the
	// embedding options struct says.
	Logger *slog.Logger
	// OnOutcome, if set, is called once per message the adapter settled,
	// with its Report. It must be fast and safe for concurrent use.
	OnOutcome func(ctx context.Context, r Report)
}
