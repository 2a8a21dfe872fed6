package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/dedup/sqltable"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

const consoleSynopsis = `console [flags]

A web console for the operator's tools, served by this process: the outbox
(backlog, oldest pending message, dead rows and their requeue), the WAL
relay's replication slot (lag, retained WAL), the dedup stores (rows by
state, one key's state) and the dead letters (grouped by reason, one with
its headers and payload, replay and discard of a selection).

Sources take the flags and environment of the other commands:

  --postgres (IDEM_POSTGRES_URL)  the outbox (--outbox-table), the WAL
                        relay's slot (--slot), the pgtable store
                        (--dedup-table), all in --schema
  --redis (IDEM_REDIS_URL)        the redisnx store (--prefix)
  --driver, --dsn       the sqltable store on database/sql
  --kafka, --topic      a Kafka dead-letter topic
  --amqp, --queue       a RabbitMQ dead-letter queue
  --nats, --stream      a NATS dead-letter stream
  --watermill-sql TOPIC the poison queue of a Watermill router on
                        watermill-sql (--postgres, --schema)
  --outbox              the outbox's dead rows on the dead-letter page too

A page whose source is not configured says so.

Security: the console listens on 127.0.0.1 by default. A --listen address
that is not a loopback address needs --token (or IDEM_CONSOLE_TOKEN): the
console refuses to start without one. With a token, every request carries
it, as "Authorization: Bearer TOKEN" or the cookie the login form sets.
Every action (requeue, replay, discard) is a POST from the console's own
pages (a CSRF token and an Origin check) and is confirmed on a second page
before it acts.`

// defaultConsoleListen is where the console listens unless --listen says.
const defaultConsoleListen = "127.0.0.1:7070"

// consoleConfig is what the console serves and how.
type consoleConfig struct {
	listen string
	token  string

	pg       pgFlags
	slot     string
	keepKeys bool
	ordered  bool

	redisURL, prefix string
	driver, dsn      string

	dlq dlqFlags
	// watermillTopic is the poison topic of a watermill-sql router.
	watermillTopic string

	// scan and limit bound what a dead-letter page reads and lists.
	scan, limit int
}

func runConsole(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("console", consoleSynopsis, stderr)
	var cfg consoleConfig
	cfg.register(fs)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usageError(fs, "unexpected argument %q", fs.Arg(0))
	}
	if err := cfg.check(); err != nil {
		return usageError(fs, "%v", err)
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	src, err := openConsoleSources(ctx, &cfg, set)
	if err != nil {
		return err
	}
	defer src.close()
	return serveConsole(ctx, &cfg, src, stdout)
}

// register adds the console's flags to fs.
func (c *consoleConfig) register(fs *flag.FlagSet) {
	fs.StringVar(&c.listen, "listen", defaultConsoleListen, "address to listen on; one that is not a loopback address needs --token")
	fs.StringVar(&c.token, "token", envDefault("IDEM_CONSOLE_TOKEN", ""), "the token every request must carry (or IDEM_CONSOLE_TOKEN); required to listen on a non-loopback address")
	c.pg.register(fs, withDedup|withOutbox)
	fs.StringVar(&c.slot, "slot", "", "the WAL relay's replication slot (default idem_outbox_<schema>_<table>)")
	fs.BoolVar(&c.keepKeys, "keep-keys", false, "with --postgres: the pgtable store keeps scopes and ids (pgtable.Options.KeepKeys)")
	fs.BoolVar(&c.ordered, "time-ordered-keys", false, "with --postgres: the pgtable store keys UUIDv6/v7 ids by their time (pgtable.Options.TimeOrderedKeys)")
	fs.StringVar(&c.redisURL, "redis", envDefault("IDEM_REDIS_URL", ""), "the redisnx store: a Redis URL or host:port (or IDEM_REDIS_URL)")
	fs.StringVar(&c.prefix, "prefix", "idem", "with --redis: the store's key prefix (redisnx.Options.Prefix)")
	fs.StringVar(&c.driver, "driver", envDefault("IDEM_DRIVER", ""), "the sqltable store on database/sql: mysql, sqlite or postgres (or IDEM_DRIVER); needs --dsn")
	fs.StringVar(&c.dsn, "dsn", envDefault("IDEM_DSN", ""), "the database/sql data source name of --driver (or IDEM_DSN)")
	fs.BoolVar(&c.dlq.outbox, "outbox", false, "list the outbox's dead rows among the dead letters too (--postgres)")
	fs.StringVar(&c.dlq.kafka, "kafka", envDefault("IDEM_KAFKA_BROKERS", ""), "comma-separated Kafka brokers (or IDEM_KAFKA_BROKERS); needs --topic")
	fs.StringVar(&c.dlq.topic, "topic", "", "with --kafka: the dead-letter topic")
	fs.StringVar(&c.dlq.group, "group", "idem-deadletter", "with --kafka: the consumer group whose committed offsets record what replay and discard removed (as idem deadletter)")
	fs.StringVar(&c.dlq.idHeader, "id-header", "idem-message-id", "with --kafka: the header that carries the message id (ConsumerOptions.IDHeader)")
	fs.StringVar(&c.dlq.amqp, "amqp", envDefault("IDEM_AMQP_URL", ""), "RabbitMQ URL (or IDEM_AMQP_URL); needs --queue")
	fs.StringVar(&c.dlq.queue, "queue", "", "with --amqp: the dead-letter queue (\"<queue>.dlq\")")
	fs.StringVar(&c.dlq.nats, "nats", envDefault("IDEM_NATS_URL", ""), "NATS URL (or IDEM_NATS_URL); needs --stream")
	fs.StringVar(&c.dlq.stream, "stream", "", "with --nats: the dead-letter stream (\"<stream>-dlq\")")
	fs.StringVar(&c.watermillTopic, "watermill-sql", "", "the poison topic of a Watermill router on watermill-sql: the table watermill_<topic> in --schema (needs --postgres)")
	fs.IntVar(&c.scan, "scan", 1000, "most dead letters a page reads")
	fs.IntVar(&c.limit, "limit", 100, "most dead letters a page lists, and an action acts on")
}

// check validates the flags that need no connection.
func (c *consoleConfig) check() error {
	host, _, err := net.SplitHostPort(c.listen)
	if err != nil {
		return fmt.Errorf("--listen %q: %w", c.listen, err)
	}
	switch {
	case !loopbackHost(host) && c.token == "":
		return fmt.Errorf("--listen %s is not a loopback address: give --token (or IDEM_CONSOLE_TOKEN), which every request must then carry", c.listen)
	case c.token != "" && len(c.token) < 16:
		return errors.New("--token must be at least 16 characters")
	case c.scan < 1 || c.limit < 1:
		return errors.New("--scan and --limit must be at least 1")
	case c.dlq.outbox && c.pg.url == "":
		return errors.New("--outbox needs --postgres")
	case c.watermillTopic != "" && c.pg.url == "":
		return errors.New("--watermill-sql needs --postgres")
	case c.dlq.kafka != "" && c.dlq.topic == "":
		return errors.New("--kafka needs --topic, the dead-letter topic")
	case c.dlq.amqp != "" && c.dlq.queue == "":
		return errors.New("--amqp needs --queue, the dead-letter queue")
	case c.dlq.nats != "" && c.dlq.stream == "":
		return errors.New("--nats needs --stream, the dead-letter stream")
	case c.driver != "" && c.dsn == "":
		return fmt.Errorf("--driver %s needs --dsn (or IDEM_DSN)", c.driver)
	}
	if _, ok := sqlDrivers[c.driver]; c.driver != "" && !ok {
		return fmt.Errorf("--driver %q: want mysql, sqlite or postgres", c.driver)
	}
	return nil
}

// loopbackHost reports whether host (of a listen address) is a loopback
// address or localhost. The empty host listens on every interface.
func loopbackHost(host string) bool {
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// consoleSources are the stores, tables and destinations the console
// reads. A nil field is a source that is not configured.
type consoleSources struct {
	pool        *pgxpool.Pool
	outbox      *pgoutbox.Outbox
	schema      string
	outboxTable string
	slot        string
	slotGiven   bool

	stores []*consoleStore
	// storeNote says why the dedup page has no store when the reason is
	// not a missing flag (the demo's memstore).
	storeNote string
	dlqs      []*consoleDLQ

	closers []func()
}

// consoleStore is a dedup store the console looks keys up in.
type consoleStore struct {
	Name  string // the form's value: pgtable, redisnx, sqltable, ...
	Where string
	inspector
	// counts reads its rows by state; nil when the store cannot say.
	counts func(ctx context.Context) (*dedupCounts, error)
}

// consoleDLQ is a dead-letter destination. Its backend is opened for each
// request and closed at its end; turn (a channel of one slot) keeps two
// requests from reading one destination at once (RabbitMQ's are taken
// from the queue while read), and a request waits for its turn only as
// long as its context lasts.
type consoleDLQ struct {
	Name  string // kafka, amqp, nats, watermill-sql or outbox
	Label string
	open  func(ctx context.Context) (dlqBackend, error)
	turn  chan struct{}
}

func (s *consoleSources) close() {
	for i := len(s.closers) - 1; i >= 0; i-- {
		s.closers[i]()
	}
	s.closers = nil
}

// openConsoleSources connects to the sources the flags name.
func openConsoleSources(ctx context.Context, c *consoleConfig, set map[string]bool) (_ *consoleSources, err error) {
	src := &consoleSources{schema: c.pg.schema, outboxTable: c.pg.outboxTable, slot: c.slot, slotGiven: c.slot != ""}
	defer func() {
		if err != nil {
			src.close()
		}
	}()
	if c.pg.url != "" {
		pool, err := c.pg.connect(ctx)
		if err != nil {
			return nil, err
		}
		src.closers = append(src.closers, pool.Close)
		if err := src.usePostgres(pool, c); err != nil {
			return nil, err
		}
	}
	if c.redisURL != "" {
		opt, err := redisOptions(c.redisURL)
		if err != nil {
			return nil, fmt.Errorf("--redis: %w", err)
		}
		client := redis.NewClient(opt)
		src.closers = append(src.closers, func() { _ = client.Close() })
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err = client.Ping(pctx).Err()
		cancel()
		if err != nil {
			return nil, fmt.Errorf("redis at %s is unreachable: %w", opt.Addr, err)
		}
		s, err := redisnx.New(client, redisnx.Options{Prefix: c.prefix})
		if err != nil {
			return nil, err
		}
		src.stores = append(src.stores, &consoleStore{Name: "redisnx", Where: fmt.Sprintf("redisnx at %s, prefix %q", opt.Addr, c.prefix), inspector: s})
	}
	if c.driver != "" {
		dr := sqlDrivers[c.driver]
		db, err := sql.Open(dr.name, c.dsn)
		if err != nil {
			return nil, fmt.Errorf("--dsn: %w", err)
		}
		src.closers = append(src.closers, func() { _ = db.Close() })
		pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err = db.PingContext(pctx)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("%s database is unreachable: %w", c.driver, err)
		}
		schema := ""
		if set["schema"] {
			schema = c.pg.schema
		}
		s, err := sqltable.New(db, dr.dialect, sqltable.Options{Schema: schema, Table: c.pg.dedupTable, KeepKeys: c.keepKeys})
		if err != nil {
			return nil, err
		}
		src.stores = append(src.stores, &consoleStore{Name: "sqltable", Where: "sqltable (" + c.driver + ") " + s.Table(), inspector: s})
	}
	f := c.dlq
	if f.kafka != "" {
		src.dlqs = append(src.dlqs, &consoleDLQ{turn: make(chan struct{}, 1), Name: "kafka", Label: fmt.Sprintf("Kafka topic %q", f.topic),
			open: func(ctx context.Context) (dlqBackend, error) { return openKafkaDLQ(ctx, &f) }})
	}
	if f.amqp != "" {
		src.dlqs = append(src.dlqs, &consoleDLQ{turn: make(chan struct{}, 1), Name: "amqp", Label: fmt.Sprintf("RabbitMQ queue %q", f.queue),
			open: func(ctx context.Context) (dlqBackend, error) { return openAMQPDLQ(ctx, &f) }})
	}
	if f.nats != "" {
		src.dlqs = append(src.dlqs, &consoleDLQ{turn: make(chan struct{}, 1), Name: "nats", Label: fmt.Sprintf("NATS stream %q", f.stream),
			open: func(ctx context.Context) (dlqBackend, error) { return openNATSDLQ(ctx, &f) }})
	}
	if c.watermillTopic != "" {
		wf := f
		wf.pg, wf.watermill = c.pg, c.watermillTopic
		src.dlqs = append(src.dlqs, &consoleDLQ{turn: make(chan struct{}, 1), Name: "watermill-sql", Label: fmt.Sprintf("Watermill poison topic %q", wf.watermill),
			open: func(ctx context.Context) (dlqBackend, error) { return openWatermillDLQ(ctx, &wf) }})
	}
	if f.outbox && src.outbox != nil {
		src.addOutboxDLQ()
	}
	return src, nil
}

// usePostgres adds the outbox and the pgtable store of pool.
func (s *consoleSources) usePostgres(pool *pgxpool.Pool, c *consoleConfig) error {
	s.pool = pool
	ob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: c.pg.schema, Table: c.pg.outboxTable})
	if err != nil {
		return err
	}
	s.outbox = ob
	st, err := pgtable.New(pool, pgtable.Options{Schema: c.pg.schema, Table: c.pg.dedupTable, KeepKeys: c.keepKeys, TimeOrderedKeys: c.ordered})
	if err != nil {
		return err
	}
	table := st.Table()
	s.stores = append([]*consoleStore{{Name: "pgtable", Where: "pgtable " + table, inspector: st,
		counts: func(ctx context.Context) (*dedupCounts, error) { return pgDedupCounts(ctx, pool, table) }}}, s.stores...)
	return nil
}

// addOutboxDLQ lists the outbox's dead rows among the dead letters.
func (s *consoleSources) addOutboxDLQ() {
	pool, ob := s.pool, s.outbox
	s.dlqs = append(s.dlqs, &consoleDLQ{turn: make(chan struct{}, 1), Name: "outbox", Label: "outbox " + ob.Table(),
		open: func(context.Context) (dlqBackend, error) { return &outboxDLQ{pool: pool, ob: ob, shared: true}, nil }})
}

// serveConsole serves the console on cfg.listen until ctx ends.
func serveConsole(ctx context.Context, cfg *consoleConfig, src *consoleSources, stdout io.Writer) error {
	h, err := newConsole(cfg, src)
	if err != nil {
		return err
	}
	ln, err := net.Listen("tcp", cfg.listen)
	if err != nil {
		return fmt.Errorf("--listen: %w", err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: time.Minute}
	done := make(chan error, 1)
	go func() { done <- srv.Serve(ln) }()
	auth := ""
	if cfg.token != "" {
		auth = " (a token is required: log in with it, or send Authorization: Bearer)"
	}
	fprintf(stdout, "idem console: http://%s/%s; stop it with Ctrl-C\n", consoleHost(ln.Addr().String()), auth)
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	// Requests in flight get a moment to end; then the connections
	// left (a browser's idle or speculative ones) are closed.
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 2*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		_ = srv.Close()
	}
	if err := <-done; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// consoleHost is the address to print for a listener's address: an
// unspecified host reads as localhost.
func consoleHost(addr string) string {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsUnspecified() {
		host = "localhost"
	}
	return net.JoinHostPort(host, port)
}
