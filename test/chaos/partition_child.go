//go:build unix

package chaos

import (
	"context"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/redisnx"
)

// The child of the partition/ cells (partition_run.go): an adapters/amqp
// Consumer in a network namespace of its own, whose every connection (the
// broker, PostgreSQL, Redis) crosses the namespace's veth pair to a
// forwarder on the host. Its clients carry the timeouts a service would
// set, and the cells' long cuts outlast them all:

const (
	// partHeartbeat is the children's AMQP heartbeat: the client closes a
	// silent connection after three intervals (6s), RabbitMQ after about
	// two (4s).
	partHeartbeat = 2 * time.Second
	// partHandlerTimeout bounds each delivery's chain (consumer.Timeout):
	// a statement whose reply is cut is abandoned after it, its connection
	// closed, and the delivery retried.
	partHandlerTimeout = 4 * time.Second
	// partRedisTimeout is the children's go-redis dial, read and write
	// timeout.
	partRedisTimeout = time.Second
	// partMaxAttempts is high enough that no message is dead-lettered for
	// retries spent while its store was cut off: every attempt of a
	// message whose claim cannot reach the store counts.
	partMaxAttempts = 1000
)

// partChildName is the registered name of the child.
const partChildName = "partition-consumer"

// partitionChild runs the consumer until SIGTERM.
func partitionChild(ctx context.Context) error {
	r, err := newChildRun(ctx)
	if err != nil {
		return err
	}
	defer r.quit()
	out, err := openOutcomeLog(partOutcomesPath(r.cfg.Log))
	if err != nil {
		return err
	}
	defer out.close()
	pool, err := childPool(r.ctx, r.cfg.PGURL, 6)
	if err != nil {
		return err
	}
	defer pool.Close()
	h, closer, err := partHandler(r, pool, out)
	if err != nil {
		return err
	}
	defer closer()
	opts := amqpConsumerOptions(r.cfg.Name, r.cfg.Exchange, r.cfg.Durable)
	opts.Config = &amqp091.Config{Heartbeat: partHeartbeat, Dial: amqp091.DefaultDial(3 * time.Second)}
	opts.MaxAttempts = partMaxAttempts
	opts.PublishTimeout = 3 * time.Second
	c, err := idemamqp.NewConsumer(r.cfg.AMQPURL, r.cfg.Queue, h, opts)
	if err != nil {
		return err
	}
	r.ready()
	return r.done(c.Run(r.ctx))
}

// partHandler is the child's chain: the deliveries log, a per-delivery
// timeout, and the effect under pgtable's Transactional (in the claim's
// transaction) or under consumer.Dedup on redisnx (a lease; the effect an
// autocommit insert outside it). Every outcome of the dedup step goes to
// out.
func partHandler(r *childRun, pool *pgxpool.Pool, out *outcomeLog) (consumer.Handler, func(), error) {
	cfg := r.cfg
	ins := effectSQL(cfg.Effects)
	record := func(_ context.Context, rep consumer.Report) { out.add(rep) }
	var inner consumer.Handler
	closer := func() {}
	switch cfg.Store {
	case storePG:
		store, err := pgtable.New(pool, pgtable.Options{Schema: cfg.Schema, Logger: childLogger()})
		if err != nil {
			return nil, nil, err
		}
		inner, err = consumer.Transactional(store, consumer.TxOptions{Scope: cfg.Scope, Telemetry: consumer.Telemetry{OnOutcome: record}},
			func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
				_, err := tx.Exec(ctx, ins, msg.ID, cfg.Name)
				return err
			})
		if err != nil {
			return nil, nil, err
		}
	case storeRedis:
		rdb := redis.NewClient(&redis.Options{
			Addr: cfg.RedisAddr, PoolSize: 8,
			DialTimeout: partRedisTimeout, ReadTimeout: partRedisTimeout, WriteTimeout: partRedisTimeout,
		})
		closer = func() { _ = rdb.Close() }
		store, err := redisnx.New(rdb, redisnx.Options{Lease: cfg.lease(), Prefix: cfg.Prefix})
		if err != nil {
			closer()
			return nil, nil, err
		}
		dd, err := consumer.Dedup(store, consumer.DedupOptions{
			Scope: cfg.Scope, Telemetry: consumer.Telemetry{Logger: childLogger(), OnOutcome: record}, FinishTimeout: 3 * time.Second,
		})
		if err != nil {
			closer()
			return nil, nil, err
		}
		inner = consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
			_, err := pool.Exec(ctx, ins, msg.ID, cfg.Name)
			if err != nil {
				// The INSERT may have committed all the same (its reply
				// was cut short by the handler's timeout): Dedup
				// releases the key and the redelivery runs it again.
				out.add(consumer.Report{Outcome: partEffectError, Message: msg, Err: err})
			}
			return err
		}), dd)
	default:
		return nil, nil, errUnknownStore(cfg.Store)
	}
	h := consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		if msg.Attempt <= 1 {
			r.log.record(msg.ID)
		}
		return inner.Handle(ctx, msg)
	})
	return consumer.Chain(h, consumer.Timeout(partHandlerTimeout)), closer, nil
}

// partEffectError is the outcome log's line for a redisnx handler whose
// effect INSERT returned an error: its result is unknown.
const partEffectError consumer.Outcome = "effect_error"

type errUnknownStore string

func (e errUnknownStore) Error() string { return "unknown store " + string(e) }

// partOutcomesPath is the outcomes file beside a child's deliveries log.
func partOutcomesPath(deliveries string) string {
	return strings.Replace(deliveries, "deliveries-", "outcomes-", 1)
}

// outcomeLog appends one line per outcome of the dedup step to a child's own file (one write
// each: a SIGKILL loses nothing written).
type outcomeLog struct {
	mu sync.Mutex
	f  *os.File
}

func openOutcomeLog(path string) (*outcomeLog, error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	return &outcomeLog{f: f}, nil
}

// add writes "OUTCOME ID ERROR" (the error on one line, if any).
func (o *outcomeLog) add(rep consumer.Report) {
	line := string(rep.Outcome)
	if rep.Message != nil {
		line += " " + rep.Message.ID
	}
	if rep.Err != nil {
		line += " " + strings.Join(strings.Fields(rep.Err.Error()), " ")
	}
	o.mu.Lock()
	_, _ = o.f.WriteString(line + "\n")
	o.mu.Unlock()
}

func (o *outcomeLog) close() { _ = o.f.Close() }
