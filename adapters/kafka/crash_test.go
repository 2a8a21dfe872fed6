package idemkafka_test

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	kafkago "github.com/segmentio/kafka-go"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/adapters/kafka/kafkapg"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// The crash tests run the consumer in a child process (this test binary,
// re-executed with childEnv set; TestMain dispatches) and SIGKILL it, at
// random points and at named points:
//
//   - in_tx: in the handler, after the effect's INSERT, before the
//     transaction commits;
//   - after_effect: the transaction committed, the record not yet marked done;
//   - before_commit: records done, the offset commit about to be sent;
//   - after_commit: just after an offset commit.
//
// The Kafka cluster (kfake) and the oracle live in the parent: the effects
// table has no unique constraint, so a duplicate effect is a second row.
const (
	childEnv         = "IDEM_KAFKA_TEST_CHILD" // "pgtable" or "pgoffsets"
	childBrokersEnv  = "IDEM_KAFKA_TEST_CHILD_BROKERS"
	childTopicEnv    = "IDEM_KAFKA_TEST_CHILD_TOPIC"
	childGroupEnv    = "IDEM_KAFKA_TEST_CHILD_GROUP"
	childSchemaEnv   = "IDEM_KAFKA_TEST_CHILD_SCHEMA"
	childSessionEnv  = "IDEM_KAFKA_TEST_CHILD_SESSION"
	childKillEnv     = "IDEM_KAFKA_TEST_CHILD_KILL"       // a named point, or empty
	childKillAfter   = "IDEM_KAFKA_TEST_CHILD_KILL_AFTER" // records acknowledged before the named point kills
	childHandlerEnv  = "IDEM_KAFKA_TEST_CHILD_HANDLER"    // pgoffsets: "tx" or "batch"
	childReadyLine   = "idem-child: ready"
	childStartedLine = "idem-child: handling"
	childDupLine     = "idem-child: duplicate"
)

var namedPoints = []string{"in_tx", "after_effect", "before_commit", "after_commit"}

const effectsDDL = ` (id text NOT NULL, part integer NOT NULL, off bigint NOT NULL, at timestamptz NOT NULL DEFAULT clock_timestamp())`

// childMain is the consumer child process. It runs until SIGTERM (then
// returns 0 after a clean stop) or until it SIGKILLs itself at its point.
func childMain() int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "idem-child:", err)
		return 3
	}
	mode := os.Getenv(childEnv)
	topic, group, schema := os.Getenv(childTopicEnv), os.Getenv(childGroupEnv), os.Getenv(childSchemaEnv)
	session, err := time.ParseDuration(os.Getenv(childSessionEnv))
	if err != nil {
		return fail(err)
	}
	point := os.Getenv(childKillEnv)
	killAfter, _ := strconv.ParseInt(os.Getenv(childKillAfter), 10, 64)

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	fmt.Println(childReadyLine) // SIGTERM now stops the child cleanly
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		return fail(err)
	}
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	claims, err := pgtable.New(pool, pgtable.Options{Schema: schema})
	if err != nil {
		return fail(err)
	}

	var acked atomic.Int64
	var once sync.Once
	die := func(at string) {
		if point == at && acked.Load() >= killAfter {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {} // the signal is on its way
		}
	}
	insert := "INSERT INTO " + pgx.Identifier{schema, "effects"}.Sanitize() + " (id, part, off) VALUES ($1, $2, $3)"
	effect := func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		once.Do(func() { fmt.Println(childStartedLine) })
		p, _ := strconv.Atoi(msg.Metadata[idemkafka.MetadataPartition])
		o, _ := strconv.ParseInt(msg.Metadata[idemkafka.MetadataOffset], 10, 64)
		if _, err := tx.Exec(ctx, insert, msg.ID, p, o); err != nil {
			return err
		}
		die("in_tx")
		return nil
	}
	dupOutcome := func(_ context.Context, r consumer.Report) {
		msg, outcome := r.Message, r.Outcome
		if outcome == consumer.OutcomeDuplicate {
			fmt.Println(childDupLine, msg.ID, msg.Metadata[idemkafka.MetadataPartition], msg.Metadata[idemkafka.MetadataOffset])
		}
	}

	rc := kafkago.ReaderConfig{
		Brokers:           strings.Split(os.Getenv(childBrokersEnv), ","),
		GroupID:           group,
		Topic:             topic,
		HeartbeatInterval: session / 15,
		SessionTimeout:    session,
		RebalanceTimeout:  2 * session,
		JoinGroupBackoff:  100 * time.Millisecond,
		MaxWait:           100 * time.Millisecond,
		ReadBackoffMin:    10 * time.Millisecond,
		ReadBackoffMax:    100 * time.Millisecond,
	}
	opts := idemkafka.ConsumerOptions{
		CommitEvery:     50,
		CommitInterval:  100 * time.Millisecond,
		DeadLetterTopic: topic + "_dlq",
		Telemetry: consumer.Telemetry{
			Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
		},
	}
	var c *idemkafka.Consumer
	switch mode {
	case "pgtable":
		h, err := consumer.Transactional(claims, consumer.TxOptions{Scope: "test/crash", Telemetry: consumer.Telemetry{OnOutcome: dupOutcome}}, effect)
		if err != nil {
			return fail(err)
		}
		c, err = idemkafka.NewConsumer(rc, h, opts)
		if err != nil {
			return fail(err)
		}
	case "pgoffsets":
		offsets, err := kafkapg.NewOffsets(pool, kafkapg.OffsetsOptions{Schema: schema})
		if err != nil {
			return fail(err)
		}
		opts.Offsets = offsets
		if os.Getenv(childHandlerEnv) == "batch" {
			bh, err := kafkapg.Batch(pool, claims, kafkapg.BatchOptions{Scope: "test/crash", Offsets: offsets, Telemetry: consumer.Telemetry{OnOutcome: dupOutcome}}, effect)
			if err != nil {
				return fail(err)
			}
			opts.BatchSize = 20
			c, err = idemkafka.NewBatchConsumer(rc, bh, opts)
			if err != nil {
				return fail(err)
			}
		} else {
			h, err := kafkapg.Transactional(claims, offsets, consumer.TxOptions{Scope: "test/crash", Telemetry: consumer.Telemetry{OnOutcome: dupOutcome}}, effect)
			if err != nil {
				return fail(err)
			}
			c, err = idemkafka.NewConsumer(rc, h, opts)
			if err != nil {
				return fail(err)
			}
		}
	default:
		return fail(fmt.Errorf("unknown mode %q", mode))
	}
	idemkafka.SetAfterEffect(c, func(*consumer.Message) {
		acked.Add(1)
		die("after_effect")
	})
	idemkafka.SetCommitHooks(c,
		func(map[string]map[int]int64) { die("before_commit") },
		func(map[string]map[int]int64) { die("after_commit") })
	if err := c.Run(ctx); err != nil {
		return fail(err)
	}
	return 0
}

// child is one consumer child process.
type child struct {
	cmd     *exec.Cmd
	ready   chan struct{} // closed when SIGTERM stops the child cleanly
	started chan struct{} // closed when the child handles its first record
	dups    atomic.Int64  // duplicate claims the child reported
	stderr  bytes.Buffer
	outDone chan struct{}
	exited  chan struct{}
	err     error // set when exited is closed
}

type crashRun struct {
	t       *testing.T
	pool    *pgxpool.Pool
	k       *kenv
	mode    string
	topic   string
	group   string
	schema  string
	handler string
	logs    []string
}

func (r *crashRun) start(point string, killAfter int) *child {
	r.t.Helper()
	exe, err := os.Executable()
	if err != nil {
		r.t.Fatal(err)
	}
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(),
		childEnv+"="+r.mode,
		childBrokersEnv+"="+strings.Join(r.k.brokers, ","),
		childTopicEnv+"="+r.topic,
		childGroupEnv+"="+r.group,
		childSchemaEnv+"="+r.schema,
		childSessionEnv+"="+r.k.childSession.String(),
		childKillEnv+"="+point,
		childKillAfter+"="+strconv.Itoa(killAfter),
		childHandlerEnv+"="+r.handler,
	)
	ch := &child{cmd: cmd, ready: make(chan struct{}), started: make(chan struct{}), outDone: make(chan struct{}), exited: make(chan struct{})}
	cmd.Stderr = &ch.stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		r.t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		r.t.Fatal(err)
	}
	go func() {
		defer close(ch.outDone)
		var once, readyOnce sync.Once
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			line := sc.Text()
			switch {
			case line == childReadyLine:
				readyOnce.Do(func() { close(ch.ready) })
			case line == childStartedLine:
				once.Do(func() { close(ch.started) })
			case strings.HasPrefix(line, childDupLine):
				ch.dups.Add(1)
			}
		}
		_, _ = io.Copy(io.Discard, out)
	}()
	go func() {
		<-ch.outDone
		ch.err = cmd.Wait()
		close(ch.exited)
	}()
	return ch
}

// wait waits for the child to exit, killing it after limit. It returns
// whether SIGKILL ended it.
func (r *crashRun) wait(ch *child, limit time.Duration) (killed bool) {
	r.t.Helper()
	select {
	case <-ch.exited:
	case <-time.After(limit):
		_ = ch.cmd.Process.Kill()
		<-ch.exited
	}
	r.logs = append(r.logs, ch.stderr.String())
	var ee *exec.ExitError
	if errors.As(ch.err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL {
			return true
		}
	}
	if ch.err != nil {
		r.t.Errorf("child exited: %v\n%s", ch.err, ch.stderr.String())
	}
	return false
}

func (r *crashRun) dumpLogs() {
	for i, l := range r.logs {
		if l != "" {
			r.t.Logf("child %d stderr:\n%s", i, l)
		}
	}
}

// crashKills is the number of kills per crash test; IDEM_TEST_KAFKA_KILLS
// overrides it.
func crashKills(def int) int {
	if n, err := strconv.Atoi(os.Getenv("IDEM_TEST_KAFKA_KILLS")); err == nil && n > 0 {
		return n
	}
	return def
}

// killLoop starts and kills children: even rounds at a random moment after
// the child started handling, odd rounds at the named points in turn, after
// a random number of acknowledged records. Each round's budget is a share of
// the ids still without an effect, so that the kills spread over the whole
// run. It returns the number of kills and of duplicates the children
// reported.
func (r *crashRun) killLoop(kills, want int, handlers []string) (done int, dups int64) {
	r.t.Helper()
	rng := rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 7))
	effects := pgx.Identifier{r.schema, "effects"}.Sanitize()
	for i := 0; i < kills; i++ {
		if len(handlers) > 0 {
			r.handler = handlers[i%len(handlers)]
		}
		var applied int
		if err := r.pool.QueryRow(context.Background(), "SELECT count(DISTINCT id) FROM "+effects).Scan(&applied); err != nil {
			r.t.Fatal(err)
		}
		budget := max(10, (want-applied)/(kills-i+3))
		point := ""
		if i%2 == 1 {
			point = namedPoints[(i/2)%len(namedPoints)]
		}
		ch := r.start(point, 5+rng.IntN(2*budget))
		if point == "" {
			select {
			case <-ch.started:
				// Roughly one record per millisecond under -race.
				time.Sleep(time.Duration(rng.IntN(2*budget)) * time.Millisecond)
			case <-ch.exited:
			case <-time.After(30 * time.Second):
			}
			_ = ch.cmd.Process.Signal(syscall.SIGKILL)
		}
		killed := r.wait(ch, 60*time.Second)
		if killed {
			done++
		}
		dups += ch.dups.Load()
		if err := r.pool.QueryRow(context.Background(), "SELECT count(DISTINCT id) FROM "+effects).Scan(&applied); err != nil {
			r.t.Fatal(err)
		}
		if point == "" {
			point = "random"
		}
		r.t.Logf("round %2d: %-13s %-5s killed=%v, %d of %d ids applied, %d duplicates caught by the claim",
			i, point, r.handler, killed, applied, want, ch.dups.Load())
	}
	return done, dups
}

// finish runs a last child until every id has its effect and every record
// is committed (caught up), stops it cleanly and returns its duplicate count.
func (r *crashRun) finish(pool *pgxpool.Pool, want int, caughtUp func() bool) int64 {
	r.t.Helper()
	ch := r.start("", 0)
	effects := pgx.Identifier{r.schema, "effects"}.Sanitize()
	deadline := time.Now().Add(3 * time.Minute)
	for {
		var n int
		if err := pool.QueryRow(context.Background(), "SELECT count(DISTINCT id) FROM "+effects).Scan(&n); err != nil {
			r.t.Fatal(err)
		}
		if n >= want && caughtUp() {
			break
		}
		select {
		case <-ch.exited:
			r.dumpLogs()
			r.t.Fatalf("the last child exited early (%v) at %d of %d ids:\n%s", ch.err, n, want, ch.stderr.String())
		case <-time.After(200 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			_ = ch.cmd.Process.Kill()
			r.wait(ch, time.Minute)
			r.dumpLogs()
			r.t.Fatalf("gave up: %d of %d ids have an effect", n, want)
		}
	}
	select {
	case <-ch.ready: // a SIGTERM before the handler is installed would kill it
	case <-ch.exited:
	}
	_ = ch.cmd.Process.Signal(syscall.SIGTERM)
	if r.wait(ch, time.Minute) {
		r.t.Error("the last child did not stop on SIGTERM")
	}
	return ch.dups.Load()
}

// oracle counts, over the effects table, the extra effects (rows beyond the
// first per id), the ids without an effect and the effects of unknown ids.
func oracleCheck(t *testing.T, pool *pgxpool.Pool, schema string, want []string) (extra, lost, unknown int) {
	t.Helper()
	ctx := context.Background()
	effects := pgx.Identifier{schema, "effects"}.Sanitize()
	var dupIDs int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM (SELECT id FROM "+effects+" GROUP BY id HAVING count(*) > 1) d").Scan(&dupIDs); err != nil {
		t.Fatal(err)
	}
	rows, err := pool.Query(ctx, "SELECT id, count(*) FROM "+effects+" GROUP BY id")
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int{}
	var (
		id string
		n  int
	)
	if _, err := pgx.ForEachRow(rows, []any{&id, &n}, func() error { got[id] = n; return nil }); err != nil {
		t.Fatal(err)
	}
	for _, w := range want {
		switch c := got[w]; {
		case c == 0:
			lost++
		case c > 1:
			extra += c - 1
		}
		delete(got, w)
	}
	if dupIDs > 0 && extra == 0 {
		t.Errorf("GROUP BY id HAVING count(*) > 1 found %d ids", dupIDs)
	}
	return extra, lost, len(got)
}

// TestCrashSafety: a consumer child process with pgtable's Transactional
// handler is SIGKILLed at random and named points over 10,000 records (and
// 500 producer duplicates): no effect applied twice, none lost.
func TestCrashSafety(t *testing.T) {
	k := newKafka(t)
	pool := testenv.Pool(t, 4)
	schema := testenv.Schema(t, pool)
	ctx := context.Background()
	claims, err := pgtable.New(pool, pgtable.Options{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := claims.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE "+pgx.Identifier{schema, "effects"}.Sanitize()+effectsDDL); err != nil {
		t.Fatal(err)
	}
	const partitions, n, producerDups = 4, 10000, 500
	topic := k.topic(t, "crash", partitions)
	k.dlq(t, topic)
	all := ids("c", n)
	recs := make([]kafkago.Message, 0, n+producerDups)
	for i, id := range all {
		recs = append(recs, rec(i%partitions, id, id, "payload-"+id))
	}
	for i := range producerDups { // re-published: same partition, later offset
		j := i*(n/producerDups) + i%partitions
		recs = append(recs, rec(j%partitions, all[j], all[j], "payload-"+all[j]))
	}
	k.produce(t, topic, recs...)

	r := &crashRun{t: t, pool: pool, k: k, mode: "pgtable", topic: topic, group: testenv.Name("g"), schema: schema}
	kills, dups := r.killLoop(crashKills(24), n, nil)
	ends := k.ends(t, topic, partitions)
	dups += r.finish(pool, n, func() bool {
		return fmt.Sprint(k.committed(t, r.group, topic, partitions)) == fmt.Sprint(ends)
	})

	extra, lost, unknown := oracleCheck(t, pool, schema, all)
	var rows int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+pgx.Identifier{schema, "effects"}.Sanitize()).Scan(&rows); err != nil {
		t.Fatal(err)
	}
	t.Logf("crash safety: %d records (%d ids + %d producer duplicates), %d kills, %d effect rows: %d duplicate effects, %d lost, %d unknown; %d redeliveries and producer duplicates caught by the claim",
		len(recs), n, producerDups, kills, rows, extra, lost, unknown, dups)
	if extra != 0 || lost != 0 || unknown != 0 {
		r.dumpLogs()
		t.Fatalf("%d duplicate effects, %d lost, %d unknown", extra, lost, unknown)
	}
	if kills < 20 && crashKills(24) >= 20 {
		t.Fatalf("only %d kills happened, want at least 20", kills)
	}
	if got := k.committed(t, r.group, topic, partitions); fmt.Sprint(got) != fmt.Sprint(ends) {
		t.Fatalf("committed %v after the clean stop, want the ends %v", got, ends)
	}
}

// TestCrashSafetyOffsetsInPostgres: the same with the offsets in PostgreSQL,
// written in the transaction of the effect (per record, and per batch in
// turn). A restarted child resumes exactly where the last transaction left
// off: no record whose effect committed is handled again (no duplicate
// claim), none is skipped.
func TestCrashSafetyOffsetsInPostgres(t *testing.T) {
	k := newKafka(t)
	pool := testenv.Pool(t, 4)
	schema := testenv.Schema(t, pool)
	ctx := context.Background()
	claims, err := pgtable.New(pool, pgtable.Options{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := claims.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	offsets, err := kafkapg.NewOffsets(pool, kafkapg.OffsetsOptions{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := offsets.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "CREATE TABLE "+pgx.Identifier{schema, "effects"}.Sanitize()+effectsDDL); err != nil {
		t.Fatal(err)
	}
	const partitions, n = 3, 4000
	topic := k.topic(t, "pgoff", partitions)
	k.dlq(t, topic)
	all := ids("o", n)
	recs := make([]kafkago.Message, 0, n)
	for i, id := range all {
		recs = append(recs, rec(i%partitions, id, id, "payload-"+id))
	}
	k.produce(t, topic, recs...)

	r := &crashRun{t: t, pool: pool, k: k, mode: "pgoffsets", topic: topic, group: testenv.Name("g"), schema: schema}
	kills, dups := r.killLoop(crashKills(8), n, []string{"tx", "batch"})
	r.handler = "batch"
	ends := k.ends(t, topic, partitions)
	dups += r.finish(pool, n, func() bool {
		stored, err := offsets.LoadOffsets(ctx, r.group, topic, []int{0, 1, 2})
		if err != nil {
			t.Fatal(err)
		}
		for p, end := range ends {
			if stored[p] != end {
				return false
			}
		}
		return true
	})

	extra, lost, unknown := oracleCheck(t, pool, schema, all)
	t.Logf("offsets in PostgreSQL: %d records, %d kills: %d duplicate effects, %d lost, %d unknown, %d records handled again after a restart",
		n, kills, extra, lost, unknown, dups)
	if extra != 0 || lost != 0 || unknown != 0 || dups != 0 {
		r.dumpLogs()
		t.Fatalf("%d duplicate effects, %d lost, %d unknown, %d records handled again", extra, lost, unknown, dups)
	}
	stored, err := offsets.LoadOffsets(ctx, r.group, topic, []int{0, 1, 2})
	if err != nil {
		t.Fatal(err)
	}
	for p, end := range ends {
		if stored[p] != end {
			t.Errorf("partition %d: stored position %d, want the end %d", p, stored[p], end)
		}
	}
}
