package consumer

import (
	"context"
	"errors"
	"time"

	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/seat"
	"github.com/idemkit/idem/internal/telemetry"
)

// errHandlerPanicked is what the handle span records when the handler
// panicked; the panic itself goes on to Recover.
var errHandlerPanicked = errors.New("consumer: the handler panicked")

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
	// OnOutcome, if set, is called once per message with one of the
	// Outcome constants, for metrics. It must be fast and safe for
	// concurrent use.
	OnOutcome func(ctx context.Context, msg *Message, outcome string)
	// MeterProvider receives idem.claims, idem.claim.duration and
	// idem.handler.duration. Defaults to otel.GetMeterProvider(), a no-op
	// until the application installs a provider.
	MeterProvider metric.MeterProvider
	// TracerProvider records the idem.claim, idem.handle and idem.commit
	// spans under a recording span in the message's context. Defaults to
	// otel.GetTracerProvider().
	TracerProvider trace.TracerProvider
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
	outcome := func(ctx context.Context, msg *Message, o string) {
		if opts.OnOutcome != nil {
			opts.OnOutcome(ctx, msg, o)
		}
	}
	return HandlerFunc(func(ctx context.Context, msg *Message) error {
		key, err := kb.build(msg)
		if err != nil {
			outcome(ctx, msg, OutcomeInvalidKey)
			tel.Claimed(ctx, telemetry.ClaimInvalidKey, 0)
			return err
		}
		var (
			ran          bool
			hErr         error
			start        = time.Now()
			hStart, hEnd time.Time
		)
		// The handler keeps the delivery's handler slot (internal/seat)
		// throughout; a Dedup it runs must not give it away.
		ctx = seat.Hide(ctx)
		_, err = store.Process(ctx, key, func(ctx context.Context, tx Tx) ([]byte, error) {
			ran = true
			hStart = time.Now()
			tel.Claimed(ctx, telemetry.ClaimFirst, hStart.Sub(start))
			if telemetry.Recording(ctx) {
				telemetry.RecordSpan(ctx, tel.Tracer, "idem.claim", start, hStart, nil,
					append(tel.SpanAttrs(key.Hash()), telemetry.AttrOutcome.String(telemetry.ClaimFirst))...)
			}
			ctx, endHandle := telemetry.StartSpan(ctx, tel.Tracer, "idem.handle")
			ended := false
			defer func() {
				if !ended { // h panicked: the span ends with it
					endHandle(errHandlerPanicked)
				}
			}()
			ctx, slot := withResultSlot(ctx)
			hErr = h(ctx, tx, msg)
			ended = true
			endHandle(hErr)
			hEnd = time.Now()
			if hErr != nil {
				return nil, hErr
			}
			return slot.get(), nil
		})
		end := time.Now()
		if ran && hErr == nil {
			telemetry.RecordSpan(ctx, tel.Tracer, "idem.commit", hEnd, end, err)
		}
		switch {
		case err == nil:
			outcome(ctx, msg, OutcomeCompleted)
			tel.Handled(ctx, OutcomeCompleted, end.Sub(hStart))
		case ran && hErr != nil:
			outcome(ctx, msg, OutcomeReleased)
			tel.Handled(ctx, OutcomeReleased, end.Sub(hStart))
		case ran && dedup.Held(err):
			// h ran, but a claim that does not wait for this transaction
			// (pgtable.Process against its lease mode or ClaimTx) took the
			// key first: the transaction rolled back, and err is the
			// verdict on that claim, acted on like any claim's.
			tel.Handled(ctx, OutcomeReleased, end.Sub(hStart))
			outcome(ctx, msg, claimOutcome(err))
		case ran:
			// h succeeded but the commit failed.
			outcome(ctx, msg, OutcomeCompleteFailed)
			tel.Handled(ctx, OutcomeCompleteFailed, end.Sub(hStart))
		default:
			o := claimOutcome(err)
			outcome(ctx, msg, o)
			tel.Claimed(ctx, telemetryClaim(o), end.Sub(start))
			if telemetry.Recording(ctx) {
				telemetry.RecordSpan(ctx, tel.Tracer, "idem.claim", start, end, spanErr(err),
					append(tel.SpanAttrs(key.Hash()), telemetry.AttrOutcome.String(telemetryClaim(o)))...)
			}
		}
		return err
	}), nil
}
