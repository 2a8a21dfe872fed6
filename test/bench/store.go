package bench

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/redisnx"
)

// storeClients is the number of concurrent clients of the store rows.
const storeClients = 8

func pgtableRow() row {
	return row{
		path:     "pgtable claim in a business tx (pgtable.Process), 8 clients",
		baseline: "the bare business tx (the same INSERT)",
		target:   0.90, unit: "tx/s", floor: txFloor,
		build: func(ctx context.Context, e *env) (side, side, error) {
			bareInsert, err := e.effects(ctx, "pg_bare")
			if err != nil {
				return nil, nil, err
			}
			idemInsert, err := e.effects(ctx, "pg_idem")
			if err != nil {
				return nil, nil, err
			}
			claims, err := e.claims(ctx, "pg_claims", pgtable.Options{})
			if err != nil {
				return nil, nil, err
			}
			bare := func(ctx context.Context, warm bool) (float64, error) {
				return closedLoop(ctx, storeClients, warmedFor(e.size.duration, warm), func(ctx context.Context) error {
					return pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
						_, err := tx.Exec(ctx, bareInsert, e.id("m"), payload)
						return err
					})
				})
			}
			idem := func(ctx context.Context, warm bool) (float64, error) {
				return closedLoop(ctx, storeClients, warmedFor(e.size.duration, warm), func(ctx context.Context) error {
					id := e.id("m")
					key := dedup.Key{Scope: "bench/pg", ID: id, Fingerprint: dedup.FingerprintOf(payload)}
					_, err := claims.Process(ctx, key, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
						_, err := tx.Exec(ctx, idemInsert, id, payload)
						return nil, err
					})
					return err
				})
			}
			return bare, idem, nil
		},
	}
}

func redisnxRow() row {
	return row{
		path:     "redisnx claim + complete, 8 clients",
		baseline: "one SET NX PX",
		target:   0.45, unit: "op/s",
		build: func(_ context.Context, e *env) (side, side, error) {
			barePrefix := e.redisPrefix("setnx") + ":"
			store, err := redisnx.New(e.rdb, redisnx.Options{Prefix: e.redisPrefix("lease"), TTL: redisTTL})
			if err != nil {
				return nil, nil, err
			}
			result := []byte("ok")
			bare := func(ctx context.Context, warm bool) (float64, error) {
				return closedLoop(ctx, storeClients, warmedFor(e.size.duration, warm), func(ctx context.Context) error {
					return e.rdb.SetNX(ctx, barePrefix+e.id(""), "1", 30*time.Second).Err()
				})
			}
			idem := func(ctx context.Context, warm bool) (float64, error) {
				return closedLoop(ctx, storeClients, warmedFor(e.size.duration, warm), func(ctx context.Context) error {
					l, err := store.Claim(ctx, dedup.Key{Scope: "bench", ID: e.id("")})
					if err == nil {
						err = store.Complete(ctx, l, result)
					}
					return err
				})
			}
			return bare, idem, nil
		},
		// redisnx's claim pipeline then its complete script, on a fresh
		// key without fingerprint, completed with the same result.
		byHand: func(_ context.Context, e *env) (side, error) {
			h := newHandRedis(e.rdb, e.redisPrefix("hand"))
			result := []byte("ok")
			return func(ctx context.Context, warm bool) (float64, error) {
				return closedLoop(ctx, storeClients, warmedFor(e.size.duration, warm), func(ctx context.Context) error {
					key, old := h.keys("bench", e.id(""))
					token := handToken()
					if err := h.claimNew(ctx, key, old, inFlight(nil, token)); err != nil {
						return err
					}
					return h.complete(ctx, key, token, result)
				})
			}, nil
		},
	}
}
