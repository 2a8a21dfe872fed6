package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	mrand "math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/adapters/httpidem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// The two pipelines of the demo, side by side on one topic.
const (
	pathNaive = "naive"
	pathIdem  = "idem"
)

// Why a delivery is a duplicate.
const (
	causeFirst       = "first"
	causeDoubleClick = "double-click"
	causeRetry       = "client-retry"
	causeRepublish   = "re-publish"
	causeRedelivery  = "redelivery"
)

// Headers the demo's APIs put on the messages they publish: which pipeline
// published it and which kind of request it came from. They are demo
// instruments for the table, never used to decide anything.
const (
	headerPath    = "demo-path"
	headerRequest = "demo-request"
	headerCause   = "X-Demo-Request" // on the HTTP request, set by the client
	// headerPublish numbers each copy the relay sends to RabbitMQ (see
	// deliveryID).
	headerPublish = "demo-publish"
)

type demoConfig struct {
	payments       int
	seed           uint64
	crashRate      float64
	doubleClicks   float64
	timeouts       float64
	republishes    float64
	partitions     int
	clients        int
	timeout        time.Duration
	dedupTTL       time.Duration
	postgres       string
	schema         string
	redisURL       string
	kafkaBrokers   string
	amqpURL        string
	keep           bool
	progress       string
	progressOutput io.Writer
	// rerun is the flags that repeat this run: every flag given, and the
	// seed.
	rerun string
	// done, when set (--console), is called with the run's result and
	// the console's sources on its broker and store, before they close.
	done func(*demoResult, *consoleSources) error
}

// defaultDedupTTL is how long the demo's marks are kept without
// --dedup-ttl: its redeliveries in this process come within a second or
// two of the first delivery.
const defaultDedupTTL = 10 * time.Second

// settleTTL sets the marks' TTL. With --redis the idem consumer runs in
// child processes that are killed, and a killed child's deliveries come
// back once its group session timed out and the group rejoined, or once
// its lease (childLease) ran out: a mark must outlast that.
func (cfg *demoConfig) settleTTL(br *demoBroker) error {
	given := cfg.dedupTTL != 0
	if !given {
		cfg.dedupTTL = defaultDedupTTL
	}
	if cfg.redisURL == "" {
		return nil
	}
	least := 2*br.session + childLease
	switch {
	case !given:
		cfg.dedupTTL = max(cfg.dedupTTL, least)
	case cfg.dedupTTL < least:
		return fmt.Errorf("--dedup-ttl %v is shorter than a killed consumer's deliveries may take to come back with --redis: use at least %v", cfg.dedupTTL, least)
	}
	return nil
}

func runDemo(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	var cfg demoConfig
	fs := newFlagSet("demo", "demo [flags]", stderr)
	fs.IntVar(&cfg.payments, "payments", 10000, "number of payments the clients submit (at most 1000000)")
	fs.Uint64Var(&cfg.seed, "seed", 0, "random seed of the workload (0 picks one; it is printed so a run can be repeated)")
	fs.Float64Var(&cfg.crashRate, "crash-rate", 0.0003, "probability that a consumer crashes after handling a delivery, before committing its offset (or ACK); with --postgres or --redis the idem consumer is a child process that is SIGKILLed and restarted instead")
	fs.Float64Var(&cfg.doubleClicks, "double-click-rate", 0.05, "fraction of payments submitted twice at once (a double click)")
	fs.Float64Var(&cfg.timeouts, "timeout-rate", 0.04, "fraction of payments whose first response is lost, so the client retries")
	fs.Float64Var(&cfg.republishes, "republish-rate", 0.05, "probability that the relay crashes after publishing a batch and before marking it, so it publishes the batch again")
	fs.IntVar(&cfg.partitions, "partitions", 4, "partitions of the payments topic")
	fs.IntVar(&cfg.clients, "clients", 16, "concurrent HTTP clients")
	fs.DurationVar(&cfg.timeout, "timeout", 0, "give up after this long (default 2m, or 1ms per payment when that is longer)")
	fs.DurationVar(&cfg.dedupTTL, "dedup-ttl", 0, "how long a completed key's dedup mark is kept, in memory (memstore) or in Redis (not with --postgres: pgtable keeps its marks 24h); it must outlast every redelivery, and bounds the marks a long run holds to those of the last TTL (default 10s, or with --redis a killed consumer's longest redelivery delay when that is longer)")
	fs.StringVar(&cfg.postgres, "postgres", envDefault("IDEM_POSTGRES_URL", ""), "PostgreSQL URL: dedup marks in pgtable, messages through a pgoutbox relay, charges in a table (drops and recreates the demo's demo_* tables in --schema; the default run takes about a minute)")
	fs.StringVar(&cfg.schema, "schema", "", "schema of the demo's tables with --postgres, kept at the end (default: a fresh idem_demo_<run>, dropped at the end unless --keep)")
	fs.BoolVar(&cfg.keep, "keep", false, "keep what the run made at the end: the fresh --postgres schema, the --redis marks (until --dedup-ttl expires them)")
	fs.StringVar(&cfg.redisURL, "redis", envDefault("IDEM_REDIS_URL", ""), "Redis URL (redis://[user:password@]host:port/db, rediss:// for TLS) or host:port: dedup marks in Redis (redisnx) instead of memstore")
	fs.StringVar(&cfg.kafkaBrokers, "kafka", envDefault("IDEM_KAFKA_BROKERS", ""), "comma-separated Kafka brokers instead of the in-process kfake cluster")
	fs.StringVar(&cfg.amqpURL, "amqp", envDefault("IDEM_AMQP_URL", ""), "RabbitMQ URL (amqp://user:password@host:port/vhost): the pipeline runs over RabbitMQ instead of Kafka, through a fanout exchange and a queue per consumer named after the run (deleted at the end)")
	fs.StringVar(&cfg.progress, "progress", "auto", "progress display: auto (a bar on a terminal, plain lines otherwise), bar, plain or none")
	withConsole, ccfg := registerDemoConsole(fs)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usageError(fs, "unexpected argument %q", fs.Arg(0))
	}
	switch {
	case cfg.payments <= 0 || cfg.payments > maxPayments:
		return usageError(fs, "--payments must be between 1 and %d", maxPayments)
	case !isRate(cfg.crashRate) || !isRate(cfg.doubleClicks) || !isRate(cfg.timeouts) || !isRate(cfg.republishes):
		return usageError(fs, "rates must be between 0 and 1")
	case cfg.crashRate > 0.01:
		return usageError(fs, "--crash-rate above 0.01 would do little but restart consumers")
	case cfg.partitions <= 0 || cfg.partitions > 1000:
		return usageError(fs, "--partitions must be between 1 and 1000")
	case cfg.clients <= 0:
		return usageError(fs, "--clients must be positive")
	case cfg.dedupTTL != 0 && cfg.dedupTTL < time.Second:
		return usageError(fs, "--dedup-ttl must be at least 1s")
	case cfg.timeout < 0:
		return usageError(fs, "--timeout must be positive")
	case cfg.progress != "auto" && cfg.progress != "bar" && cfg.progress != "plain" && cfg.progress != "none":
		return usageError(fs, "--progress must be auto, bar, plain or none")
	case cfg.postgres != "" && cfg.redisURL != "":
		return usageError(fs, "--postgres and --redis are exclusive")
	case cfg.postgres != "" && cfg.schema != "" && !schemaName.MatchString(cfg.schema):
		return usageError(fs, "--schema must be a lowercase identifier")
	case cfg.amqpURL != "" && cfg.kafkaBrokers != "":
		return usageError(fs, "--amqp and --kafka are exclusive")
	}
	if *withConsole {
		if err := ccfg.check(); err != nil {
			return usageError(fs, "%v", err)
		}
		cfg.done = demoConsole(ctx, ccfg, stdout)
	}
	if cfg.seed == 0 {
		var b [8]byte
		_, _ = rand.Read(b[:])
		for _, x := range b {
			cfg.seed = cfg.seed<<8 | uint64(x)
		}
		cfg.seed = cfg.seed>>1 | 1
	}
	cfg.progressOutput = stderr
	if cfg.timeout == 0 {
		cfg.timeout = max(2*time.Minute, time.Duration(cfg.payments)*time.Millisecond)
	}
	cfg.rerun = rerunFlags(fs, cfg.seed)

	ctx, cancel := context.WithTimeout(ctx, cfg.timeout)
	defer cancel()
	res, err := demo(ctx, cfg, stdout)
	if err != nil {
		return err
	}
	if !res.printed {
		res.print(stdout)
	}
	if res.idem.extra() != 0 || res.idem.lost() != 0 {
		return errFailed
	}
	return nil
}

// redisOptions parses a Redis address the way every idem command takes it:
// a URL (redis://[user:password@]host:port[/db], rediss:// for TLS) or a
// bare host:port.
func redisOptions(s string) (*redis.Options, error) {
	if !strings.Contains(s, "://") {
		s = "redis://" + s
	}
	return redis.ParseURL(s)
}

// deleteRedisKeys deletes the keys that start with prefix.
func deleteRedisKeys(client *redis.Client, prefix string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	iter := client.Scan(ctx, 0, prefix+"*", 1000).Iterator()
	for iter.Next(ctx) {
		_ = client.Del(ctx, iter.Val()).Err()
	}
}

// quietRedis drops go-redis's own log lines (a failed dial of its pool, for
// one): the commands report Redis errors themselves, on one line.
type quietRedis struct{}

func (quietRedis) Printf(context.Context, string, ...any) {}

func init() { redis.SetLogger(quietRedis{}) }

// rerunFlags returns the flags that repeat a run: --payments and --seed (the
// one the run used), then every other flag given on the command line.
func rerunFlags(fs *flag.FlagSet, seed uint64) string {
	args := []string{"--payments", fs.Lookup("payments").Value.String(), "--seed", strconv.FormatUint(seed, 10)}
	fs.Visit(func(f *flag.Flag) {
		switch b, isBool := f.Value.(interface{ IsBoolFlag() bool }); {
		case f.Name == "payments" || f.Name == "seed":
		case isBool && b.IsBoolFlag():
			// "--keep true" would read true as an argument.
			args = append(args, "--"+f.Name+"="+f.Value.String())
		default:
			args = append(args, "--"+f.Name, shellQuote(f.Value.String()))
		}
	})
	return strings.Join(args, " ")
}

// shellQuote quotes s for a POSIX shell when it needs it.
func shellQuote(s string) string {
	plain := func(r rune) bool {
		return r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || strings.ContainsRune("-_./:@%+=,", r)
	}
	if s != "" && strings.IndexFunc(s, func(r rune) bool { return !plain(r) }) < 0 {
		return s
	}
	return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'"
}

// demoResult is what the demo prints.
type demoResult struct {
	cfg        demoConfig
	backend    string
	store      string
	published  int64
	republish  int64
	relayCrash int64
	elapsed    time.Duration
	naive      *ledger
	idem       *ledger
	// children is set when the idem consumer ran as child processes
	// (--postgres, --redis); kills and restarts count the SIGKILLs they
	// got and the processes started again.
	children        bool
	kills, restarts int
	// printed is set when the table has been printed (by --console).
	printed bool
}

// demo runs the pipeline and returns its counts.
func demo(ctx context.Context, cfg demoConfig, stdout io.Writer) (*demoResult, error) {
	start := time.Now()
	runID := newRunID()
	res := &demoResult{cfg: cfg, naive: newLedger(cfg.payments), idem: newLedger(cfg.payments)}
	pl := &plan{cfg: cfg, runID: runID}
	logger := slog.New(slog.DiscardHandler)

	// The broker: Kafka (kfake in this process, or the brokers given) or
	// RabbitMQ.
	var (
		br  *demoBroker
		err error
	)
	if cfg.amqpURL != "" {
		br, err = setupAMQP(ctx, cfg.amqpURL, runID, logger)
	} else {
		br, err = setupKafka(ctx, cfg, runID)
	}
	if err != nil {
		return nil, err
	}
	defer br.close()
	res.backend = br.describe
	if err := cfg.settleTTL(br); err != nil {
		return nil, err
	}

	// The dedup store, shared by the idem API and the idem consumer group
	// (each with its own scope).
	var (
		store      dedup.LeaseStore
		storeWhere string
		pgd        *pgDemo
	)
	redisPrefix := "idem-demo-" + runID
	switch {
	case cfg.postgres != "":
		fresh := cfg.schema == ""
		if fresh {
			cfg.schema = "idem_demo_" + runID
		}
		pgd, err = setupPG(ctx, cfg.postgres, cfg.schema)
		if err != nil {
			return nil, err
		}
		defer pgd.close()
		if fresh && !cfg.keep {
			defer pgd.dropSchema(cfg.schema)
		}
		res.store = "pgtable + pgoutbox on " + pgd.where
	case cfg.redisURL == "":
		// A mark is swept at most max(TTL/4, 1s) after it expired.
		ms, err := memstore.New(memstore.Options{TTL: cfg.dedupTTL, SweepInterval: max(cfg.dedupTTL/4, time.Second)})
		if err != nil {
			return nil, err
		}
		defer func() { _ = ms.Close() }()
		store = ms
		res.store = "dedup marks in memory (memstore)"
	default:
		opt, err := redisOptions(cfg.redisURL)
		if err != nil {
			return nil, fmt.Errorf("--redis: %w", err)
		}
		client := redis.NewClient(opt)
		defer func() { _ = client.Close() }()
		pctx, pcancel := context.WithTimeout(ctx, 5*time.Second)
		err = client.Ping(pctx).Err()
		pcancel()
		if err != nil {
			return nil, fmt.Errorf("redis at %s is unreachable: %w", opt.Addr, err)
		}
		if !cfg.keep {
			defer deleteRedisKeys(client, redisPrefix+":")
		}
		rs, err := redisnx.New(client, redisnx.Options{Prefix: redisPrefix, TTL: cfg.dedupTTL})
		if err != nil {
			return nil, err
		}
		store, storeWhere = rs, fmt.Sprintf("redisnx at %s, prefix %q", opt.Addr, redisPrefix)
		res.store = "dedup marks in Redis (redisnx) at " + opt.Addr
	}
	// A shared store lets the idem consumer live in other processes: they
	// run as children of this one and are SIGKILLed. memstore lives in
	// this process, so there the crashes are simulated.
	res.children = pgd != nil || cfg.redisURL != ""
	consumers := "consumer crashes simulated in this process"
	if res.children {
		consumers = "idem consumer in child processes, SIGKILLed and restarted"
	}

	fprintf(stdout, "idem demo: seed %d, %d payments; %s; %s; %s\n", cfg.seed, cfg.payments, res.backend, res.store, consumers)

	// The relay: an in-memory outbox both APIs append to, published in
	// batches to the topic, and now and then published twice (a crash
	// between publish and mark).
	clientsDone := make(chan struct{})
	var (
		sink        outboxSink
		rl          *relay
		runRelay    func(context.Context) error
		published   func() int64
		relayDone   func() bool
		relayCounts func() (republished, crashes int64)
	)
	if pgd == nil {
		rl = &relay{
			pub:   br.pub,
			queue: make(chan relayed, 1024),
			plan:  pl,
			done:  make(chan struct{}),
		}
		sink, runRelay, published = rl, rl.run, rl.published.Load
		relayDone = func() bool { return isClosed(rl.done) }
		relayCounts = func() (int64, int64) { return rl.republished.Load(), pl.relayBlocks() }
	} else {
		// pgoutbox's relay, through a publisher that now and then
		// "crashes" between publish and mark: the rows stay unmarked
		// and the relay publishes them again.
		cp := &crashingPublisher{pub: br.pub, rng: mrand.New(mrand.NewPCG(cfg.seed, 2)), rate: cfg.republishes}
		pr, err := pgoutbox.NewRelay(pgd.ob, cp, pgoutbox.RelayOptions{
			BatchSize:        relayBatch,
			PollInterval:     100 * time.Millisecond,
			ReconnectBackoff: consumer.Backoff{Initial: 5 * time.Millisecond, Max: 50 * time.Millisecond},

			CleanupInterval: -1,
			DeletePublished: true,
			ShutdownTimeout: 2 * time.Second,
			Telemetry:       consumer.Telemetry{Logger: logger},
		})
		if err != nil {
			return nil, err
		}
		sink = &pgSink{d: pgd, topic: br.topic}
		runRelay, published = pr.Run, cp.published.Load
		relayDone = func() bool { return isClosed(clientsDone) && pgd.backlogEmpty(ctx) }
		relayCounts = func() (int64, int64) { return cp.republished.Load(), cp.crashes.Load() }
	}

	// The APIs.
	naiveAPI := &api{path: pathNaive, ledger: res.naive, sink: sink}
	idemAPI := &api{path: pathIdem, ledger: res.idem, sink: sink}
	mwOpts := httpidem.Options{
		Wait:         10 * time.Second,
		PollInterval: 2 * time.Millisecond,
		Telemetry: consumer.Telemetry{
			OnOutcome: func(_ context.Context, rep consumer.Report) {
				if rep.Outcome == consumer.OutcomeDuplicate {
					res.idem.mu.Lock()
					res.idem.replayed++
					res.idem.mu.Unlock()
				}
			},
		},
	}
	var mw *httpidem.Middleware
	if pgd != nil {
		mw, err = httpidem.NewTx(pgd.store, mwOpts)
	} else {
		mw, err = httpidem.New(store, mwOpts)
	}
	if err != nil {
		return nil, err
	}
	apis := []apiTarget{
		{ledger: res.naive, handler: naiveAPI},
		{ledger: res.idem, handler: mw.Handler(idemAPI)},
	}

	// The consumer groups.
	runCtx, stopAll := context.WithCancel(ctx)
	defer stopAll()
	groups := []*group{
		{path: pathNaive, name: "billing-naive-" + runID, ledger: res.naive},
		{path: pathIdem, name: "billing-idem-" + runID, ledger: res.idem},
	}
	for i, g := range groups {
		g.br, g.logger, g.plan = br, logger, pl
		// A generator per group: the crashes of each follow from the
		// seed, whatever the other does meanwhile.
		g.crashRate, g.rng = cfg.crashRate, &lockedRand{r: mrand.New(mrand.NewPCG(cfg.seed, uint64(3+i)))}
		g.offsets = &offsetStore{pos: map[int]int64{}, partitions: cfg.partitions}
		g.seen, g.crashed = copySet{}, map[int]bool{}
		if g.path != pathIdem {
			continue
		}
		if !res.children {
			dd, err := consumer.Dedup(store, consumer.DedupOptions{Scope: chargeScope})
			if err != nil {
				return nil, err
			}
			g.dedup = dd
			continue
		}
		exe, err := os.Executable()
		if err != nil {
			return nil, fmt.Errorf("child processes: %w", err)
		}
		cc := &childConfig{Broker: br.kind, Group: g.name, Path: g.path}
		switch br.kind {
		case brokerKafka:
			cc.Brokers, cc.Topic, cc.DLQ, cc.SessionMS = br.brokers, br.topic, br.dlq, br.session.Milliseconds()
		case brokerAMQP:
			cc.AMQPURL, cc.Queue, cc.Exchange = br.amqpURL, br.queues[g.path], br.topic
		}
		if pgd != nil {
			cc.Postgres, cc.Schema = cfg.postgres, cfg.schema
		} else {
			// The lease store: a SIGKILL between the charge and
			// Complete would charge again once the lease ran out (the
			// limit of lease stores the README states), so the child is
			// stopped between deliveries before it is killed.
			cc.Redis, cc.Prefix, cc.TTLMS = cfg.redisURL, redisPrefix, cfg.dedupTTL.Milliseconds()
			g.freeze = true
		}
		g.exe, g.child = exe, cc
	}

	var wg sync.WaitGroup
	errs := make(chan error, 8)
	wg.Go(func() {
		if err := runRelay(runCtx); err != nil {
			errs <- err
			stopAll()
		}
	})
	if t := br.trimmer; t != nil {
		t.groups = groups
		wg.Go(func() { t.run(runCtx) })
	}
	for _, g := range groups {
		wg.Go(func() {
			if err := g.run(runCtx); err != nil {
				errs <- err
				stopAll()
			}
		})
	}

	// The clients.
	var submitted atomic.Int64
	wg.Go(func() {
		defer close(clientsDone)
		if rl != nil {
			defer rl.closeQueue()
		}
		submit(runCtx, cfg.clients, pl, apis, &submitted)
	})

	// Progress, and the end: every record published has been handled by
	// both groups.
	prog := newProgress(cfg.progress, cfg.progressOutput, cfg.payments)
	state := func() progressState {
		// The relay first: once it is done, what it published is final.
		done := relayDone()
		return progressState{
			submitted:       submitted.Load(),
			published:       published(),
			naive:           groups[0].handled.Load(),
			idem:            groups[1].handled.Load(),
			naiveDeliveries: int64(res.naive.deliveryCount()),
			idemDeliveries:  int64(res.idem.deliveryCount()),
			naiveCrashes:    groups[0].crashes.Load(),
			idemCrashes:     groups[1].crashes.Load(),
			relayDone:       done,
		}
	}
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	var waitErr error
loop:
	for {
		select {
		case <-runCtx.Done():
			waitErr = runCtx.Err()
			break loop
		case <-tick.C:
		}
		s := state()
		prog.update(s)
		if s.relayDone && s.naive >= s.published && s.idem >= s.published {
			break loop
		}
	}
	stopAll()
	wg.Wait()
	// The consumers are stopped: the final state is the table's.
	prog.finish(state())
	close(errs)
	for err := range errs {
		return nil, err
	}
	if waitErr != nil {
		if ctx.Err() != nil {
			why := fmt.Sprintf("gave up after %v (--timeout)", cfg.timeout)
			if !errors.Is(ctx.Err(), context.DeadlineExceeded) {
				why = "interrupted"
			}
			return nil, fmt.Errorf("%s: %d of %d payments submitted, %d records published, naive handled %d, idem handled %d",
				why, submitted.Load(), cfg.payments, published(), groups[0].handled.Load(), groups[1].handled.Load())
		}
		return nil, waitErr
	}
	res.published = published()
	res.republish, res.relayCrash = relayCounts()
	if pgd != nil {
		if err := pgd.count(ctx, res.idem); err != nil {
			return nil, err
		}
	}
	res.naive.crashes = int(groups[0].crashes.Load())
	res.idem.crashes = int(groups[1].crashes.Load())
	res.kills, res.restarts = int(groups[1].kills.Load()), int(groups[1].restarts.Load())
	res.elapsed = time.Since(start)
	if cfg.done != nil {
		if err := cfg.done(res, demoSources(br, pgd, cfg.schema, store, storeWhere)); err != nil {
			return nil, err
		}
	}
	return res, nil
}

// chargeScope is the idem consumer's dedup scope.
const chargeScope = "billing/charge"

func newRunID() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}
