package idemwatermill_test

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	wmsql "github.com/ThreeDotsLabs/watermill-sql/v3/pkg/sql"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/idemkit/idem/adapters/adaptertest"
	"github.com/idemkit/idem/adapters/watermill"
	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestConformanceSQL runs the adapter conformance suite on the router of
// TestConformance over watermill-sql on the test PostgreSQL: a pub/sub
// outside the consumer's process, so the suite kills consumers with
// SIGKILL in child processes, and cuts a subscriber's connection to the
// database through a TCP proxy. Each destination is a topic of its own,
// its tables in a schema of its own, dropped when the test ends.
//
// A watermill-sql subscriber hands out its consumer group's messages one
// at a time in the order they were published, and the next only once the
// previous was acknowledged; Watermill's Retry retries inside the handler,
// and a nacked message is handed out again before the ones after it. So
// the messages of a destination are applied in the order they were
// published, retries included.
func TestConformanceSQL(t *testing.T) {
	t.Parallel()
	adaptertest.Run(t, &sqlHarness{pools: map[string]*pgxpool.Pool{}})
}

// sqlGroup is the consumer group of every consumer: the offsets table is
// per topic, so one name is enough.
const sqlGroup = "conformance"

// sqlHarness is the Watermill adapter's adaptertest.Harness on
// watermill-sql.
type sqlHarness struct {
	mu    sync.Mutex
	pools map[string]*pgxpool.Pool // the test's own connections, by topic
}

func (h *sqlHarness) Capabilities() adaptertest.Capabilities {
	return adaptertest.Capabilities{Ordering: adaptertest.OrderPerDestination, ChildProcess: true, Parallel: true}
}

// sqlSchema is watermill-sql's PostgreSQL schema adapter with its messages
// table made for any message: the uuid column is text, because the
// message id is the producer's and idem bounds its length itself (the
// stock VARCHAR(36) refuses the suite's oversized id, so that message
// could never reach the consumer that must dead-letter it), and the
// payload is bytea, because a payload need not be JSON (the stock JSON
// column refuses the suite's malformed payload). Everything else is the
// stock adapter: the select reads past the group's offset in (transaction
// id, offset) order and only rows of transactions older than every one
// still running, so a row that commits late is never skipped.
type sqlSchema struct{ wmsql.DefaultPostgreSQLSchema }

func (s sqlSchema) SchemaInitializingQueries(topic string) []wmsql.Query {
	return []wmsql.Query{{Query: `CREATE TABLE IF NOT EXISTS ` + s.MessagesTable(topic) + ` (
		"offset" bigserial,
		uuid text NOT NULL,
		created_at timestamp NOT NULL DEFAULT current_timestamp,
		payload bytea,
		metadata json,
		transaction_id xid8 NOT NULL,
		PRIMARY KEY (transaction_id, "offset"))`}}
}

// sqlAdapters return the schema and offsets adapters of the destinations
// whose tables live in schema.
//
// SubscribeBatchSize is the stock one (100): the subscriber reads a batch
// in a transaction that locks the group's offset row, hands its messages
// out one at a time, and moves the offset past the acknowledged ones when
// the batch ends. A consumer killed inside a batch gives back every
// message of it, acknowledged or not: the next consumer gets them again
// and idem's claims make them duplicates, which the kill cases check.
// (A batch of 1 would give back only the message in flight; either way a
// handler that runs holds the batch's transaction open, and with it
// pg_snapshot_xmin, which hides rows published meanwhile from every
// subscriber of the server until it ends.)
//
// DefaultPostgreSQLOffsetsAdapter keeps one row per consumer group, taken
// FOR UPDATE by the batch's select: two subscribers of a group never hold
// the same message at once, and a subscriber that dies (its transaction
// rolled back by the server) leaves the offset where the last
// acknowledged batch put it, so its message is handed out again.
func sqlAdapters(schema string) (sqlSchema, wmsql.DefaultPostgreSQLOffsetsAdapter) {
	return sqlSchema{wmsql.DefaultPostgreSQLSchema{
			GenerateMessagesTableName: func(topic string) string {
				return pgx.Identifier{schema, "watermill_" + topic}.Sanitize()
			},
		}}, wmsql.DefaultPostgreSQLOffsetsAdapter{
			GenerateMessagesOffsetsTableName: func(topic string) string {
				return pgx.Identifier{schema, "watermill_offsets_" + topic}.Sanitize()
			},
		}
}

func (h *sqlHarness) NewDestination(t testing.TB, _ adaptertest.ConsumerOptions) adaptertest.Destination {
	t.Helper()
	pool := testenv.Pool(t, 4)
	schema := testenv.Schema(t, pool) // dropped with the topics' tables
	name := testenv.Name("wmconf")
	d := adaptertest.Destination{Name: name, DeadLetter: name + "_poison", Params: map[string]string{
		"url":    testenv.PostgresURL(),
		"schema": schema,
	}}
	msgs, offsets := sqlAdapters(schema)
	queries := append(msgs.SchemaInitializingQueries(d.Name), offsets.SchemaInitializingQueries(d.Name)...)
	queries = append(queries, msgs.SchemaInitializingQueries(d.DeadLetter)...)
	for _, q := range queries {
		if _, err := pool.Exec(context.Background(), q.Query, q.Args...); err != nil {
			t.Fatalf("create the tables of %s: %v", d.Name, err)
		}
	}
	h.mu.Lock()
	h.pools[d.Name] = pool
	h.mu.Unlock()
	t.Cleanup(func() {
		h.mu.Lock()
		delete(h.pools, d.Name)
		h.mu.Unlock()
	})
	return d
}

func (h *sqlHarness) pool(d adaptertest.Destination) (*pgxpool.Pool, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if p := h.pools[d.Name]; p != nil {
		return p, nil
	}
	return nil, fmt.Errorf("destination %s was not made by this harness in this process", d.Name)
}

// Publish inserts msgs into the topic's table in one transaction.
func (h *sqlHarness) Publish(_ context.Context, d adaptertest.Destination, msgs ...adaptertest.Message) error {
	pool, err := h.pool(d)
	if err != nil {
		return err
	}
	db := stdlib.OpenDBFromPool(pool)
	defer func() { _ = db.Close() }()
	schema, _ := sqlAdapters(d.Params["schema"])
	pub, err := wmsql.NewPublisher(db, wmsql.PublisherConfig{SchemaAdapter: schema}, nopLogger)
	if err != nil {
		return err
	}
	defer func() { _ = pub.Close() }()
	return pub.Publish(d.Name, conformanceMessages(msgs)...)
}

// Start runs a router whose subscriber and poison queue reach PostgreSQL
// through a TCP proxy of the consumer's own, which Interrupt resets.
func (h *sqlHarness) Start(ctx context.Context, d adaptertest.Destination, w adaptertest.Work, opts adaptertest.ConsumerOptions) (adaptertest.Consumer, error) {
	cfg, err := pgx.ParseConfig(d.Params["url"])
	if err != nil {
		return nil, err
	}
	proxy, err := fault.NewProxy(net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))))
	if err != nil {
		return nil, err
	}
	host, port, _ := net.SplitHostPort(proxy.Addr())
	p, _ := strconv.Atoi(port)
	cfg.Host, cfg.Port = host, uint16(p)
	for _, fb := range cfg.Fallbacks { // sslmode=prefer's plain-text attempt
		fb.Host, fb.Port = host, uint16(p)
	}
	cfg.ConnectTimeout = 5 * time.Second
	db := stdlib.OpenDB(*cfg)
	// The subscriber's transaction holds one connection while the poison
	// queue publishes on another.
	db.SetMaxOpenConns(4)
	c := &sqlConsumer{proxy: proxy, db: db}
	schema, offsets := sqlAdapters(d.Params["schema"])
	// AckDeadline: a message not acknowledged within it is given up: the
	// subscriber cancels the message's context, which rolls back the
	// claim's transaction, and hands the message out again (applied once
	// all the same, the claim being idem's). Until then the group's
	// offset row stays locked, so it bounds how long a hung handler holds
	// up the destination. It is twice Retry's longest wait in a handler
	// (MaxAttempts waits of at most Backoff.Max), so a message is not
	// given up while Retry still works on it.
	deadline := 2 * time.Duration(opts.MaxAttempts) * opts.Backoff.Max
	sub, err := wmsql.NewSubscriber(db, wmsql.SubscriberConfig{
		ConsumerGroup:  sqlGroup,
		SchemaAdapter:  schema,
		OffsetsAdapter: offsets,
		AckDeadline:    &deadline,
		// InitializeSchema is off: NewDestination made the tables before
		// anything was published, and a consumer pointed at a topic that
		// is not there fails to subscribe instead of making an empty one
		// and waiting on it for ever.
		InitializeSchema: false,
		PollInterval:     20 * time.Millisecond,
		ResendInterval:   opts.Backoff.Initial,
		RetryInterval:    opts.Backoff.Initial,
	}, nopLogger)
	if err != nil {
		c.close()
		return nil, err
	}
	// The poison queue's publisher writes in a transaction of its own, not
	// in the subscriber's: a consumer killed after it published a dead
	// letter, before the offset moved, publishes it again, with the same
	// UUID.
	c.pub, err = wmsql.NewPublisher(db, wmsql.PublisherConfig{SchemaAdapter: schema}, nopLogger)
	if err != nil {
		c.close()
		return nil, err
	}
	c.wmConsumer, err = startConformanceRouter(ctx, d, w, opts, sub, c.pub)
	if err != nil {
		c.close()
		return nil, err
	}
	return c, nil
}

type sqlConsumer struct {
	*wmConsumer
	proxy *fault.Proxy // between the consumer and PostgreSQL
	db    *sql.DB
	pub   *wmsql.Publisher
}

func (c *sqlConsumer) close() {
	if c.pub != nil {
		_ = c.pub.Close()
	}
	_ = c.db.Close()
	_ = c.proxy.Close()
}

// Stop stops the router (which closes the subscriber), then the
// consumer's connections.
func (c *sqlConsumer) Stop(ctx context.Context) error {
	err := c.wmConsumer.Stop(ctx)
	c.close()
	return err
}

// Interrupt resets every connection of the consumer in the proxy and waits
// until the consumer connected again.
func (c *sqlConsumer) Interrupt(ctx context.Context) error {
	before := c.proxy.Stats().Accepted
	if c.proxy.ResetAll() == 0 {
		return fmt.Errorf("the proxy had no connection to reset")
	}
	for c.proxy.Stats().Accepted <= before {
		select {
		case <-ctx.Done():
			return fmt.Errorf("the consumer did not connect again: %w", ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
	return nil
}

// DeadLetters reads the poison topic's table, in the order the rows were
// published.
func (h *sqlHarness) DeadLetters(ctx context.Context, d adaptertest.Destination) ([]adaptertest.DeadLetter, error) {
	pool, err := h.pool(d)
	if err != nil {
		return nil, err
	}
	schema, _ := sqlAdapters(d.Params["schema"])
	rows, err := pool.Query(ctx, `SELECT uuid, payload, metadata::text FROM `+schema.MessagesTable(d.DeadLetter)+` ORDER BY transaction_id, "offset"`)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(row pgx.CollectableRow) (adaptertest.DeadLetter, error) {
		var (
			dl   adaptertest.DeadLetter
			meta *string
		)
		if err := row.Scan(&dl.ID, &dl.Payload, &meta); err != nil {
			return dl, err
		}
		if meta != nil {
			if err := json.Unmarshal([]byte(*meta), &dl.Headers); err != nil {
				return dl, fmt.Errorf("the metadata of dead letter %q: %w", dl.ID, err)
			}
		}
		dl.Reason = dl.Headers[idemwatermill.MetadataReason]
		return dl, nil
	})
}
