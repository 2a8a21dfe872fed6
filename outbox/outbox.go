// Package outbox is idem's transactional outbox, broker-neutral part: the
// Message a relay publishes, the Publisher interface the broker adapters
// implement, and the header names every adapter uses.
//
// Outgoing messages are written in the business transaction (see the
// PostgreSQL subpackage) and published by a relay after commit. Every
// published message carries its outbox row id as its message id — a header
// on Kafka (HeaderMessageID), the message-id property on AMQP, the UUID on
// Watermill — so a re-publish after a relay crash is deduplicated by the
// consumer's idem claim.
//
// The PostgreSQL part — Enqueue in the caller's pgx.Tx, the migrations and
// the Relay — is the subpackage outbox/pgoutbox. The broker adapters
// implement Publisher: adapters/amqp (publisher confirms), adapters/kafka.
//
// Trace context present at Enqueue time travels with the message: the
// OpenTelemetry span context of Enqueue's context is stored in the message's
// headers and sent as the W3C HeaderTraceParent and HeaderTraceState
// headers, so the consumer's span continues the trace of the request that
// enqueued the message (the Propagator option of pgoutbox.Options and
// walrelay.Options, an OpenTelemetry propagation.TextMapPropagator, picks
// another format). The relay's publish span links to it without replacing
// it. An application that traces with another library, or not at all, can
// still pass on a traceparent it received: propagation.TraceContext{}.Extract
// puts it in the context (OpenTelemetry's API, no SDK needed), and headers
// set on the Message itself win over the propagated ones.
//
// The relays report their metrics and spans through OpenTelemetry
// (idem.outbox.*, docs/operating.md).
//
// This package imports no driver.
package outbox

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"time"
)

// Header names set on every published message.
const (
	// HeaderMessageID carries the outbox row id where the broker has no
	// message-id property of its own (Kafka headers, Watermill metadata
	// copies). The idem consumers read it by default.
	HeaderMessageID = "idem-message-id"
	// HeaderTraceParent and HeaderTraceState carry the W3C trace context
	// present at Enqueue time.
	HeaderTraceParent = "traceparent"
	HeaderTraceState  = "tracestate"
)

// Message is one outgoing message.
type Message struct {
	// ID is the outbox row id, time-ordered; it is the message id
	// downstream. Set by Enqueue.
	ID string
	// Topic is the Kafka topic, the AMQP exchange (with the routing key in
	// Key), or the Watermill topic.
	Topic string
	// Key orders messages: two messages with the same key are published in
	// commit order. It is the Kafka message key and the AMQP routing key.
	Key []byte
	// Payload is the body.
	Payload []byte
	// Headers are sent as message headers.
	Headers map[string]string
	// CreatedAt is when the message was enqueued (database clock).
	CreatedAt time.Time
	// Attempt is the publish attempt, 1-based. Set by the relay.
	Attempt int
}

// Publisher sends messages to a broker. Publish returns nil only when the
// broker confirmed every message in msgs (Kafka acks from all in-sync
// replicas, AMQP publisher confirms). When some messages failed it returns a
// *PublishError naming them; any other error means the outcome of every
// message is unknown and the relay sends them again. A publisher must be safe
// for use by one relay goroutine at a time; the relay calls it with messages
// in per-key order and publishes a key's next message only after the previous
// one was confirmed.
//
// A publisher sends Message.Headers as they are. ctx may carry the relay's
// publish span (a producer span linked to the messages' traces); the
// headers' HeaderTraceParent is the trace context of Enqueue and must not be
// replaced by the one of ctx, or the consumer's span would continue the
// relay's trace instead of the producer's.
type Publisher interface {
	Publish(ctx context.Context, msgs []*Message) error
}

// PublishError reports the messages of a batch that were not confirmed, by
// their index in the batch. Messages not listed were confirmed.
type PublishError struct {
	Failed map[int]error
}

func (e *PublishError) Error() string {
	idx := make([]int, 0, len(e.Failed))
	for i := range e.Failed {
		idx = append(idx, i)
	}
	sort.Ints(idx)
	parts := make([]string, 0, len(idx))
	for _, i := range idx {
		parts = append(parts, fmt.Sprintf("#%d: %v", i, e.Failed[i]))
	}
	return fmt.Sprintf("outbox: %d of the batch not confirmed: %s", len(idx), strings.Join(parts, "; "))
}
