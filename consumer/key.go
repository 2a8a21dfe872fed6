package consumer

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/defaults"
)

// keyBuilder turns a Message into a dedup.Key. Dedup and Transactional share
// it.
type keyBuilder struct {
	scope       string
	keyFunc     func(*Message) (string, error)
	fingerprint func(*Message) dedup.Fingerprint
	maxLen      int
}

func newKeyBuilder(who, scope string, keyFunc func(*Message) (string, error), fp func(*Message) dedup.Fingerprint, maxLen int) (*keyBuilder, error) {
	opts := "DedupOptions"
	if who == "Transactional" {
		opts = "TxOptions"
	}
	c := defaults.New("consumer: " + who + ": " + opts)
	c.Int("MaxKeyLen", &maxLen, dedup.DefaultMaxKeyLen)
	if err := c.Err(); err != nil {
		return nil, err
	}
	if scope == "" {
		return nil, fmt.Errorf("consumer: %s: Scope is required: name the consumer group and handler, for example \"billing/charge-card\"", who)
	}
	if err := dedup.ValidateKey(dedup.Key{Scope: scope, ID: "x"}, maxLen); err != nil {
		return nil, fmt.Errorf("consumer: %s: Scope %q: %w", who, scope, err)
	}
	if keyFunc == nil {
		keyFunc = messageID
	}
	if fp == nil {
		fp = payloadFingerprint
	}
	return &keyBuilder{scope: scope, keyFunc: keyFunc, fingerprint: fp, maxLen: maxLen}, nil
}

func messageID(m *Message) (string, error) { return m.ID, nil }

func payloadFingerprint(m *Message) dedup.Fingerprint { return dedup.FingerprintOf(m.Payload) }

// build returns msg's key. An empty or malformed id is an error wrapping
// dedup.ErrInvalidKey (dead-lettered); an error from the key function is
// returned as the function classified it.
func (b *keyBuilder) build(msg *Message) (dedup.Key, error) {
	if msg == nil {
		return dedup.Key{}, Permanent(fmt.Errorf("consumer: nil message: %w", dedup.ErrInvalidKey))
	}
	id, err := b.keyFunc(msg)
	if err != nil {
		return dedup.Key{}, fmt.Errorf("consumer: key function: %w", err)
	}
	k := dedup.Key{Scope: b.scope, ID: id, Fingerprint: b.fingerprint(msg)}
	if err := dedup.ValidateKey(k, b.maxLen); err != nil {
		if id == "" {
			return dedup.Key{}, Permanent(fmt.Errorf("consumer: message has no id (set Message.ID, or DedupOptions.KeyFunc / TxOptions.KeyFunc): %w", err))
		}
		return dedup.Key{}, Permanent(fmt.Errorf("consumer: message id: %w", err))
	}
	return k, nil
}

// claimOutcome names the outcome of a claim that did not grant ownership.
func claimOutcome(err error) Outcome {
	switch {
	case errors.Is(err, dedup.ErrDuplicate):
		return OutcomeDuplicate
	case errors.Is(err, dedup.ErrInFlight):
		return OutcomeInFlight
	case errors.Is(err, dedup.ErrFingerprintMismatch):
		return OutcomeFingerprintMismatch
	case errors.Is(err, dedup.ErrInvalidKey):
		return OutcomeInvalidKey
	}
	return OutcomeStoreError
}

// resultSlot holds what a handler passed to SetResult.
type resultSlot struct {
	mu     sync.Mutex
	result []byte
}

func (s *resultSlot) set(b []byte) {
	s.mu.Lock()
	s.result = append([]byte(nil), b...)
	s.mu.Unlock()
}

func (s *resultSlot) get() []byte {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.result
}

type resultKey struct{}

func withResultSlot(ctx context.Context) (context.Context, *resultSlot) {
	s := &resultSlot{}
	return context.WithValue(ctx, resultKey{}, s), s
}

// SetResult records result as the outcome of the message being handled. When
// the handler succeeds, the innermost Dedup or Transactional around it stores
// result with the completed key, and later duplicates of the message get it
// back through dedup.StoredResult(Result.Err) — an HTTP adapter replays it,
// for example. Calling it again replaces the result; result is copied.
//
// SetResult reports whether a Dedup or Transactional middleware is there to
// store the result; outside one it does nothing and returns false.
func SetResult(ctx context.Context, result []byte) bool {
	s, ok := ctx.Value(resultKey{}).(*resultSlot)
	if !ok {
		return false
	}
	s.set(result)
	return true
}
