package chaos

// pgbouncer/ cells: idem's PostgreSQL paths through a throwaway PgBouncer
// (internal/testkit/pgbouncer) in transaction mode, in front of the shared
// PostgreSQL, with a pool of 4 server connections that every client of the
// cell shares, and pgx in the cache_describe exec mode.
//
//   - pgbouncer/pgtable/sigkill: kafka/pgtable/sigkill with the consumer
//     children's claims and effects through PgBouncer. A killed child's
//     open transaction ends when PgBouncer drops its server connection.
//   - pgbouncer/pgtable/bouncer-kill: the same children, while PgBouncer
//     itself is SIGKILLed and restarted on its port every 0.3 to 1.2 s:
//     every transaction in flight breaks, some after their COMMIT reached
//     PostgreSQL and before the reply came back; the redelivery finds the
//     claim.
//   - pgbouncer/relay/kafka/sigkill: relay/kafka/sigkill with the runner's
//     Enqueue, the consumer's claims and the relay children's pools through
//     PgBouncer; the relays' sessions, which need a session of their own,
//     connect directly (RelayOptions.ConnConfig).
//
// The oracle reads the shared PostgreSQL directly. Promise: 0 duplicate
// effects, 0 lost.

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/idemkit/idem/internal/testkit/pgbouncer"
)

func init() {
	Register(pgbouncerConsumerCell("pgbouncer/pgtable/sigkill", false))
	Register(pgbouncerConsumerCell("pgbouncer/pgtable/bouncer-kill", true))
	Register(pgbouncerRelayCell("pgbouncer/relay/kafka/sigkill"))
}

// startBouncer starts the cell's PgBouncer in front of env.PGURL. A
// missing pgbouncer executable fails the cell.
func startBouncer(ctx context.Context, env *Env) (*pgbouncer.Bouncer, error) {
	dir := filepath.Join(env.TempDir, "pgbouncer")
	if err := os.Mkdir(dir, 0o700); err != nil {
		return nil, err
	}
	return pgbouncer.Start(ctx, pgbouncer.Options{Upstream: env.PGURL, Dir: dir})
}

// bouncedWorkload is a workload whose children connect through PgBouncer.
type bouncedWorkload struct {
	*kafkaWorkload
	url string
}

func (w bouncedWorkload) config(slot int) childConfig {
	c := w.kafkaWorkload.config(slot)
	c.PGURL = w.url
	return c
}

// pgbouncerConsumerCell is pgbouncer/pgtable/sigkill, or with bouncerKills
// pgbouncer/pgtable/bouncer-kill.
func pgbouncerConsumerCell(name string, bouncerKills bool) Cell {
	return Cell{
		Name: name,
		Run: func(ctx context.Context, env *Env) (Result, error) {
			bn, err := startBouncer(ctx, env)
			if err != nil {
				return Result{}, err
			}
			defer bn.Close()
			n, kills := env.Pick(1000, 20000), env.Pick(8, 40)
			if bouncerKills {
				n, kills = env.Pick(3000, 20000), env.Pick(2, 10)
			}
			return withBase(ctx, env, name, storePG, n, func(b *cellBase) (Result, error) {
				kw, err := newKafkaWorkload(ctx, b, "kafka-consumer", kafkaPartitions, 1)
				if err != nil {
					return Result{}, err
				}
				defer kw.closer()
				var bk *bouncerKiller
				if bouncerKills {
					bk = startBouncerKiller(ctx, env, bn)
				}
				res, err := killCell(ctx, b, bouncedWorkload{kw, bn.URL()}, killSpec{
					kills: kills, workers: 2, points: consumerPoints,
					named: 8 * time.Second, limit: time.Duration(env.Pick(90, 600)) * time.Second,
				})
				if bk != nil {
					kills, restarts, kerr := bk.stop()
					res.Kills += kills
					res.Restarts += restarts
					res.Note = fmt.Sprintf("PgBouncer SIGKILLed and restarted %d times; consumers: %s", kills, res.Note)
					if err == nil && kerr != nil {
						err = kerr
					}
				}
				return res, err
			})
		},
	}
}

// bouncerKiller SIGKILLs PgBouncer every 0.3 to 1.2 s and starts it again
// 100 to 400ms later, until stopped.
type bouncerKiller struct {
	stopc           chan struct{}
	done            chan struct{}
	mu              sync.Mutex
	kills, restarts int
	err             error
}

func startBouncerKiller(ctx context.Context, env *Env, bn *pgbouncer.Bouncer) *bouncerKiller {
	k := &bouncerKiller{stopc: make(chan struct{}), done: make(chan struct{})}
	r := rand.New(rand.NewPCG(env.Seed, hash("bouncer-kill")))
	between := func(lo, hi time.Duration) time.Duration { return lo + time.Duration(r.Int64N(int64(hi-lo))) }
	go func() {
		defer close(k.done)
		for {
			select {
			case <-k.stopc:
				return
			case <-ctx.Done():
				return
			case <-time.After(between(300*time.Millisecond, 1200*time.Millisecond)):
			}
			bn.Kill()
			k.mu.Lock()
			k.kills++
			k.mu.Unlock()
			time.Sleep(between(100*time.Millisecond, 400*time.Millisecond))
			// Start even when ctx ended: the cell stops its children after.
			if err := bn.Start(context.WithoutCancel(ctx)); err != nil {
				k.mu.Lock()
				k.err = fmt.Errorf("restart PgBouncer: %w", err)
				k.mu.Unlock()
				return
			}
			env.Logf("PgBouncer killed and restarted")
			k.mu.Lock()
			k.restarts++
			k.mu.Unlock()
		}
	}()
	return k
}

// stop ends the loop (PgBouncer is left running) and returns its counts.
func (k *bouncerKiller) stop() (kills, restarts int, err error) {
	close(k.stopc)
	<-k.done
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.kills, k.restarts, k.err
}

// directSink is a relay cell's sink that also gives the relay children a
// direct connection for their sessions.
type directSink struct {
	relaySink
	url string
}

func (s directSink) configure(c *childConfig) {
	s.relaySink.configure(c)
	c.DirectURL = s.url
}

// pgbouncerRelayCell is pgbouncer/relay/kafka/sigkill.
func pgbouncerRelayCell(name string) Cell {
	return Cell{
		Name: name,
		Run: func(ctx context.Context, env *Env) (Result, error) {
			bn, err := startBouncer(ctx, env)
			if err != nil {
				return Result{}, err
			}
			defer bn.Close()
			direct := env.PGURL
			benv := *env
			benv.PGURL = bn.URL()
			n, kills := env.Pick(1000, 20000), env.Pick(8, 40)
			return withBase(ctx, &benv, name, storePG, n, func(b *cellBase) (Result, error) {
				sink, cleanup, err := newKafkaSink(ctx, b)
				if err != nil {
					return Result{}, err
				}
				defer cleanup()
				return relayKillCell(ctx, b, directSink{sink, direct}, kills)
			})
		},
	}
}
