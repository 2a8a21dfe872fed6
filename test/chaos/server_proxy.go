//go:build unix

package chaos

// proxy/ cells: a TCP proxy (internal/testkit/fault) between a client and its
// server that, in short bursts, delays every chunk, resets the connections,
// or cuts a connection after the request reached the server and before the
// reply reaches the client (the ambiguous acknowledgement).
//
//   - proxy/pgtable: consumers on the shared PostgreSQL through the proxy,
//     claim in dedup/pgtable and effect in one transaction. A COMMIT whose
//     reply is cut has committed: the redelivery finds the claim and is
//     acknowledged as a duplicate. Promise: 0 duplicate effects, 0 lost.
//   - proxy/redisnx: consumer.Dedup on dedup/redisnx on the shared Redis
//     through the proxy, the effect in the oracle (direct). A Complete that
//     never reaches Redis (a reset) leaves the lease to expire and the
//     redelivery runs the handler again: that is the lease guarantee's
//     documented window, so duplicates are expected, and the cell fails if
//     there are more duplicates than handlers that could not mark their key
//     done (a failed Complete, a lease found lost).
//   - proxy/outbox-kafka: a pgoutbox Relay on the shared PostgreSQL publishes
//     to Kafka (kfake, in process) through the proxy with adapters/kafka's
//     Publisher; a produce whose acknowledgement is cut is sent again
//     (re-published). A kafka Consumer group (direct) applies each message
//     with consumer.Transactional on dedup/pgtable. Promise: every committed
//     message applied exactly once.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

func init() {
	Register(Cell{Name: "proxy/pgtable", Run: srvProxyPGTable})
	Register(Cell{Name: "proxy/redisnx", ExpectDuplicates: true, Run: srvProxyRedisNX})
	Register(Cell{Name: "proxy/outbox-kafka", Run: srvProxyOutboxKafka})
}

// srvProxyCycle is the mean length of one proxy fault round, for pacing.
const srvProxyCycle = 400 * time.Millisecond

// srvProxyFaults runs rounds of: pass for a while, then one burst of cut,
// delay or reset (the Reset mode, or ResetAll of the open connections).
func srvProxyFaults(px *fault.Proxy, rounds int, r *rand.Rand, bursts *srvCounts, env *Env) func(ctx context.Context) error {
	return func(ctx context.Context) error {
		defer px.SetMode(fault.Pass, 0)
		for range rounds {
			if !srvSleep(ctx, srvBetween(r, 100*time.Millisecond, 400*time.Millisecond)) {
				return nil
			}
			switch r.IntN(4) {
			case 0:
				px.SetMode(fault.Cut, 0)
				bursts.add("cut", 1)
				srvSleep(ctx, srvBetween(r, 20*time.Millisecond, 80*time.Millisecond))
			case 1:
				px.SetMode(fault.Delay, srvBetween(r, 5*time.Millisecond, 40*time.Millisecond))
				bursts.add("delay", 1)
				srvSleep(ctx, srvBetween(r, 200*time.Millisecond, 500*time.Millisecond))
			case 2:
				px.SetMode(fault.Reset, 0)
				bursts.add("reset", 1)
				srvSleep(ctx, srvBetween(r, 10*time.Millisecond, 40*time.Millisecond))
			default:
				px.ResetAll()
				bursts.add("reset_all", 1)
			}
			px.SetMode(fault.Pass, 0)
		}
		env.Logf("%d proxy rounds done", rounds)
		return nil
	}
}

// srvProxyNote describes the proxy's work for a cell's line.
func srvProxyNote(px *fault.Proxy, bursts *srvCounts) string {
	s := px.Stats()
	return fmt.Sprintf("bursts: %s; %d replies cut after the request, %d connections reset", bursts.String(), s.Cuts, s.Resets)
}

// srvProxyKills is the connections the proxy killed.
func srvProxyKills(px *fault.Proxy) int {
	s := px.Stats()
	return int(s.Resets + s.Cuts)
}

// srvHostPort splits addr into host and port.
func srvHostPort(addr string) (string, uint16, error) {
	h, p, err := net.SplitHostPort(addr)
	if err != nil {
		return "", 0, err
	}
	port, err := strconv.ParseUint(p, 10, 16)
	return h, uint16(port), err
}

func srvProxyPGTable(ctx context.Context, env *Env) (res Result, err error) {
	const name = "proxy/pgtable"
	n := env.Pick(800, 5000)
	rounds := env.Pick(15, 100)
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
	cfg, err := pgxpool.ParseConfig(env.PGURL)
	if err != nil {
		return res, err
	}
	px, err := fault.NewProxy(fmt.Sprintf("%s:%d", cfg.ConnConfig.Host, cfg.ConnConfig.Port))
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, px.Close()) }()
	host, port, err := srvHostPort(px.Addr())
	if err != nil {
		return res, err
	}
	cfg.ConnConfig.Host, cfg.ConnConfig.Port, cfg.ConnConfig.Fallbacks = host, port, nil
	cfg.ConnConfig.ConnectTimeout = 3 * time.Second
	cfg.MaxConns = 6
	proxied, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return res, err
	}
	defer proxied.Close()

	// Migrate directly; the store under test goes through the proxy.
	if _, err := srvMigratedStore(ctx, shared, o.Schema()); err != nil {
		return res, err
	}
	store, err := pgtable.New(proxied, pgtable.Options{Schema: o.Schema(), Logger: srvQuiet})
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
	q := newSrvQueue(srvRand(env), 0.05, 500*time.Millisecond)
	var bursts srvCounts
	plan := time.Duration(rounds) * srvProxyCycle
	rep, runErr := srvRun(ctx, env, q, srvIDs(n), plan, 4, srvChain(h), srvProxyFaults(px, rounds, srvRand(env), &bursts, env))
	res.Messages, res.Redeliveries, res.Kills = rep.released, rep.redeliveries, srvProxyKills(px)
	if err := srvCheck(ctx, o, rep.acked, &res); err != nil {
		return res, errors.Join(runErr, err)
	}
	res.Note = fmt.Sprintf("%d acked after a lost commit reply (found as duplicate); %s; %s", rep.firstDup, srvProxyNote(px, &bursts), outcomes.String())
	return res, runErr
}

// srvRedisCleanup deletes every key of prefix from the Redis at client.
func srvRedisCleanup(ctx context.Context, client *redis.Client, prefix string) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	it := client.Scan(ctx, 0, prefix+":*", 1000).Iterator()
	var batch []string
	for it.Next(ctx) {
		batch = append(batch, it.Val())
		if len(batch) == 1000 {
			if err := client.Unlink(ctx, batch...).Err(); err != nil {
				return err
			}
			batch = batch[:0]
		}
	}
	if err := it.Err(); err != nil {
		return err
	}
	if len(batch) > 0 {
		return client.Unlink(ctx, batch...).Err()
	}
	return nil
}

// srvRedisPrefix is a cell's own key prefix on the shared Redis.
func srvRedisPrefix(name string, seed uint64) string {
	return fmt.Sprintf("idemchaos.%s.%d", sanitize(name), seed%1_000_000_007)
}

func srvProxyRedisNX(ctx context.Context, env *Env) (res Result, err error) {
	const name = "proxy/redisnx"
	n := env.Pick(800, 5000)
	rounds := env.Pick(15, 100)
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
	direct := srvRedisClient(env.RedisAddr)
	defer func() { err = errors.Join(err, direct.Close()) }()
	if err := direct.Ping(ctx).Err(); err != nil {
		return res, fmt.Errorf("redis at %s: %w", env.RedisAddr, err)
	}
	prefix := srvRedisPrefix(name, env.Seed)
	defer func() { err = errors.Join(err, srvRedisCleanup(ctx, direct, prefix)) }()
	px, err := fault.NewProxy(env.RedisAddr)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, px.Close()) }()
	client := srvRedisClient(px.Addr())
	defer func() { err = errors.Join(err, client.Close()) }()
	store, err := redisnx.New(client, redisnx.Options{Lease: time.Second, TTL: time.Hour, Prefix: prefix})
	if err != nil {
		return res, err
	}
	var outcomes srvCounts
	dd, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "chaos/" + name, Telemetry: consumer.Telemetry{OnOutcome: outcomes.outcome}, FinishTimeout: 3 * time.Second})
	if err != nil {
		return res, err
	}
	h := srvChain(consumer.HandlerFunc(func(ctx context.Context, m *consumer.Message) error {
		return o.Record(ctx, shared, m.ID, "consumer")
	}), dd)
	q := newSrvQueue(srvRand(env), 0.05, 500*time.Millisecond)
	var bursts srvCounts
	plan := time.Duration(rounds) * srvProxyCycle
	rep, runErr := srvRun(ctx, env, q, srvIDs(n), plan, 4, h, srvProxyFaults(px, rounds, srvRand(env), &bursts, env))
	res.Messages, res.Redeliveries, res.Kills = rep.released, rep.redeliveries, srvProxyKills(px)
	if err := srvCheck(ctx, o, rep.acked, &res); err != nil {
		return res, errors.Join(runErr, err)
	}
	// A handler that succeeded and then could not mark its key done
	// (Complete failed, or the heartbeat found the lease lost) is the only
	// way to a second run of the handler for one message.
	unmarked := outcomes.get(string(consumer.OutcomeCompleteFailed)) + outcomes.get(string(consumer.OutcomeLeaseLost))
	res.Note = fmt.Sprintf("%d acked after a cut Complete (found done); %s; %s",
		rep.firstDup, srvProxyNote(px, &bursts), outcomes.String())
	if res.Duplicates > unmarked {
		runErr = errors.Join(runErr, fmt.Errorf("%d duplicate effects but only %d handlers that could not mark their key done: a duplicate the lease window does not explain (%s)",
			res.Duplicates, unmarked, srvDupDetail(ctx, shared, o)))
	}
	return res, runErr
}

func srvProxyOutboxKafka(ctx context.Context, env *Env) (res Result, err error) {
	const name = "proxy/outbox-kafka"
	n := env.Pick(800, 5000)
	rounds := env.Pick(15, 100)
	topic, dlq := "chaos", "chaos-dlq" // srvProducers enqueue to topic "chaos"
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(4, topic, dlq),
		kfake.GroupMinSessionTimeout(100*time.Millisecond))
	if err != nil {
		return res, err
	}
	defer cluster.Close()
	brokers := cluster.ListenAddrs()
	px, err := fault.NewProxy(brokers[0])
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, px.Close()) }()

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
	ob, err := srvMigratedOutbox(ctx, shared, o.Schema())
	if err != nil {
		return res, err
	}
	store, err := srvMigratedStore(ctx, shared, o.Schema())
	if err != nil {
		return res, err
	}

	// The relay's producer reaches the broker only through the proxy: the
	// bootstrap address and every broker address of the metadata.
	tr := &kafkago.Transport{
		Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "tcp", px.Addr())
		},
	}
	defer tr.CloseIdleConnections()
	w := &kafkago.Writer{
		Addr: kafkago.TCP(px.Addr()), Balancer: &kafkago.Hash{}, RequiredAcks: kafkago.RequireAll,
		BatchSize: 100, BatchTimeout: 5 * time.Millisecond, MaxAttempts: 5,
		WriteBackoffMin: 20 * time.Millisecond, WriteBackoffMax: 200 * time.Millisecond,
		ReadTimeout: 5 * time.Second, WriteTimeout: 5 * time.Second, Transport: tr,
	}
	defer func() { err = errors.Join(err, w.Close()) }()
	pub, err := idemkafka.NewPublisher(w, idemkafka.PublisherOptions{})
	if err != nil {
		return res, err
	}
	relay, err := pgoutbox.NewRelay(ob, pub, srvRelayOptions())
	if err != nil {
		return res, err
	}

	var outcomes srvCounts
	apply, err := consumer.Transactional(store, consumer.TxOptions{Scope: "chaos/" + name, Telemetry: consumer.Telemetry{OnOutcome: outcomes.outcome}},
		func(ctx context.Context, tx pgx.Tx, m *consumer.Message) error {
			return o.Record(ctx, tx, m.ID, "consumer")
		})
	if err != nil {
		return res, err
	}
	var dups, acks atomic.Int64
	var deadMu sync.Mutex
	var dead []string
	c, err := idemkafka.NewConsumer(kafkago.ReaderConfig{
		Brokers: brokers, GroupID: "chaos-" + sanitize(name), Topic: topic,
		HeartbeatInterval: 100 * time.Millisecond, SessionTimeout: 10 * time.Second, RebalanceTimeout: 10 * time.Second,
		JoinGroupBackoff: 100 * time.Millisecond, MaxWait: 100 * time.Millisecond,
		ReadBackoffMin: 10 * time.Millisecond, ReadBackoffMax: 100 * time.Millisecond,
	}, consumer.Chain(apply, consumer.Recover()), idemkafka.ConsumerOptions{
		DeadLetterTopic: dlq,
		Telemetry: consumer.Telemetry{
			Logger: srvQuiet,
			OnOutcome: func(_ context.Context, rep consumer.Report) {
				m, r := rep.Message, rep.Result
				switch r.Action {
				case consumer.ActionAck:
					acks.Add(1)
					if r.Duplicate {
						dups.Add(1)
					}
				case consumer.ActionDeadLetter:
					deadMu.Lock()
					dead = append(dead, fmt.Sprintf("%s (%s: %v)", m.ID, r.Reason, r.Err))
					deadMu.Unlock()
				}
			},
		},
	})
	if err != nil {
		return res, err
	}
	_, stopConsumer := srvStart(ctx, "kafka consumer", c.Run)
	stopAll := srvStopAll(srvRelay(ctx, relay), stopConsumer)
	defer func() { err = errors.Join(err, stopAll()) }()

	bursts, runErr, verr := srvProxyOutboxWorkload(ctx, env, px, shared, ob, o, n, rounds, stopAll, &res)
	res.Redeliveries = int(dups.Load())
	res.Kills = srvProxyKills(px)
	deadMu.Lock()
	if len(dead) > 0 {
		verr = errors.Join(verr, fmt.Errorf("%d record(s) dead-lettered, first %s", len(dead), dead[0]))
	}
	deadMu.Unlock()
	res.Note = fmt.Sprintf("%d records consumed, %d of them re-published duplicates; %s", acks.Load(), dups.Load(), srvProxyNote(px, bursts))
	return res, errors.Join(runErr, verr)
}

// srvStart runs run in a goroutine. stop cancels it and waits for it up to
// 60s; exiting with context.Canceled is a clean stop. exited delivers
// run's error if it ends on its own (read it only instead of stop).
func srvStart(ctx context.Context, what string, run func(context.Context) error) (exited <-chan error, stop func() error) {
	cctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- run(cctx) }()
	return done, func() error {
		cancel()
		select {
		case err := <-done:
			if errors.Is(err, context.Canceled) {
				return nil
			}
			return err
		case <-time.After(60 * time.Second):
			return fmt.Errorf("the %s did not stop within 60s", what)
		}
	}
}

// srvStopAll returns a function that runs every stop once, in order, and
// joins their errors; later calls return the same result.
func srvStopAll(stops ...func() error) func() error {
	var once sync.Once
	var err error
	return func() error {
		once.Do(func() {
			for _, stop := range stops {
				err = errors.Join(err, stop())
			}
		})
		return err
	}
}

// srvProxyOutboxWorkload is the run of the proxy/outbox-* cells once the
// relay and the consumer are up: producers enqueue n messages over rounds
// proxy cycles while the proxy injects faults; then it waits for the
// outbox to drain and every committed message's effect, stops the relay
// and the consumer (stopAll), and fills res from the oracle. runErr is the
// run's failure, verr the verdict's.
func srvProxyOutboxWorkload(ctx context.Context, env *Env, px *fault.Proxy, shared *pgxpool.Pool, ob *pgoutbox.Outbox, o *Oracle,
	n, rounds int, stopAll func() error, res *Result) (bursts *srvCounts, runErr, verr error) {
	prod := &srvProducers{keys: 16}
	bursts = &srvCounts{}
	plan := time.Duration(rounds) * srvProxyCycle
	pctx, pcancel := context.WithTimeout(ctx, plan+srvDrain(env))
	defer pcancel()
	var g srvGroup
	g.Go("producers", func() error { return prod.run(pctx, shared, ob, n, plan) })
	faults := srvProxyFaults(px, rounds, srvRand(env), bursts, env)
	g.Go("faults", func() error { return faults(pctx) })
	runErr = g.Wait()
	if runErr == nil {
		runErr = srvWaitOutbox(ctx, shared, ob, srvDrain(env))
	}
	if runErr == nil {
		runErr = srvWaitEffects(ctx, o, prod.acked, srvDrain(env))
	}
	runErr = errors.Join(runErr, stopAll())
	_, verr = srvOutboxVerdict(ctx, shared, ob, o, prod, res)
	return bursts, runErr, verr
}

// srvWaitEffects waits until every id of must has an effect in o.
func srvWaitEffects(ctx context.Context, o *Oracle, must []string, d time.Duration) error {
	deadline := time.Now().Add(d)
	for {
		var res Result
		if err := srvCheck(ctx, o, must, &res); err != nil {
			return err
		}
		if res.Lost == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("stalled: %d committed message(s) without an effect %v after the faults ended", res.Lost, d)
		}
		if !srvSleep(ctx, 100*time.Millisecond) {
			return ctx.Err()
		}
	}
}
