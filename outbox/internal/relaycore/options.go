package relaycore

import (
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/propagation"

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

// Common are the relay options every relay has, filled by FillCommon
// after FillDurations.
type Common struct {
	Backoff, MaxBackoff, ReconnectBackoff, MaxReconnectBackoff time.Duration
	CleanupInterval                                            *time.Duration
	Logger                                                     **slog.Logger
}

// FillCommon checks that each backoff's maximum is not shorter than its
// start, defaults CleanupInterval to a minute and Logger to def.
func FillCommon(prefix string, c Common, def *slog.Logger) error {
	if c.MaxBackoff < c.Backoff {
		return fmt.Errorf("%sMaxBackoff %v is shorter than Backoff %v", prefix, c.MaxBackoff, c.Backoff)
	}
	if c.MaxReconnectBackoff < c.ReconnectBackoff {
		return fmt.Errorf("%sMaxReconnectBackoff %v is shorter than ReconnectBackoff %v", prefix, c.MaxReconnectBackoff, c.ReconnectBackoff)
	}
	if *c.CleanupInterval == 0 {
		*c.CleanupInterval = time.Minute
	}
	if *c.Logger == nil {
		*c.Logger = def
	}
	return nil
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
