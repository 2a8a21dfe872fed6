package idemwatermill

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"reflect"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/google/uuid"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/txflow"
	"github.com/idemkit/idem/outbox"
)

type txKey struct{}

// Tx returns the transaction that holds the message's claim when the handler
// runs under Transactional, or the zero T. Call it with msg.Context(); T is
// the store's transaction type: Tx[pgx.Tx](ctx) under pgtable,
// Tx[*sql.Tx](ctx) under sqltable. The handler's writes through it commit
// together with the claim (and the outbox rows), or not at all. The handler
// must not commit or roll it back, and must close any Rows it opens before
// returning.
func Tx[T any](ctx context.Context) T {
	tx, _ := ctx.Value(txKey{}).(T)
	return tx
}

// Transactional returns router middleware that runs the handler inside
// store.Process (dedup/pgtable's Store): it begins a transaction, claims the
// message's key in it, runs the handler with the transaction in
// msg.Context() (see Tx), and commits when the handler succeeds. The claim
// and the handler's writes commit together, so the effect on the database
// happens exactly once: no lease, no clock.
//
//   - the handler fails or panics: the transaction rolls back, the claim with
//     it, and the handler's error (or panic) goes on unchanged, so the
//     redelivery or Watermill's Retry middleware runs the handler again.
//   - duplicate: the message is acknowledged without running the handler
//     (nil, nil). A concurrent delivery of the same key waits on the
//     claim's row until the first transaction ends, then is a duplicate (or
//     runs, if the first rolled back).
//   - fingerprint mismatch or invalid key: poison, see Options.PoisonQueue.
//   - a store error, or the key held by a lease-mode claim (dedup.ErrInFlight):
//     an error is returned and the handler does not run.
//
// With Options.Outbox, the messages the handler returns are written to the
// outbox in the same transaction and not returned to the router: they are
// published by the outbox relay once committed, and never when the
// transaction rolls back. Without it they are returned to the router, which
// publishes them after the commit.
//
// Options.ExtendEvery and FinishTimeout are not used.
func Transactional[Tx any](store dedup.TxStore[Tx], opts Options) (message.HandlerMiddleware, error) {
	if store == nil {
		return nil, errors.New("watermill: Transactional: store is nil; pass a transactional store such as a *pgtable.Store or a *sqltable.Store")
	}
	if opts.Outbox == nil && (opts.OutboxTopic != "" || opts.OutboxKey != nil) {
		return nil, errors.New("watermill: Transactional: Options.OutboxTopic and OutboxKey need Options.Outbox (a *pgoutbox.Outbox or a *sqloutbox.Outbox)")
	}
	var ob Enqueuer[Tx]
	if opts.Outbox != nil {
		var ok bool
		if ob, ok = opts.Outbox.(Enqueuer[Tx]); !ok {
			return nil, fmt.Errorf("watermill: Transactional: Options.Outbox is a %T, which does not enqueue in the store's transaction (%v): pass a *pgoutbox.Outbox with pgtable, a *sqloutbox.Outbox with sqltable", opts.Outbox, reflect.TypeFor[Tx]())
		}
	}
	c, err := newConfig("Transactional", opts, store)
	if err != nil {
		return nil, err
	}
	t := &txMiddleware[Tx]{config: c, store: store, outbox: ob}
	return func(h message.HandlerFunc) message.HandlerFunc {
		return func(msg *message.Message) ([]*message.Message, error) {
			dl := c.begin(msg)
			defer dl.finish()
			return dl.verdict(t.handle(&dl, h, msg))
		}
	}, nil
}

type txMiddleware[Tx any] struct {
	*config
	store  dedup.TxStore[Tx]
	outbox Enqueuer[Tx]
}

func (t *txMiddleware[Tx]) handle(dl *delivery, h message.HandlerFunc, msg *message.Message) ([]*message.Message, error) {
	key, err := t.keys.build(msg)
	if err != nil {
		return t.rejectKey(dl, msg, err)
	}
	tel := t.tel.Get(key.Scope)
	orig := msg.Context()
	var (
		out      []*message.Message
		returned bool // the handler returned (no panic)
	)
	defer func() {
		if !returned {
			// The handler panicked: Process rolled back (and recorded
			// the run as released).
			dl.report(key, consumer.OutcomeReleased, errPanicked)
		}
	}()
	r := txflow.Process(orig, t.store, key, tel, func(ctx context.Context, tx Tx) ([]byte, error) {
		hctx := context.WithValue(ctx, txKey{}, tx)
		msg.SetContext(hctx)
		defer msg.SetContext(orig)
		var herr error
		out, herr = h(msg)
		if herr == nil && t.outbox != nil && len(out) > 0 {
			if herr = t.enqueue(hctx, orig, tx, out); herr == nil {
				out = nil
			}
		}
		return nil, herr
	})
	returned = true
	if v := r.Verdict(); v != nil {
		return t.claimFailed(dl, msg, key, v)
	}
	dl.report(key, consumer.Outcome(r.Handled()), r.Err)
	switch {
	case r.Err == nil:
		return out, nil
	case r.HandlerErr != nil:
		return nil, r.HandlerErr
	}
	// The handler succeeded but the commit failed: nothing happened.
	return nil, fmt.Errorf("watermill: commit %s: %w", key, r.Err)
}

// enqueue writes the handler's messages to the outbox in tx.
func (t *txMiddleware[Tx]) enqueue(ctx, msgCtx context.Context, tx Tx, out []*message.Message) error {
	topic := t.OutboxTopic
	if topic == "" {
		topic = message.PublishTopicFromCtx(msgCtx)
	}
	if topic == "" {
		return errors.New("watermill: the handler returned messages but there is no topic to write them to the outbox with: register the handler with Router.AddHandler and a publish topic, or set Options.OutboxTopic")
	}
	msgs := make([]outbox.Message, 0, len(out))
	for _, m := range out {
		if m == nil {
			continue
		}
		om := outbox.Message{Topic: topic, Payload: m.Payload}
		// The message keeps its UUID downstream when it is one; otherwise
		// the outbox assigns a UUIDv7.
		if _, err := uuid.Parse(m.UUID); err == nil {
			om.ID = m.UUID
		}
		if len(m.Metadata) > 0 {
			om.Headers = maps.Clone(map[string]string(m.Metadata))
		}
		if t.OutboxKey != nil {
			om.Key = t.OutboxKey(m)
		}
		msgs = append(msgs, om)
	}
	if len(msgs) == 0 {
		return nil
	}
	if _, err := t.outbox.Enqueue(ctx, tx, msgs...); err != nil {
		return fmt.Errorf("watermill: write %d returned messages to the outbox: %w", len(msgs), err)
	}
	return nil
}
