package consumer

import (
	"cmp"
	"time"

	"github.com/idemkit/idem/internal/backoff"
	"github.com/idemkit/idem/internal/defaults"
)

// Backoff shapes the delays of a retry loop: the delay before retry n
// (1, 2, ...) is Initial·Factor^(n-1), at most Max. It is the one way idem
// is told how long to wait between retries: the Backoff field of
// RetryOptions and of the adapters' options (Kafka, RabbitMQ, the HTTP
// Transport) for a message's retries, and ReconnectBackoff for a
// reconnecting client. Each loop adds its own jitter around Delay.
//
// The zero value, and each zero field, means the defaults of the options
// struct that holds the Backoff: its documentation gives them. A negative
// field, a Factor below 1 or an Initial above Max is refused by that
// struct's constructor.
type Backoff struct {
	// Initial is the delay before the first retry.
	Initial time.Duration
	// Max caps every delay.
	Max time.Duration
	// Factor multiplies the delay from one retry to the next; 1 keeps
	// every delay at Initial. Defaults to 2, unless the options struct
	// holding the Backoff says otherwise (RabbitMQ's retry queues use 5).
	Factor float64
}

// Delay returns the delay before retry n (1-based), without jitter:
// Initial·Factor^(n-1), at most Max; Initial (at most Max) for n below 2.
// A zero Factor counts as 2. It never overflows.
func (b Backoff) Delay(n int) time.Duration {
	f := b.Factor
	if f == 0 {
		f = 2
	}
	return backoff.Pow(b.Initial, b.Max, f, n)
}

// WithDefaults returns b with each zero field taken from def (a zero
// Factor in both becomes 2), or an error when a field is negative, Factor
// is below 1 or Initial is above Max. Options structs that hold a Backoff
// call it in their constructor; the error names the field ("Initial is
// -1s; it must be positive (or zero for 100ms)"), to be prefixed with the
// Backoff's own name.
func (b Backoff) WithDefaults(def Backoff) (Backoff, error) {
	c := defaults.New("")
	c.Duration("Initial", &b.Initial, def.Initial)
	c.Duration("Max", &b.Max, def.Max)
	c.Factor("Factor", &b.Factor, cmp.Or(def.Factor, 2))
	c.Order("Initial", b.Initial, "Max", b.Max)
	return b, c.Err()
}
