package bench

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	amqp091 "github.com/rabbitmq/amqp091-go"
	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// env holds the services of a run and what the run created in them.
type env struct {
	cfg     Config
	size    sizes
	pool    *pgxpool.Pool
	rdb     *redis.Client
	amqpURL string
	kafka   *kafkaBroker // nil until a Kafka row starts it
	mysql   *sql.DB      // MariaDB, nil until a sqltable row opens it
	// logical is a pool on a throwaway cluster with wal_level = logical
	// (the WAL relay's), nil until a WAL relay row starts it.
	logical    *pgxpool.Pool
	logicalErr error
	pgstd      *sql.DB      // PostgreSQL through pgx's stdlib driver, nil until a sqltable row opens it
	schema     string       // every table of the run, dropped at the end
	log        *slog.Logger // for the components under test: warnings only
	seq        atomic.Int64

	floorOnce sync.Once // creates the pgbench scripts' tables

	natsOnce sync.Once // connects js, or sets natsErr
	js       jetstream.JetStream
	natsErr  error

	mu       sync.Mutex
	cleanups []func(ctx context.Context)
}

func newEnv(ctx context.Context, cfg Config) (*env, error) {
	e := &env{cfg: cfg, size: cfg.sizes(), amqpURL: testenv.AMQPURL(),
		log: slog.New(slog.NewTextHandler(cfg.Log, &slog.HandlerOptions{Level: slog.LevelError}))}
	pcfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		return nil, err
	}
	pcfg.MaxConns = 24
	if e.pool, err = pgxpool.NewWithConfig(ctx, pcfg); err == nil {
		err = e.pool.Ping(ctx)
	}
	if err != nil {
		return nil, fmt.Errorf("PostgreSQL at %s: %w (make up starts it)", testenv.PostgresURL(), err)
	}
	e.rdb = redis.NewClient(&redis.Options{Addr: testenv.RedisAddr(), PoolSize: 32})
	if err := e.rdb.Ping(ctx).Err(); err != nil {
		e.close()
		return nil, fmt.Errorf("redis at %s: %w (make up starts it)", testenv.RedisAddr(), err)
	}
	e.schema = testenv.Name("idembench")
	if _, err := e.pool.Exec(ctx, "CREATE SCHEMA "+e.ident()); err != nil {
		e.close()
		return nil, err
	}
	e.onClose(func(ctx context.Context) { _, _ = e.pool.Exec(ctx, "DROP SCHEMA "+e.ident()+" CASCADE") })
	return e, nil
}

// close undoes what the run created, last first, and closes the clients.
func (e *env) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	for i := len(e.cleanups) - 1; i >= 0; i-- {
		e.cleanups[i](ctx)
	}
	if e.kafka != nil {
		e.kafka.stop()
	}
	if e.rdb != nil {
		_ = e.rdb.Close()
	}
	for _, db := range []*sql.DB{e.mysql, e.pgstd} {
		if db != nil {
			_ = db.Close()
		}
	}
	e.pool.Close()
}

func (e *env) onClose(f func(ctx context.Context)) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.cleanups = append(e.cleanups, f)
}

func (e *env) logf(format string, args ...any) {
	_, _ = fmt.Fprintf(e.cfg.Log, "bench: "+format+"\n", args...)
}

func (e *env) ident() string { return pgx.Identifier{e.schema}.Sanitize() }

// table creates the table name (columns cols) in the run's schema and
// returns its quoted, qualified name.
func (e *env) table(ctx context.Context, name, cols string) (string, error) {
	t := pgx.Identifier{e.schema, name}.Sanitize()
	_, err := e.pool.Exec(ctx, "CREATE TABLE "+t+" ("+cols+")")
	return t, err
}

// effects creates a business table the consumer rows insert into, and
// returns the statement that inserts one row ($1 the id, $2 the payload).
func (e *env) effects(ctx context.Context, name string) (string, error) {
	t, err := e.table(ctx, name, "id text NOT NULL, payload bytea, at timestamptz NOT NULL DEFAULT now()")
	return "INSERT INTO " + t + " (id, payload) VALUES ($1, $2)", err
}

// id returns a fresh message id.
func (e *env) id(prefix string) string { return prefix + strconv.FormatInt(e.seq.Add(1), 36) }

// redisPrefix returns a fresh key prefix whose keys are deleted at the end.
func (e *env) redisPrefix(name string) string {
	p := testenv.Name("idembench_" + name)
	e.onClose(func(ctx context.Context) {
		iter := e.rdb.Scan(ctx, 0, p+"*", 1000).Iterator()
		var keys []string
		for iter.Next(ctx) {
			if keys = append(keys, iter.Val()); len(keys) == 1000 {
				_ = e.rdb.Unlink(ctx, keys...).Err()
				keys = keys[:0]
			}
		}
		if len(keys) > 0 {
			_ = e.rdb.Unlink(ctx, keys...).Err()
		}
	})
	return p
}

// amqp runs f on a channel of a fresh connection.
func (e *env) amqp(f func(ch *amqp091.Channel) error) error {
	conn, err := amqp091.Dial(e.amqpURL)
	if err != nil {
		return fmt.Errorf("RabbitMQ at %s: %w", e.amqpURL, err)
	}
	defer func() { _ = conn.Close() }()
	ch, err := conn.Channel()
	if err != nil {
		return err
	}
	return f(ch)
}

// queue declares a fresh durable queue, deleted at the end with the retry
// and dead-letter queues and exchange idem's consumer declares beside it.
func (e *env) queue() (string, error) {
	q := testenv.Name("idembench_q")
	err := e.amqp(func(ch *amqp091.Channel) error {
		_, err := ch.QueueDeclare(q, true, false, false, false, nil)
		return err
	})
	e.onClose(func(context.Context) {
		_ = e.amqp(func(ch *amqp091.Channel) error {
			for _, name := range []string{q, q + ".dlq", q + ".retry.1000ms"} {
				_, _ = ch.QueueDelete(name, false, false, false)
			}
			return ch.ExchangeDelete(q+".dlx", false, false)
		})
	})
	return q, err
}

// publish sends n persistent messages with ids prefix0, prefix1, ... and
// body body to queue, and waits for the broker's confirms.
func (e *env) publish(ctx context.Context, queue, prefix string, n int, body []byte) error {
	return e.amqp(func(ch *amqp091.Channel) error {
		if err := ch.Confirm(false); err != nil {
			return err
		}
		dcs := make([]*amqp091.DeferredConfirmation, 0, 500)
		for i := range n {
			dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, "", queue, false, false, amqp091.Publishing{
				DeliveryMode: amqp091.Persistent, MessageId: prefix + strconv.Itoa(i), Body: body})
			if err != nil {
				return err
			}
			if dcs = append(dcs, dc); len(dcs) == cap(dcs) || i == n-1 {
				if err := waitConfirms(ctx, dcs); err != nil {
					return err
				}
				dcs = dcs[:0]
			}
		}
		return nil
	})
}

func waitConfirms(ctx context.Context, dcs []*amqp091.DeferredConfirmation) error {
	for _, dc := range dcs {
		ok, err := dc.WaitContext(ctx)
		if err != nil {
			return err
		}
		if !ok {
			return errors.New("publish nacked")
		}
	}
	return nil
}

// meter times a side that handles n units on its own goroutines: from the
// first unit done to the last, so that connecting and joining a consumer
// group are not counted.
type meter struct {
	n     int64
	done  chan struct{}
	count atomic.Int64
	first atomic.Int64 // UnixNano of the first unit
	last  int64
}

func newMeter(n int) *meter { return &meter{n: int64(n), done: make(chan struct{})} }

// tick counts one unit done.
func (m *meter) tick() {
	switch m.count.Add(1) {
	case 1:
		m.first.Store(time.Now().UnixNano())
	case m.n:
		m.last = time.Now().UnixNano()
		close(m.done)
	}
}

// wait waits for the n units, errc (the side's goroutines failing) or the
// timeout, and returns the rate.
func (m *meter) wait(ctx context.Context, errc <-chan error) (float64, error) {
	select {
	case <-m.done:
		return float64(m.n-1) / (float64(m.last-m.first.Load()) / 1e9), nil
	case err := <-errc:
		return 0, fmt.Errorf("stopped after %d of %d: %w", m.count.Load(), m.n, err)
	case <-time.After(10 * time.Minute):
		return 0, fmt.Errorf("only %d of %d done after 10 minutes", m.count.Load(), m.n)
	case <-ctx.Done():
		return 0, ctx.Err()
	}
}

// closedLoop runs op on clients goroutines for d and returns the rate of
// successful calls. The first error stops it.
func closedLoop(ctx context.Context, clients int, d time.Duration, op func(ctx context.Context) error) (float64, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		n     atomic.Int64
		wg    sync.WaitGroup
		once  sync.Once
		first error
	)
	start := time.Now()
	deadline := start.Add(d)
	for range clients {
		wg.Go(func() {
			for time.Now().Before(deadline) && ctx.Err() == nil {
				if err := op(ctx); err != nil {
					once.Do(func() { first = err; cancel() })
					return
				}
				n.Add(1)
			}
		})
	}
	wg.Wait()
	if first != nil {
		return 0, first
	}
	return float64(n.Load()) / time.Since(start).Seconds(), nil
}

// warmed scales a round's size down for a warm-up.
func warmed(n int, warm bool) int {
	if warm {
		return max(n/5, 100)
	}
	return n
}

func warmedFor(d time.Duration, warm bool) time.Duration {
	if warm {
		return d / 2
	}
	return d
}
