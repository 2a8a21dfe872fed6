package consumer

import (
	"context"
	"errors"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/txflow"
)

// TxHandler processes a message inside the transaction that holds its
// claim. With dedup/pgtable, Tx is a pgx.Tx: write the business rows (and the
// outbox rows) with it and they commit together with the claim, or not at
// all.
type TxHandler[Tx any] func(ctx context.Context, tx Tx, msg *Message) error

// TxOptions configure Transactional. Only Scope is required.
type TxOptions struct {
	// Scope names who processes the messages; see DedupOptions.Scope.
	// Required.
	Scope string
	// KeyFunc returns a message's id. Defaults to Message.ID. See
	// DedupOptions.KeyFunc.
	KeyFunc func(*Message) (string, error)
	// Fingerprint returns the digest of a message's content. Defaults to
	// dedup.FingerprintOf(msg.Payload); return the zero Fingerprint to
	// disable the check.
	Fingerprint func(*Message) dedup.Fingerprint
	// MaxKeyLen limits scope and id, in bytes. Defaults to
	// dedup.DefaultMaxKeyLen.
	MaxKeyLen int
	// Telemetry: the handler's metrics, spans and outcome reports (the
	// block every idem adapter's options embed).
	//
	// OnOutcome, if set, is called once per message with its Report
	// (Outcome, Key, Message, Err). It must be fast and safe for
	// concurrent use.
	//
	// MeterProvider receives idem.claims, idem.claim.duration and
	// idem.handler.duration. Defaults to otel.GetMeterProvider(), a no-op
	// until the application installs a provider.
	//
	// TracerProvider records the idem.claim, idem.handle and idem.commit
	// spans under a recording span in the message's context. Defaults to
	// otel.GetTracerProvider().
	//
	// Logger is not used: Transactional logs nothing of its own, its
	// failures are its return value (the adapter that settles the
	// message logs them).
	Telemetry
	// StoreName is the idem.store metric attribute. Defaults to the
	// store's package name (pgtable).
	StoreName string
}

// Transactional returns a Handler that runs h inside store.Process: the
// claim, h's writes and the result h passed to SetResult commit in one
// transaction. This is the exact guarantee: no lease, no clock.
//
// The handler's error is returned unchanged after the transaction rolled
// back (the claim with it, so the redelivery runs h again). A duplicate
// returns an error wrapping dedup.ErrDuplicate (acknowledged by Decide, with
// the stored result in dedup.StoredResult); a fingerprint mismatch or an
// invalid key is dead-lettered; a store error is retried and h does not run.
// A panic in h goes through store.Process, which rolls back, to Recover.
//
// Transactional is a Handler, not a Middleware, because h takes the
// transaction; wrap it with Chain like any other handler.
func Transactional[Tx any](store dedup.TxStore[Tx], opts TxOptions, h TxHandler[Tx]) (Handler, error) {
	if store == nil {
		return nil, errors.New("consumer: Transactional: store is nil; pass a dedup.TxStore such as pgtable's")
	}
	if h == nil {
		return nil, errors.New("consumer: Transactional: handler h is nil")
	}
	kb, err := newKeyBuilder("Transactional", opts.Scope, opts.KeyFunc, opts.Fingerprint, opts.MaxKeyLen)
	if err != nil {
		return nil, err
	}
	if opts.StoreName == "" {
		opts.StoreName = telemetry.StoreName(store)
	}
	tel := telemetry.NewDedup(opts.MeterProvider, opts.TracerProvider, opts.Scope, opts.StoreName)
	return HandlerFunc(func(ctx context.Context, msg *Message) error {
		key, err := kb.build(msg)
		if err != nil {
			report(ctx, opts.OnOutcome, Report{Outcome: OutcomeInvalidKey, Message: msg, Err: err})
			tel.Claimed(ctx, telemetry.ClaimInvalidKey, 0)
			return err
		}
		// The handler keeps the delivery's handler slot (Message.Slot)
		// throughout; a Dedup it runs must not give it away.
		ctx = hideSlot(ctx, msg)
		r := txflow.Process(ctx, store, key, tel, func(ctx context.Context, tx Tx) ([]byte, error) {
			ctx, slot := withResultSlot(ctx)
			if err := h(ctx, tx, msg); err != nil {
				return nil, err
			}
			return slot.get(), nil
		})
		o := Outcome(r.Handled())
		if v := r.Verdict(); v != nil {
			o = claimOutcome(v)
		}
		report(ctx, opts.OnOutcome, Report{Outcome: o, Key: key, Message: msg, Err: r.Err})
		return r.Err
	}), nil
}
