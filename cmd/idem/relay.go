package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

const relaySynopsis = `relay --postgres URL (--kafka BROKERS | --amqp URL) [flags]

Publishes the committed rows of the outbox table until SIGINT or SIGTERM,
then finishes the batch in flight, releases its shards and exits 0.
Run as many as needed: they share the work by shards.`

func runRelay(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("relay", relaySynopsis, stderr)
	var pg pgFlags
	pg.register(fs, false)
	var (
		brokers   = fs.String("kafka", envDefault("IDEM_KAFKA_BROKERS", ""), "comma-separated Kafka brokers (or IDEM_KAFKA_BROKERS)")
		amqpURL   = fs.String("amqp", envDefault("IDEM_AMQP_URL", ""), "RabbitMQ URL (or IDEM_AMQP_URL)")
		shards    = fs.Int("shards", 0, "shards of the key space; every relay of a table must use the same (default 16)")
		sessions  = fs.Int("sessions", 0, "database sessions (claim loops) of this relay (default 1; above 1 only with --amqp)")
		batch     = fs.Int("batch-size", 0, "most messages one claim takes (default 500)")
		poll      = fs.Duration("poll", 0, "poll interval, the fallback for lost notifications (default 1s)")
		maxTries  = fs.Int("max-attempts", 0, "failed publishes after which a message is parked dead (default 10)")
		shutdown  = fs.Duration("shutdown-timeout", 0, "how long the batch in flight may take to finish on SIGTERM (default 10s)")
		httpAddr  = fs.String("http", envDefault("IDEM_RELAY_HTTP", ""), "address of /healthz and /metrics, e.g. :9090 (default none)")
		logFormat = fs.String("log-format", "text", "log format: text or json")
		logLevel  = fs.String("log-level", "info", "log level: debug, info, warn or error")
	)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usageError(fs, "unexpected argument %q", fs.Arg(0))
	}
	switch {
	case pg.url == "":
		return usageError(fs, "--postgres (or IDEM_POSTGRES_URL) is required")
	case (*brokers == "") == (*amqpURL == ""):
		return usageError(fs, "exactly one of --kafka and --amqp is required")
	case *sessions > 1 && *brokers != "":
		return usageError(fs, "--sessions above 1 needs a publisher safe for concurrent use: use it with --amqp")
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(*logLevel)); err != nil {
		return usageError(fs, "--log-level: %v", err)
	}
	var handler slog.Handler
	switch *logFormat {
	case "text":
		handler = slog.NewTextHandler(stderr, &slog.HandlerOptions{Level: level})
	case "json":
		handler = slog.NewJSONHandler(stderr, &slog.HandlerOptions{Level: level})
	default:
		return usageError(fs, "--log-format must be text or json")
	}
	logger := slog.New(handler)

	pool, err := pg.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	ob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: pg.schema, Table: pg.outboxTable, Logger: logger})
	if err != nil {
		return err
	}

	var pub outbox.Publisher
	target := ""
	if *brokers != "" {
		transport := &kafkago.Transport{}
		defer transport.CloseIdleConnections()
		w := &kafkago.Writer{
			Addr:         kafkago.TCP(strings.Split(*brokers, ",")...),
			Balancer:     &kafkago.Hash{},
			RequiredAcks: kafkago.RequireAll,
			BatchTimeout: 10 * time.Millisecond,
			Transport:    transport,
		}
		defer func() { _ = w.Close() }()
		kp, err := kafka.NewPublisher(w, kafka.PublisherOptions{})
		if err != nil {
			return err
		}
		pub, target = kp, "kafka "+*brokers
	} else {
		ap, err := amqp.NewPublisher(*amqpURL, amqp.PublisherOptions{Logger: logger, ConnectionName: "idem-relay"})
		if err != nil {
			return err
		}
		defer func() { _ = ap.Close() }()
		pub, target = ap, "amqp"
	}

	metrics := newRelayMetrics()
	r, err := pgoutbox.NewRelay(ob, pub, pgoutbox.RelayOptions{
		Shards:          *shards,
		Sessions:        *sessions,
		BatchSize:       *batch,
		PollInterval:    *poll,
		MaxAttempts:     *maxTries,
		ShutdownTimeout: *shutdown,
		Metrics:         metrics,
		MetricsInterval: 5 * time.Second,
		Logger:          logger,
	})
	if err != nil {
		return err
	}

	var wg sync.WaitGroup
	defer wg.Wait()
	if *httpAddr != "" {
		ln, err := net.Listen("tcp", *httpAddr)
		if err != nil {
			return fmt.Errorf("--http: %w", err)
		}
		srv := &http.Server{Handler: metrics.mux(), ReadHeaderTimeout: 5 * time.Second}
		wg.Go(func() { _ = srv.Serve(ln) })
		defer func() {
			sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_ = srv.Shutdown(sctx)
		}()
		logger.Info("serving /healthz and /metrics", "addr", ln.Addr().String())
	}

	opts := r.Options()
	logger.Info("relay starting", "outbox", ob.Table(), "publisher", target,
		"shards", opts.Shards, "sessions", opts.Sessions, "batch_size", opts.BatchSize)
	metrics.running.Store(true)
	err = r.Run(ctx)
	metrics.running.Store(false)
	if err != nil {
		return fmt.Errorf("relay: %w", err)
	}
	logger.Info("relay stopped", "published", metrics.total("published"))
	return nil
}

// relayMetrics implements outbox.Metrics in memory and serves them in the
// Prometheus text format.
type relayMetrics struct {
	running  atomic.Bool
	mu       sync.Mutex
	counters map[string]map[string]int64 // kind → topic → n
	pending  int64
	oldest   time.Duration
}

func newRelayMetrics() *relayMetrics {
	return &relayMetrics{counters: map[string]map[string]int64{"published": {}, "retried": {}, "dead": {}}}
}

func (m *relayMetrics) add(kind, topic string, n int) {
	m.mu.Lock()
	m.counters[kind][topic] += int64(n)
	m.mu.Unlock()
}

func (m *relayMetrics) Published(topic string, n int) { m.add("published", topic, n) }
func (m *relayMetrics) Retried(topic string, n int)   { m.add("retried", topic, n) }
func (m *relayMetrics) Dead(topic string, n int)      { m.add("dead", topic, n) }

func (m *relayMetrics) Backlog(pending int64, oldest time.Duration) {
	m.mu.Lock()
	m.pending, m.oldest = pending, oldest
	m.mu.Unlock()
}

func (m *relayMetrics) total(kind string) int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	var t int64
	for _, n := range m.counters[kind] {
		t += n
	}
	return t
}

func (m *relayMetrics) mux() *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		if !m.running.Load() {
			http.Error(w, "stopping", http.StatusServiceUnavailable)
			return
		}
		_, _ = io.WriteString(w, "ok\n")
	})
	mux.HandleFunc("GET /metrics", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; version=0.0.4")
		m.writeTo(w)
	})
	return mux
}

func (m *relayMetrics) writeTo(w io.Writer) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, kind := range []string{"published", "retried", "dead"} {
		name := "idem_outbox_" + kind + "_total"
		fprintf(w, "# TYPE %s counter\n", name)
		topics := make([]string, 0, len(m.counters[kind]))
		for t := range m.counters[kind] {
			topics = append(topics, t)
		}
		sort.Strings(topics)
		for _, t := range topics {
			fprintf(w, "%s{topic=%q} %d\n", name, t, m.counters[kind][t])
		}
	}
	fprintf(w, "# TYPE idem_outbox_pending gauge\nidem_outbox_pending %d\n", m.pending)
	fprintf(w, "# TYPE idem_outbox_oldest_seconds gauge\nidem_outbox_oldest_seconds %g\n", m.oldest.Seconds())
}

var _ outbox.Metrics = (*relayMetrics)(nil)
