package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"math"
	mrand "math/rand/v2"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/adapters/httpidem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// The demo's tables in --schema. Their names start with demo_ so that a
// demo pointed at a schema with real idem tables never drops those.
const (
	pgDedupTable    = "demo_processed_events"
	pgOutboxTable   = "demo_outbox"
	pgPaymentsTable = "demo_payments"
	pgChargesTable  = "demo_charges"
	// pgMaxConns bounds the demo's pool. The relay's session opens up to
	// two more, dedicated connections.
	pgMaxConns = 8
)

var schemaName = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,62}$`)

// pgDemo is the PostgreSQL side of `idem demo --postgres`: pgtable for the
// dedup marks of the idem API and the idem consumer, pgoutbox for both
// APIs' messages, the payments the idem API writes and the charges the idem
// consumer applies (the oracle: no unique constraint, so a double charge
// shows up as a second row).
type pgDemo struct {
	pool     *pgxpool.Pool
	store    *pgtable.Store
	ob       *pgoutbox.Outbox
	payments string // quoted, schema-qualified
	charges  string
	where    string
}

func setupPG(ctx context.Context, rawURL, schema string) (*pgDemo, error) {
	if !schemaName.MatchString(schema) {
		return nil, fmt.Errorf("--schema %q: want a lowercase identifier", schema)
	}
	pcfg, err := pgxpool.ParseConfig(rawURL)
	if err != nil {
		return nil, fmt.Errorf("--postgres: %w", err)
	}
	if !strings.Contains(rawURL, "pool_max_conns") {
		pcfg.MaxConns = pgMaxConns
	}
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, fmt.Errorf("--postgres: %w", err)
	}
	where := redactURL(rawURL)
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	err = pool.Ping(pctx)
	cancel()
	if err != nil {
		pool.Close()
		return nil, fmt.Errorf("PostgreSQL at %s is unreachable: %w", where, err)
	}
	d := &pgDemo{
		pool:     pool,
		payments: pgx.Identifier{schema, pgPaymentsTable}.Sanitize(),
		charges:  pgx.Identifier{schema, pgChargesTable}.Sanitize(),
		where:    fmt.Sprintf("PostgreSQL at %s, schema %s", where, schema),
	}
	if err := d.init(ctx, schema); err != nil {
		pool.Close()
		return nil, err
	}
	return d, nil
}

// init drops the demo's tables and creates them again, so runs are
// repeatable.
func (d *pgDemo) init(ctx context.Context, schema string) error {
	quiet := slog.New(slog.DiscardHandler)
	store, err := pgDemoStore(d.pool, schema)
	if err != nil {
		return err
	}
	ob, err := pgoutbox.New(d.pool, pgoutbox.Options{Schema: schema, Table: pgOutboxTable, Logger: quiet})
	if err != nil {
		return err
	}
	d.store, d.ob = store, ob
	var drop []string
	for _, t := range []string{pgDedupTable, pgDedupTable + "_migrations", pgOutboxTable, pgOutboxTable + "_migrations", pgPaymentsTable, pgChargesTable} {
		drop = append(drop, pgx.Identifier{schema, t}.Sanitize())
	}
	for _, q := range []string{
		"CREATE SCHEMA IF NOT EXISTS " + pgx.Identifier{schema}.Sanitize(),
		"DROP TABLE IF EXISTS " + strings.Join(drop, ", ") + " CASCADE",
		// No unique constraints: a payment written twice, or charged
		// twice, is a second row for the counts to find.
		"CREATE TABLE " + d.payments + " (payment int NOT NULL, customer text NOT NULL, cents bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now())",
		"CREATE TABLE " + d.charges + " (payment int NOT NULL, cents bigint NOT NULL, message_id text NOT NULL, charged_at timestamptz NOT NULL DEFAULT now())",
	} {
		if _, err := d.pool.Exec(ctx, q); err != nil {
			return fmt.Errorf("prepare schema %s: %w", schema, err)
		}
	}
	if err := store.Migrate(ctx); err != nil {
		return fmt.Errorf("migrate pgtable: %w", err)
	}
	if err := ob.Migrate(ctx); err != nil {
		return fmt.Errorf("migrate pgoutbox: %w", err)
	}
	return nil
}

func (d *pgDemo) close() { d.pool.Close() }

// dropSchema drops the schema the run made, and everything in it.
func (d *pgDemo) dropSchema(schema string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, _ = d.pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
}

// pgSink is what the demo's APIs enqueue to with --postgres. The idem API
// runs under httpidem.NewTx: its payment row and outbox message commit in
// the transaction that holds the key's claim. The naive API enqueues in a
// transaction of its own, once per request.
type pgSink struct {
	d     *pgDemo
	topic string
}

func (s *pgSink) enqueue(r *http.Request, p *paymentBody, msg *outbox.Message) error {
	ctx := r.Context()
	m := *msg
	m.ID = "" // pgoutbox gives it a UUIDv7: the message id downstream
	m.Topic = s.topic
	if tx := httpidem.Tx[pgx.Tx](ctx); tx != nil {
		if _, err := tx.Exec(ctx, "INSERT INTO "+s.d.payments+" (payment, customer, cents) VALUES ($1, $2, $3)",
			p.Payment, p.Customer, p.Cents); err != nil {
			return err
		}
		_, err := s.d.ob.Enqueue(ctx, tx, m)
		return err
	}
	return pgx.BeginFunc(ctx, s.d.pool, func(tx pgx.Tx) error {
		_, err := s.d.ob.Enqueue(ctx, tx, m)
		return err
	})
}

// chargeTxHandler is the idem consumer's handler with --postgres: the
// charge row is inserted into charges (quoted, schema-qualified) in the
// transaction of the message's claim in store.
func chargeTxHandler(store *pgtable.Store, charges string) (consumer.Handler, error) {
	return consumer.Transactional(store, consumer.TxOptions{Scope: chargeScope},
		func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			var p paymentBody
			if err := json.Unmarshal(msg.Payload, &p); err != nil {
				return consumer.Permanent(err)
			}
			_, err := tx.Exec(ctx, "INSERT INTO "+charges+" (payment, cents, message_id) VALUES ($1, $2, $3)",
				p.Payment, p.Cents, msg.ID)
			return err
		})
}

// pgDemoStore is the demo's pgtable store in schema.
func pgDemoStore(pool pgtable.DB, schema string) (*pgtable.Store, error) {
	return pgtable.New(pool, pgtable.Options{
		Schema: schema, Table: pgDedupTable, Retention: 24 * time.Hour, Logger: slog.New(slog.DiscardHandler),
	})
}

// backlogEmpty reports whether every committed outbox row is published.
func (d *pgDemo) backlogEmpty(ctx context.Context) bool {
	n, _, err := d.ob.Backlog(ctx)
	return err == nil && n == 0
}

// count reads the idem pipeline's effects from the oracle table into l:
// the charges per payment (GROUP BY payment) and the payments the API
// wrote. It checks them against the counts SQL computes on its own.
func (d *pgDemo) count(ctx context.Context, l *ledger) error {
	rows, err := d.pool.Query(ctx, "SELECT payment, count(*), max(cents) FROM "+d.charges+" GROUP BY payment")
	if err != nil {
		return fmt.Errorf("count charges: %w", err)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	for rows.Next() {
		var n, c int
		var cents int64
		if err := rows.Scan(&n, &c, &cents); err != nil {
			rows.Close()
			return err
		}
		if l.valid(n) {
			l.charges[n], l.amounts[n] = uint32(c), int32(min(cents, math.MaxInt32))
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("count charges: %w", err)
	}
	rows, err = d.pool.Query(ctx, "SELECT DISTINCT payment FROM "+d.payments)
	if err != nil {
		return fmt.Errorf("read payments: %w", err)
	}
	for rows.Next() {
		var n int
		if err := rows.Scan(&n); err != nil {
			rows.Close()
			return err
		}
		if l.valid(n) {
			l.accepted.add(n)
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return fmt.Errorf("read payments: %w", err)
	}
	// The same counts in SQL alone.
	var extra, lost int
	err = d.pool.QueryRow(ctx, `SELECT
		(SELECT coalesce(sum(n - 1), 0) FROM (SELECT count(*) AS n FROM `+d.charges+` GROUP BY payment) c),
		(SELECT count(DISTINCT payment) FROM `+d.payments+` p WHERE NOT EXISTS (SELECT 1 FROM `+d.charges+` c WHERE c.payment = p.payment))`).
		Scan(&extra, &lost)
	if err != nil {
		return fmt.Errorf("count extra and lost: %w", err)
	}
	le, ll := 0, 0
	for _, c := range l.charges {
		if c > 0 {
			le += int(c) - 1
		}
	}
	for n, c := range l.charges {
		if c == 0 && l.accepted.has(n) {
			ll++
		}
	}
	if le != extra || ll < lost {
		return fmt.Errorf("counts disagree: SQL says %d extra, %d lost; the ledger %d and %d", extra, lost, le, ll)
	}
	return nil
}

// errRelayCrash is what crashingPublisher returns after a batch went out:
// the relay does not mark the batch and publishes it again, as a relay
// restarted after a crash between publish and mark does.
var errRelayCrash = errors.New("demo: relay crashed after publishing, before marking")

// crashingPublisher wraps the relay's publisher. After a confirmed batch,
// with probability rate, it reports an unknown outcome instead of success.
type crashingPublisher struct {
	pub  outbox.Publisher
	mu   sync.Mutex
	rng  *mrand.Rand
	rate float64

	published   atomic.Int64
	republished atomic.Int64
	crashes     atomic.Int64
}

func (c *crashingPublisher) Publish(ctx context.Context, msgs []*outbox.Message) error {
	err := c.pub.Publish(ctx, msgs)
	if err != nil {
		var pe *outbox.PublishError
		if errors.As(err, &pe) {
			c.published.Add(int64(len(msgs) - len(pe.Failed)))
		}
		return err
	}
	c.published.Add(int64(len(msgs)))
	c.mu.Lock()
	crash := c.rng.Float64() < c.rate
	c.mu.Unlock()
	if crash {
		c.crashes.Add(1)
		c.republished.Add(int64(len(msgs)))
		return errRelayCrash
	}
	return nil
}
