package kafkapg

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/telemetry"
)

// errNoPosition is returned by the handlers when they do not run under a
// idemkafka.Consumer: there is no position to store.
var errNoPosition = errors.New("kafkapg: no partition position in the context: run this handler with a idemkafka.Consumer")

// Transactional is consumer.Transactional that also stores the record's
// partition position (idemkafka.PositionAfter) in the transaction: the claim,
// the handler's writes and the position commit together. Give the Consumer
// the same offsets as Options.Offsets, so that a partition assigned to it is
// consumed from the stored position: after a crash, consumption resumes
// exactly after the last committed transaction.
//
// A duplicate runs no transaction, so its position is stored by the
// Consumer's next commit instead (Options.CommitEvery, CommitInterval).
func Transactional(claims dedup.TxStore[pgx.Tx], offsets *Offsets, opts consumer.TxOptions, h consumer.TxHandler[pgx.Tx]) (consumer.Handler, error) {
	if offsets == nil {
		return nil, errors.New("kafkapg: Transactional: offsets is nil; without offsets use consumer.Transactional")
	}
	if h == nil {
		return nil, errors.New("kafkapg: Transactional: handler h is nil")
	}
	return consumer.Transactional(claims, opts, func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		if err := h(ctx, tx, msg); err != nil {
			return err
		}
		pos, ok := idemkafka.PositionAfter(ctx)
		if !ok {
			return consumer.Permanent(errNoPosition)
		}
		return offsets.SaveTx(ctx, tx, pos)
	})
}

// BatchOptions configure Batch. Only Scope is required.
type BatchOptions struct {
	// Scope names who processes the messages; see
	// consumer.DedupOptions.Scope. Required.
	Scope string
	// KeyFunc returns a message's id. Defaults to Message.ID.
	KeyFunc func(*consumer.Message) (string, error)
	// Fingerprint returns the digest of a message's content. Defaults to
	// dedup.FingerprintOf(msg.Payload); return the zero Fingerprint to
	// disable the check.
	Fingerprint func(*consumer.Message) dedup.Fingerprint
	// Offsets, when set, stores the partition's position in each batch's
	// transaction. Give the Consumer the same one as Options.Offsets.
	Offsets *Offsets
	// OnOutcome, if set, is called once per message of a committed batch
	// with its Report: consumer.OutcomeCompleted, OutcomeDuplicate,
	// OutcomeFingerprintMismatch or OutcomeInvalidKey.
	OnOutcome func(ctx context.Context, r consumer.Report)
	// MeterProvider receives idem.claims (one per message, by outcome),
	// idem.claim.duration (the batch claim's time, once per outcome) and
	// idem.handler.duration (each message's handler run, by how the batch
	// ended: completed, released, complete_failed), with idem.scope and
	// idem.store "pgtable", as consumer.Transactional does. Defaults to the
	// OpenTelemetry global, a no-op until the application installs a
	// provider.
	MeterProvider metric.MeterProvider
	// TracerProvider records an idem.claim span around the batch claim, an
	// idem.handle span per message and an idem.commit span, under the
	// recording span in the batch's context (the idemkafka.Consumer's batch
	// span). Defaults to the OpenTelemetry global.
	TracerProvider trace.TracerProvider
}

// Batch returns a idemkafka.BatchHandler that handles a batch of records in one
// transaction on db: one statement claims every key (pgtable's ClaimBatchTx),
// h runs for each key claimed first, in offset order, and with
// BatchOptions.Offsets the partition's position is written; then the
// transaction commits. Effects, claims and position commit together.
//
// A duplicate is acknowledged without h; a fingerprint mismatch is reported
// for the dead-letter topic (after the commit, so its position is stored by a
// later commit). When h fails, or a key is held by a lease-mode claim, the
// whole transaction rolls back and the Consumer hands the records over one at
// a time. consumer.SetResult has no effect in a batch.
func Batch(db DB, claims *pgtable.Store, opts BatchOptions, h consumer.TxHandler[pgx.Tx]) (idemkafka.BatchHandler, error) {
	switch {
	case db == nil:
		return nil, errors.New("kafkapg: Batch: db is nil: pass the *pgxpool.Pool of the store")
	case claims == nil:
		return nil, errors.New("kafkapg: Batch: claims is nil: pass a *pgtable.Store")
	case h == nil:
		return nil, errors.New("kafkapg: Batch: handler h is nil")
	case opts.Scope == "":
		return nil, errors.New("kafkapg: Batch: Scope is required: name the consumer group and handler, for example \"billing/charge-card\"")
	}
	if err := dedup.ValidateKey(dedup.Key{Scope: opts.Scope, ID: "x"}, claims.Options().MaxKeyLen); err != nil {
		return nil, fmt.Errorf("kafkapg: Batch: Scope %q: %w", opts.Scope, err)
	}
	if opts.KeyFunc == nil {
		opts.KeyFunc = func(m *consumer.Message) (string, error) { return m.ID, nil }
	}
	if opts.Fingerprint == nil {
		opts.Fingerprint = func(m *consumer.Message) dedup.Fingerprint { return dedup.FingerprintOf(m.Payload) }
	}
	tel := telemetry.NewDedup(opts.MeterProvider, opts.TracerProvider, opts.Scope, telemetry.StoreName(claims))
	return &batch{db: db, claims: claims, opts: opts, h: h, tel: tel}, nil
}

type batch struct {
	db     DB
	claims *pgtable.Store
	opts   BatchOptions
	h      consumer.TxHandler[pgx.Tx]
	tel    *telemetry.Dedup
}

// attrBatchCount is the claim span's number of keys.
const attrBatchCount = attribute.Key("messaging.batch.message_count")

// claimOutcome is the idem.claims outcome of a key's verdict.
func claimOutcome(v error) string {
	switch {
	case v == nil:
		return telemetry.ClaimFirst
	case errors.Is(v, dedup.ErrDuplicate):
		return telemetry.ClaimDuplicate
	case errors.Is(v, dedup.ErrFingerprintMismatch):
		return telemetry.ClaimFingerprintMismatch
	case errors.Is(v, dedup.ErrInvalidKey):
		return telemetry.ClaimInvalidKey
	case errors.Is(v, dedup.ErrInFlight):
		return telemetry.ClaimInFlight
	}
	return telemetry.ClaimError
}

// recordClaims counts the verdicts of one batch claim that took took.
func (b *batch) recordClaims(ctx context.Context, verdicts []error, took time.Duration) {
	var n [6]int
	names := [6]string{telemetry.ClaimFirst, telemetry.ClaimDuplicate, telemetry.ClaimFingerprintMismatch,
		telemetry.ClaimInvalidKey, telemetry.ClaimInFlight, telemetry.ClaimError}
	for _, v := range verdicts {
		o := claimOutcome(v)
		for i, name := range names {
			if name == o {
				n[i]++
				break
			}
		}
	}
	for i, name := range names {
		b.tel.ClaimedN(ctx, name, n[i], took)
	}
}

func (b *batch) outcome(ctx context.Context, msg *consumer.Message, key dedup.Key, o consumer.Outcome, err error) {
	if b.opts.OnOutcome != nil {
		b.opts.OnOutcome(ctx, consumer.Report{Outcome: o, Key: key, Message: msg, Err: err})
	}
}

func (b *batch) HandleBatch(ctx context.Context, msgs []*consumer.Message) (err error) {
	errs := map[int]error{}
	keys := make([]dedup.Key, 0, len(msgs))
	at := make([]int, 0, len(msgs)) // keys[j] is msgs[at[j]]'s
	keyOf := make([]dedup.Key, len(msgs))
	for i, m := range msgs {
		id, kerr := b.opts.KeyFunc(m)
		if kerr != nil {
			errs[i] = fmt.Errorf("kafkapg: key function: %w", kerr)
			b.tel.Claimed(ctx, telemetry.ClaimInvalidKey, 0)
			continue
		}
		keys = append(keys, dedup.Key{Scope: b.opts.Scope, ID: id, Fingerprint: b.opts.Fingerprint(m)})
		at = append(at, i)
		keyOf[i] = keys[len(keys)-1]
	}
	tx, err := b.db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("kafkapg: begin: %w", err)
	}
	committed := false
	// ran holds the time each handler run took; they are recorded with
	// how the batch ended.
	ran := make([]time.Duration, 0, len(keys))
	handled := consumer.OutcomeReleased
	defer func() {
		if !committed {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			_ = tx.Rollback(rctx)
			cancel()
		}
		for _, d := range ran {
			b.tel.Handled(ctx, string(handled), d)
		}
	}()
	// Span attributes are built only under a recording span (the key
	// hashes cost a SHA-256 each).
	tracing := telemetry.Recording(ctx)
	start := time.Now()
	cctx, endClaim := ctx, func(error, ...attribute.KeyValue) {}
	if tracing {
		cctx, endClaim = telemetry.StartSpan(ctx, b.tel.Tracer, "idem.claim",
			telemetry.AttrScope.String(b.tel.Scope()), telemetry.AttrStore.String(b.tel.Store()), attrBatchCount.Int(len(keys)))
	}
	verdicts, err := b.claims.ClaimBatchTx(cctx, tx, keys)
	took := time.Since(start)
	endClaim(err)
	if err != nil {
		b.tel.ClaimedN(ctx, telemetry.ClaimError, len(keys), took)
		return err
	}
	b.recordClaims(ctx, verdicts, took)
	done := make([]*consumer.Message, 0, len(msgs))
	outcomes := make([]consumer.Outcome, len(msgs))
	for j, i := range at {
		v := verdicts[j]
		switch {
		case v == nil:
			hctx, endHandle := ctx, func(error, ...attribute.KeyValue) {}
			if tracing {
				hctx, endHandle = telemetry.StartSpan(ctx, b.tel.Tracer, "idem.handle", telemetry.AttrKeyHash.String(keys[j].Hash()))
			}
			hstart := time.Now()
			herr := callEnding(hctx, tx, msgs[i], b.h, endHandle)
			ran = append(ran, time.Since(hstart))
			if herr != nil {
				return fmt.Errorf("kafkapg: message %d of the batch (%s): %w", i, keys[j], herr)
			}
			done = append(done, msgs[i])
			outcomes[i] = consumer.OutcomeCompleted
		case errors.Is(v, dedup.ErrDuplicate):
			errs[i] = v
			done = append(done, msgs[i])
			outcomes[i] = consumer.OutcomeDuplicate
		case errors.Is(v, dedup.ErrFingerprintMismatch), errors.Is(v, dedup.ErrInvalidKey):
			errs[i] = v
			outcomes[i] = consumer.OutcomeFingerprintMismatch
			if errors.Is(v, dedup.ErrInvalidKey) {
				outcomes[i] = consumer.OutcomeInvalidKey
			}
		default:
			// In flight under a lease-mode claim, or a claim error: not
			// this batch's to decide. Roll back, one at a time.
			return fmt.Errorf("kafkapg: message %d of the batch (%s): %w", i, keys[j], v)
		}
	}
	if b.opts.Offsets != nil {
		pos, ok := idemkafka.PositionAfter(ctx, done...)
		if !ok {
			return consumer.Permanent(errNoPosition)
		}
		if err := b.opts.Offsets.SaveTx(ctx, tx, pos); err != nil {
			return err
		}
	}
	cmStart := time.Now()
	if err := tx.Commit(ctx); err != nil {
		telemetry.RecordSpan(ctx, b.tel.Tracer, "idem.commit", cmStart, time.Now(), err)
		handled = consumer.OutcomeCompleteFailed
		return fmt.Errorf("kafkapg: commit: %w", err)
	}
	telemetry.RecordSpan(ctx, b.tel.Tracer, "idem.commit", cmStart, time.Now(), nil)
	committed = true
	handled = consumer.OutcomeCompleted
	for i, o := range outcomes {
		if o != "" {
			b.outcome(ctx, msgs[i], keyOf[i], o, errs[i])
		}
	}
	if len(errs) > 0 {
		return &idemkafka.BatchError{Errs: errs}
	}
	return nil
}

// callEnding runs h and ends its span, also when h panics (the panic goes
// on, and the batch's transaction rolls back).
func callEnding(ctx context.Context, tx pgx.Tx, msg *consumer.Message, h func(context.Context, pgx.Tx, *consumer.Message) error, end func(error, ...attribute.KeyValue)) (err error) {
	ended := false
	defer func() {
		if !ended {
			end(errors.New("kafkapg: the handler panicked"))
		}
	}()
	err = h(ctx, tx, msg)
	ended = true
	end(err)
	return err
}
