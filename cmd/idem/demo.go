package main

import (
	"github.com/jackc/pgx/v5"

	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"math"
	mrand "math/rand/v2"
	"net/http"
	"net/http/httptest"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemkit/idem/adapters/httpidem"
	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/outbox"
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
	fs.StringVar(&cfg.postgres, "postgres", envDefault("IDEM_POSTGRES_URL", ""), "PostgreSQL URL: dedup marks in pgtable, messages through a pgoutbox relay, charges in a table (drops and recreates the demo's demo_* tables in --schema; the default run takes about a minute)")
	fs.StringVar(&cfg.schema, "schema", "", "schema of the demo's tables with --postgres, kept at the end (default: a fresh idem_demo_<run>, dropped at the end unless --keep)")
	fs.BoolVar(&cfg.keep, "keep", false, "keep what the run made at the end: the fresh --postgres schema, the --redis marks")
	fs.StringVar(&cfg.redisURL, "redis", envDefault("IDEM_REDIS_URL", ""), "Redis URL (redis://[user:password@]host:port/db, rediss:// for TLS) or host:port: dedup marks in Redis (redisnx) instead of memstore")
	fs.StringVar(&cfg.kafkaBrokers, "kafka", envDefault("IDEM_KAFKA_BROKERS", ""), "comma-separated Kafka brokers instead of the in-process kfake cluster")
	fs.StringVar(&cfg.amqpURL, "amqp", envDefault("IDEM_AMQP_URL", ""), "RabbitMQ URL (amqp://user:password@host:port/vhost): the pipeline runs over RabbitMQ instead of Kafka, through a fanout exchange and a queue per consumer named after the run (deleted at the end)")
	fs.StringVar(&cfg.progress, "progress", "auto", "progress display: auto (a bar on a terminal, plain lines otherwise), bar, plain or none")
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
	res.print(stdout)
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
		if f.Name != "payments" && f.Name != "seed" {
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

// maxPayments bounds --payments: the demo keeps a few counters per payment
// and per delivery, and a run of a million takes minutes.
const maxPayments = 1_000_000

func isRate(f float64) bool { return f >= 0 && f <= 1 && !math.IsNaN(f) }

// payment is one logical payment a client submits: one idempotency key,
// one or more requests.
type payment struct {
	n           int
	key         string
	customer    string
	cents       int64
	doubleClick bool
	loseFirst   bool
	// crash says whether the naive [0] and the idem [1] consumer crash
	// after handling this payment's first delivery.
	crash [2]bool
}

// ledger is one pipeline's effect sink and counters. Everything is guarded
// by mu. It keeps a few bytes per payment and a bit per broker copy, not the
// deliveries themselves: a run of maxPayments fits in a few megabytes.
type ledger struct {
	mu sync.Mutex
	// accepted are the payments the API answered with success.
	accepted paymentSet
	// charges counts the charges applied per payment (the effect sink),
	// amounts is the amount of each, both indexed by payment number.
	charges []uint32
	amounts []int32
	// deliveries of this pipeline's records, by cause.
	deliveries int
	causes     map[string]int
	// classification state of the consumer group: the broker copies
	// delivered, and per payment the request of its first delivery
	// (reasons[firstReason[n]-1]; 0: none yet) and the message ids
	// delivered (see seenID).
	seenCopy    copySet
	firstReason []uint8
	reasons     []string
	firstID     []uint64
	moreIDs     map[paymentID]struct{}
	// replayed counts API answers replayed by the idem middleware.
	replayed int
	crashes  int
}

// paymentID is one of a payment's message ids, hashed (idHash).
type paymentID struct {
	payment int32
	id      uint64
}

// idHash is a 64-bit FNV-1a hash of a message id, never 0. Ids are compared
// only among the few of one payment, where a collision has a chance of one
// in 2^64.
func idHash(id string) uint64 {
	h := uint64(14695981039346656037)
	for i := range len(id) {
		h = (h ^ uint64(id[i])) * 1099511628211
	}
	return h | 1
}

func newLedger(payments int) *ledger {
	return &ledger{
		accepted:    newPaymentSet(payments),
		charges:     make([]uint32, payments),
		amounts:     make([]int32, payments),
		causes:      map[string]int{},
		seenCopy:    copySet{},
		firstReason: make([]uint8, payments),
		firstID:     make([]uint64, payments),
		moreIDs:     map[paymentID]struct{}{},
	}
}

// valid reports whether n is a payment number of the run.
func (l *ledger) valid(n int) bool { return n >= 0 && n < len(l.charges) }

func (l *ledger) accept(n int) {
	l.mu.Lock()
	if l.valid(n) {
		l.accepted.add(n)
	}
	l.mu.Unlock()
}

func (l *ledger) charge(n int, cents int64) {
	l.mu.Lock()
	if l.valid(n) {
		l.charges[n]++
		l.amounts[n] = int32(min(cents, math.MaxInt32))
	}
	l.mu.Unlock()
}

// copyID names the broker's copy of a message: its partition and offset on
// Kafka; on RabbitMQ, which has no offsets, the publish sequence number the
// demo's publisher stamps on each copy it sends (headerPublish), with
// partition -1. A second delivery of the same copy is the broker delivering
// it again; another copy with the same message id is a re-publish.
type copyID struct {
	partition int
	offset    int64
}

// deliveryID returns the copy msg is.
func deliveryID(msg *consumer.Message) copyID {
	if seq := msg.Headers[headerPublish]; seq != "" {
		n, _ := strconv.ParseInt(seq, 10, 64)
		return copyID{partition: -1, offset: n}
	}
	p, _ := strconv.Atoi(msg.Metadata["kafka.partition"])
	o, _ := strconv.ParseInt(msg.Metadata["kafka.offset"], 10, 64)
	return copyID{partition: p, offset: o}
}

// String is the copy as the child processes report it: partition/offset.
func (c copyID) String() string {
	return strconv.Itoa(c.partition) + "/" + strconv.FormatInt(c.offset, 10)
}

// parseCopyID reads a copyID's String.
func parseCopyID(s string) (copyID, bool) {
	ps, os, ok := strings.Cut(s, "/")
	p, err1 := strconv.Atoi(ps)
	o, err2 := strconv.ParseInt(os, 10, 64)
	return copyID{partition: p, offset: o}, ok && err1 == nil && err2 == nil
}

// copySet is a set of broker copies: a bitset of offsets per partition. The
// offsets of a partition (and the publish sequence numbers) are dense from
// 0, so a copy costs a bit.
type copySet map[int]*bitset

// add adds c and reports whether it was new.
func (s copySet) add(c copyID) bool {
	if c.offset < 0 {
		return false
	}
	b := s[c.partition]
	if b == nil {
		b = new(bitset)
		s[c.partition] = b
	}
	return b.add(int(c.offset))
}

// bitset is a set of non-negative integers that are dense from 0: a bit
// each. It grows as numbers are added.
type bitset []uint64

// add adds n and reports whether it was new.
func (s *bitset) add(n int) bool {
	w, b := n/64, uint64(1)<<(n%64)
	if w >= len(*s) {
		*s = append(*s, make([]uint64, w+1-len(*s))...)
	}
	if (*s)[w]&b != 0 {
		return false
	}
	(*s)[w] |= b
	return true
}

// has reports whether n is in the set.
func (s bitset) has(n int) bool {
	w := n / 64
	return w < len(s) && s[w]&(uint64(1)<<(n%64)) != 0
}

// seenID reports whether message id h of payment n was delivered, and
// records it.
func (l *ledger) seenID(n int, h uint64) bool {
	switch l.firstID[n] {
	case 0:
		l.firstID[n] = h
		return false
	case h:
		return true
	}
	k := paymentID{payment: int32(n), id: h}
	if _, ok := l.moreIDs[k]; ok {
		return true
	}
	l.moreIDs[k] = struct{}{}
	return false
}

// reason returns the code of request in firstReason, adding it to reasons.
func (l *ledger) reason(request string) uint8 {
	for i, r := range l.reasons {
		if r == request {
			return uint8(i + 1)
		}
	}
	l.reasons = append(l.reasons, request)
	return uint8(len(l.reasons))
}

// classify records a delivery of this pipeline's record, the broker's copy
// po of message id with the demo-request header request, and returns why it
// is a duplicate (causeFirst when it is not).
func (l *ledger) classify(po copyID, id, request string, n int) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.valid(n) {
		return causeFirst
	}
	cause := causeFirst
	redelivered := !l.seenCopy.add(po)
	republished := l.seenID(n, idHash(id))
	switch first := l.firstReason[n]; {
	case redelivered:
		cause = causeRedelivery
	case republished:
		cause = causeRepublish
	case first != 0:
		// Another request of the same payment: a double click or a retry.
		// When the double click's second request was published first,
		// this one says "original": the duplicate is still the click's.
		cause = request
		if cause == causeFirst || cause == "" {
			cause = l.reasons[first-1]
		}
	default:
		l.firstReason[n] = l.reason(request)
	}
	l.deliveries++
	if cause != causeFirst {
		l.causes[cause]++
	}
	return cause
}

// deliveryCount returns the deliveries classified so far.
func (l *ledger) deliveryCount() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.deliveries
}

func (l *ledger) duplicates() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	d := 0
	for _, c := range l.causes {
		d += c
	}
	return d
}

func (l *ledger) effects() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	e := 0
	for _, c := range l.charges {
		e += int(c)
	}
	return e
}

// extra is the number of charges beyond one per payment.
func (l *ledger) extra() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	e := 0
	for _, c := range l.charges {
		if c > 1 {
			e += int(c) - 1
		}
	}
	return e
}

func (l *ledger) extraCents() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	var e int64
	for n, c := range l.charges {
		if c > 1 {
			e += int64(c-1) * int64(l.amounts[n])
		}
	}
	return e
}

// lost is the number of accepted payments never charged.
func (l *ledger) lost() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	lost := 0
	for n, c := range l.charges {
		if c == 0 && l.accepted.has(n) {
			lost++
		}
	}
	return lost
}

// paymentSet is a set of a run's payment numbers, with its size.
type paymentSet struct {
	bits bitset
	n    int
}

func newPaymentSet(payments int) paymentSet {
	return paymentSet{bits: make(bitset, (payments+63)/64)}
}

// add adds payment n.
func (s *paymentSet) add(n int) {
	if s.bits.add(n) {
		s.n++
	}
}

// has reports whether payment n is in the set.
func (s *paymentSet) has(n int) bool { return s.bits.has(n) }

// len returns the number of payments in the set.
func (s *paymentSet) len() int { return s.n }

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

	// The dedup store, shared by the idem API and the idem consumer group
	// (each with its own scope).
	var store dedup.LeaseStore
	var pgd *pgDemo
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
		ms, err := memstore.New(memstore.Options{})
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
		rs, err := redisnx.New(client, redisnx.Options{Prefix: redisPrefix, TTL: time.Hour})
		if err != nil {
			return nil, err
		}
		store = rs
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
			BatchSize:           relayBatch,
			PollInterval:        100 * time.Millisecond,
			ReconnectBackoff:    5 * time.Millisecond,
			MaxReconnectBackoff: 50 * time.Millisecond,
			CleanupInterval:     -1,
			DeletePublished:     true,
			ShutdownTimeout:     2 * time.Second,
			Logger:              logger,
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
		OnOutcome: func(_ context.Context, rep consumer.Report) {
			if rep.Outcome == consumer.OutcomeDuplicate {
				res.idem.mu.Lock()
				res.idem.replayed++
				res.idem.mu.Unlock()
			}
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
			cc.Redis, cc.Prefix = cfg.redisURL, redisPrefix
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
	return res, nil
}

// chargeScope is the idem consumer's dedup scope.
const chargeScope = "billing/charge"

func newRunID() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// plan decides the run from the seed, before it starts: each payment, its
// double click and lost response, the consumer crashes it causes, and the
// relay crashes. Each decision is a function of the seed and the payment's
// number (or the relay block's), whatever the goroutines do meanwhile, so
// that a run in this process repeats with its seed; and payments are made
// one at a time, so that none is held longer than its submission.
type plan struct {
	cfg   demoConfig
	runID string
}

// The streams of the seed's generator, one per kind of decision.
const (
	streamPayment = iota + 1
	streamRelay
)

// rng returns the generator of decision n of a stream.
func (pl *plan) rng(stream, n uint64) *mrand.Rand {
	// PCG's first outputs for neighbouring seeds are alike: mix first.
	a := splitmix(pl.cfg.seed ^ splitmix(stream<<56|n))
	return mrand.New(mrand.NewPCG(a, splitmix(a)))
}

// splitmix is SplitMix64's mixing function.
func splitmix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}

// payment returns payment n.
func (pl *plan) payment(n int) payment {
	r := pl.rng(streamPayment, uint64(n))
	return payment{
		n:           n,
		key:         fmt.Sprintf("pay-%s-%06d", pl.runID, n),
		customer:    "customer-" + strconv.Itoa(r.IntN(500)),
		cents:       100 + r.Int64N(99900),
		doubleClick: r.Float64() < pl.cfg.doubleClicks,
		loseFirst:   r.Float64() < pl.cfg.timeouts,
		crash: [2]bool{
			r.Float64() < pl.cfg.crashRate,
			r.Float64() < pl.cfg.crashRate,
		},
	}
}

// crashes reports whether the consumer group of path crashes after it
// handled payment n's first delivery, before it committed it (in this
// process: the child processes are SIGKILLed at random instead).
func (pl *plan) crashes(path string, n int) bool {
	i := 0
	if path == pathIdem {
		i = 1
	}
	return pl.payment(n).crash[i]
}

// relayCrashes reports whether the relay crashes after publishing the
// messages of payments block*relayBatch to (block+1)*relayBatch-1, before
// marking them sent: it publishes them again.
func (pl *plan) relayCrashes(block int) bool {
	return pl.rng(streamRelay, uint64(block)).Float64() < pl.cfg.republishes
}

// relayBlocks returns the number of relay blocks that crash.
func (pl *plan) relayBlocks() (crashed int64) {
	for b := range (pl.cfg.payments + relayBatch - 1) / relayBatch {
		if pl.relayCrashes(b) {
			crashed++
		}
	}
	return crashed
}

// lockedRand is a rand.Rand safe for concurrent use.
type lockedRand struct {
	mu sync.Mutex
	r  *mrand.Rand
}

func (l *lockedRand) Float64() float64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.r.Float64()
}

// The clients.

type apiTarget struct {
	ledger  *ledger
	handler http.Handler
}

// paymentBody is what a client sends.
type paymentBody struct {
	Payment  int    `json:"payment"`
	Customer string `json:"customer"`
	Cents    int64  `json:"amount_cents"`
}

// submit sends every payment of the plan to every API from clients
// goroutines.
func submit(ctx context.Context, clients int, pl *plan, apis []apiTarget, submitted *atomic.Int64) {
	next := make(chan *payment)
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			httpClients := make([]*http.Client, len(apis))
			for i, a := range apis {
				t, err := httpidem.NewTransport(httpidem.TransportOptions{
					Base:        &inProcess{handler: a.handler},
					BaseDelay:   time.Millisecond,
					MaxDelay:    10 * time.Millisecond,
					MaxAttempts: 10,
				})
				if err != nil {
					panic(err) // the options are constant
				}
				httpClients[i] = &http.Client{Transport: t}
			}
			for p := range next {
				for i, a := range apis {
					submitOne(ctx, httpClients[i], a.ledger, p)
				}
				submitted.Add(1)
			}
		})
	}
	defer wg.Wait()
	defer close(next)
	for n := range pl.cfg.payments {
		p := pl.payment(n)
		select {
		case next <- &p:
		case <-ctx.Done():
			return
		}
	}
}

// submitOne submits p once, or twice at once when it is double-clicked.
func submitOne(ctx context.Context, c *http.Client, l *ledger, p *payment) {
	body, _ := json.Marshal(paymentBody{Payment: p.n, Customer: p.customer, Cents: p.cents})
	clicks := 1
	if p.doubleClick {
		clicks = 2
	}
	var wg sync.WaitGroup
	for click := 1; click <= clicks; click++ {
		wg.Go(func() {
			cause := causeFirst
			if click == 2 {
				cause = causeDoubleClick
			}
			st := &attemptState{cause: cause, loseFirst: p.loseFirst && click == 1}
			req, err := http.NewRequestWithContext(context.WithValue(ctx, attemptKey{}, st),
				http.MethodPost, "http://payments.demo/payments", bytes.NewReader(body))
			if err != nil {
				return
			}
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Idempotency-Key", p.key)
			resp, err := c.Do(req)
			if err != nil {
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			if resp.StatusCode/100 == 2 {
				l.accept(p.n)
			}
		})
	}
	wg.Wait()
}

type attemptKey struct{}

// attemptState follows one request through the Transport's attempts.
type attemptState struct {
	cause     string
	loseFirst bool
	attempts  atomic.Int32
}

// inProcess is an http.RoundTripper that serves requests with a handler in
// this process, and loses the response of a request's first attempt when
// told to: the server did the work, the client saw a timeout and retries
// with the same key.
type inProcess struct {
	handler http.Handler
}

var errResponseLost = errors.New("demo: response lost (client timeout)")

func (t *inProcess) RoundTrip(req *http.Request) (*http.Response, error) {
	st, _ := req.Context().Value(attemptKey{}).(*attemptState)
	attempt := int32(1)
	cause := causeFirst
	if st != nil {
		attempt = st.attempts.Add(1)
		cause = st.cause
	}
	if attempt > 1 {
		cause = causeRetry
	}
	req = req.Clone(req.Context())
	req.Header.Set(headerCause, cause)
	rec := httptest.NewRecorder()
	t.handler.ServeHTTP(rec, req)
	if req.Body != nil {
		_ = req.Body.Close()
	}
	if st != nil && st.loseFirst && attempt == 1 {
		return nil, errResponseLost
	}
	resp := rec.Result()
	resp.Request = req
	return resp, nil
}

// api is the payments endpoint: it accepts a payment and publishes it
// through the outbox. The naive one publishes every request it gets under a
// fresh id; the idem one runs behind the httpidem middleware, once per
// idempotency key, and publishes the key as the message id.
type api struct {
	path   string
	ledger *ledger
	sink   outboxSink
	seq    atomic.Int64
}

// outboxSink is where the APIs put their messages: the demo's in-memory
// relay, or pgoutbox with --postgres.
type outboxSink interface {
	enqueue(r *http.Request, p *paymentBody, msg *outbox.Message) error
}

func isClosed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

func (a *api) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var p paymentBody
	if err := json.Unmarshal(body, &p); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	id := r.Header.Get("Idempotency-Key")
	if a.path == pathNaive {
		id = fmt.Sprintf("naive-%d", a.seq.Add(1))
	}
	msg := &outbox.Message{
		ID:      id,
		Key:     []byte(p.Customer),
		Payload: body,
		Headers: map[string]string{headerPath: a.path, headerRequest: r.Header.Get(headerCause)},
	}
	if err := a.sink.enqueue(r, &p, msg); err != nil {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	if httpidem.Tx[pgx.Tx](r.Context()) == nil {
		// Under httpidem.NewTx the payment is accepted when the
		// transaction commits: the client counts it on the response.
		a.ledger.accept(p.Payment)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fprintf(w, "{\"id\":%q}\n", id)
}

// relay publishes the outbox's messages in batches. The plan says which
// blocks of payments it crashes after (relayCrashes): it publishes their
// messages, "crashes" before marking them sent, and publishes them again,
// with the same ids, as a restarted relay does.
type relay struct {
	pub         outbox.Publisher
	queue       chan relayed
	closeOnce   sync.Once
	plan        *plan
	published   atomic.Int64
	republished atomic.Int64
	done        chan struct{}
}

// relayed is a message in the relay's queue, with its payment's number.
type relayed struct {
	msg     *outbox.Message
	payment int
}

func (r *relay) enqueue(req *http.Request, p *paymentBody, msg *outbox.Message) error {
	select {
	case r.queue <- relayed{msg: msg, payment: p.Payment}:
		return nil
	case <-req.Context().Done():
		return req.Context().Err()
	}
}

func (r *relay) closeQueue() { r.closeOnce.Do(func() { close(r.queue) }) }

const relayBatch = 100

func (r *relay) run(ctx context.Context) error {
	defer close(r.done)
	var batch, again []*outbox.Message
	for {
		batch, again = batch[:0], again[:0]
		add := func(m relayed) {
			batch = append(batch, m.msg)
			if r.plan.relayCrashes(m.payment / relayBatch) {
				again = append(again, m.msg)
			}
		}
		select {
		case m, ok := <-r.queue:
			if !ok {
				return nil
			}
			add(m)
		case <-ctx.Done():
			return nil
		}
	fill:
		for len(batch) < relayBatch {
			select {
			case m, ok := <-r.queue:
				if !ok {
					break fill
				}
				add(m)
			default:
				break fill
			}
		}
		if err := r.publish(ctx, batch); err != nil {
			return err
		}
		if len(again) > 0 {
			// Crashed after publishing, before marking: the restarted
			// relay finds these unmarked and publishes them again.
			if err := r.publish(ctx, again); err != nil {
				return err
			}
			r.republished.Add(int64(len(again)))
		}
	}
}

// relayAttempts bounds the sends of a message the broker keeps refusing
// (an outbox.PublishError: nacked, returned, unconfirmed).
const relayAttempts = 50

// publish sends batch until every message is confirmed. A message whose
// outcome is unknown is sent again, as the relay does: the whole batch
// after a lost connection or a timeout, the failed messages of an
// outbox.PublishError.
func (r *relay) publish(ctx context.Context, batch []*outbox.Message) error {
	for refused := 0; ; {
		err := r.pub.Publish(ctx, batch)
		if err == nil {
			r.published.Add(int64(len(batch)))
			return nil
		}
		if ctx.Err() != nil {
			return nil
		}
		var pe *outbox.PublishError
		if errors.As(err, &pe) {
			if refused++; refused >= relayAttempts {
				return fmt.Errorf("publish: %w", err)
			}
			r.published.Add(int64(len(batch) - len(pe.Failed)))
			failed := make([]*outbox.Message, 0, len(pe.Failed))
			for i, m := range batch {
				if _, ok := pe.Failed[i]; ok {
					failed = append(failed, m)
				}
			}
			batch = failed
		}
		select {
		case <-time.After(100 * time.Millisecond):
		case <-ctx.Done():
			return nil
		}
	}
}

// group is a consumer group of one pipeline: a idemkafka.Consumer, or an
// idemamqp.Consumer of the pipeline's queue, that crashes now and then before
// committing and is restarted. With a shared store, the idem group runs in
// child processes instead (demo_proc.go).
type group struct {
	path      string
	name      string
	br        *demoBroker
	logger    *slog.Logger
	ledger    *ledger
	dedup     consumer.Middleware // nil for the naive group
	crashRate float64
	rng       *lockedRand
	plan      *plan
	offsets   *offsetStore
	// crashed holds the payments whose planned crash happened (Kafka in
	// this process).
	crashed map[int]bool
	// child, when set, is the configuration of the child processes that
	// run this group, started from exe. freeze makes the demo stop a
	// child between deliveries before it SIGKILLs it.
	child  *childConfig
	exe    string
	freeze bool

	mu       sync.Mutex
	handled  atomic.Int64 // distinct records handled, of both pipelines
	seen     copySet      // the broker copies handled
	crashes  atomic.Int64
	kills    atomic.Int64 // child processes SIGKILLed
	restarts atomic.Int64 // child processes started after a kill
}

// instance is one run of a group's consumer: one process, in a real
// deployment.
type instance struct {
	dead   atomic.Bool
	cancel context.CancelFunc
}

func (g *group) run(ctx context.Context) error {
	if g.child != nil {
		return g.runChildren(ctx)
	}
	for ctx.Err() == nil {
		inst := &instance{}
		ictx, cancel := context.WithCancel(ctx)
		inst.cancel = cancel
		var err error
		if g.br.kind == brokerAMQP {
			err = g.runAMQPInstance(ictx, inst)
		} else {
			err = g.runInstance(ictx, inst)
		}
		cancel()
		if err != nil {
			return err
		}
	}
	return nil
}

// markHandled counts the broker's copy po as handled by the group.
func (g *group) markHandled(po copyID) {
	g.mu.Lock()
	if g.seen.add(po) {
		g.handled.Add(1)
	}
	g.mu.Unlock()
}

// handler is the group's handler chain in this process: route (skip the
// other pipeline's records, classify this one's deliveries), then the dedup
// claim for the idem group, then the charge on the ledger.
func (g *group) handler() consumer.Handler {
	charge := consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
		var p paymentBody
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return consumer.Permanent(err)
		}
		g.ledger.charge(p.Payment, p.Cents)
		return nil
	})
	classify := func(msg *consumer.Message, p *paymentBody) {
		g.ledger.classify(deliveryID(msg), msg.ID, msg.Headers[headerRequest], p.Payment)
	}
	return consumer.Chain(charge, route(g.path, classify), consumer.Recover(), g.dedup)
}

// route is the outermost middleware of a group: it skips the other
// pipeline's records (both pipelines share the topic) and reports each
// broker delivery of this pipeline's records to delivered before passing it
// on. A retry the consumer decided (Attempt > 1) is not a delivery.
func route(path string, delivered func(msg *consumer.Message, p *paymentBody)) consumer.Middleware {
	return func(next consumer.Handler) consumer.Handler {
		return consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
			if msg.Headers[headerPath] != path {
				return nil
			}
			var p paymentBody
			if err := json.Unmarshal(msg.Payload, &p); err != nil {
				return consumer.Permanent(err)
			}
			if msg.Attempt <= 1 {
				delivered(msg, &p)
			}
			return next.Handle(ctx, msg)
		})
	}
}

// errDead is what a crashed instance answers: the process is gone and
// handles nothing more.
var errDead = errors.New("demo: the consumer crashed")

// crashing wraps the group's handler for an instance in this process, so
// that what it handles and commits follows from the plan alone: the
// instance commits each record's position as soon as the record is
// handled, but after the first delivery of a payment whose plan says it
// crashes, which it handles and never commits; and once crashed it
// handles nothing more. The restarted instance gets that delivery again,
// and no other.
func (g *group) crashing(inst *instance, next consumer.Handler) consumer.Handler {
	return consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		if inst.dead.Load() {
			return errDead
		}
		// A crash stops the consumer, not a handler midway: the
		// handler runs to its end.
		err := next.Handle(context.WithoutCancel(ctx), msg)
		if consumer.Decide(err).Action != consumer.ActionAck {
			return err
		}
		if msg.Headers[headerPath] == g.path {
			var p paymentBody
			if json.Unmarshal(msg.Payload, &p) == nil && g.crashAfter(p.Payment) {
				inst.dead.Store(true)
				g.crashes.Add(1)
				inst.cancel()
				return err
			}
		}
		part, _ := strconv.Atoi(msg.Metadata["kafka.partition"])
		off, _ := strconv.ParseInt(msg.Metadata["kafka.offset"], 10, 64)
		g.offsets.save(part, off+1)
		g.markHandled(deliveryID(msg))
		return err // nil, or a completed duplicate's
	})
}

// crashAfter reports whether the group crashes after handling a delivery
// of payment n: the first one, when the plan says so.
func (g *group) crashAfter(n int) bool {
	if !g.plan.crashes(g.path, n) {
		return false
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.crashed[n] {
		return false
	}
	g.crashed[n] = true
	return true
}

func (g *group) runInstance(ctx context.Context, inst *instance) error {
	c, err := idemkafka.NewConsumer(kafkago.ReaderConfig{
		Brokers:  g.br.brokers,
		GroupID:  g.name,
		Topic:    g.br.topic,
		MinBytes: 1,
		MaxBytes: 10 << 20,
		MaxWait:  50 * time.Millisecond,
	}, g.crashing(inst, g.handler()), idemkafka.ConsumerOptions{
		DeadLetterTopic: g.br.dlq,
		Logger:          g.logger,
		CommitEvery:     500,
		CommitInterval:  500 * time.Millisecond,
		ShutdownTimeout: time.Second,
		Offsets:         &instanceOffsets{store: g.offsets, inst: inst},
		OnOutcome: func(_ context.Context, rep consumer.Report) {
			msg, r := rep.Message, rep.Result
			if r.Action == consumer.ActionRetry || inst.dead.Load() {
				return
			}
			g.markHandled(deliveryID(msg))
		},
	})
	if err != nil {
		return err
	}
	return c.Run(ctx)
}

// offsetStore keeps a group's committed positions: the source of truth for
// where a restarted consumer resumes. A fresh topic starts at offset 0.
type offsetStore struct {
	mu         sync.Mutex
	pos        map[int]int64
	partitions int
}

// instanceOffsets is one instance's view of its group's offsetStore: once
// the instance is dead, its commits are lost, as a crashed process's are.
type instanceOffsets struct {
	store *offsetStore
	inst  *instance
}

// save records that a partition's records before off are done.
func (o *offsetStore) save(partition int, off int64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if off > o.pos[partition] {
		o.pos[partition] = off
	}
}

func (o *instanceOffsets) LoadOffsets(_ context.Context, _, _ string, partitions []int) (map[int]int64, error) {
	o.store.mu.Lock()
	defer o.store.mu.Unlock()
	out := make(map[int]int64, len(partitions))
	for _, p := range partitions {
		out[p] = o.store.pos[p]
	}
	return out, nil
}

func (o *instanceOffsets) SaveOffsets(_ context.Context, _ string, offsets map[string]map[int]int64) error {
	if o.inst.dead.Load() {
		return nil // the process is gone: the commit never happens
	}
	o.store.mu.Lock()
	defer o.store.mu.Unlock()
	for _, parts := range offsets {
		for p, off := range parts {
			if off > o.store.pos[p] {
				o.store.pos[p] = off
			}
		}
	}
	return nil
}

// createTopics creates the demo's topics on a real cluster and waits for
// their leaders.
func createTopics(ctx context.Context, brokers []string, transport *kafkago.Transport, partitions int, topic, dlq string) error {
	client := &kafkago.Client{Addr: kafkago.TCP(brokers...), Transport: transport, Timeout: 10 * time.Second}
	res, err := client.CreateTopics(ctx, &kafkago.CreateTopicsRequest{Topics: []kafkago.TopicConfig{
		{Topic: topic, NumPartitions: partitions, ReplicationFactor: 1},
		{Topic: dlq, NumPartitions: 1, ReplicationFactor: 1},
	}})
	if err != nil {
		return fmt.Errorf("kafka at %s: create topics: %w", strings.Join(brokers, ","), err)
	}
	for t, err := range res.Errors {
		if err != nil && !errors.Is(err, kafkago.TopicAlreadyExists) {
			return fmt.Errorf("kafka: create topic %s: %w", t, err)
		}
	}
	for {
		md, err := client.Metadata(ctx, &kafkago.MetadataRequest{Topics: []string{topic, dlq}})
		if err == nil && topicsReady(md) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("kafka: topics have no leaders: %w", ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func topicsReady(md *kafkago.MetadataResponse) bool {
	for _, t := range md.Topics {
		if t.Error != nil || len(t.Partitions) == 0 {
			return false
		}
		for _, p := range t.Partitions {
			if p.Error != nil || p.Leader.Host == "" {
				return false
			}
		}
	}
	return true
}
