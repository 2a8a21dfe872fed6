package consumer

import (
	"context"
	"time"
)

// Message is one delivery of a message, independent of the broker that
// delivered it. Adapters fill it in; middleware and handlers read it.
type Message struct {
	// ID is the producer-assigned id, stable across retries and
	// re-publishes: the id half of the dedup key (see DedupOptions.KeyFunc).
	ID string
	// Key is the partition or routing key. It may be nil.
	Key []byte
	// Payload is the message body. The default fingerprint is its SHA-256.
	Payload []byte
	// Headers are the message's application headers.
	Headers map[string]string
	// Topic is the topic, queue or route the message came from.
	Topic string
	// Metadata is broker metadata: partition, offset, delivery tag and the
	// like. Keys are adapter-specific.
	Metadata map[string]string
	// Attempt is the delivery attempt as counted by idem's adapter,
	// 1-based. The Retry middleware leaves it alone: its in-process attempt
	// is in the context (see RetryAttempt).
	Attempt int
	// Redelivered is the broker's redelivered flag. It is a hint for logs
	// and metrics only: nothing in idem decides on it.
	Redelivered bool
	// Time is when the message was produced or delivered, as the broker
	// reports it; the zero time when unknown.
	Time time.Time
	// Slot is a handler slot an adapter may attach, when it works on more
	// deliveries at once than it runs handlers: Dedup gives it up while it
	// waits on the store and takes it back before the handler runs. Back
	// waits for a free slot and returns an error when none can be had (the
	// context ended, the adapter is stopping): the handler then does not
	// run. The slot is the outermost Dedup's, or Transactional's, which
	// keeps it throughout: a Dedup the handler runs under its context, on
	// this message or another, leaves it alone. Nil when the adapter
	// attaches none.
	Slot interface {
		Away()
		Back(ctx context.Context) error
	}
}

// Handler processes one message. A nil error means the effect committed and
// the message may be acknowledged; see Decide for how errors are classified.
type Handler interface {
	Handle(ctx context.Context, msg *Message) error
}

// HandlerFunc adapts a function to a Handler.
type HandlerFunc func(ctx context.Context, msg *Message) error

// Handle calls f(ctx, msg).
func (f HandlerFunc) Handle(ctx context.Context, msg *Message) error { return f(ctx, msg) }

// Middleware wraps a Handler with more behaviour.
type Middleware func(Handler) Handler

// Chain wraps h with mws. The first middleware is the outermost: Chain(h, a,
// b) is a(b(h)), so a message passes a, then b, then reaches h. Nil
// middlewares are skipped, which lets a caller leave out an optional one.
func Chain(h Handler, mws ...Middleware) Handler {
	for i := len(mws) - 1; i >= 0; i-- {
		if mws[i] != nil {
			h = mws[i](h)
		}
	}
	return h
}
