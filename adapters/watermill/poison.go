package idemwatermill

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"slices"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/telemetry"
)

// MetadataReason is the metadata field that carries why a message went to
// the poison queue: consumer.HeaderReason, the name every adapter uses for
// it. The middleware sets it on a message it rejects as poison, to
// consumer.OutcomeFingerprintMismatch ("fingerprint_mismatch") or
// consumer.OutcomeInvalidKey ("invalid_key"), and on a message whose
// handler returned an error that will never succeed, to consumer.Decide's
// dead-letter reason (consumer.OutcomePermanent for an error marked
// consumer.Permanent). It travels with the message to the poison queue,
// next to the fields Watermill's PoisonQueue sets (reason_poisoned,
// topic_poisoned, ...).
//
// A poison message without a UUID gets one on its way to the poison queue:
// "idem-dl-" and a digest of its payload and metadata, the same for every
// delivery of the message, so a reader of the poison topic can deduplicate
// it like any other.
const MetadataReason = consumer.HeaderReason

// maxErrorMetadata bounds the consumer.HeaderError metadata field.
const maxErrorMetadata = 1 << 10

// poisonError is returned for a message the middleware will never process:
// its key was already seen with other content (Reason
// consumer.OutcomeFingerprintMismatch), or it has no valid key (Reason
// consumer.OutcomeInvalidKey). errors.Is sees through to
// dedup.ErrFingerprintMismatch or dedup.ErrInvalidKey.
//
// The middleware returns it marked consumer.Permanent, or hands it to
// Options.PoisonQueue.
type poisonError struct {
	// Reason is why the message is poison.
	Reason consumer.Outcome
	// Err is the cause.
	Err error
}

func (e *poisonError) Error() string {
	return fmt.Sprintf("idem: poison message (%s): %v", e.Reason, e.Err)
}

func (e *poisonError) Unwrap() error { return e.Err }

// IsPoison reports whether err is the middleware's rejection of a poison
// message: a message whose key was already seen with other content, or that
// has no valid key (the reason is in its consumer.HeaderReason metadata field). It is the filter
// for Watermill's poison queue when only idem's rejections should go there:
//
//	pq, err := middleware.PoisonQueueWithFilter(pub, "poison", watermill.IsPoison)
func IsPoison(err error) bool {
	var pe *poisonError
	return errors.As(err, &pe)
}

// Retryable reports whether running the handler again can change the outcome
// of err, by idem's ACK rule (consumer.Decide): false for nil, for a
// poison error (IsPoison), for errors marked consumer.Permanent and for consumer's panic
// and retries-exhausted errors; true for everything else, including
// dedup.ErrInFlight and dedup.ErrLeaseLost. Plug it into Watermill's Retry
// middleware so that poison goes straight to the poison queue instead of
// being retried:
//
//	retry := middleware.Retry{
//		MaxRetries:  5,
//		ShouldRetry: func(p middleware.RetryParams) bool { return watermill.Retryable(p.Err) },
//	}
func Retryable(err error) bool {
	return err != nil && consumer.Decide(err).Action == consumer.ActionRetry
}

// poison rejects msg: consumer's dead-letter headers go to its metadata
// (the reason, the error, the topic it was consumed from, its UUID as the
// dead letter's id), then the error goes to the poison queue middleware
// when there is one, else back to the router.
func (c *config) poison(d *delivery, msg *message.Message, pe *poisonError) ([]*message.Message, error) {
	d.poison = pe.Reason
	if msg.Metadata == nil {
		msg.Metadata = make(message.Metadata)
	}
	if msg.UUID == "" {
		msg.UUID = deadLetterID(msg)
	}
	msg.Metadata.Set(consumer.HeaderReason, string(pe.Reason))
	errText := pe.Err.Error()
	if len(errText) > maxErrorMetadata {
		errText = errText[:maxErrorMetadata]
	}
	msg.Metadata.Set(consumer.HeaderError, errText)
	if topic := message.SubscribeTopicFromCtx(msg.Context()); topic != "" {
		msg.Metadata.Set(consumer.HeaderSource, topic)
	}
	msg.Metadata.Set(consumer.HeaderID, msg.UUID)
	err := consumer.Permanent(pe)
	if c.PoisonQueue == nil {
		return nil, err
	}
	reject := func(*message.Message) ([]*message.Message, error) { return nil, err }
	return c.PoisonQueue(reject)(msg)
}

// rejectKey handles an error from keyBuilder.build: a *poisonError is an
// invalid key; anything else (no scope, a key function that failed) is
// retried and counted as a claim error.
func (c *config) rejectKey(d *delivery, msg *message.Message, err error) ([]*message.Message, error) {
	d.report(dedup.Key{}, consumer.OutcomeInvalidKey, err)
	tel := c.tel.Get(c.scopeOf(msg))
	var pe *poisonError
	if errors.As(err, &pe) {
		tel.Claimed(d.ctx, telemetry.ClaimInvalidKey, 0)
		return c.poison(d, msg, pe)
	}
	tel.Claimed(d.ctx, telemetry.ClaimError, 0)
	return nil, err
}

// claimFailed turns a claim that granted no ownership into the handler's
// answer: a duplicate is acknowledged without running the handler, a
// conflict or invalid key is poison, a key in flight elsewhere or a store
// error is returned so that the message is retried (fail closed).
func (c *config) claimFailed(d *delivery, msg *message.Message, key dedup.Key, err error) ([]*message.Message, error) {
	switch {
	case errors.Is(err, dedup.ErrDuplicate):
		d.report(key, consumer.OutcomeDuplicate, err)
		return nil, nil
	case errors.Is(err, dedup.ErrFingerprintMismatch):
		d.report(key, consumer.OutcomeFingerprintMismatch, err)
		return c.poison(d, msg, &poisonError{Reason: consumer.OutcomeFingerprintMismatch, Err: fmt.Errorf("watermill: claim %s: %w", key, err)})
	case errors.Is(err, dedup.ErrInvalidKey):
		d.report(key, consumer.OutcomeInvalidKey, err)
		return c.poison(d, msg, &poisonError{Reason: consumer.OutcomeInvalidKey, Err: fmt.Errorf("watermill: claim %s: %w", key, err)})
	case errors.Is(err, dedup.ErrInFlight):
		d.report(key, consumer.OutcomeInFlight, err)
	default:
		d.report(key, consumer.OutcomeStoreError, err)
	}
	return nil, fmt.Errorf("watermill: claim %s: %w", key, err)
}

// deadLetterID is the UUID given to a poison message that has none:
// "idem-dl-" and a digest of its payload and metadata (but MetadataReason).
func deadLetterID(msg *message.Message) string {
	h := sha256.New()
	keys := slices.Sorted(maps.Keys(msg.Metadata))
	for _, k := range keys {
		if k == MetadataReason {
			continue
		}
		_, _ = fmt.Fprintf(h, "%d:%s%d:%s", len(k), k, len(msg.Metadata[k]), msg.Metadata[k])
	}
	h.Write(msg.Payload)
	return "idem-dl-" + hex.EncodeToString(h.Sum(nil)[:16])
}
