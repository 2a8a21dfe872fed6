package httpidem

import (
	"context"
	"sync/atomic"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/leasekeep"
)

// call is what the middleware shares with the handler of one request
// through its context.
type call struct {
	key      dedup.Key
	tx       any // the claim's transaction (NewTx), of the store's type
	released atomic.Bool

	// Under a lease: the lease flow (the handler's context, cancelled
	// when the lease is lost, the heartbeat, Complete and Release), in
	// the call's one allocation.
	leasekeep.Run
}

type callKey struct{}

func withCall(ctx context.Context, c *call) context.Context {
	return context.WithValue(ctx, callKey{}, c)
}

func callFrom(ctx context.Context) *call {
	c, _ := ctx.Value(callKey{}).(*call)
	return c
}

// Tx returns the transaction that holds the request's claim when the
// handler runs under a transactional Middleware (NewTx), or the zero T. T
// is the store's transaction type: Tx[pgx.Tx](ctx) under pgtable,
// Tx[*sql.Tx](ctx) under sqltable. The handler's writes through it commit
// together with the claim and the stored response, or not at all. The
// handler must not commit or roll it back, and must close any Rows it
// opens before returning.
func Tx[T any](ctx context.Context) T {
	if c := callFrom(ctx); c != nil {
		if tx, ok := c.tx.(T); ok {
			return tx
		}
	}
	var zero T
	return zero
}

// RequestKey returns the dedup key of the request the handler is serving,
// and whether there is one.
func RequestKey(ctx context.Context) (dedup.Key, bool) {
	if c := callFrom(ctx); c != nil {
		return c.key, true
	}
	return dedup.Key{}, false
}

// Release tells the middleware not to store the response the handler is
// writing: when the handler returns, the key is released (lease stores) or
// the transaction rolled back with everything the handler wrote through Tx
// (transactional stores), and the response is sent once, unstored. A retry
// with the same key then runs the handler again.
//
// Call it for answers that say nothing happened and must not be replayed: a
// validation error, a dependency that was down. Release returns false when
// ctx is not a request under the middleware.
func Release(ctx context.Context) bool {
	if c := callFrom(ctx); c != nil {
		c.released.Store(true)
		return true
	}
	return false
}
