package outbox

import "time"

// Metrics receives a relay's measurements. Counters are reported per topic,
// as they happen; the backlog is sampled periodically. Implementations must
// be fast and safe for concurrent use: the relay calls them from its
// goroutines. Embed NopMetrics to implement only some of them.
//
// The PostgreSQL relay reports the same measurements, and more (publish
// latency, delay), through OpenTelemetry (pgoutbox.RelayOptions.MeterProvider);
// a Metrics set alongside keeps receiving its calls.
type Metrics interface {
	// Published counts messages the broker confirmed and the relay then
	// marked published (or deleted).
	Published(topic string, n int)
	// Retried counts failed publish attempts that will be retried after a
	// backoff.
	Retried(topic string, n int)
	// Dead counts messages parked as dead after their last attempt.
	Dead(topic string, n int)
	// Backlog reports the number of unpublished (pending, not dead)
	// messages of the whole outbox and the age of the oldest one (zero when
	// there is none).
	Backlog(pending int64, oldest time.Duration)
}

// NopMetrics implements Metrics and does nothing.
type NopMetrics struct{}

// Published does nothing.
func (NopMetrics) Published(string, int) {}

// Retried does nothing.
func (NopMetrics) Retried(string, int) {}

// Dead does nothing.
func (NopMetrics) Dead(string, int) {}

// Backlog does nothing.
func (NopMetrics) Backlog(int64, time.Duration) {}

var _ Metrics = NopMetrics{}
