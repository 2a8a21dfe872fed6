package chaos

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/dedup/pgtable"
)

// The consumer SIGKILL cells: one per adapter and store. Each runs two
// consumer child processes (HTTP: two server processes behind a client
// that picks one at random for every attempt), SIGKILLs them at random
// moments and at the named points in turn (before the transaction, after
// the effect before the commit, after the commit before the ACK), restarts
// each at once, and checks the oracle once the broker acknowledged every
// input.
//
// pgtable cells promise 0 duplicate effects and 0 lost: the effect is an
// INSERT in the claim's transaction.
//
// redisnx cells promise 0 lost only. The claim is a lease in Redis and the
// effect an autocommit INSERT in PostgreSQL: a consumer killed after the
// effect and before Complete leaves a lease that runs out, and the
// redelivery runs the effect again. Nothing in idem can close that window
// for an effect outside the store (the lease guarantee: at-least-once
// effects, with duplicates made rare); the kills at after_effect make it happen on purpose,
// so the cells are marked ExpectDuplicates and print the rate.
const redisNote = "redisnx lease, effect outside it: a kill between the effect and Complete repeats the effect once the lease runs out, so duplicates are expected (at-least-once); 0 lost promised"

// leaseMS is the redisnx lease of the cells: short, so that a killed
// consumer's lease runs out quickly, with heartbeats every third of it.
const leaseMS = 2000

var consumerPoints = []string{pointBeforeTx, pointAfterEffect, pointAfterCommit}

// cellBase is what every consumer cell sets up: a pool, the oracle, the
// dedup store's tables or key prefix, and the inputs.
type cellBase struct {
	env    *Env
	name   string
	store  string
	pool   *pgxpool.Pool
	oracle *Oracle
	prefix string // redisnx key prefix
	scope  string
	ids    []string
	suffix string // random, for topic, queue and group names
}

// config is the part of a child's configuration every consumer shares.
func (b *cellBase) config() childConfig {
	return childConfig{
		Store: b.store, PGURL: b.env.PGURL, RedisAddr: b.env.RedisAddr, AMQPURL: b.env.AMQPURL,
		Schema: b.oracle.Schema(), Effects: b.oracle.Table(), Prefix: b.prefix, LeaseMS: leaseMS, Scope: b.scope,
	}
}

// distinctEffects is the number of inputs with an effect.
func (b *cellBase) distinctEffects(ctx context.Context) (n int, err error) {
	err = b.pool.QueryRow(ctx, "SELECT count(DISTINCT id) FROM "+b.oracle.Table()).Scan(&n)
	return n, err
}

// randSuffix returns 12 random hex digits (crypto/rand: names must not
// collide across runs with the same seed).
func randSuffix() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// newPool opens a pool of at most conns connections on url.
func newPool(ctx context.Context, url string, conns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = conns
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if err := pool.Ping(ctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("PostgreSQL at %s: %w", url, err)
	}
	return pool, nil
}

// withBase sets up a cellBase for a cell, runs f and tears everything down.
func withBase(ctx context.Context, env *Env, name, store string, n int, f func(b *cellBase) (Result, error)) (Result, error) {
	pool, err := newPool(ctx, env.PGURL, 4)
	if err != nil {
		return Result{}, err
	}
	defer pool.Close()
	o, err := NewOracle(ctx, pool, name, env.Seed)
	if err != nil {
		return Result{}, err
	}
	defer func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		_ = o.Drop(dctx)
	}()
	b := &cellBase{env: env, name: name, store: store, pool: pool, oracle: o, scope: "chaos/" + name, suffix: randSuffix()}
	b.ids = makeIDs("m"+b.suffix[:6], n)
	switch store {
	case storePG:
		s, err := pgtable.New(pool, pgtable.Options{Schema: o.Schema()})
		if err != nil {
			return Result{}, err
		}
		if err := s.Migrate(ctx); err != nil {
			return Result{}, err
		}
	case storeRedis:
		b.prefix = "chaos:" + b.suffix
		defer func() {
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
			defer cancel()
			_ = deleteRedisPrefix(dctx, env.RedisAddr, b.prefix)
		}()
	case "":
	default:
		return Result{}, fmt.Errorf("unknown store %q", store)
	}
	return f(b)
}

// oracleVerdict runs the oracle over the cell's inputs. Duplicates count
// whatever happened; lost only when the run finished (runErr nil), since
// only then was every input acknowledged: a failed run is reported by its
// error, not by a lost count over inputs nobody acknowledged.
func oracleVerdict(ctx context.Context, b *cellBase, runErr error) (dups, lost int, err error) {
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 60*time.Second)
	defer cancel()
	must := b.ids
	if runErr != nil {
		must = nil
	}
	return b.oracle.Check(cctx, must)
}

// deleteRedisPrefix deletes the keys under prefix.
func deleteRedisPrefix(ctx context.Context, addr, prefix string) error {
	rdb := redis.NewClient(&redis.Options{Addr: addr})
	defer func() { _ = rdb.Close() }()
	iter := rdb.Scan(ctx, 0, prefix+":*", 1000).Iterator()
	var keys []string
	for iter.Next(ctx) {
		keys = append(keys, iter.Val())
		if len(keys) == 500 {
			if err := rdb.Del(ctx, keys...).Err(); err != nil {
				return err
			}
			keys = keys[:0]
		}
	}
	if err := iter.Err(); err != nil {
		return err
	}
	if len(keys) > 0 {
		return rdb.Del(ctx, keys...).Err()
	}
	return nil
}

// killCell is the common body of a consumer SIGKILL cell: run the kill loop
// over w, then the oracle over every input (each was acknowledged: the
// loop ends only when the broker says so).
func killCell(ctx context.Context, b *cellBase, w workload, spec killSpec) (Result, error) {
	spec.ids = b.ids
	st, runErr := runKills(ctx, b.env, w, spec)
	res := Result{Messages: len(b.ids), Kills: st.kills, Restarts: st.restarts, Note: st.note()}
	if b.store == storeRedis {
		res.Note = redisNote + "; " + res.Note
	}
	deliveries, distinct, err := countDeliveries(b.env.TempDir, "deliveries")
	if err != nil && runErr == nil {
		runErr = err
	}
	res.Redeliveries = deliveries - distinct
	dups, lost, err := oracleVerdict(ctx, b, runErr)
	if err != nil {
		if runErr == nil {
			runErr = err
		}
		return res, runErr
	}
	res.Duplicates, res.Lost = dups, lost
	if runErr == nil {
		b.env.Logf("%d inputs, %d deliveries, %d kills in %v", len(b.ids), deliveries, st.kills, st.elapsed.Round(100*time.Millisecond))
	}
	return res, runErr
}
