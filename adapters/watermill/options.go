package idemwatermill

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/defaults"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/outbox"
	"go.opentelemetry.io/otel/propagation"
)

// defaultFinishTimeout is the default Options.FinishTimeout.
const defaultFinishTimeout = 10 * time.Second

// Options configure Dedup and Transactional. The zero value is usable; each
// field says its default.
type Options struct {
	// Scope names who processes the messages, the first half of the dedup
	// key. Two handlers of the same message need two scopes, or the second
	// never runs. Defaults to the name of the router handler the message
	// is delivered to (message.HandlerNameFromCtx), so every handler of a
	// router is its own scope and the instances of a service that register
	// the same handler name share one. Set it when handler names are not
	// stable across deployments, or to give two handler names one scope.
	// At most MaxKeyLen bytes, no control bytes.
	Scope string
	// KeyMetadata names a metadata field that holds the message id, the
	// second half of the dedup key. Defaults to "": the id is msg.UUID,
	// which idem's outbox Publisher sets to the outbox row id.
	KeyMetadata string
	// KeyFunc returns a message's id; when set, KeyMetadata is ignored. An
	// empty or malformed id makes the message poison (OutcomeInvalidKey, see
	// Options.PoisonQueue); so does an error that wraps
	// dedup.ErrInvalidKey or is marked consumer.Permanent. Any other error
	// is returned as is (the message is retried).
	//
	// The id must be assigned by the producer and stay the same across
	// redeliveries. A key derived from the broker's position (an offset)
	// catches broker redeliveries only, never a producer that publishes
	// the same message twice.
	KeyFunc func(msg *message.Message) (string, error)
	// Fingerprint returns the digest of a message's content. The same id
	// with another fingerprint is a conflict: the message is poison
	// (OutcomeFingerprintMismatch) and never processed. Defaults to
	// dedup.FingerprintOf(msg.Payload). Return the zero Fingerprint to
	// turn the check off.
	Fingerprint func(msg *message.Message) dedup.Fingerprint
	// MaxKeyLen limits scope and id, in bytes. Defaults to
	// dedup.DefaultMaxKeyLen. Match the store's own limit.
	MaxKeyLen int

	// PoisonQueue receives the messages the middleware finds
	// unprocessable: a fingerprint mismatch or an invalid key. Pass
	// the middleware built by Watermill's middleware.PoisonQueue or
	// middleware.PoisonQueueWithFilter; the idem middleware runs it around
	// a handler that returns the poison error, so the poison queue's filter
	// decides and, when it takes the message, publishes it to its topic and
	// the message is acknowledged. The handler does not run.
	//
	// Either way the message's metadata gets consumer's dead-letter
	// headers (consumer.HeaderReason, HeaderError, HeaderSource, HeaderID).
	// Defaults to nil: a poison error (IsPoison) is returned, marked
	// consumer.Permanent; the router nacks it unless a poison queue
	// further out takes it (see IsPoison).
	PoisonQueue message.HandlerMiddleware

	// ExtendEvery is how often Dedup extends the lease while the handler
	// runs. Defaults to a third of the lease's TTL (no heartbeat when the
	// store reports no TTL). Negative disables the heartbeat. The first
	// extension comes between ExtendEvery/2 and ExtendEvery after the
	// claim, the later ones every ExtendEvery (one timer per middleware
	// serves every handler in flight). Not used by Transactional.
	ExtendEvery time.Duration
	// FinishTimeout bounds Dedup's Complete and Release calls, which run
	// with context.WithoutCancel so that a handler that succeeded just as
	// the router stopped is still recorded. Defaults to
	// 10s. Not used by Transactional.
	FinishTimeout time.Duration

	// Outbox, when set, makes Transactional write the messages the
	// handler returns to the outbox in the handler's transaction, instead
	// of handing them to the router to publish: they commit with the claim
	// and the handler's writes, or not at all, and a relay publishes them
	// (pgoutbox.NewRelay with this package's Publisher, or any other).
	// It must be an Enqueuer[Tx] of the store's transaction type:
	// *pgoutbox.Outbox with pgtable (pgx.Tx), *sqloutbox.Outbox with
	// sqltable (*sql.Tx); Transactional refuses another. Defaults to nil: returned
	// messages are published by the router after the commit, as usual,
	// and a publish that fails after the commit is not retried by a
	// redelivery (it is a duplicate by then). Only for Transactional.
	Outbox any
	// OutboxTopic is the topic of the messages written to the outbox.
	// Defaults to the handler's publish topic (message.PublishTopicFromCtx,
	// the publishTopic of Router.AddHandler).
	OutboxTopic string
	// OutboxKey returns the ordering key of a returned message: messages
	// with the same key are published in commit order. Defaults to no key
	// (no order).
	OutboxKey func(msg *message.Message) []byte

	// Telemetry: the middleware's metrics, spans, logs and outcome reports
	// (consumer's block, shared by every adapter).
	//
	// Logger receives warnings: failed heartbeats, releases and
	// completions, lost leases. Keys appear in it as their hash
	// (dedup.Key.Hash), never raw. Defaults to discarding them
	// (slog.DiscardHandler).
	//
	// OnOutcome, if set, is called once per run of the middleware on a
	// message with its consumer.Report (Outcome, Key, Err; Message is
	// nil, Key.ID names the message), when the middleware's answer is
	// final: after the key was completed or released (or the claiming
	// transaction ended), and after a poison message was handed to
	// Options.PoisonQueue. When the poison queue did not take it, Err
	// holds the poison queue's error next to the poison error, and the
	// router nacks the message. The router acknowledges or nacks the
	// message once the middleware returned. With Watermill's Retry
	// middleware outside this one, each attempt reports. It must be fast
	// and safe for concurrent use.
	//
	// MeterProvider receives the middleware's metrics: idem.claims,
	// idem.claim.duration, idem.handler.duration and idem.lease.lost, with
	// the scope (the handler name, or Options.Scope) and the store as
	// attributes; and idem.messages and messaging.process.duration, the
	// verdict on each message (ack, retry, dead_letter) by topic, with
	// messaging.system "watermill". No attribute carries a message id or a
	// key. Defaults to otel.GetMeterProvider(), a no-op until the
	// application installs a provider.
	//
	// TracerProvider starts the consumer span of each message ("process
	// <topic>", continuing the trace found in the message's metadata, see
	// Propagator) and, under it, the idem.claim, idem.handle and
	// idem.complete (Transactional: idem.commit) spans; the handler runs
	// under idem.handle (msg.Context()). When msg.Context() already holds a
	// recording span (Watermill's or another OpenTelemetry middleware
	// outside this one started it), no consumer span is started: the idem
	// spans become its children. Defaults to otel.GetTracerProvider(), a
	// no-op until the application installs a provider.
	consumer.Telemetry

	// Propagator reads the producer's trace context from the message's
	// metadata (idem's outbox stores it as the traceparent and tracestate
	// headers, which Publisher copies to metadata unchanged). Metadata
	// values longer than 8 KiB are read as absent, so a hostile header
	// cannot make the propagator parse megabytes. Defaults to W3C Trace
	// Context (telemetry.DefaultPropagator; add propagation.Baggage{} in
	// a composite propagator to carry baggage).
	Propagator propagation.TextMapPropagator
	// StoreName is the idem.store metric attribute. Defaults to the
	// store's package name: memstore, pgtable, redisnx, twolevel.
	StoreName string
}

// Enqueuer writes messages to an outbox in the caller's transaction, of
// type Tx. *pgoutbox.Outbox is an Enqueuer[pgx.Tx], *sqloutbox.Outbox an
// Enqueuer[*sql.Tx].
type Enqueuer[Tx any] interface {
	Enqueue(ctx context.Context, tx Tx, msgs ...outbox.Message) ([]string, error)
}

// config is Options validated, with defaults filled in.
type config struct {
	Options
	keys keyBuilder
	// tel are the claim instruments, per scope; msgs the verdicts'.
	tel  *telemetry.Scopes
	msgs *telemetry.Adapter
}

// newConfig validates opts for the middleware who, claiming on store.
func newConfig(who string, opts Options, store any) (*config, error) {
	chk := defaults.New("watermill: " + who + ": Options")
	chk.Int("MaxKeyLen", &opts.MaxKeyLen, dedup.DefaultMaxKeyLen)
	chk.Duration("FinishTimeout", &opts.FinishTimeout, defaultFinishTimeout)
	if err := chk.Err(); err != nil {
		return nil, err
	}
	if opts.Scope != "" {
		if err := validateScope(opts.Scope, opts.MaxKeyLen); err != nil {
			return nil, fmt.Errorf("watermill: %s: Options.Scope %q: %w", who, opts.Scope, err)
		}
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Propagator == nil {
		opts.Propagator = telemetry.DefaultPropagator
	}
	if opts.StoreName == "" {
		opts.StoreName = telemetry.StoreName(store)
	}
	c := &config{
		Options: opts,
		tel:     telemetry.NewScopes(opts.MeterProvider, opts.TracerProvider, opts.StoreName),
		msgs:    telemetry.NewAdapter(opts.MeterProvider, opts.TracerProvider, "watermill"),
	}
	c.keys = keyBuilder{
		scope:       opts.Scope,
		keyMetadata: opts.KeyMetadata,
		keyFunc:     opts.KeyFunc,
		fingerprint: opts.Fingerprint,
		maxLen:      opts.MaxKeyLen,
	}
	return c, nil
}

// validateScope checks a scope like the scope half of a key.
func validateScope(scope string, maxLen int) error {
	return dedup.ValidateKey(dedup.Key{Scope: scope, ID: "x"}, maxLen)
}

// errNoScope is returned for a message that did not come through a router
// handler while Options.Scope is empty. It is a configuration error, not a
// property of the message, so it is not poison: the message is retried.
var errNoScope = errors.New("watermill: the message carries no handler name (it did not come through a message.Router handler) and Options.Scope is empty: set Options.Scope")

// keyBuilder turns a message into a dedup key.
type keyBuilder struct {
	scope       string
	keyMetadata string
	keyFunc     func(*message.Message) (string, error)
	fingerprint func(*message.Message) dedup.Fingerprint
	maxLen      int
}

// build returns msg's key. An error is either a *poisonError (invalid key),
// or a transient error (the key function failed, no scope).
func (b *keyBuilder) build(msg *message.Message) (dedup.Key, error) {
	scope := b.scope
	if scope == "" {
		scope = message.HandlerNameFromCtx(msg.Context())
		if scope == "" {
			return dedup.Key{}, errNoScope
		}
	}
	var id string
	switch {
	case b.keyFunc != nil:
		var err error
		if id, err = b.keyFunc(msg); err != nil {
			return dedup.Key{}, keyFuncError(err)
		}
	case b.keyMetadata != "":
		id = msg.Metadata.Get(b.keyMetadata)
	default:
		id = msg.UUID
	}
	k := dedup.Key{Scope: scope, ID: id}
	if b.fingerprint != nil {
		k.Fingerprint = b.fingerprint(msg)
	} else {
		k.Fingerprint = dedup.FingerprintOf(msg.Payload)
	}
	if err := dedup.ValidateKey(k, b.maxLen); err != nil {
		return dedup.Key{}, b.invalid(scope, err)
	}
	return k, nil
}

func keyFuncError(err error) error {
	if errors.Is(err, dedup.ErrInvalidKey) || consumer.Decide(err).Action == consumer.ActionDeadLetter {
		return &poisonError{Reason: consumer.OutcomeInvalidKey, Err: fmt.Errorf("watermill: key function: %w", err)}
	}
	return fmt.Errorf("watermill: key function: %w", err)
}

// invalid classifies a key that failed validation: a bad handler name is
// configuration (retried, never poison), a bad id is poison.
func (b *keyBuilder) invalid(scope string, err error) error {
	if b.scope == "" {
		if serr := validateScope(scope, b.maxLen); serr != nil {
			return fmt.Errorf("watermill: handler name %q is not a valid scope (set Options.Scope): %w", scope, serr)
		}
	}
	where := "msg.UUID"
	switch {
	case b.keyFunc != nil:
		where = "Options.KeyFunc"
	case b.keyMetadata != "":
		where = fmt.Sprintf("metadata %q", b.keyMetadata)
	}
	return &poisonError{Reason: consumer.OutcomeInvalidKey, Err: fmt.Errorf("watermill: message id from %s: %w", where, err)}
}
