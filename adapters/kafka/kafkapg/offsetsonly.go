package kafkapg

import (
	"context"
	"errors"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/pgtx"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/txflow"
)

// OffsetsOnlyOptions configure OffsetsOnly. The zero value is usable.
type OffsetsOnlyOptions struct {
	// Scope names the handler in telemetry (idem.scope) and in the Key of
	// each Report. Defaults to "kafkapg/offsets-only".
	Scope string
	// Telemetry: the handler's metrics, spans and outcome reports
	// (consumer's block, shared by every adapter).
	//
	// OnOutcome, if set, is called once per message of a committed batch
	// with its Report: consumer.OutcomeCompleted, or
	// consumer.OutcomeDuplicate for a record before the stored position
	// (a broker redelivery).
	//
	// MeterProvider receives idem.claims (one per message: first, or
	// duplicate for a record before the stored position),
	// idem.claim.duration (the compare-and-set of the position, BEGIN
	// included) and idem.handler.duration (one per batch), with idem.store
	// "kafkapg". Defaults to the OpenTelemetry global.
	//
	// TracerProvider records the idem.claim, idem.handle and idem.commit
	// spans of each batch under the recording span in its context.
	// Defaults to the OpenTelemetry global.
	//
	// Logger is not used: the batch's failures are its return value, which
	// the idemkafka.Consumer logs.
	consumer.Telemetry
}

// errNotCovered is the verdict of a record of a batch that comes after a
// record of the same batch that is not done yet (one without a valid id,
// dead-lettered after the batch): the stored position cannot cover it, so
// the Consumer runs it alone once the records before it are done.
var errNotCovered = errors.New("kafkapg: an earlier record of the batch is not done yet; this record runs alone after it")

// OffsetsOnly returns a idemkafka.BatchHandler whose only claim is the
// partition's position in offsets: no row per message. Each batch runs in
// one transaction on db that moves the stored position of its partition
// from at most the batch's first offset to the position after the batch
// (an UPDATE with that compare-and-set, sent with BEGIN), calls h once with
// the records, and commits; the position and h's effects commit together,
// or not at all. A record before the stored position was committed by an
// earlier transaction: it is acknowledged as a duplicate without h, so a
// batch the broker delivers again (after a crash or a rebalance before the
// Kafka commit, or a group whose Kafka offsets were reset) changes
// nothing. A concurrent transaction of the same partition (a member that
// lost the partition and still runs) holds the position's row until it
// ends: the batch waits for it, then sees its records as duplicates, or
// claims them if it rolled back.
//
// It catches broker redelivery only, never a producer that sends the same
// message twice (a Kafka producer's retry without idempotence, an outbox
// relay that publishes a row again after a crash): those are two records
// at two offsets, and h runs for both. This is what a key derived from
// topic, partition and offset catches (ConsumerOptions.OffsetID); BatchAll,
// with a claim per message id, catches both. Use OffsetsOnly where the
// producer cannot send a message twice, or where a second effect is
// harmless.
//
// Give the Consumer the same offsets as ConsumerOptions.Offsets, so that it
// resumes from the stored position. Records without a valid id never reach
// a BatchHandler: a record after such a record in the batch is left to run
// alone, after it (the stored position cannot pass a record that is not
// done). When h fails, the whole transaction rolls back and the Consumer
// hands the records over one at a time. msgs is h's to keep.
func OffsetsOnly(db pgtable.DB, offsets *Offsets, opts OffsetsOnlyOptions,
	h func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error) (idemkafka.BatchHandler, error) {
	switch {
	case db == nil:
		return nil, errors.New("kafkapg: OffsetsOnly: db is nil: pass the *pgxpool.Pool of the offsets")
	case offsets == nil:
		return nil, errors.New("kafkapg: OffsetsOnly: offsets is nil: pass the *kafkapg.Offsets the Consumer resumes from")
	case h == nil:
		return nil, errors.New("kafkapg: OffsetsOnly: handler h is nil")
	}
	if opts.Scope == "" {
		opts.Scope = "kafkapg/offsets-only"
	}
	tel := telemetry.NewDedup(opts.MeterProvider, opts.TracerProvider, opts.Scope, telemetry.StoreName(offsets))
	o := &offsetsOnly{db: db, offsets: offsets, opts: opts, h: h, tel: tel}
	return o.handle, nil
}

type offsetsOnly struct {
	db      pgtable.DB
	offsets *Offsets
	opts    OffsetsOnlyOptions
	h       func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error
	tel     *telemetry.Dedup
}

func (o *offsetsOnly) handle(ctx context.Context, msgs []*consumer.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	pos, ok := idemkafka.PositionAfter(ctx, msgs...)
	if !ok {
		return consumer.Permanent(errNoPosition)
	}
	offs := make([]int64, len(msgs))
	for i, m := range msgs {
		off, err := strconv.ParseInt(m.Metadata[idemkafka.MetadataOffset], 10, 64)
		if err != nil {
			return consumer.Permanent(fmt.Errorf("kafkapg: OffsetsOnly: message %d has no Kafka offset in its metadata: %w", i, err))
		}
		offs[i] = off
	}
	// The records the position after the batch covers: those before it.
	// The ones after a record that is not done yet run alone.
	errs := map[int]error{}
	n := len(msgs)
	for i, off := range offs {
		if off >= pos.Offset {
			errs[i] = errNotCovered
			n = min(n, i)
		}
	}
	if n == 0 {
		return &idemkafka.BatchError{Errs: errs}
	}
	keys := make([]dedup.Key, n)
	for i := range keys {
		keys[i] = dedup.Key{Scope: o.opts.Scope, ID: msgs[i].ID}
	}
	outcomes := make([]consumer.Outcome, n)
	err := txflow.ProcessBatch(ctx, o.tel, keys, txflow.BatchSteps[*pgtx.Tx]{
		Who: "kafkapg",
		Begin: func(ctx context.Context, keys []dedup.Key) (*pgtx.Tx, []error, error) {
			t, from, err := o.offsets.claimRange(ctx, o.db, pos, offs[0])
			if err != nil {
				return nil, nil, err
			}
			verdicts := make([]error, len(keys))
			for i := range keys {
				if offs[i] < from {
					verdicts[i] = &dedup.ClaimError{Err: dedup.ErrDuplicate, Key: keys[i]}
				}
			}
			return t, verdicts, nil
		},
		Work: func(ctx context.Context, t *pgtx.Tx, verdicts []error, run func(func(context.Context) error, ...int) error) error {
			var (
				fresh  []*consumer.Message
				freshJ []int
			)
			for i, v := range verdicts {
				if v != nil {
					errs[i], outcomes[i] = v, consumer.OutcomeDuplicate
					continue
				}
				fresh, freshJ = append(fresh, msgs[i]), append(freshJ, i)
				outcomes[i] = consumer.OutcomeCompleted
			}
			if len(fresh) == 0 {
				return nil
			}
			if herr := run(func(hctx context.Context) error { return o.h(hctx, t.Tx(), fresh) }, freshJ...); herr != nil {
				return fmt.Errorf("kafkapg: %d messages of the batch: %w", len(fresh), herr)
			}
			return nil
		},
	})
	if err != nil {
		return err
	}
	if o.opts.OnOutcome != nil {
		for i, oc := range outcomes {
			o.opts.OnOutcome(ctx, consumer.Report{Outcome: oc, Key: keys[i], Message: msgs[i], Err: errs[i]})
		}
	}
	if len(errs) > 0 {
		return &idemkafka.BatchError{Errs: errs}
	}
	return nil
}

// claimRange begins a transaction on db that holds pos's partition
// position, and returns the offset from which the records up to
// pos.Offset are not done: the position stored before this transaction
// (first when it was at or before first, or when there was none). The
// stored position is pos.Offset in the transaction, when that is further.
//
// The common case is one UPDATE, sent with BEGIN: the position moves from
// at most first to pos.Offset. When it does not match (the position is past
// first, or the partition has no row yet), the row is read under a lock
// and moved forward, or inserted.
func (o *Offsets) claimRange(ctx context.Context, db pgtable.DB, pos idemkafka.Position, first int64) (*pgtx.Tx, int64, error) {
	part := int32(pos.Partition)
	moved := false
	t, err := pgtx.Begin(ctx, db, func(b *pgx.Batch) {
		b.Queue(o.advance, pos.Group, pos.Topic, part, pos.Offset, first)
	}, func(br pgx.BatchResults) error {
		tag, err := br.Exec()
		moved = tag.RowsAffected() == 1
		return err
	})
	if err != nil {
		return nil, 0, fmt.Errorf("kafkapg: claim the position: %w", err)
	}
	if moved {
		return t, first, nil
	}
	from, err := o.claimRead(ctx, t.Tx(), pos, first)
	if err != nil {
		_ = t.Rollback(ctx)
		return nil, 0, fmt.Errorf("kafkapg: claim the position: %w", err)
	}
	return t, from, nil
}

// claimRead is claimRange's way when its UPDATE did not match.
func (o *Offsets) claimRead(ctx context.Context, tx pgx.Tx, pos idemkafka.Position, first int64) (int64, error) {
	const maxTries = 3
	part := int32(pos.Partition)
	for range maxTries {
		var stored int64
		err := tx.QueryRow(ctx, o.lockRow, pos.Group, pos.Topic, part).Scan(&stored)
		if err == nil {
			if stored < pos.Offset {
				if _, err := tx.Exec(ctx, o.saveOne, o.saveArgs(pos)...); err != nil {
					return 0, err
				}
			}
			return max(stored, first), nil
		}
		if !errors.Is(err, pgx.ErrNoRows) {
			return 0, err
		}
		// No position yet: insert it, unless a concurrent transaction
		// inserted it first (then read it again).
		tag, err := tx.Exec(ctx, o.insertNew, pos.Group, pos.Topic, part, pos.Offset)
		if err != nil {
			return 0, err
		}
		if tag.RowsAffected() == 1 {
			return first, nil
		}
	}
	return 0, fmt.Errorf("the position of %s/%d changed under %d reads in a row; retry", pos.Topic, pos.Partition, maxTries)
}
