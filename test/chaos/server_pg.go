//go:build unix

package chaos

// pg/ cells: a throwaway PostgreSQL (internal/testkit/fault) crashed with
// `pg_ctl stop -m immediate` and restarted (crash recovery replays the WAL;
// fsync is on), or whose sessions are killed with pg_terminate_backend,
// while a workload runs on it.
//
//   - pg/<fault>/pgtable: consumers claim each message in dedup/pgtable and
//     write its effect in the same transaction, both on the throwaway
//     server (the effect must commit with the claim, so here the effects
//     table is on the server that crashes; it is read after recovery). A
//     commit whose reply is lost is retried by the broker and found as a
//     duplicate. Promise: 0 duplicate effects, 0 acknowledged messages
//     without an effect.
//   - pg/<fault>/outbox: producers enqueue with pgoutbox on the throwaway
//     server, a Relay publishes to a consumer that claims in dedup/pgtable
//     on the shared PostgreSQL, where the oracle is. Promise: every message
//     whose transaction committed (acknowledged, or found in the outbox
//     after recovery) is published and applied exactly once.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// srvPGFault is one way of hurting the throwaway PostgreSQL.
type srvPGFault struct {
	name         string
	small, full  int           // rounds
	gapLo, gapHi time.Duration // between rounds
	cycle        time.Duration // mean length of a round, gap included, for pacing
	inject       func(ctx context.Context, pg *fault.Postgres, r *rand.Rand, res *Result) error
}

var srvPGFaults = []srvPGFault{
	{
		name: "immediate", small: 5, full: 25,
		gapLo: 300 * time.Millisecond, gapHi: 900 * time.Millisecond, cycle: 1300 * time.Millisecond,
		inject: func(ctx context.Context, pg *fault.Postgres, r *rand.Rand, res *Result) error {
			if err := pg.Stop(ctx); err != nil {
				return err
			}
			res.Kills++
			srvSleep(ctx, srvBetween(r, 100*time.Millisecond, 500*time.Millisecond))
			// Start even when ctx ended: the cell reads the server after.
			if err := pg.Start(context.WithoutCancel(ctx)); err != nil {
				return err
			}
			res.Restarts++
			return nil
		},
	},
	{
		name: "terminate", small: 12, full: 80,
		gapLo: 150 * time.Millisecond, gapHi: 450 * time.Millisecond, cycle: 320 * time.Millisecond,
		inject: func(ctx context.Context, pg *fault.Postgres, _ *rand.Rand, res *Result) error {
			n, err := srvTerminate(ctx, pg.URL())
			res.Kills += n
			return err
		},
	},
}

// srvTerminate kills every client session of the database at url but its
// own (pg_terminate_backend) and returns how many it killed.
func srvTerminate(ctx context.Context, url string) (int, error) {
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	c, err := pgx.Connect(cctx, url)
	if err != nil {
		return 0, fmt.Errorf("terminate: %w", err)
	}
	defer func() { _ = c.Close(context.WithoutCancel(ctx)) }()
	var n int
	err = c.QueryRow(cctx, `SELECT count(*) FILTER (WHERE pg_terminate_backend(pid))::int FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'`).Scan(&n)
	if err != nil {
		return 0, fmt.Errorf("terminate: %w", err)
	}
	return n, nil
}

func init() {
	for _, f := range srvPGFaults {
		Register(Cell{Name: "pg/" + f.name + "/pgtable", Run: func(ctx context.Context, env *Env) (Result, error) {
			return srvPGTable(ctx, env, f)
		}})
		Register(Cell{Name: "pg/" + f.name + "/outbox", Run: func(ctx context.Context, env *Env) (Result, error) {
			return srvPGOutbox(ctx, env, f)
		}})
	}
}

// srvPGFaultLoop runs f's rounds with random gaps.
func srvPGFaultLoop(f srvPGFault, rounds int, pg *fault.Postgres, r *rand.Rand, res *Result, env *Env) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		for i := range rounds {
			if !srvSleep(ctx, srvBetween(r, f.gapLo, f.gapHi)) {
				return nil
			}
			if err := f.inject(ctx, pg, r, res); err != nil {
				return fmt.Errorf("round %d: %w", i+1, err)
			}
		}
		env.Logf("%d %s rounds done", rounds, f.name)
		return nil
	}
}

// srvStartPG starts a throwaway PostgreSQL and a pool on it.
func srvStartPG(ctx context.Context) (*fault.Postgres, *pgxpool.Pool, error) {
	pg, err := fault.StartPostgres(ctx, fault.PostgresOptions{})
	if err != nil {
		return nil, nil, err
	}
	pool, err := srvPool(ctx, pg.URL(), 6)
	if err != nil {
		_ = pg.Close()
		return nil, nil, err
	}
	return pg, pool, nil
}

// srvEnsureUp restarts pg if a fault left it down.
func srvEnsureUp(ctx context.Context, pg *fault.Postgres, res *Result) error {
	if pg.Running() {
		return nil
	}
	if err := pg.Start(context.WithoutCancel(ctx)); err != nil {
		return err
	}
	res.Restarts++
	return nil
}

func srvPGTable(ctx context.Context, env *Env, f srvPGFault) (res Result, err error) {
	name := "pg/" + f.name + "/pgtable"
	n := env.Pick(600, 4000)
	rounds := env.Pick(f.small, f.full)
	pg, pool, err := srvStartPG(ctx)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, pg.Close()) }()
	defer pool.Close()
	// The effects table is on the crashed server, in the claim's
	// transaction: built by NewOracle like every other, read after recovery.
	o, err := NewOracle(ctx, pool, name, env.Seed)
	if err != nil {
		return res, err
	}
	store, err := srvMigratedStore(ctx, pool, o.Schema())
	if err != nil {
		return res, err
	}
	var outcomes srvCounts
	h, err := consumer.Transactional(store, consumer.TxOptions{Scope: "chaos/" + name, Telemetry: consumer.Telemetry{OnOutcome: outcomes.outcome}},
		func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			return o.Record(ctx, tx, m.ID, "consumer")
		})
	if err != nil {
		return res, err
	}
	q := newSrvQueue(srvRand(env), 0.1, time.Second)
	plan := time.Duration(rounds) * f.cycle
	rep, runErr := srvRun(ctx, env, q, srvIDs(n), plan, 4, srvChain(h), srvPGFaultLoop(f, rounds, pg, srvRand(env), &res, env))
	res.Messages, res.Redeliveries = rep.released, rep.redeliveries
	if err := srvEnsureUp(ctx, pg, &res); err != nil {
		return res, errors.Join(runErr, err)
	}
	if err := srvCheck(ctx, o, rep.acked, &res); err != nil {
		return res, errors.Join(runErr, err)
	}
	res.Note = fmt.Sprintf("%d acked after a lost commit reply (found as duplicate); %s", rep.firstDup, outcomes.String())
	return res, runErr
}

// srvApplyPublisher is the relay's broker in the pg/*/outbox cells: it
// hands each message to the consumer's handler chain (claim in pgtable on
// the shared PostgreSQL, effect in the same transaction) and confirms it
// once the chain acknowledged it. A re-publish (the relay crashed, or lost
// its connection, between publish and mark) reaches the consumer again.
type srvApplyPublisher struct {
	h    consumer.Handler
	mu   sync.Mutex
	seen map[string]int
}

func (p *srvApplyPublisher) Publish(ctx context.Context, msgs []*outbox.Message) error {
	failed := map[int]error{}
	for i, m := range msgs {
		r := consumer.Process(ctx, p.h, &consumer.Message{ID: m.ID, Key: m.Key, Payload: m.Payload, Headers: m.Headers, Topic: m.Topic, Attempt: m.Attempt})
		if r.Action != consumer.ActionAck {
			failed[i] = fmt.Errorf("consumer: %s: %w", r.Action, r.Err)
			continue
		}
		p.mu.Lock()
		p.seen[m.ID]++
		p.mu.Unlock()
	}
	if len(failed) > 0 {
		return &outbox.PublishError{Failed: failed}
	}
	return nil
}

// republished is the number of deliveries beyond the first.
func (p *srvApplyPublisher) republished() (unique, extra int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, n := range p.seen {
		extra += n - 1
	}
	return len(p.seen), extra
}

// srvRelayOptions are the relay settings of the outbox cells: quick
// reconnects and polls, so the relay recovers within the cell's time.
func srvRelayOptions() pgoutbox.RelayOptions {
	return pgoutbox.RelayOptions{
		Shards: 4, Sessions: 2, BatchSize: 64,
		PollInterval: 200 * time.Millisecond, RebalanceInterval: 300 * time.Millisecond,
		MaxAttempts: 1000, Backoff: consumer.Backoff{Initial: 50 * time.Millisecond, Max: time.Second},
		ReconnectBackoff: consumer.Backoff{Initial: 50 * time.Millisecond, Max: 500 * time.Millisecond},
		CleanupInterval:  -1, ShutdownTimeout: 5 * time.Second, QueryTimeout: 5 * time.Second,
		Telemetry: consumer.Telemetry{Logger: srvQuiet},
	}
}

// srvRelay runs a relay until stop is called; stop returns Run's error, or
// an error when Run does not return within 30s.
func srvRelay(ctx context.Context, r *pgoutbox.Relay) (stop func() error) {
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	var once sync.Once
	var err error
	return func() error {
		once.Do(func() {
			cancel()
			select {
			case err = <-done:
			case <-time.After(30 * time.Second):
				err = errors.New("the relay did not stop within 30s")
			}
		})
		return err
	}
}

// srvProducers enqueues n messages through ob on pool, paced evenly over d,
// with two producers. A transaction that fails before its commit is retried;
// a commit that returns an error is ambiguous (it may have committed) and is
// not retried — the outbox table tells after recovery.
type srvProducers struct {
	mu                 sync.Mutex
	acked, ambiguous   []string
	failedBeforeCommit int
	keys               int
}

func (p *srvProducers) run(ctx context.Context, pool *pgxpool.Pool, ob enqueuer, n int, d time.Duration) error {
	idx := make(chan int)
	var g srvGroup
	for w := range 2 {
		g.Go(fmt.Sprintf("producer %d", w), func() error {
			for i := range idx {
				p.enqueue(ctx, pool, ob, i)
			}
			return nil
		})
	}
	start := time.Now()
	for i := range n {
		if d > 0 {
			if at := time.Duration(float64(d) * float64(i) / float64(n)); !srvSleep(ctx, time.Until(start.Add(at))) {
				break
			}
		}
		select {
		case idx <- i:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			break
		}
	}
	close(idx)
	_ = g.Wait()
	return ctx.Err()
}

func (p *srvProducers) enqueue(ctx context.Context, pool *pgxpool.Pool, ob enqueuer, i int) {
	keys := max(p.keys, 1)
	for attempt := 0; ctx.Err() == nil; attempt++ {
		if attempt > 0 {
			srvSleep(ctx, srvBackoff(attempt, 0))
		}
		tx, err := pool.Begin(ctx)
		if err != nil {
			p.count(func() { p.failedBeforeCommit++ })
			continue
		}
		ids, err := ob.Enqueue(ctx, tx, outbox.Message{
			Topic: "chaos", Key: fmt.Appendf(nil, "k%02d", i%keys), Payload: fmt.Appendf(nil, "chaos outbox message %d", i),
		})
		if err != nil {
			_ = tx.Rollback(context.WithoutCancel(ctx))
			p.count(func() { p.failedBeforeCommit++ })
			continue
		}
		if err := tx.Commit(ctx); err != nil {
			p.count(func() { p.ambiguous = append(p.ambiguous, ids[0]) })
			return
		}
		p.count(func() { p.acked = append(p.acked, ids[0]) })
		return
	}
}

func (p *srvProducers) count(f func()) {
	p.mu.Lock()
	defer p.mu.Unlock()
	f()
}

// srvOutboxRows reads the ids and states of every row of ob's table.
func srvOutboxRows(ctx context.Context, pool *pgxpool.Pool, ob *pgoutbox.Outbox) (ids []string, pending, dead int, err error) {
	err = srvRetry(ctx, 30*time.Second, func(ctx context.Context) error {
		ids, pending, dead = nil, 0, 0
		rows, err := pool.Query(ctx, "SELECT id::text, state FROM "+ob.Table())
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var id string
			var st int16
			if err := rows.Scan(&id, &st); err != nil {
				return err
			}
			ids = append(ids, id)
			switch st {
			case 0:
				pending++
			case 2:
				dead++
			}
		}
		return rows.Err()
	})
	return ids, pending, dead, err
}

// srvWaitOutbox waits until ob has no pending row (and d passes at most).
func srvWaitOutbox(ctx context.Context, pool *pgxpool.Pool, ob *pgoutbox.Outbox, d time.Duration) error {
	deadline := time.Now().Add(d)
	for {
		_, pending, dead, err := srvOutboxRows(ctx, pool, ob)
		if err != nil {
			return err
		}
		if dead > 0 {
			return fmt.Errorf("%d outbox message(s) parked dead", dead)
		}
		if pending == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("stalled: %d outbox message(s) still pending %v after the faults ended", pending, d)
		}
		if !srvSleep(ctx, 100*time.Millisecond) {
			return ctx.Err()
		}
	}
}

// srvOutboxVerdict checks the committed messages of an outbox cell: acked
// ids must be in the table after recovery, every row must have one effect.
func srvOutboxVerdict(ctx context.Context, pool *pgxpool.Pool, ob *pgoutbox.Outbox, o *Oracle, prod *srvProducers, res *Result) (committed []string, err error) {
	committed, _, _, err = srvOutboxRows(ctx, pool, ob)
	if err != nil {
		return nil, err
	}
	inTable := make(map[string]bool, len(committed))
	for _, id := range committed {
		inTable[id] = true
	}
	must := append([]string(nil), committed...)
	var missing int
	for _, id := range prod.acked {
		if !inTable[id] {
			missing++
			must = append(must, id)
		}
	}
	res.Messages = len(must)
	if err := srvCheck(ctx, o, must, res); err != nil {
		return committed, err
	}
	if missing > 0 {
		return committed, fmt.Errorf("%d acknowledged commit(s) missing from the outbox after recovery", missing)
	}
	return committed, nil
}

func srvPGOutbox(ctx context.Context, env *Env, f srvPGFault) (res Result, err error) {
	name := "pg/" + f.name + "/outbox"
	n := env.Pick(600, 4000)
	rounds := env.Pick(f.small, f.full)
	pg, tpool, err := srvStartPG(ctx)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, pg.Close()) }()
	defer tpool.Close()
	shared, err := srvPool(ctx, env.PGURL, 4)
	if err != nil {
		return res, err
	}
	defer shared.Close()
	o, err := NewOracle(ctx, shared, name, env.Seed)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, o.Drop(context.WithoutCancel(ctx))) }()

	ob, err := srvMigratedOutbox(ctx, tpool, "")
	if err != nil {
		return res, err
	}
	store, err := srvMigratedStore(ctx, shared, o.Schema())
	if err != nil {
		return res, err
	}
	var outcomes srvCounts
	apply, err := consumer.Transactional(store, consumer.TxOptions{Scope: "chaos/" + name, Telemetry: consumer.Telemetry{OnOutcome: outcomes.outcome}},
		func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			return o.Record(ctx, tx, m.ID, "relay")
		})
	if err != nil {
		return res, err
	}
	pub := &srvApplyPublisher{h: srvChain(apply), seen: map[string]int{}}
	relay, err := pgoutbox.NewRelay(ob, pub, srvRelayOptions())
	if err != nil {
		return res, err
	}
	stopRelay := srvRelay(ctx, relay)
	defer func() { err = errors.Join(err, stopRelay()) }()

	prod := &srvProducers{keys: 16}
	plan := time.Duration(rounds) * f.cycle
	var g srvGroup
	pctx, pcancel := context.WithTimeout(ctx, plan+srvDrain(env))
	defer pcancel()
	g.Go("producers", func() error { return prod.run(pctx, tpool, ob, n, plan) })
	faults := srvPGFaultLoop(f, rounds, pg, srvRand(env), &res, env)
	g.Go("faults", func() error { return faults(pctx) })
	runErr := g.Wait()
	if err := srvEnsureUp(ctx, pg, &res); err != nil {
		return res, errors.Join(runErr, err)
	}
	if runErr == nil {
		runErr = srvWaitOutbox(ctx, tpool, ob, srvDrain(env))
	}
	if err := stopRelay(); err != nil {
		runErr = errors.Join(runErr, err)
	}
	committed, verr := srvOutboxVerdict(ctx, tpool, ob, o, prod, &res)
	unique, extra := pub.republished()
	res.Redeliveries = extra
	inTable := make(map[string]bool, len(committed))
	for _, id := range committed {
		inTable[id] = true
	}
	ambCommitted := 0
	for _, id := range prod.ambiguous {
		if inTable[id] {
			ambCommitted++
		}
	}
	res.Note = fmt.Sprintf("%d commits acked, %d ambiguous (%d of them committed), %d failed before commit and retried; %d published, %d re-published",
		len(prod.acked), len(prod.ambiguous), ambCommitted, prod.failedBeforeCommit, unique, extra)
	return res, errors.Join(runErr, verr)
}
