package chaos

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/signal"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	idemnats "github.com/idemkit/idem/adapters/nats"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/redisnx"
)

// The child side of the SIGKILL cells. A cell starts the chaos binary again
// with IDEM_CHAOS_CHILD naming one of the children registered below and its
// whole configuration, as JSON, in IDEM_CHAOS_CONFIG: among it the named
// point (cfg.Point) and the probability (cfg.Prob) with which it fires. The
// child prints childReadyLine once it is set up and childStartedLine at its
// first delivery, and appends the id of every first-attempt delivery to its
// own file (cfg.Log: a write per delivery, so a SIGKILL loses nothing). Its
// named point goes live when the runner writes childArmLine to its stdin
// (cfg.Gated; at once otherwise); from then on, past cfg.After passes, the
// child SIGKILLs itself at the point with probability cfg.Prob at each pass.
// SIGTERM stops it gracefully (exit 0).

// childConfigEnv holds a child's childConfig as JSON.
const childConfigEnv = "IDEM_CHAOS_CONFIG"

const (
	childReadyLine   = "idem-chaos: ready"   // child -> runner: set up
	childStartedLine = "idem-chaos: started" // child -> runner: first delivery
	childArmLine     = "arm"                 // runner -> child (stdin): the named point is live
)

// The stores a consumer cell runs with.
const (
	storePG    = "pgtable" // transactional: claim and effect in one transaction
	storeRedis = "redisnx" // lease in Redis, effect in PostgreSQL outside it
)

// The named kill points.
const (
	pointBeforeTx    = "before_tx"     // the delivery reached the handler chain; nothing claimed
	pointAfterEffect = "after_effect"  // the effect is written, not committed (pgtable) or not completed (redisnx)
	pointAfterCommit = "after_commit"  // committed / completed, not yet acknowledged (ACK, offset, HTTP response)
	pointAfterPub    = "after_publish" // relay: the broker confirmed, the outbox rows not yet marked
	pointBeforePub   = "before_publish"
)

// childConfig is everything a child needs; unused fields stay empty.
type childConfig struct {
	Name      string   `json:"name"` // worker name, written with each effect
	Store     string   `json:"store"`
	PGURL     string   `json:"pg"`
	DirectURL string   `json:"direct_pg"` // a relay's sessions, when PGURL goes through PgBouncer (pgbouncer_cells.go)
	RedisAddr string   `json:"redis"`
	AMQPURL   string   `json:"amqp"`
	NATSURL   string   `json:"nats"`
	Stream    string   `json:"stream"`  // JetStream stream (consumer_nats.go)
	MySQLDSN  string   `json:"mysql"`   // sqltable on MySQL/MariaDB (mariadb_*.go)
	Schema    string   `json:"schema"`  // oracle schema: processed_events, outbox, watermill tables
	Effects   string   `json:"effects"` // quoted effects table
	Brokers   []string `json:"brokers"`
	Topic     string   `json:"topic"`
	Group     string   `json:"group"`
	Queue     string   `json:"queue"`
	Exchange  string   `json:"exchange"`
	Durable   bool     `json:"durable"`
	Prefix    string   `json:"prefix"` // redisnx key prefix
	LeaseMS   int      `json:"lease_ms"`
	Addr      string   `json:"addr"` // HTTP listen address
	Scope     string   `json:"scope"`
	Log       string   `json:"log"` // deliveries file
	Point     string   `json:"point"`
	Gated     bool     `json:"gated"` // the point is live only once "arm" is read from stdin
	After     int      `json:"after"`
	Prob      float64  `json:"prob"`
	Seed      uint64   `json:"seed"`
}

func (c childConfig) lease() time.Duration { return time.Duration(c.LeaseMS) * time.Millisecond }

func loadChildConfig() (childConfig, error) {
	var c childConfig
	if err := json.Unmarshal([]byte(os.Getenv(childConfigEnv)), &c); err != nil {
		return c, fmt.Errorf("%s: %w", childConfigEnv, err)
	}
	return c, nil
}

// childRun is the frame of every child: the configuration, a context
// cancelled by SIGTERM, the killer and the deliveries log.
type childRun struct {
	cfg  childConfig
	ctx  context.Context
	kill *killer
	log  *deliveryLog
	quit func()
}

func newChildRun(ctx context.Context) (*childRun, error) {
	cfg, err := loadChildConfig()
	if err != nil {
		return nil, err
	}
	ctx, stop := signal.NotifyContext(ctx, syscall.SIGTERM)
	dl, err := openDeliveryLog(cfg.Log)
	if err != nil {
		stop()
		return nil, err
	}
	k := newKiller(cfg)
	if cfg.Gated && cfg.Point != "" {
		k.armFrom(os.Stdin)
	}
	return &childRun{cfg: cfg, ctx: ctx, kill: k, log: dl, quit: func() { stop(); _ = dl.f.Close() }}, nil
}

func (r *childRun) ready() { fmt.Println(childReadyLine) }

// done is what a child returns when its consumer's Run returned err: an
// error caused by the SIGTERM itself (a router stopped before it finished
// subscribing) is a clean stop, logged only.
func (r *childRun) done(err error) error {
	if err != nil && r.ctx.Err() != nil {
		fmt.Fprintln(os.Stderr, "stopped by SIGTERM with:", err)
		return nil
	}
	return err
}

// childLogger is the child's slog logger: warnings to stderr, which the runner
// keeps the tail of.
func childLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
}

// killer SIGKILLs the process at its named point.
type killer struct {
	point  string
	after  int64
	prob   float64
	live   atomic.Bool
	passes atomic.Int64
	mu     sync.Mutex
	rng    *rand.Rand
}

func newKiller(c childConfig) *killer {
	p := c.Prob
	if p <= 0 {
		p = 1
	}
	k := &killer{point: c.Point, after: int64(c.After), prob: p, rng: rand.New(rand.NewPCG(c.Seed, 0x6b696c6c))}
	k.live.Store(!c.Gated)
	return k
}

// armFrom makes the point live when childArmLine arrives on r (the
// runner's pipe; the goroutine ends with it).
func (k *killer) armFrom(r io.Reader) {
	go func() {
		sc := bufio.NewScanner(r)
		for sc.Scan() {
			if sc.Text() == childArmLine {
				k.live.Store(true)
			}
		}
	}()
}

// at is a pass through point: the process dies there when it is the
// configured point, live, and its turn came.
func (k *killer) at(point string) {
	if k == nil || point != k.point || !k.live.Load() {
		return
	}
	if k.passes.Add(1) < k.after {
		return
	}
	k.mu.Lock()
	fire := k.rng.Float64() < k.prob
	k.mu.Unlock()
	if fire {
		_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
		select {} // the signal is on its way
	}
}

// deliveryLog appends one line per delivery to the child's own file.
type deliveryLog struct {
	f    *os.File
	mu   sync.Mutex
	once sync.Once
}

func openDeliveryLog(path string) (*deliveryLog, error) {
	if path == "" {
		return nil, errors.New("no deliveries log")
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600)
	if err != nil {
		return nil, err
	}
	return &deliveryLog{f: f}, nil
}

// record writes id (one write call: a SIGKILL right after loses nothing).
func (d *deliveryLog) record(id string) {
	d.once.Do(func() { fmt.Println(childStartedLine) })
	d.mu.Lock()
	_, _ = d.f.WriteString(id + "\n")
	d.mu.Unlock()
}

// childPool opens a small pool on the shared PostgreSQL.
func childPool(ctx context.Context, url string, conns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = conns
	return pgxpool.NewWithConfig(ctx, cfg)
}

// effectSQL is the statement that records an effect.
func effectSQL(table string) string {
	return "INSERT INTO " + table + " (id, worker) VALUES ($1, $2)"
}

// brokerHandler builds the consumer.Handler the Kafka and AMQP children
// run: the effect under pgtable's Transactional (in the claim's
// transaction) or under consumer.Dedup on redisnx (a lease; the effect is
// an autocommit insert outside it), with the kill points around it and the
// deliveries log in front. It returns a closer for the Redis client.
func brokerHandler(r *childRun, pool *pgxpool.Pool) (consumer.Handler, func(), error) {
	cfg := r.cfg
	ins := effectSQL(cfg.Effects)
	var inner consumer.Handler
	closer := func() {}
	switch cfg.Store {
	case storePG:
		store, err := pgtable.New(pool, pgtable.Options{Schema: cfg.Schema, Logger: childLogger()})
		if err != nil {
			return nil, nil, err
		}
		inner, err = consumer.Transactional(store, consumer.TxOptions{Scope: cfg.Scope},
			func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
				if _, err := tx.Exec(ctx, ins, msg.ID, cfg.Name); err != nil {
					return err
				}
				r.kill.at(pointAfterEffect)
				return nil
			})
		if err != nil {
			return nil, nil, err
		}
	case storeRedis:
		rdb := redis.NewClient(&redis.Options{Addr: cfg.RedisAddr, PoolSize: 8})
		closer = func() { _ = rdb.Close() }
		store, err := redisnx.New(rdb, redisnx.Options{Lease: cfg.lease(), Prefix: cfg.Prefix})
		if err != nil {
			closer()
			return nil, nil, err
		}
		dd, err := consumer.Dedup(store, consumer.DedupOptions{Scope: cfg.Scope, Telemetry: consumer.Telemetry{Logger: childLogger()}})
		if err != nil {
			closer()
			return nil, nil, err
		}
		inner = consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
			if _, err := pool.Exec(ctx, ins, msg.ID, cfg.Name); err != nil {
				return err
			}
			r.kill.at(pointAfterEffect)
			return nil
		}), dd)
	default:
		return nil, nil, fmt.Errorf("unknown store %q", cfg.Store)
	}
	h := consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		// A broker delivery, not an in-process retry. JetStream's
		// Attempt counts the broker's deliveries: each is one.
		if msg.Attempt <= 1 || msg.Metadata[idemnats.MetadataDeliveries] != "" {
			r.log.record(msg.ID)
		}
		r.kill.at(pointBeforeTx)
		err := inner.Handle(ctx, msg)
		if err == nil {
			r.kill.at(pointAfterCommit)
		}
		return err
	})
	return h, closer, nil
}

// quietLogger discards everything: for the runner's own clients, whose
// warnings during a fault are expected.
func quietLogger() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }
