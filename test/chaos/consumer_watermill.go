package chaos

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	wm "github.com/ThreeDotsLabs/watermill"
	wmsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/adapters/watermill"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/redisnx"
)

// Watermill SIGKILL cells: routers in child processes with idem's
// middleware (Transactional on pgtable, Dedup on redisnx), on watermill-sql
// over PostgreSQL — a broker that survives a process kill: a subscriber
// reads a batch in a transaction that holds its consumer group's offset row
// and moves the offset when the batch is acknowledged, so a killed
// subscriber's batch is read again by the next one. The topic's tables live
// in the oracle's schema.

// wmDB opens a database/sql handle whose search_path is schema, where
// watermill-sql creates its tables.
func wmDB(pgURL, schema string, conns int) (*sql.DB, error) {
	cfg, err := pgx.ParseConfig(pgURL)
	if err != nil {
		return nil, err
	}
	cfg.RuntimeParams["search_path"] = schema
	db := stdlib.OpenDB(*cfg)
	db.SetMaxOpenConns(conns)
	return db, nil
}

func wmSubscriberConfig(group string) wmsql.SubscriberConfig {
	return wmsql.SubscriberConfig{
		ConsumerGroup:    group,
		SchemaAdapter:    wmsql.DefaultPostgreSQLSchema{SubscribeBatchSize: 50},
		OffsetsAdapter:   wmsql.DefaultPostgreSQLOffsetsAdapter{},
		InitializeSchema: true,
		PollInterval:     50 * time.Millisecond,
		ResendInterval:   100 * time.Millisecond,
		RetryInterval:    100 * time.Millisecond,
	}
}

// wmWorkload feeds a watermill-sql topic consumed by watermill-consumer
// children.
type wmWorkload struct {
	b     *cellBase
	db    *sql.DB
	pub   *wmsql.Publisher
	topic string
	group string
}

func newWMWorkload(b *cellBase) (*wmWorkload, func(), error) {
	db, err := wmDB(b.env.PGURL, b.oracle.Schema(), 2)
	if err != nil {
		return nil, nil, err
	}
	w := &wmWorkload{b: b, db: db, topic: "chaos_" + b.suffix, group: "chaos_g_" + b.suffix}
	logger := wm.NewSlogLogger(quietLogger())
	w.pub, err = wmsql.NewPublisher(db, wmsql.PublisherConfig{SchemaAdapter: wmsql.DefaultPostgreSQLSchema{}, AutoInitializeSchema: true}, logger)
	if err != nil {
		_ = db.Close()
		return nil, nil, err
	}
	// The offsets table and the group's row exist before any child runs.
	sub, err := wmsql.NewSubscriber(db, wmSubscriberConfig(w.group), logger)
	if err == nil {
		err = sub.SubscribeInitialize(w.topic)
		_ = sub.Close()
	}
	if err != nil {
		_ = w.pub.Close()
		_ = db.Close()
		return nil, nil, err
	}
	return w, func() { _ = w.pub.Close(); _ = db.Close() }, nil
}

func (w *wmWorkload) child() string { return "watermill-consumer" }

func (w *wmWorkload) config(int) childConfig {
	c := w.b.config()
	c.Topic, c.Group = w.topic, w.group
	return c
}

func (w *wmWorkload) produce(_ context.Context, ids []string) error {
	for len(ids) > 0 {
		n := min(len(ids), 200)
		msgs := make([]*message.Message, n)
		for i, id := range ids[:n] {
			msgs[i] = message.NewMessage(id, []byte(`{"id":"`+id+`"}`))
		}
		if err := w.pub.Publish(w.topic, msgs...); err != nil {
			return err
		}
		ids = ids[n:]
	}
	return nil
}

func (w *wmWorkload) progress(ctx context.Context) (int, error) { return w.b.distinctEffects(ctx) }

// behind counts the messages past the group's acknowledged position.
func (w *wmWorkload) behind(ctx context.Context) (n int, err error) {
	msgs := pgx.Identifier{w.b.oracle.Schema(), "watermill_" + w.topic}.Sanitize()
	offs := pgx.Identifier{w.b.oracle.Schema(), "watermill_offsets_" + w.topic}.Sanitize()
	err = w.b.pool.QueryRow(ctx, `SELECT count(*) FROM `+msgs+` m, `+offs+` o
WHERE o.consumer_group = $1 AND (m.transaction_id > o.last_processed_transaction_id
 OR (m.transaction_id = o.last_processed_transaction_id AND m."offset" > o.offset_acked))`, w.group).Scan(&n)
	return n, err
}

func (w *wmWorkload) drained(ctx context.Context, _ time.Duration) (bool, error) {
	n, err := w.behind(ctx)
	return n == 0, err
}

func (w *wmWorkload) settle(ctx context.Context) error {
	n, err := w.behind(ctx)
	if err != nil {
		return err
	}
	if n > 0 {
		return fmt.Errorf("%d messages past the group's acknowledged offset after the children stopped", n)
	}
	return nil
}

// wmChild is the watermill-consumer child: a Watermill router with idem's
// middleware around the effect.
func wmChild(ctx context.Context) error {
	r, err := newChildRun(ctx)
	if err != nil {
		return err
	}
	defer r.quit()
	cfg := r.cfg
	pool, err := childPool(r.ctx, cfg.PGURL, 4)
	if err != nil {
		return err
	}
	defer pool.Close()
	db, err := wmDB(cfg.PGURL, cfg.Schema, 2)
	if err != nil {
		return err
	}
	defer func() { _ = db.Close() }()
	logger := wm.NewSlogLogger(childLogger())

	ins := effectSQL(cfg.Effects)
	var mw message.HandlerMiddleware
	switch cfg.Store {
	case storePG:
		store, err := pgtable.New(pool, pgtable.Options{Schema: cfg.Schema, Logger: childLogger()})
		if err != nil {
			return err
		}
		mw, err = idemwatermill.Transactional(store, idemwatermill.Options{Scope: cfg.Scope, Telemetry: consumer.Telemetry{Logger: childLogger()}})
		if err != nil {
			return err
		}
	case storeRedis:
		rdb := redis.NewClient(&redis.Options{Addr: cfg.RedisAddr, PoolSize: 4})
		defer func() { _ = rdb.Close() }()
		store, err := redisnx.New(rdb, redisnx.Options{Lease: cfg.lease(), Prefix: cfg.Prefix})
		if err != nil {
			return err
		}
		mw, err = idemwatermill.Dedup(store, idemwatermill.Options{Scope: cfg.Scope, Telemetry: consumer.Telemetry{Logger: childLogger()}})
		if err != nil {
			return err
		}
	default:
		return fmt.Errorf("unknown store %q", cfg.Store)
	}
	effect := func(msg *message.Message) ([]*message.Message, error) {
		ctx := msg.Context()
		var err error
		if tx := idemwatermill.Tx[pgx.Tx](ctx); tx != nil {
			_, err = tx.Exec(ctx, ins, msg.UUID, cfg.Name)
		} else if cfg.Store == storeRedis {
			_, err = pool.Exec(ctx, ins, msg.UUID, cfg.Name)
		} else {
			err = errors.New("no transaction in the message's context")
		}
		if err != nil {
			return nil, err
		}
		r.kill.at(pointAfterEffect)
		return nil, nil
	}
	h := mw(effect)

	sub, err := wmsql.NewSubscriber(db, wmSubscriberConfig(cfg.Group), logger)
	if err != nil {
		return err
	}
	router, err := message.NewRouter(message.RouterConfig{CloseTimeout: 10 * time.Second}, logger)
	if err != nil {
		return err
	}
	router.AddConsumerHandler("chaos", cfg.Topic, sub, func(msg *message.Message) error {
		r.log.record(msg.UUID)
		r.kill.at(pointBeforeTx)
		if _, err := h(msg); err != nil {
			return err
		}
		r.kill.at(pointAfterCommit)
		return nil
	})
	r.ready()
	return r.done(router.Run(r.ctx))
}

// wmCell is a Watermill SIGKILL cell.
func wmCell(name, store string) Cell {
	return Cell{
		Name:             name,
		ExpectDuplicates: store == storeRedis,
		Run: func(ctx context.Context, env *Env) (Result, error) {
			n, kills := env.Pick(800, 10000), env.Pick(6, 30)
			return withBase(ctx, env, name, store, n, func(b *cellBase) (Result, error) {
				w, cleanup, err := newWMWorkload(b)
				if err != nil {
					return Result{}, err
				}
				defer cleanup()
				return killCell(ctx, b, w, killSpec{
					kills: kills, workers: 2, points: consumerPoints,
					named: 8 * time.Second, limit: time.Duration(env.Pick(90, 600)) * time.Second,
				})
			})
		},
	}
}
