package kafkasql_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"os/signal"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/adapters/kafka/kafkasql"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/sqltable"
	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/testkit/kafkatest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// effects is a MariaDB table of effects without a unique constraint: an
// effect applied twice is a second row.
type effects struct {
	db    *sql.DB
	table string
}

func newEffects(t testing.TB, db *sql.DB) *effects {
	t.Helper()
	name := testenv.Name("eff")
	ctx := context.Background()
	if _, err := db.ExecContext(ctx, "CREATE TABLE `"+name+"` (id VARCHAR(64) NOT NULL, part INT NOT NULL, off BIGINT NOT NULL) ENGINE = InnoDB"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS `"+name+"`") })
	return &effects{db: db, table: "`" + name + "`"}
}

// insert is the effect: one row with the record's id, partition and offset.
func (e *effects) insert(ctx context.Context, tx *sql.Tx, msg *consumer.Message) error {
	p, _ := strconv.Atoi(msg.Metadata["kafka.partition"])
	o, _ := strconv.ParseInt(msg.Metadata["kafka.offset"], 10, 64)
	_, err := tx.ExecContext(ctx, "INSERT INTO "+e.table+" (id, part, off) VALUES (?, ?, ?)", msg.ID, p, o)
	return err
}

// count returns the number of ids applied and of rows.
func (e *effects) count(t testing.TB) (distinct, rows int) {
	t.Helper()
	if err := e.db.QueryRowContext(context.Background(), "SELECT COUNT(DISTINCT id), COUNT(*) FROM "+e.table).Scan(&distinct, &rows); err != nil {
		t.Fatal(err)
	}
	return distinct, rows
}

// oracle fails the test unless every id of want has exactly one effect and
// no other effect exists.
func (e *effects) oracle(t testing.TB, want []string) {
	t.Helper()
	rows, err := e.db.QueryContext(context.Background(), "SELECT id, COUNT(*) FROM "+e.table+" GROUP BY id ORDER BY id")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = rows.Close() }()
	var got, twice []string
	for rows.Next() {
		var (
			id string
			n  int
		)
		if err := rows.Scan(&id, &n); err != nil {
			t.Fatal(err)
		}
		got = append(got, id)
		if n > 1 {
			twice = append(twice, fmt.Sprintf("%s×%d", id, n))
		}
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	want = slices.Sorted(slices.Values(want))
	if len(twice) > 0 {
		t.Errorf("%d ids applied more than once: %v", len(twice), twice[:min(len(twice), 10)])
	}
	if !slices.Equal(got, want) {
		t.Errorf("%d ids applied, want %d", len(got), len(want))
	}
}

// newClaims is an sqltable store on MariaDB in a table of the test's own.
func newClaims(t testing.TB, db *sql.DB) *sqltable.Store {
	t.Helper()
	table := testenv.Name("pe")
	t.Cleanup(func() {
		_, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS `"+table+"`, `"+table+"_migrations`")
	})
	s, err := sqltable.New(db, sqltable.MySQL, sqltable.Options{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(context.Background()); err != nil {
		t.Fatal(err)
	}
	return s
}

func ids(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s-%06d", prefix, i)
	}
	return out
}

// produce writes ids to topic, id i to partition i % partitions, each with
// its id in the outbox message-id header.
func produce(t testing.TB, k *kafkatest.Env, topic string, partitions int, all []string) {
	t.Helper()
	w := &kafkago.Writer{
		Addr:         kafkago.TCP(k.Brokers...),
		Topic:        topic,
		Balancer:     kafkago.BalancerFunc(func(m kafkago.Message, _ ...int) int { return m.Partition }),
		RequiredAcks: kafkago.RequireAll,
		BatchSize:    1000,
		BatchTimeout: 5 * time.Millisecond,
		Transport:    k.Transport,
	}
	defer func() { _ = w.Close() }()
	recs := make([]kafkago.Message, len(all))
	for i, id := range all {
		recs[i] = kafkago.Message{Partition: i % partitions, Key: []byte(id), Value: []byte("payload-" + id),
			Headers: []kafkago.Header{{Key: outbox.HeaderMessageID, Value: []byte(id)}}}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if err := w.WriteMessages(ctx, recs...); err != nil {
		t.Fatalf("produce: %v", err)
	}
}

// committed returns the group's offsets of topic's partitions committed to
// Kafka (-1 for none).
func committed(t testing.TB, k *kafkatest.Env, group, topic string, partitions int) []int64 {
	t.Helper()
	ps := make([]int, partitions)
	out := make([]int64, partitions)
	for i := range ps {
		ps[i], out[i] = i, -1
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	res, err := k.Client.OffsetFetch(ctx, &kafkago.OffsetFetchRequest{GroupID: group, Topics: map[string][]int{topic: ps}})
	if err == nil {
		err = res.Error
	}
	if errors.Is(err, kafkago.GroupIdNotFound) {
		return out
	}
	if err != nil {
		t.Fatalf("offset fetch: %v", err)
	}
	for _, p := range res.Topics[topic] {
		if p.Error == nil {
			out[p.Partition] = p.CommittedOffset
		}
	}
	return out
}

func readerConfig(brokers []string, group, topic string, session time.Duration) kafkago.ReaderConfig {
	return kafkago.ReaderConfig{
		Brokers:           brokers,
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
}

// A partition assigned to a Consumer is consumed from the position stored
// in MariaDB, not from Kafka's committed offset (there is none) nor from the
// start; a partition with no stored position is consumed from the start.
// The stored positions then reach Kafka's committed offsets.
func TestResumeFromStoredPosition(t *testing.T) {
	k := kafkatest.New(t)
	db := testenv.MySQL(t, "")
	ctx := context.Background()
	claims := newClaims(t, db)
	b := backends[0]
	offsets := newOffsets(t, b, db, "")
	e := newEffects(t, db)
	const partitions, perPartition = 3, 10
	topic := k.Topic(t, "kafkasql", partitions)
	dlq := topic + "_dlq"
	k.CreateTopic(t, dlq, 1)
	group := testenv.Name("g")
	all := ids("r", partitions*perPartition)
	produce(t, k, topic, partitions, all)
	// Partition 0 is done up to offset 4, partition 1 up to 7: their
	// records before those are never handed to the handler.
	if err := offsets.SaveOffsets(ctx, group, map[string]map[int]int64{topic: {0: 4, 1: 7}}); err != nil {
		t.Fatal(err)
	}
	h, err := kafkasql.Transactional(claims, offsets, consumer.TxOptions{Scope: "test/resume"}, e.insert)
	if err != nil {
		t.Fatal(err)
	}
	c, err := idemkafka.NewConsumer(readerConfig(k.Brokers, group, topic, 10*time.Second), h, idemkafka.ConsumerOptions{
		Offsets:         offsets,
		DeadLetterTopic: dlq,
		CommitInterval:  100 * time.Millisecond,
		Telemetry: consumer.Telemetry{
			Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- c.Run(rctx) }()
	var stopOnce sync.Once
	stop := func() {
		stopOnce.Do(func() {
			cancel()
			if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("Run: %v", err)
			}
		})
	}
	defer stop()

	want := fmt.Sprint([]int64{perPartition, perPartition, perPartition})
	// Read with SQL of the test's own, not with the LoadOffsets under test.
	stored := func() string {
		got := make([]int64, partitions)
		for p := range got {
			err := db.QueryRowContext(ctx, "SELECT next_offset FROM "+offsets.Table()+" WHERE group_id = ? AND topic = ? AND partition_id = ?",
				group, topic, p).Scan(&got[p])
			if err != nil && !errors.Is(err, sql.ErrNoRows) {
				t.Fatal(err)
			}
		}
		return fmt.Sprint(got)
	}
	testenv.Eventually(t, 60*time.Second, "the stored positions to reach "+want, func() bool { return stored() == want })
	testenv.Eventually(t, 60*time.Second, "Kafka's committed offsets to reach "+want, func() bool {
		return fmt.Sprint(committed(t, k, group, topic, partitions)) == want
	})
	stop()

	rows, err := db.QueryContext(ctx, "SELECT part, MIN(off), COUNT(*) FROM "+e.table+" GROUP BY part ORDER BY part")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = rows.Close() }()
	var got []string
	for rows.Next() {
		var p, first, n int
		if err := rows.Scan(&p, &first, &n); err != nil {
			t.Fatal(err)
		}
		got = append(got, fmt.Sprintf("%d:%d+%d", p, first, n))
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	// partition:first offset handled+records handled
	if s := strings.Join(got, " "); s != "0:4+6 1:7+3 2:0+10" {
		t.Fatalf("handled %s, want 0:4+6 1:7+3 2:0+10", s)
	}
	var wantIDs []string
	for i, id := range all {
		p, off := i%partitions, i/partitions
		if (p == 0 && off < 4) || (p == 1 && off < 7) {
			continue
		}
		wantIDs = append(wantIDs, id)
	}
	e.oracle(t, wantIDs)
}

// The crash test runs the consumer in a child process (this test binary,
// re-executed with childEnv set; TestMain dispatches) that SIGKILLs itself,
// in turn inside the handler's transaction (after the effect's INSERT,
// before the commit) and just after the transaction committed (before any
// commit to Kafka). Kafka never receives a commit before the last, clean
// stop, except the positions a member finds stored when a partition is
// assigned to it: every restart finds Kafka behind the positions in MariaDB.
const (
	childEnv        = "IDEM_KAFKASQL_TEST_CHILD" // the kill point: "in_tx", "after_commit" or "none"
	childBrokersEnv = "IDEM_KAFKASQL_TEST_BROKERS"
	childTopicEnv   = "IDEM_KAFKASQL_TEST_TOPIC"
	childGroupEnv   = "IDEM_KAFKASQL_TEST_GROUP"
	childTablesEnv  = "IDEM_KAFKASQL_TEST_TABLES" // claims,offsets,effects
	childAfterEnv   = "IDEM_KAFKASQL_TEST_AFTER"  // records committed before the kill
	childReadyLine  = "idem-child: ready"
	childDupLine    = "idem-child: duplicate"
)

// childMain is the consumer child process. It runs until SIGTERM (then
// returns 0 after a clean stop) or until it SIGKILLs itself.
func childMain() int {
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "idem-child:", err)
		return 3
	}
	point := os.Getenv(childEnv)
	after, _ := strconv.ParseInt(os.Getenv(childAfterEnv), 10, 64)
	tables := strings.Split(os.Getenv(childTablesEnv), ",")
	if len(tables) != 3 {
		return fail(fmt.Errorf("%s=%q", childTablesEnv, os.Getenv(childTablesEnv)))
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	db, err := sql.Open("mysql", testenv.MySQLDSN())
	if err != nil {
		return fail(err)
	}
	defer func() { _ = db.Close() }()
	claims, err := sqltable.New(db, sqltable.MySQL, sqltable.Options{Table: tables[0]})
	if err != nil {
		return fail(err)
	}
	offsets, err := kafkasql.New(db, kafkasql.MySQL, kafkasql.Options{Table: tables[1]})
	if err != nil {
		return fail(err)
	}
	e := &effects{db: db, table: "`" + tables[2] + "`"}
	var committedTx atomic.Int64
	die := func(at string) {
		if point == at && committedTx.Load() >= after {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {} // the signal is on its way
		}
	}
	h, err := kafkasql.Transactional(claims, offsets, consumer.TxOptions{
		Scope: "test/crash",
		Telemetry: consumer.Telemetry{OnOutcome: func(_ context.Context, r consumer.Report) {
			switch r.Outcome {
			case consumer.OutcomeDuplicate:
				fmt.Println(childDupLine, r.Message.ID)
			case consumer.OutcomeCompleted:
				committedTx.Add(1)
				die("after_commit")
			}
		}},
	}, func(ctx context.Context, tx *sql.Tx, msg *consumer.Message) error {
		if err := e.insert(ctx, tx, msg); err != nil {
			return err
		}
		die("in_tx")
		return nil
	})
	if err != nil {
		return fail(err)
	}
	c, err := idemkafka.NewConsumer(readerConfig(strings.Split(os.Getenv(childBrokersEnv), ","), os.Getenv(childGroupEnv), os.Getenv(childTopicEnv), 1500*time.Millisecond), h,
		idemkafka.ConsumerOptions{
			Offsets:         offsets,
			DeadLetterTopic: os.Getenv(childTopicEnv) + "_dlq",
			// No commit to Kafka while records are handled: only the
			// positions in MariaDB move, in the handler's transactions.
			CommitEvery:    1 << 20,
			CommitInterval: time.Hour,
			Telemetry: consumer.Telemetry{
				Logger: slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})),
			},
		})
	if err != nil {
		return fail(err)
	}
	fmt.Println(childReadyLine) // SIGTERM now stops the child cleanly
	if err := c.Run(ctx); err != nil && !errors.Is(err, context.Canceled) {
		return fail(err)
	}
	return 0
}

// Consumers with their positions in MariaDB (kafkasql.Transactional) and
// their claims in sqltable are SIGKILLed in turn, inside the transaction and
// just after its commit, with Kafka's committed offsets behind; then a last
// one runs to the end. Every record has its effect exactly once, and no
// record whose transaction committed is handed to a handler again (no
// duplicate claim): each restart resumes at the stored positions.
func TestCrashOracle(t *testing.T) {
	k := kafkatest.New(t)
	if k.Real {
		t.Skip("the child's session timeout (1.5s) is below a real broker's group.min.session.timeout.ms")
	}
	db := testenv.MySQL(t, "")
	ctx := context.Background()
	claims := newClaims(t, db)
	offsets := newOffsets(t, backends[0], db, "")
	e := newEffects(t, db)
	const partitions, n = 3, 600
	topic := k.Topic(t, "kafkasqlcrash", partitions)
	k.CreateTopic(t, topic+"_dlq", 1)
	group := testenv.Name("g")
	all := ids("c", n)
	produce(t, k, topic, partitions, all)
	tables := strings.Join([]string{
		strings.Trim(claims.Table(), "`"), strings.Trim(offsets.Table(), "`"), strings.Trim(e.table, "`"),
	}, ",")

	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	var dups atomic.Int64
	start := func(point string, after int) (*childproc.Proc, chan struct{}) {
		cmd := exec.Command(exe, "-test.run=^$")
		cmd.Env = append(os.Environ(),
			childEnv+"="+point,
			childBrokersEnv+"="+strings.Join(k.Brokers, ","),
			childTopicEnv+"="+topic,
			childGroupEnv+"="+group,
			childTablesEnv+"="+tables,
			childAfterEnv+"="+strconv.Itoa(after),
		)
		ready := make(chan struct{})
		var once atomic.Bool
		p, err := childproc.Start(cmd, 8<<10, func(line string) {
			switch {
			case line == childReadyLine:
				if once.CompareAndSwap(false, true) {
					close(ready)
				}
			case strings.HasPrefix(line, childDupLine):
				dups.Add(1)
			}
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.Kill(); <-p.Exited() })
		return p, ready
	}

	points := []string{"in_tx", "after_commit", "in_tx", "after_commit"}
	for i, point := range points {
		before, _ := e.count(t)
		p, _ := start(point, 60+20*i)
		select {
		case <-p.Exited():
		case <-time.After(2 * time.Minute):
			p.Kill()
			<-p.Exited()
			t.Fatalf("child %d (%s) did not kill itself within 2 minutes%s", i, point, p.StderrTail())
		}
		if !p.DiedOfSIGKILL() {
			t.Fatalf("child %d (%s) exited: %v%s", i, point, p.ExitErr(), p.StderrTail())
		}
		after, rows := e.count(t)
		t.Logf("child %d killed %s: %d ids applied (+%d), %d effect rows", i, point, after, after-before, rows)
		if after <= before {
			t.Fatalf("child %d applied nothing before its kill", i)
		}
	}
	// A Consumer commits to Kafka only the positions it found stored when
	// a partition was assigned to it: Kafka lags behind MariaDB by what
	// the killed child committed, and a restart from Kafka's offsets would
	// hand those records to a handler again.
	kafkaAt := committed(t, k, group, topic, partitions)
	storedAt, err := offsets.LoadOffsets(ctx, group, topic, []int{0, 1, 2})
	if err != nil {
		t.Fatal(err)
	}
	var behind int64
	for p, off := range kafkaAt {
		behind += storedAt[p] - max(off, 0)
	}
	t.Logf("before the last child: Kafka's committed offsets %v, the stored positions %v", kafkaAt, storedAt)
	if behind <= 0 {
		t.Fatalf("Kafka's committed offsets %v are not behind the stored positions %v: the test needs them to be", kafkaAt, storedAt)
	}

	p, ready := start("none", 0)
	testenv.Eventually(t, 2*time.Minute, "every record applied", func() bool {
		select {
		case <-p.Exited():
			t.Fatalf("the last child exited: %v%s", p.ExitErr(), p.StderrTail())
		default:
		}
		got, _ := e.count(t)
		return got == n
	})
	want := fmt.Sprint([]int64{n / partitions, n / partitions, n / partitions})
	testenv.Eventually(t, time.Minute, "the stored positions to reach the ends "+want, func() bool {
		got, err := offsets.LoadOffsets(ctx, group, topic, []int{0, 1, 2})
		if err != nil {
			t.Fatal(err)
		}
		return fmt.Sprint([]int64{got[0], got[1], got[2]}) == want
	})
	<-ready
	if err := p.Cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.Exited():
	case <-time.After(time.Minute):
		t.Fatalf("the last child did not stop within a minute of SIGTERM%s", p.StderrTail())
	}
	if err := p.Err(); err != nil {
		t.Fatalf("the last child: %v%s", err, p.StderrTail())
	}
	if got := committed(t, k, group, topic, partitions); fmt.Sprint(got) != want {
		t.Errorf("Kafka's committed offsets %v after the clean stop, want %s", got, want)
	}
	distinct, rows := e.count(t)
	t.Logf("%d records, %d kills: %d ids applied, %d effect rows, %d records handed to a handler again", n, len(points), distinct, rows, dups.Load())
	e.oracle(t, all)
	if d := dups.Load(); d != 0 {
		t.Errorf("%d records whose transaction committed were handed to a handler again: the restarts did not resume at the stored positions", d)
	}
}
