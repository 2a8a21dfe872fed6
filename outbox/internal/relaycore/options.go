package relaycore

import (
	"errors"
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/propagation"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/backoff"
	"github.com/idemkit/idem/internal/telemetry"
)

// Int is a count option: zero means Def, negative is refused, and so is
// more than Max.
type Int struct {
	Name     string
	V        *int
	Def, Max int
}

// Duration is a duration option: zero means Def, negative or under 1ms
// is refused.
type Duration struct {
	Name string
	V    *time.Duration
	Def  time.Duration
}

// FillInts checks and defaults ints in order; errors start with prefix
// ("pgoutbox: RelayOptions.").
func FillInts(prefix string, ints ...Int) error {
	for _, f := range ints {
		if *f.V < 0 {
			return fmt.Errorf("%s%s is %d; it must not be negative (zero means the default)", prefix, f.Name, *f.V)
		}
		if *f.V == 0 {
			*f.V = f.Def
		}
		if *f.V > f.Max {
			return fmt.Errorf("%s%s is %d; the most is %d", prefix, f.Name, *f.V, f.Max)
		}
	}
	return nil
}

// FillDurations checks and defaults durs in order; errors start with
// prefix.
func FillDurations(prefix string, durs ...Duration) error {
	for _, d := range durs {
		if *d.V < 0 {
			return fmt.Errorf("%s%s is %v; it must not be negative (zero means the default)", prefix, d.Name, *d.V)
		}
		if *d.V == 0 {
			*d.V = d.Def
		}
		if *d.V < time.Millisecond {
			return fmt.Errorf("%s%s is %v; use at least 1ms", prefix, d.Name, *d.V)
		}
	}
	return nil
}

// Common are the relay options every relay has, filled by FillCommon.
type Common struct {
	// Backoff spaces the attempts of a failed message; BackoffDef is its
	// default.
	Backoff    *consumer.Backoff
	BackoffDef consumer.Backoff
	// ReconnectBackoff spaces the retries of a session; its default is
	// Initial 100ms, Max 10s, Factor 2.
	ReconnectBackoff *consumer.Backoff
	CleanupInterval  *time.Duration
	Telemetry        *consumer.Telemetry
}

// DefaultReconnectBackoff is the default of every relay's
// RelayOptions.ReconnectBackoff.
var DefaultReconnectBackoff = consumer.Backoff{Initial: 100 * time.Millisecond, Max: 10 * time.Second, Factor: 2}

// errOnOutcome is FillCommon's answer to a set Telemetry.OnOutcome.
var errOnOutcome = errors.New("OnOutcome is set, but a relay reports no consumer.Report: " +
	"its MeterProvider counts the messages published, retried and parked dead (idem.outbox.published, .retried, .dead); leave OnOutcome nil")

// FillCommon fills both backoffs with their defaults and checks them
// (their Initial at least 1ms), defaults CleanupInterval to a minute and
// the Logger to def, and refuses a set OnOutcome: a relay publishes rows,
// it settles no consumer message to report on.
func FillCommon(prefix string, c Common, def *slog.Logger) error {
	for _, b := range []struct {
		name string
		v    *consumer.Backoff
		def  consumer.Backoff
	}{{"Backoff", c.Backoff, c.BackoffDef}, {"ReconnectBackoff", c.ReconnectBackoff, DefaultReconnectBackoff}} {
		v, err := b.v.WithDefaults(b.def)
		if err != nil {
			return fmt.Errorf("%s%s: %w", prefix, b.name, err)
		}
		if v.Initial < time.Millisecond {
			return fmt.Errorf("%s%s.Initial is %v; use at least 1ms", prefix, b.name, v.Initial)
		}
		*b.v = v
	}
	if c.Telemetry.OnOutcome != nil {
		return fmt.Errorf("%s%w", prefix, errOnOutcome)
	}
	if *c.CleanupInterval == 0 {
		*c.CleanupInterval = time.Minute
	}
	if c.Telemetry.Logger == nil {
		c.Telemetry.Logger = def
	}
	return nil
}

// Growing is the reconnect loop's delay of b: Initial, growing by Factor
// up to Max, each spread ±20%.
func Growing(b consumer.Backoff) backoff.Growing {
	return backoff.Growing{Min: b.Initial, Max: b.Max, Factor: b.Factor}
}

// CheckRetentions refuses a negative retention, or one under 1ms; zero
// is left for the default. Errors start with prefix ("pgoutbox:
// Options.").
func CheckRetentions(prefix string, durs ...Duration) error {
	for _, d := range durs {
		if *d.V < 0 {
			return fmt.Errorf("%s%s is %v; it must not be negative (zero means the default)", prefix, d.Name, *d.V)
		}
		if *d.V > 0 && *d.V < time.Millisecond {
			return fmt.Errorf("%s%s is %v; use at least 1ms", prefix, d.Name, *d.V)
		}
	}
	return nil
}

// OutboxDefaults are the outbox options every outbox has, filled by
// FillOutbox.
type OutboxDefaults struct {
	Retention    *time.Duration
	CleanupBatch *int
	Propagator   *propagation.TextMapPropagator
	Logger       **slog.Logger
}

// FillOutbox refuses a negative CleanupBatch and fills the defaults: W3C
// Trace Context, 24 hours of retention, 1000 rows a cleanup statement,
// slog.Default().
func FillOutbox(prefix string, o OutboxDefaults) error {
	if *o.CleanupBatch < 0 {
		return fmt.Errorf("%sCleanupBatch is %d; it must not be negative", prefix, *o.CleanupBatch)
	}
	if *o.Propagator == nil {
		*o.Propagator = telemetry.DefaultPropagator
	}
	if *o.Retention == 0 {
		*o.Retention = 24 * time.Hour
	}
	if *o.CleanupBatch == 0 {
		*o.CleanupBatch = 1000
	}
	if *o.Logger == nil {
		*o.Logger = slog.Default()
	}
	return nil
}
