package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
	"github.com/idemkit/idem/outbox/walrelay"
)

const relaySynopsis = `relay --postgres URL (--kafka BROKERS | --amqp URL) [--source poll|wal] [flags]
       relay slot show|drop --postgres URL [--slot NAME] [flags]

Publishes the committed outbox messages until SIGINT or SIGTERM, then
finishes the batch in flight and exits 0.

--source poll (the default) reads the outbox table (outbox/pgoutbox): run
as many relays as needed, they share the work by shards.

--source wal reads the write-ahead log through a logical replication slot
(outbox/walrelay): PostgreSQL 14 or later with wal_level = logical. At start
it checks the server's settings (saying what to change when they are
wrong) and creates the publication and the slot if they are missing; a slot
starts at the end of the WAL, so create it (a first start) before the first
message is enqueued. One relay streams a slot; more wait and take over.
--wal-source says what the application's Enqueue writes: messages (logical
decoding messages, no table; the default) or table (the outbox table).
"relay slot show" prints the slot's state and lag; "relay slot drop" drops
it, so that PostgreSQL stops keeping WAL for a relay that will not come
back (stop the relay first).

Through PgBouncer in transaction mode (or another pooler), --postgres may
point at the pooler while --direct-postgres points at PostgreSQL itself:
the poll relay's sessions (session-level advisory locks, LISTEN) and the
WAL relay's replication connection use it. Without it, the relay refuses a
pooled connection and exits 1.

With --metrics-addr (off by default; :9464 is the usual port) it serves
GET /metrics in the Prometheus text format, through the OpenTelemetry
Prometheus exporter: idem_outbox_published_total, idem_outbox_retried_total
and idem_outbox_dead_total per table and topic, idem_outbox_backlog and
idem_outbox_oldest_age_seconds (sampled at most every 5s),
idem_outbox_publish_duration_seconds and idem_outbox_delay_seconds
histograms, plus the Go runtime's go_* and process_* series. GET /healthz
answers 200 while the relay runs and 503 once it is stopping.`

func runRelay(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && args[0] == "slot" {
		return runRelaySlot(ctx, args[1:], stdout, stderr)
	}
	fs := newFlagSet("relay", relaySynopsis, stderr)
	var pg pgFlags
	pg.register(fs, withOutbox)
	var (
		source    = fs.String("source", "poll", "where the relay reads the outbox: poll (the table) or wal (logical replication)")
		directURL = fs.String("direct-postgres", envDefault("IDEM_DIRECT_POSTGRES_URL", ""), "PostgreSQL URL, not through a pooler, for the relay's own connections when --postgres goes through PgBouncer (or IDEM_DIRECT_POSTGRES_URL; default --postgres)")
		walSource = fs.String("wal-source", "messages", "with --source wal: what Enqueue writes, messages or table")
		slot      = fs.String("slot", "", "with --source wal: the replication slot (default idem_outbox_<schema>_<table>)")
		brokers   = fs.String("kafka", envDefault("IDEM_KAFKA_BROKERS", ""), "comma-separated Kafka brokers (or IDEM_KAFKA_BROKERS)")
		amqpURL   = fs.String("amqp", envDefault("IDEM_AMQP_URL", ""), "RabbitMQ URL (or IDEM_AMQP_URL)")
		shards    = fs.Int("shards", 0, "shards of the key space; every relay of a table must use the same (default 16)")
		sessions  = fs.Int("sessions", 0, "database sessions (claim loops) of this relay (default 1)")
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
	case *source != "poll" && *source != "wal":
		return usageError(fs, "--source must be poll or wal")
	case *source == "wal" && (*shards != 0 || *sessions != 0 || *poll != 0):
		return usageError(fs, "--shards, --sessions and --poll are for --source poll; the WAL relay streams one slot")
	case *source == "poll" && (*slot != "" || *walSource != "messages"):
		return usageError(fs, "--slot and --wal-source are for --source wal")
	}
	var direct *pgx.ConnConfig
	if *directURL != "" {
		var err error
		if direct, err = pgx.ParseConfig(*directURL); err != nil {
			return usageError(fs, "--direct-postgres: %v", err)
		}
	}
	var walSrc walrelay.Source
	if err := walSrc.UnmarshalText([]byte(*walSource)); err != nil {
		return usageError(fs, "--wal-source: %v", err)
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
		kp, err := idemkafka.NewPublisher(w, idemkafka.PublisherOptions{})
		if err != nil {
			return err
		}
		pub, target = kp, "kafka "+*brokers
	} else {
		ap, err := idemamqp.NewPublisher(*amqpURL, idemamqp.PublisherOptions{Logger: logger, ConnectionName: "idem-relay"})
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
	var (
		run  func(context.Context) error
		desc []any
	)
	if *source == "wal" {
		ob, err := walrelay.New(pool, walrelay.Options{Source: walSrc, Schema: pg.schema, Table: pg.outboxTable, Slot: *slot, Logger: logger})
		if err != nil {
			return err
		}
		// Migrate checks wal_level and the other settings first, and
		// creates the publication and the slot when they are missing.
		if err := ob.Migrate(ctx); err != nil {
			return fmt.Errorf("relay: %w", err)
		}
		ropts := walrelay.RelayOptions{
			// Both publishers are safe for concurrent use: the next
			// batch goes out while the broker confirms one.
			PublishesInFlight: 2,
			BatchSize:         *batch,
			MaxAttempts:       *maxTries,
			ShutdownTimeout:   *shutdown,
			Telemetry:         consumer.Telemetry{MeterProvider: ms.meterProvider(), Logger: logger},
		}
		if direct != nil {
			ropts.ConnConfig = &direct.Config
		}
		r, err := walrelay.NewRelay(ob, pub, ropts)
		if err != nil {
			return err
		}
		run = r.Run
		desc = []any{"source", "wal", "wal_source", ob.Options().Source.String(), "slot", ob.Options().Slot,
			"batch_size", r.Options().BatchSize}
	} else {
		ob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: pg.schema, Table: pg.outboxTable, Logger: logger})
		if err != nil {
			return err
		}
		r, err := pgoutbox.NewRelay(ob, pub, pgoutbox.RelayOptions{
			Shards:          *shards,
			Sessions:        *sessions,
			BatchSize:       *batch,
			PollInterval:    *poll,
			MaxAttempts:     *maxTries,
			ShutdownTimeout: *shutdown,
			Telemetry:       consumer.Telemetry{MeterProvider: ms.meterProvider(), Logger: logger},
			MetricsInterval: 5 * time.Second,
			ConnConfig:      direct,
		})
		if err != nil {
			return err
		}
		run = r.Run
		opts := r.Options()
		desc = []any{"source", "poll", "outbox", ob.Table(), "shards", opts.Shards, "sessions", opts.Sessions, "batch_size", opts.BatchSize}
	}

	if ms != nil {
		stop, err := ms.serve(*metricsAt)
		if err != nil {
			return fmt.Errorf("--metrics-addr: %w", err)
		}
		defer stop()
		logger.Info("serving /metrics and /healthz", "addr", ms.addr())
	}

	logger.Info("relay starting", append([]any{"publisher", target}, desc...)...)
	ms.setRunning(true)
	err = run(ctx)
	ms.setRunning(false)
	if err != nil {
		if strings.Contains(err.Error(), "RelayOptions.ConnConfig") {
			return fmt.Errorf("relay: %w (idem relay: set --direct-postgres)", err)
		}
		return fmt.Errorf("relay: %w", err)
	}
	logger.Info("relay stopped")
	return nil
}

const relaySlotSynopsis = `relay slot show|drop --postgres URL [--slot NAME] [flags]

show prints the WAL relay's replication slot: whether a relay streams it,
its confirmed position, the WAL written since (lag) and the WAL PostgreSQL
keeps for it (retained). drop drops it, so that PostgreSQL stops keeping
WAL for it; messages committed after its confirmed position are then never
published by the WAL relay. It fails while a relay streams the slot.
Exit status: 0 done, 1 error (no such slot, or the slot is in use).`

// runRelaySlot shows or drops the WAL relay's replication slot.
func runRelaySlot(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("relay slot", relaySlotSynopsis, stderr)
	var pg pgFlags
	pg.register(fs, withOutbox)
	slot := fs.String("slot", "", "the replication slot (default idem_outbox_<schema>_<table>)")
	if len(args) == 0 || (args[0] != "show" && args[0] != "drop") {
		return usageError(fs, "relay slot needs show or drop")
	}
	verb := args[0]
	if err := parseFlags(fs, args[1:]); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usageError(fs, "unexpected argument %q", fs.Arg(0))
	}
	pool, err := pg.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	ob, err := walrelay.New(pool, walrelay.Options{Schema: pg.schema, Table: pg.outboxTable, Slot: *slot})
	if err != nil {
		return err
	}
	if verb == "drop" {
		if err := ob.DropSlot(ctx); err != nil {
			return err
		}
		_, _ = fmt.Fprintf(stdout, "dropped slot %s\n", ob.Options().Slot)
		return nil
	}
	info, err := ob.Slot(ctx)
	if err != nil {
		return err
	}
	status := "idle (no relay streams it)"
	if info.Active {
		status = fmt.Sprintf("streamed by server process %d", info.ActivePID)
	}
	safe := "unlimited (max_slot_wal_keep_size = -1)"
	if info.SafeWALSize >= 0 {
		safe = fmt.Sprintf("%d bytes", info.SafeWALSize)
	}
	_, _ = fmt.Fprintf(stdout, "slot:          %s (%s, database %s)\nstatus:        %s\nconfirmed LSN: %s\nrestart LSN:   %s\nlag:           %d bytes\nretained:      %d bytes\nwal status:    %s\nsafe WAL size: %s\n",
		info.Name, info.Plugin, info.Database, status, info.ConfirmedLSN, info.RestartLSN,
		info.LagBytes, info.RetainedBytes, info.WALStatus, safe)
	return nil
}
