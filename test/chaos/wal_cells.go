//go:build unix

package chaos

// wal/ cells: the outbox relay that reads the write-ahead log
// (outbox/walrelay) on a throwaway PostgreSQL of its own with
// wal_level = logical (internal/testkit/fault; the shared server is not
// reconfigured). The messages are written with walrelay's default source
// (logical decoding messages, no table row); the consumer claims each in
// dedup/pgtable on the shared PostgreSQL and writes its effect in the
// claim's transaction, where the oracle reads it.
//
//   - wal/amqp/sigkill: a relay child process publishes to RabbitMQ
//     (adapters/amqp, publisher confirms) and is SIGKILLed at random and
//     at the named points before_publish and after_publish: the broker
//     confirmed the batch, the relay has not confirmed its position (the
//     slot's LSN), so the server streams the batch again to the next
//     relay, which publishes it again with the same ids.
//   - wal/pg/immediate: the relay runs in the runner and the server that
//     holds the slot is crashed (pg_ctl stop -m immediate) and restarted
//     while producers enqueue; the slot comes back at its last persisted
//     position and the relay streams again from there. The broker is the
//     consumer's handler chain itself (srvApplyPublisher).
//   - wal/proxy/amqp: the relay in the runner publishes to RabbitMQ
//     through the fault proxy (srvAMQPBroker, as proxy/outbox-amqp): a
//     publish whose confirm is cut or whose connection is reset is
//     unconfirmed, and the relay sends it again; the consumer (direct)
//     finds the copies claimed.
//
// The producers of wal/pg/immediate and wal/proxy/amqp also write each
// message's id into a table of the throwaway server in the same
// transaction (walCommits): after a crash, that table tells which
// transactions committed, including those whose COMMIT reply was lost. The
// promise: every committed message has exactly one effect, and the cell
// reports the copies the relay published again.

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/walrelay"
)

func init() {
	RegisterChild("wal-relay", walRelayChild)
	Register(walAMQPKillCell("wal/amqp/sigkill"))
	Register(Cell{Name: "wal/pg/immediate", Run: walPGImmediate})
	Register(Cell{Name: "wal/proxy/amqp", Run: walProxyAMQP})
}

// walSchema holds the outbox's dead table and migrations, and the commits
// table, on the throwaway server.
const walSchema = "chaos_wal"

// walStartPG starts a throwaway PostgreSQL with wal_level = logical and a
// pool on it.
func walStartPG(ctx context.Context) (*fault.Postgres, *pgxpool.Pool, error) {
	pg, err := fault.StartLogicalPostgres(ctx)
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

// walMigratedOutbox returns a walrelay Outbox on pool, migrated (its
// publication and slot created), with the commits table.
func walMigratedOutbox(ctx context.Context, pool *pgxpool.Pool, logger *slog.Logger) (*walrelay.Outbox, error) {
	if _, err := pool.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+pgx.Identifier{walSchema}.Sanitize()); err != nil {
		return nil, err
	}
	ob, err := walrelay.New(pool, walrelay.Options{Schema: walSchema, Logger: logger})
	if err != nil {
		return nil, err
	}
	if err := ob.Migrate(ctx); err != nil {
		return nil, err
	}
	return ob, nil
}

// walRelayOptions are the relay settings of the cells: quick reconnects
// and take-overs, so that the relay recovers within the cell's time, and a
// poison message never parked (the consumer's transient failures under
// faults are retried). The position is reported every 200ms (a fifth of
// the default), so that the slot moves on between the kills, which come
// about every half second: what the broker confirmed since the last report
// before a crash is published again.
func walRelayOptions(logger *slog.Logger) walrelay.RelayOptions {
	return walrelay.RelayOptions{
		BatchSize: 64, PublishesInFlight: 2, MaxAttempts: 1000, Backoff: consumer.Backoff{Initial: 50 * time.Millisecond, Max: time.Second},
		ReconnectBackoff: consumer.Backoff{Initial: 50 * time.Millisecond, Max: 500 * time.Millisecond},
		TakeoverInterval: 100 * time.Millisecond, StatusInterval: 200 * time.Millisecond, CleanupInterval: -1,
		ShutdownTimeout: 5 * time.Second, QueryTimeout: 5 * time.Second, Telemetry: consumer.Telemetry{Logger: logger},
	}
}

// walRelayChild is the relay child of wal/*/sigkill: a walrelay Relay on
// the throwaway server (cfg.PGURL, outbox in cfg.Schema) whose publisher
// passes the kill points around each confirmed batch.
func walRelayChild(ctx context.Context) error {
	r, err := newChildRun(ctx)
	if err != nil {
		return err
	}
	defer r.quit()
	pool, err := childPool(r.ctx, r.cfg.PGURL, 3)
	if err != nil {
		return err
	}
	defer pool.Close()
	ob, err := walrelay.New(pool, walrelay.Options{Schema: r.cfg.Schema, Logger: childLogger()})
	if err != nil {
		return err
	}
	pub, closer, err := killingPublisher(r)
	if err != nil {
		return err
	}
	defer closer()
	relay, err := walrelay.NewRelay(ob, pub, walRelayOptions(childLogger()))
	if err != nil {
		return err
	}
	r.ready()
	return r.done(relay.Run(r.ctx))
}

// walWorkload is the workload of a wal SIGKILL cell: the runner enqueues
// the inputs on the throwaway server, evenly over span, the relay children
// publish them, and progress is the consumer's distinct effects.
type walWorkload struct {
	b        *cellBase
	span     time.Duration
	url      string
	pool     *pgxpool.Pool
	ob       *walrelay.Outbox
	sink     relaySink
	next     int
	enqueued atomic.Int64
	stop     context.CancelFunc
	done     chan error
}

func (w *walWorkload) child() string { return "wal-relay" }

func (w *walWorkload) logPrefix() string { return "publishes" }

func (w *walWorkload) config(int) childConfig {
	c := w.b.config()
	c.PGURL, c.Schema = w.url, walSchema
	w.sink.configure(&c)
	return c
}

func (w *walWorkload) produce(ctx context.Context, ids []string) error {
	ctx, w.stop = context.WithCancel(ctx)
	w.done = make(chan error, 1)
	go func() {
		w.done <- paced(ctx, ids, w.span, nil, func(ctx context.Context, batch []string) error {
			if err := enqueue(ctx, w.pool, w.ob, w.sink.topic(), batch, &w.next); err != nil {
				return err
			}
			w.enqueued.Add(int64(len(batch)))
			return nil
		})
	}()
	return nil
}

// close stops the producer.
func (w *walWorkload) close() {
	if w.stop != nil {
		w.stop()
		if err := <-w.done; err != nil && !errors.Is(err, context.Canceled) {
			w.b.env.Logf("producer: %v", err) // reported by progress, if it ran
		}
		w.stop = nil
	}
}

// producerErr is the producer's failure, if it ended with one.
func (w *walWorkload) producerErr() error {
	select {
	case err := <-w.done:
		w.done <- err
		if err != nil && !errors.Is(err, context.Canceled) {
			return fmt.Errorf("producer: %w", err)
		}
	default:
	}
	return nil
}

func (w *walWorkload) progress(ctx context.Context) (int, error) {
	if err := w.producerErr(); err != nil {
		return 0, err
	}
	return w.b.distinctEffects(ctx)
}

func (w *walWorkload) drained(ctx context.Context, idle time.Duration) (bool, error) {
	if err := w.producerErr(); err != nil {
		return false, err
	}
	if int(w.enqueued.Load()) < len(w.b.ids) {
		return false, nil
	}
	return w.sink.caughtUp(ctx, idle)
}

func (w *walWorkload) settle(ctx context.Context) error { return w.sink.settle(ctx) }

// walAMQPKillCell is wal/amqp/sigkill.
func walAMQPKillCell(name string) Cell {
	return Cell{
		Name: name,
		Run: func(ctx context.Context, env *Env) (res Result, err error) {
			n, kills := env.Pick(1000, 20000), env.Pick(8, 40)
			pg, pool, err := walStartPG(ctx)
			if err != nil {
				return res, err
			}
			defer func() { err = errors.Join(err, pg.Close()) }()
			defer pool.Close()
			ob, err := walMigratedOutbox(ctx, pool, srvQuiet)
			if err != nil {
				return res, err
			}
			return withBase(ctx, env, name, storePG, n, func(b *cellBase) (Result, error) {
				ctl, err := newRabbitCtl(env.AMQPURL)
				if err != nil {
					return Result{}, err
				}
				q := &amqpQueue{url: env.AMQPURL, vhost: vhostOf(env.AMQPURL), queue: "chaos." + b.suffix, exchange: "chaos." + b.suffix + ".in", ctl: ctl}
				defer q.remove()
				sink, cleanup, err := newAMQPSink(ctx, b, q, 1, 0)
				if err != nil {
					return Result{}, err
				}
				defer cleanup()
				return walKillCell(ctx, b, &walWorkload{b: b, url: pg.URL(), pool: pool, ob: ob, sink: sink}, kills)
			})
		},
	}
}

// walKillSpan is the time per kill the producer of a SIGKILL cell allows:
// a kill, the restart of the relay child and its first publish take up to
// about that long on a loaded machine. The WAL relay keeps up with any
// producer, so the inputs done follow the enqueued ones; spread over less
// time, the last kills would find a relay with nothing left to publish.
const walKillSpan = 2500 * time.Millisecond

// walKillCell runs the kill loop over w (one relay child at a time: every
// kill hits the relay that streams the slot) and reports the copies the
// broker confirmed more than once.
func walKillCell(ctx context.Context, b *cellBase, w *walWorkload, kills int) (Result, error) {
	w.span = max(time.Duration(len(b.ids))*time.Second/relayRate, time.Duration(kills)*walKillSpan)
	ids, err := uuidIDs(len(b.ids))
	if err != nil {
		return Result{}, err
	}
	b.ids = ids
	defer w.close()
	res, err := killCell(ctx, b, w, killSpec{
		kills: kills, workers: 1, points: relayPoints,
		named: 8 * time.Second, limit: time.Duration(b.env.Pick(90, 600)) * time.Second,
	})
	pubs, distinct, perr := countDeliveries(b.env.TempDir, "publishes")
	if perr == nil {
		res.Note += fmt.Sprintf("; the broker confirmed %d publishes of %d messages (%d published again; copies sent but unconfirmed at a kill are not counted)", pubs, distinct, pubs-distinct)
	}
	dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
	defer cancel()
	if dead, derr := walDead(dctx, w.pool, w.ob); derr == nil && dead > 0 {
		res.Note += fmt.Sprintf("; %d messages parked dead", dead)
	}
	return res, err
}

// walDead counts the messages the relay parked: inputs never delivered,
// which the oracle counts as lost.
func walDead(ctx context.Context, pool *pgxpool.Pool, ob *walrelay.Outbox) (n int, err error) {
	err = pool.QueryRow(ctx, "SELECT count(*) FROM "+ob.DeadTable()).Scan(&n)
	return n, err
}

// walCommits is the producers' enqueuer of the wal/pg and wal/proxy
// cells: walrelay's Enqueue plus the messages' ids in the commits table,
// in the same transaction.
type walCommits struct {
	ob    *walrelay.Outbox
	table string
}

func newWALCommits(ctx context.Context, pool *pgxpool.Pool, ob *walrelay.Outbox) (*walCommits, error) {
	c := &walCommits{ob: ob, table: pgx.Identifier{walSchema, "commits"}.Sanitize()}
	_, err := pool.Exec(ctx, "CREATE TABLE IF NOT EXISTS "+c.table+" (id text NOT NULL)")
	return c, err
}

func (c *walCommits) Enqueue(ctx context.Context, tx pgx.Tx, msgs ...outbox.Message) ([]string, error) {
	ids, err := c.ob.Enqueue(ctx, tx, msgs...)
	if err != nil {
		return nil, err
	}
	_, err = tx.Exec(ctx, "INSERT INTO "+c.table+" (id) SELECT unnest($1::text[])", ids)
	return ids, err
}

// committed reads the ids whose transaction committed.
func (c *walCommits) committed(ctx context.Context, pool *pgxpool.Pool) (ids []string, err error) {
	err = srvRetry(ctx, 30*time.Second, func(ctx context.Context) error {
		rows, err := pool.Query(ctx, "SELECT id FROM "+c.table)
		if err != nil {
			return err
		}
		ids, err = pgx.CollectRows(rows, pgx.RowTo[string])
		return err
	})
	return ids, err
}

// walVerdict waits (up to the drain time) until every committed message
// has an effect, stops the relay and the consumer (stop), then fills res
// from the oracle: Messages are the committed messages (the acknowledged
// commits must be among them).
func walVerdict(ctx context.Context, env *Env, pool *pgxpool.Pool, commits *walCommits, o *Oracle, prod *srvProducers, stop func() error, res *Result) (runErr, verr error) {
	committed, err := commits.committed(ctx, pool)
	if err != nil {
		return stop(), err
	}
	runErr = errors.Join(srvWaitEffects(ctx, o, committed, srvDrain(env)), stop())
	inTable := make(map[string]bool, len(committed))
	for _, id := range committed {
		inTable[id] = true
	}
	var missing int
	for _, id := range prod.acked {
		if !inTable[id] {
			missing++
		}
	}
	res.Messages = len(committed)
	if err := srvCheck(ctx, o, committed, res); err != nil {
		return runErr, err
	}
	if missing > 0 {
		return runErr, fmt.Errorf("%d acknowledged commit(s) missing from the server after recovery", missing)
	}
	ambCommitted := 0
	for _, id := range prod.ambiguous {
		if inTable[id] {
			ambCommitted++
		}
	}
	res.Note = fmt.Sprintf("%d commits acked, %d ambiguous (%d of them committed), %d failed before commit and retried",
		len(prod.acked), len(prod.ambiguous), ambCommitted, prod.failedBeforeCommit)
	return runErr, nil
}

// walPGImmediate is wal/pg/immediate.
func walPGImmediate(ctx context.Context, env *Env) (res Result, err error) {
	const name = "wal/pg/immediate"
	f := srvPGFaults[0]
	if f.name != "immediate" {
		return res, fmt.Errorf("the first PostgreSQL fault is %s, not immediate", f.name)
	}
	n := env.Pick(600, 4000)
	rounds := env.Pick(f.small, f.full)
	pg, tpool, err := walStartPG(ctx)
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

	ob, err := walMigratedOutbox(ctx, tpool, srvQuiet)
	if err != nil {
		return res, err
	}
	commits, err := newWALCommits(ctx, tpool, ob)
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
	relay, err := walrelay.NewRelay(ob, pub, walRelayOptions(srvQuiet))
	if err != nil {
		return res, err
	}
	_, stopRelay := srvStart(ctx, "wal relay", relay.Run)
	stopRelay = srvStopAll(stopRelay)
	defer func() { err = errors.Join(err, stopRelay()) }()

	prod := &srvProducers{keys: 16}
	plan := time.Duration(rounds) * f.cycle
	var g srvGroup
	pctx, pcancel := context.WithTimeout(ctx, plan+srvDrain(env))
	defer pcancel()
	g.Go("producers", func() error { return prod.run(pctx, tpool, commits, n, plan) })
	faults := srvPGFaultLoop(f, rounds, pg, srvRand(env), &res, env)
	g.Go("faults", func() error { return faults(pctx) })
	runErr := g.Wait()
	if err := srvEnsureUp(ctx, pg, &res); err != nil {
		return res, errors.Join(runErr, err)
	}
	werr, verr := walVerdict(ctx, env, tpool, commits, o, prod, stopRelay, &res)
	runErr = errors.Join(runErr, werr)
	unique, extra := pub.republished()
	res.Redeliveries = extra
	res.Note += fmt.Sprintf("; %d published, %d re-published; %s", unique, extra, outcomes.String())
	return res, errors.Join(runErr, verr)
}

// walProxyAMQP is wal/proxy/amqp.
func walProxyAMQP(ctx context.Context, env *Env) (res Result, err error) {
	const name = "wal/proxy/amqp"
	n := env.Pick(800, 5000)
	rounds := env.Pick(15, 100)
	pg, tpool, err := walStartPG(ctx)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, pg.Close()) }()
	defer tpool.Close()
	shared, err := srvPool(ctx, env.PGURL, 6)
	if err != nil {
		return res, err
	}
	defer shared.Close()
	o, err := NewOracle(ctx, shared, name, env.Seed)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, o.Drop(context.WithoutCancel(ctx))) }()
	ob, err := walMigratedOutbox(ctx, tpool, srvQuiet)
	if err != nil {
		return res, err
	}
	commits, err := newWALCommits(ctx, tpool, ob)
	if err != nil {
		return res, err
	}
	br, err := srvStartAMQPBroker(ctx, env, name, shared, o)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, br.close()) }()
	relay, err := walrelay.NewRelay(ob, br.pub, walRelayOptions(srvQuiet))
	if err != nil {
		return res, err
	}
	_, stopRelay := srvStart(ctx, "wal relay", relay.Run)
	stopAll := srvStopAll(stopRelay, br.stopConsumer)
	defer func() { err = errors.Join(err, stopAll()) }()

	prod := &srvProducers{keys: 16}
	bursts := &srvCounts{}
	plan := time.Duration(rounds) * srvProxyCycle
	pctx, pcancel := context.WithTimeout(ctx, plan+srvDrain(env))
	defer pcancel()
	var g srvGroup
	g.Go("producers", func() error { return prod.run(pctx, tpool, commits, n, plan) })
	faults := srvProxyFaults(br.px, rounds, srvRand(env), bursts, env)
	g.Go("faults", func() error { return faults(pctx) })
	runErr := g.Wait()
	werr, verr := walVerdict(ctx, env, tpool, commits, o, prod, stopAll, &res)
	runErr = errors.Join(runErr, werr)
	verr = errors.Join(verr, br.verdict(&res))
	res.Note += fmt.Sprintf("; %d messages consumed, %d of them re-published duplicates; %s", br.acks.Load(), br.dups.Load(), srvProxyNote(br.px, bursts))
	return res, errors.Join(runErr, verr)
}
