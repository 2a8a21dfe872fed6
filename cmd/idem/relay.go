package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
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
Run as many as needed: they share the work by shards.

With --metrics-addr (off by default; :9464 is the usual port) it serves
GET /metrics in the Prometheus text format, through the OpenTelemetry
Prometheus exporter: idem_outbox_published_total, idem_outbox_retried_total
and idem_outbox_dead_total per table and topic, idem_outbox_backlog and
idem_outbox_oldest_age_seconds (sampled at most every 5s),
idem_outbox_publish_duration_seconds and idem_outbox_delay_seconds
histograms, plus the Go runtime's go_* and process_* series. GET /healthz
answers 200 while the relay runs and 503 once it is stopping.`

func runRelay(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("relay", relaySynopsis, stderr)
	var pg pgFlags
	pg.register(fs, withOutbox)
	var (
		brokers   = fs.String("kafka", envDefault("IDEM_KAFKA_BROKERS", ""), "comma-separated Kafka brokers (or IDEM_KAFKA_BROKERS)")
		amqpURL   = fs.String("amqp", envDefault("IDEM_AMQP_URL", ""), "RabbitMQ URL (or IDEM_AMQP_URL)")
		shards    = fs.Int("shards", 0, "shards of the key space; every relay of a table must use the same (default 16)")
		sessions  = fs.Int("sessions", 0, "database sessions (claim loops) of this relay (default 1; above 1 only with --amqp)")
		batch     = fs.Int("batch-size", 0, "most messages one claim takes (default 500)")
		poll      = fs.Duration("poll", 0, "poll interval, the fallback for lost notifications (default 1s)")
		maxTries  = fs.Int("max-attempts", 0, "failed publishes after which a message is parked dead (default 10)")
		shutdown  = fs.Duration("shutdown-timeout", 0, "how long the batch in flight may take to finish on SIGTERM (default 10s)")
		metricsAt = fs.String("metrics-addr", envDefault("IDEM_RELAY_METRICS_ADDR", ""), "address to serve /metrics (Prometheus) and /healthz on, e.g. :9464 (or IDEM_RELAY_METRICS_ADDR; default none)")
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

	var ms *metricsServer
	if *metricsAt != "" {
		if ms, err = newMetricsServer("idem-relay"); err != nil {
			return err
		}
		defer ms.shutdown()
	}
	r, err := pgoutbox.NewRelay(ob, pub, pgoutbox.RelayOptions{
		Shards:          *shards,
		Sessions:        *sessions,
		BatchSize:       *batch,
		PollInterval:    *poll,
		MaxAttempts:     *maxTries,
		ShutdownTimeout: *shutdown,
		MeterProvider:   ms.meterProvider(),
		MetricsInterval: 5 * time.Second,
		Logger:          logger,
	})
	if err != nil {
		return err
	}

	if ms != nil {
		stop, err := ms.serve(*metricsAt)
		if err != nil {
			return fmt.Errorf("--metrics-addr: %w", err)
		}
		defer stop()
		logger.Info("serving /metrics and /healthz", "addr", ms.addr())
	}

	opts := r.Options()
	logger.Info("relay starting", "outbox", ob.Table(), "publisher", target,
		"shards", opts.Shards, "sessions", opts.Sessions, "batch_size", opts.BatchSize)
	ms.setRunning(true)
	err = r.Run(ctx)
	ms.setRunning(false)
	if err != nil {
		return fmt.Errorf("relay: %w", err)
	}
	logger.Info("relay stopped")
	return nil
}
