package kafkasql

import (
	"context"
	"database/sql"
	"errors"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
)

// errNoPosition is returned by the handler when it does not run under an
// idemkafka.Consumer: there is no position to store.
var errNoPosition = errors.New("kafkasql: no partition position in the context: run this handler with an idemkafka.Consumer")

// Transactional is consumer.Transactional that also stores the record's
// partition position (idemkafka.PositionAfter) in the transaction: the
// claim, the handler's writes and the position commit together. claims is a
// transactional store on the same database as offsets (a *sqltable.Store).
// Give the Consumer the same offsets as ConsumerOptions.Offsets, so that a
// partition assigned to it is consumed from the stored position: after a
// crash, consumption resumes exactly after the last committed transaction.
//
// A duplicate runs no transaction, so its position is stored by the
// Consumer's next commit instead (ConsumerOptions.CommitEvery,
// CommitInterval).
func Transactional(claims dedup.TxStore[*sql.Tx], offsets *Offsets, opts consumer.TxOptions, h consumer.TxHandler[*sql.Tx]) (consumer.Handler, error) {
	if offsets == nil {
		return nil, errors.New("kafkasql: Transactional: offsets is nil; without offsets use consumer.Transactional")
	}
	if h == nil {
		return nil, errors.New("kafkasql: Transactional: handler h is nil")
	}
	return consumer.Transactional(claims, opts, func(ctx context.Context, tx *sql.Tx, msg *consumer.Message) error {
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
