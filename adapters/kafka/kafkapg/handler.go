package kafkapg

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/txflow"
)

// errNoPosition is returned by the handlers when they do not run under a
// idemkafka.Consumer: there is no position to store.
var errNoPosition = errors.New("kafkapg: no partition position in the context: run this handler with a idemkafka.Consumer")

// Transactional is consumer.Transactional that also stores the record's
// partition position (idemkafka.PositionAfter) in the transaction: the claim,
// the handler's writes and the position commit together. Give the Consumer
// the same offsets as ConsumerOptions.Offsets, so that a partition assigned to it is
// consumed from the stored position: after a crash, consumption resumes
// exactly after the last committed transaction.
//
// A duplicate runs no transaction, so its position is stored by the
// Consumer's next commit instead (ConsumerOptions.CommitEvery, CommitInterval).
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
	// transaction, in the round trip of its COMMIT. Give the Consumer the
	// same one as ConsumerOptions.Offsets.
	Offsets *Offsets
	// Telemetry: the handler's metrics, spans and outcome reports
	// (consumer's block, shared by every adapter).
	//
	// OnOutcome, if set, is called once per message of a committed batch
	// with its Report: consumer.OutcomeCompleted, OutcomeDuplicate,
	// OutcomeFingerprintMismatch or OutcomeInvalidKey.
	//
	// MeterProvider receives idem.claims (one per message, by outcome),
	// idem.claim.duration (the batch claim's time, once per outcome) and
	// idem.handler.duration (each handler call, by how the batch ended:
	// completed, released, complete_failed: one per message with Batch,
	// one per batch with BatchAll), with idem.scope and idem.store
	// "pgtable", as consumer.Transactional does. Defaults to the
	// OpenTelemetry global, a no-op until the application installs a
	// provider.
	//
	// TracerProvider records an idem.claim span around the batch claim, an
	// idem.handle span per handler call (per message with Batch, per batch
	// with BatchAll) and an idem.commit span, under the
	// recording span in the batch's context (the idemkafka.Consumer's batch
	// span). Defaults to the OpenTelemetry global.
	//
	// Logger is not used, as in consumer.TxOptions: the batch's failures
	// are its return value, which the idemkafka.Consumer logs.
	consumer.Telemetry
}

// Batch returns a idemkafka.BatchHandler that handles a batch of records in one
// transaction on db: one statement sent with BEGIN claims every key
// (pgtable's BeginBatch), h runs for each key claimed first, in offset
// order, and with BatchOptions.Offsets the partition's position is written
// with COMMIT. Effects, claims and position commit together.
//
// A duplicate is acknowledged without h; a fingerprint mismatch is reported
// for the dead-letter topic (after the commit, so its position is stored by a
// later commit). When h fails, or a key is held by a lease-mode claim, the
// whole transaction rolls back and the Consumer hands the records over one at
// a time. consumer.SetResult has no effect in a batch. BatchAll hands h all
// the records claimed first in one call instead.
func Batch(db pgtable.DB, claims *pgtable.Store, opts BatchOptions, h consumer.TxHandler[pgx.Tx]) (idemkafka.BatchHandler, error) {
	if h == nil {
		return nil, errors.New("kafkapg: Batch: handler h is nil")
	}
	b, err := newBatch("Batch", db, claims, opts)
	if err != nil {
		return nil, err
	}
	b.h = h
	return b.handle, nil
}

// BatchAll is Batch with a handler for the whole batch: h is called once per
// batch, in the batch's transaction, with every record claimed first, in
// offset order, so that it can write their effects in one statement (an
// INSERT ... SELECT FROM unnest, or CopyFrom). Duplicates, fingerprint
// mismatches and records without a valid key are left out, as Batch leaves
// them out of its handler; when no record is new, h is not called and the
// transaction holds the claims and the position only. msgs is h's to keep.
//
// Effects, claims and position commit together, or not at all. When h
// fails, the whole transaction rolls back and the Consumer hands the records
// over one at a time: h is then called with one record, so that a permanent
// error dead-letters that record alone, as with Batch.
func BatchAll(db pgtable.DB, claims *pgtable.Store, opts BatchOptions,
	h func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error) (idemkafka.BatchHandler, error) {
	if h == nil {
		return nil, errors.New("kafkapg: BatchAll: handler h is nil")
	}
	b, err := newBatch("BatchAll", db, claims, opts)
	if err != nil {
		return nil, err
	}
	b.all = h
	return b.handle, nil
}

// newBatch checks the arguments of Batch and BatchAll (who) and fills in
// opts' defaults.
func newBatch(who string, db pgtable.DB, claims *pgtable.Store, opts BatchOptions) (*batch, error) {
	switch {
	case db == nil:
		return nil, fmt.Errorf("kafkapg: %s: db is nil: pass the *pgxpool.Pool of the store", who)
	case claims == nil:
		return nil, fmt.Errorf("kafkapg: %s: claims is nil: pass a *pgtable.Store", who)
	case opts.Scope == "":
		return nil, fmt.Errorf("kafkapg: %s: Scope is required: name the consumer group and handler, for example \"billing/charge-card\"", who)
	}
	if err := dedup.ValidateKey(dedup.Key{Scope: opts.Scope, ID: "x"}, claims.Options().MaxKeyLen); err != nil {
		return nil, fmt.Errorf("kafkapg: %s: Scope %q: %w", who, opts.Scope, err)
	}
	if opts.KeyFunc == nil {
		opts.KeyFunc = func(m *consumer.Message) (string, error) { return m.ID, nil }
	}
	if opts.Fingerprint == nil {
		opts.Fingerprint = func(m *consumer.Message) dedup.Fingerprint { return dedup.FingerprintOf(m.Payload) }
	}
	tel := telemetry.NewDedup(opts.MeterProvider, opts.TracerProvider, opts.Scope, telemetry.StoreName(claims))
	return &batch{db: db, claims: claims, opts: opts, tel: tel}, nil
}

type batch struct {
	db     pgtable.DB
	claims *pgtable.Store
	opts   BatchOptions
	// Either h runs for each record claimed first (Batch), or all runs
	// once for all of them (BatchAll).
	h   consumer.TxHandler[pgx.Tx]
	all func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error
	tel *telemetry.Dedup
}

func (b *batch) outcome(ctx context.Context, msg *consumer.Message, key dedup.Key, o consumer.Outcome, err error) {
	if b.opts.OnOutcome != nil {
		b.opts.OnOutcome(ctx, consumer.Report{Outcome: o, Key: key, Message: msg, Err: err})
	}
}

// handle is the BatchHandler: the batch's keys are claimed, its handlers
// run and its position is written in one transaction (txflow.ProcessBatch);
// the verdicts that are not the batch's to decide roll it back.
func (b *batch) handle(ctx context.Context, msgs []*consumer.Message) error {
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
	outcomes := make([]consumer.Outcome, len(msgs))
	err := txflow.ProcessBatch(ctx, b.tel, keys, txflow.BatchSteps[*pgtable.BatchTx]{
		Who: "kafkapg",
		Begin: func(ctx context.Context, keys []dedup.Key) (*pgtable.BatchTx, []error, error) {
			return b.claims.BeginBatch(ctx, b.db, keys)
		},
		Work: func(ctx context.Context, tx *pgtable.BatchTx, verdicts []error, run func(func(context.Context) error, ...int) error) error {
			return b.work(ctx, tx, msgs, keys, at, verdicts, run, errs, outcomes)
		},
	})
	if err != nil {
		return err
	}
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

// work acts on the batch claim's verdicts in tx: the handler runs for the
// keys claimed first (h for each in turn, or all once for all of them),
// duplicates and poison are noted in errs and outcomes, and with
// BatchOptions.Offsets the partition's position after the done messages is
// written.
func (b *batch) work(ctx context.Context, btx *pgtable.BatchTx, msgs []*consumer.Message, keys []dedup.Key, at []int, verdicts []error,
	run func(func(context.Context) error, ...int) error, errs map[int]error, outcomes []consumer.Outcome) error {
	tx := btx.Tx()
	done := make([]*consumer.Message, 0, len(msgs))
	var (
		fresh  []*consumer.Message // for all: the messages claimed first
		freshJ []int               // and their keys' indexes
	)
	for j, i := range at {
		v := verdicts[j]
		switch {
		case v == nil:
			if b.all != nil {
				fresh, freshJ = append(fresh, msgs[i]), append(freshJ, j)
			} else if herr := run(func(hctx context.Context) error { return b.h(hctx, tx, msgs[i]) }, j); herr != nil {
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
	if len(fresh) > 0 {
		if herr := run(func(hctx context.Context) error { return b.all(hctx, tx, fresh) }, freshJ...); herr != nil {
			return fmt.Errorf("kafkapg: %d messages of the batch: %w", len(fresh), herr)
		}
	}
	if b.opts.Offsets == nil {
		return nil
	}
	pos, ok := idemkafka.PositionAfter(ctx, done...)
	if !ok {
		return consumer.Permanent(errNoPosition)
	}
	// The position goes with COMMIT, in its round trip.
	btx.AtCommit(b.opts.Offsets.saveOne, b.opts.Offsets.saveArgs(pos)...)
	return nil
}
