package sqloutbox_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/sqloutbox"
)

// effects is the oracle on MariaDB: one row per message a publisher
// confirmed, in a table with no unique constraint, numbered in the order
// the confirmations happened.
type effects struct {
	db    *sql.DB
	table string
}

func newEffects(t testing.TB, db *sql.DB) *effects {
	t.Helper()
	e := &effects{db: db, table: testenv.Name("idemtest_eff")}
	dropTables(t, db, e.table)
	if _, err := db.ExecContext(testenv.Ctx(t), "CREATE TABLE `"+e.table+
		"` (n BIGINT NOT NULL AUTO_INCREMENT PRIMARY KEY, msg_id CHAR(36) NOT NULL, payload VARCHAR(255) NOT NULL, relay INT NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	return e
}

// effPublisher is a publisher whose broker is the effects table: it
// confirms a batch once its rows are inserted, and fails the messages
// poison names. It is safe for concurrent use.
type effPublisher struct {
	e      *effects
	relay  int
	poison func(m *outbox.Message) bool
}

func (p *effPublisher) Publish(ctx context.Context, msgs []*outbox.Message) error {
	var (
		pe   outbox.PublishError
		args []any
		rows []string
	)
	for i, m := range msgs {
		if p.poison != nil && p.poison(m) {
			if pe.Failed == nil {
				pe.Failed = map[int]error{}
			}
			pe.Failed[i] = errors.New("rejected by the broker")
			continue
		}
		rows = append(rows, "(?, ?, ?)")
		args = append(args, m.ID, string(m.Payload), p.relay)
	}
	if len(rows) > 0 {
		if _, err := p.e.db.ExecContext(ctx, "INSERT INTO `"+p.e.table+"` (msg_id, payload, relay) VALUES "+strings.Join(rows, ", "), args...); err != nil {
			return err
		}
	}
	if pe.Failed != nil {
		return &pe
	}
	return nil
}

// tally reads the effects: per message id the number of effects, the
// payloads in confirmation order, and the effects per relay.
func (e *effects) tally(t testing.TB) (perID map[string]int, payloads []string, perRelay map[int]int) {
	t.Helper()
	rows, err := e.db.QueryContext(context.Background(), "SELECT msg_id, payload, relay FROM `"+e.table+"` ORDER BY n")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = rows.Close() }()
	perID, perRelay = map[string]int{}, map[int]int{}
	for rows.Next() {
		var (
			id, p string
			r     int
		)
		if err := rows.Scan(&id, &p, &r); err != nil {
			t.Fatal(err)
		}
		perID[id]++
		payloads = append(payloads, p)
		perRelay[r]++
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return perID, payloads, perRelay
}

func (e *effects) count(t testing.TB) int {
	t.Helper()
	var n int
	if err := e.db.QueryRowContext(context.Background(), "SELECT COUNT(DISTINCT msg_id) FROM `"+e.table+"`").Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// Three relays of two sessions each publish while eight producers enqueue,
// some of them rolling back. Every committed message is published exactly
// once, in per-key order, nothing of a rolled back transaction is, and a
// message the broker always rejects is parked dead after MaxAttempts while
// every other message, its key's later ones included, goes out; a message
// published at its third attempt still comes before its key's later ones.
func TestMariaDBRelaysOracle(t *testing.T) {
	t.Parallel()
	db := mariaDB(t)
	ob := newOutbox(t, db, sqloutbox.MySQL, sqloutbox.Options{})
	eff := newEffects(t, db)
	const (
		producers   = 8
		keys        = 40
		perKey      = 25
		keyless     = 100
		maxAttempts = 4
		poison      = "k007/5"
		flaky       = "f/1" // rejected at its first two attempts
	)
	isPoison := func(m *outbox.Message) bool {
		p := string(m.Payload)
		return p == poison || (p == flaky && m.Attempt < 3)
	}
	// The flaky message's key has later messages before the relays start.
	committed := map[string]string{} // id -> payload
	for n := range 5 {
		m := msg("orders", "f", fmt.Sprintf("f/%d", n))
		committed[enqueue(t, db, ob, m)[0]] = string(m.Payload)
	}
	for i := range 3 {
		r, err := sqloutbox.NewRelay(ob, &effPublisher{e: eff, relay: i, poison: isPoison}, fastRelay(sqloutbox.RelayOptions{
			Sessions: 2, BatchSize: 50, MaxAttempts: maxAttempts, CleanupInterval: -1,
		}))
		if err != nil {
			t.Fatal(err)
		}
		start(t, r)
	}

	ctx := testenv.Ctx(t)
	var (
		mu         sync.Mutex
		rolledBack = map[string]bool{}
		wg         sync.WaitGroup
	)
	errs := make(chan error, producers)
	for p := range producers {
		wg.Go(func() {
			tx := 0
			for n := range perKey {
				for k := p; k < keys; k += producers {
					key := fmt.Sprintf("k%03d", k)
					tx++
					if tx%7 == 0 { // a business transaction that rolls back
						ids, err := enqueueTx(ctx, db, ob, false, msg("orders", key, "rolledback"))
						if err != nil {
							errs <- err
							return
						}
						mu.Lock()
						rolledBack[ids[0]] = true
						mu.Unlock()
					}
					ms := []outbox.Message{msg("orders", key, fmt.Sprintf("%s/%d", key, n))}
					if k == p && n < keyless/producers {
						ms = append(ms, msg("orders", "", fmt.Sprintf("nokey-%d/%d", p, n)))
					}
					ids, err := enqueueTx(ctx, db, ob, true, ms...)
					if err != nil {
						errs <- err
						return
					}
					mu.Lock()
					for i, id := range ids {
						committed[id] = string(ms[i].Payload)
					}
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	want := len(committed) - 1 // all but the poison
	testenv.Eventually(t, 120*time.Second, "every committed message published", func() bool { return eff.count(t) >= want })
	testenv.Eventually(t, 30*time.Second, "no row pending", func() bool { return countState(t, db, ob, 0) == 0 })

	perID, payloads, perRelay := eff.tally(t)
	var lost, dups, unexpected int
	for id, p := range committed {
		switch n := perID[id]; {
		case p == poison && n != 0:
			t.Errorf("the poison message was published %d times", n)
		case p == poison:
		case n == 0:
			lost++
		case n > 1:
			dups += n - 1
		}
	}
	for id := range perID {
		if _, ok := committed[id]; !ok {
			unexpected++
			if rolledBack[id] {
				t.Errorf("message %s of a rolled back transaction published", id)
			}
		}
	}
	var keyed []string
	for _, p := range payloads {
		if !strings.HasPrefix(p, "nokey-") {
			keyed = append(keyed, p)
		}
	}
	bad := orderViolations(keyed)
	t.Logf("3 relays × 2 sessions, %d committed messages on %d keys + keyless, %d rolled back: %d lost, %d duplicates, %d unexpected, %d order violations; effects per relay %v",
		len(committed), keys, len(rolledBack), lost, dups, unexpected, len(bad), perRelay)
	if lost+dups+unexpected > 0 || len(bad) > 0 {
		t.Fatalf("lost %d, duplicates %d, unexpected %d, order violations %v", lost, dups, unexpected, bad)
	}
	var (
		state, attempts int
		lastErr         sql.NullString
	)
	if err := db.QueryRowContext(ctx, "SELECT state, attempts, last_error FROM "+ob.Table()+" WHERE payload = ?", poison).Scan(&state, &attempts, &lastErr); err != nil {
		t.Fatal(err)
	}
	if state != 2 || attempts != maxAttempts || !strings.Contains(lastErr.String, "rejected") {
		t.Fatalf("poison row: state %d, attempts %d, last_error %q; want dead after %d attempts", state, attempts, lastErr.String, maxAttempts)
	}
	if n := countState(t, db, ob, 1); n != want {
		t.Fatalf("%d rows published, want %d", n, want)
	}
}

// A relay whose connection is killed after the broker confirmed a batch and
// before the rows were marked loses its claim: the batch is published again,
// with the same ids, and nothing is lost or reordered.
func TestMariaDBRelayKilledBetweenPublishAndMark(t *testing.T) {
	t.Parallel()
	db := mariaDB(t)
	ob := newOutbox(t, db, sqloutbox.MySQL, sqloutbox.Options{})
	const keys, perKey = 10, 3
	var want []string
	for n := range perKey {
		for k := range keys {
			key := fmt.Sprintf("k%02d", k)
			want = append(want, enqueue(t, db, ob, msg("t", key, fmt.Sprintf("%s/%d", key, n)))...)
		}
	}
	pub := &memPublisher{}
	r, err := sqloutbox.NewRelay(ob, pub, fastRelay(sqloutbox.RelayOptions{BatchSize: 5, CleanupInterval: -1}))
	if err != nil {
		t.Fatal(err)
	}
	var (
		killed   atomic.Bool
		killedMu sync.Mutex
		batch    []string
		hookErr  error
	)
	sqloutbox.SetAfterPublish(r, func(tx *sql.Tx, msgs []*outbox.Message, err error) {
		if err != nil || !killed.CompareAndSwap(false, true) {
			return
		}
		killedMu.Lock()
		defer killedMu.Unlock()
		for _, m := range msgs {
			batch = append(batch, m.ID)
		}
		var id int64
		if hookErr = tx.QueryRowContext(context.Background(), "SELECT CONNECTION_ID()").Scan(&id); hookErr != nil {
			return
		}
		_, hookErr = db.ExecContext(context.Background(), fmt.Sprintf("KILL CONNECTION %d", id))
	})
	start(t, r)
	testenv.Eventually(t, 60*time.Second, "every row marked published", func() bool { return countState(t, db, ob, 1) == len(want) })
	killedMu.Lock()
	defer killedMu.Unlock()
	if hookErr != nil {
		t.Fatalf("killing the relay's connection: %v", hookErr)
	}
	if len(batch) == 0 {
		t.Fatal("no batch was published")
	}
	got := pub.publishedIDs()
	inBatch := map[string]bool{}
	for _, id := range batch {
		inBatch[id] = true
		if got[id] != 2 {
			t.Errorf("message %s of the killed batch published %d times, want 2 (once more with the same id)", id, got[id])
		}
	}
	for _, id := range want {
		if !inBatch[id] && got[id] != 1 {
			t.Errorf("message %s published %d times, want 1", id, got[id])
		}
	}
	var payloads []string
	for _, m := range pub.published() {
		payloads = append(payloads, string(m.Payload))
	}
	if bad := orderViolations(payloads); len(bad) > 0 {
		t.Fatalf("per-key order violated: %v", bad)
	}
	t.Logf("killed batch of %d re-published with the same ids; %d messages in all", len(batch), len(want))
}

// Enqueue on MySQL locks the key until the transaction ends: a second
// transaction enqueueing the same key waits, so the key's rows are
// numbered in commit order.
func TestMariaDBEnqueueOrdersKeyByCommit(t *testing.T) {
	t.Parallel()
	db := mariaDB(t)
	ob := newOutbox(t, db, sqloutbox.MySQL, sqloutbox.Options{})
	ctx := testenv.Ctx(t)
	tx1, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx1.Rollback() }()
	if _, err := ob.Enqueue(ctx, tx1, msg("t", "k", "a1")); err != nil {
		t.Fatal(err)
	}
	tx2, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx2.Rollback() }()
	var conn2 int64
	if err := tx2.QueryRowContext(ctx, "SELECT CONNECTION_ID()").Scan(&conn2); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		_, err := ob.Enqueue(ctx, tx2, msg("t", "k", "b1"))
		if err == nil {
			err = tx2.Commit()
		}
		done <- err
	}()
	testenv.Eventually(t, 30*time.Second, "the second transaction waiting on the key", func() bool {
		waits, err := testenv.MySQLLockWaits(ctx, db)
		if err != nil {
			t.Fatal(err)
		}
		for _, w := range waits {
			if w.Thread == conn2 {
				return true
			}
		}
		return false
	})
	if _, err := ob.Enqueue(ctx, tx1, msg("t", "k", "a2"), msg("t", "other", "o1")); err != nil {
		t.Fatal(err)
	}
	if err := tx1.Commit(); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	rows, err := db.QueryContext(ctx, "SELECT payload FROM "+ob.Table()+" WHERE msg_key = 'k' ORDER BY seq")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = rows.Close() }()
	var got []string
	for rows.Next() {
		var p string
		if err := rows.Scan(&p); err != nil {
			t.Fatal(err)
		}
		got = append(got, p)
	}
	if strings.Join(got, ",") != "a1,a2,b1" {
		t.Fatalf("key k in seq order: %v, want a1,a2,b1 (commit order)", got)
	}
}

// Cleanup deletes published rows past the retention in batches of
// CleanupBatch, keeps pending and dead rows, and deletes dead rows only
// with a DeadRetention.
func TestCleanupInBatches(t *testing.T) {
	t.Parallel()
	for _, d := range []sqloutbox.Dialect{sqloutbox.MySQL, sqloutbox.SQLite} {
		t.Run(d.String(), func(t *testing.T) {
			var db *sql.DB
			if d == sqloutbox.MySQL {
				db = mariaDB(t)
			} else {
				db = sqliteDB(t)
			}
			ob := newOutbox(t, db, d, sqloutbox.Options{Retention: time.Millisecond, CleanupBatch: 10})
			var msgs []outbox.Message
			for i := range 25 {
				msgs = append(msgs, msg("t", fmt.Sprintf("k%d", i), "x"))
			}
			msgs = append(msgs, msg("t", "dead", "poison"))
			enqueue(t, db, ob, msgs...)
			pub := &memPublisher{fail: func(m *outbox.Message) error {
				if string(m.Payload) == "poison" {
					return errors.New("no")
				}
				return nil
			}}
			r, err := sqloutbox.NewRelay(ob, pub, fastRelay(sqloutbox.RelayOptions{MaxAttempts: 1, CleanupInterval: -1}))
			if err != nil {
				t.Fatal(err)
			}
			rr := start(t, r)
			testenv.Eventually(t, 30*time.Second, "published and dead", func() bool {
				return countState(t, db, ob, 1) == 25 && countState(t, db, ob, 2) == 1
			})
			rr.stop(t)
			enqueue(t, db, ob, msg("t", "later", "pending"))
			time.Sleep(5 * time.Millisecond) // past the 1ms retention
			var batches []int64
			sqloutbox.SetAfterCleanupBatch(ob, func(n int64) { batches = append(batches, n) })
			n, err := ob.Cleanup(testenv.Ctx(t))
			if err != nil {
				t.Fatal(err)
			}
			if n != 25 || fmt.Sprint(batches) != "[10 10 5]" {
				t.Fatalf("Cleanup deleted %d in batches %v, want 25 in [10 10 5]", n, batches)
			}
			if countState(t, db, ob, 0) != 1 || countState(t, db, ob, 2) != 1 {
				t.Fatal("Cleanup deleted a pending or dead row")
			}
			withDead, err := sqloutbox.New(db, d, sqloutbox.Options{Table: ob.Options().Table, Retention: time.Millisecond, DeadRetention: time.Millisecond})
			if err != nil {
				t.Fatal(err)
			}
			if n, err := withDead.Cleanup(testenv.Ctx(t)); err != nil || n != 1 {
				t.Fatalf("Cleanup with DeadRetention deleted %d, %v; want the dead row", n, err)
			}
		})
	}
}

// A dead message made pending again by RequeueDead is published.
func TestRequeueDead(t *testing.T) {
	t.Parallel()
	db := mariaDB(t)
	ob := newOutbox(t, db, sqloutbox.MySQL, sqloutbox.Options{})
	var healed atomic.Bool
	pub := &memPublisher{fail: func(*outbox.Message) error {
		if healed.Load() {
			return nil
		}
		return errors.New("no")
	}}
	ids := enqueue(t, db, ob, msg("t", "k", "k/0"), msg("t", "k2", "k2/0"))
	r, err := sqloutbox.NewRelay(ob, pub, fastRelay(sqloutbox.RelayOptions{MaxAttempts: 2, CleanupInterval: -1}))
	if err != nil {
		t.Fatal(err)
	}
	start(t, r)
	testenv.Eventually(t, 30*time.Second, "both dead", func() bool { return countState(t, db, ob, 2) == 2 })
	healed.Store(true)
	n, err := ob.RequeueDead(testenv.Ctx(t), ids[0])
	if err != nil || n != 1 {
		t.Fatalf("RequeueDead = %d, %v", n, err)
	}
	testenv.Eventually(t, 30*time.Second, "the requeued message published", func() bool { return pub.publishedIDs()[ids[0]] == 1 })
	if countState(t, db, ob, 2) != 1 {
		t.Fatal("the message not requeued left the dead state")
	}
}

// Run returns at once, with an error saying what to do, when the table
// does not exist.
func TestRunWithoutTable(t *testing.T) {
	t.Parallel()
	for _, d := range []sqloutbox.Dialect{sqloutbox.MySQL, sqloutbox.SQLite} {
		t.Run(d.String(), func(t *testing.T) {
			var db *sql.DB
			if d == sqloutbox.MySQL {
				db = mariaDB(t)
			} else {
				db = sqliteDB(t)
			}
			ob, err := sqloutbox.New(db, d, sqloutbox.Options{Table: testenv.Name("idemtest_none")})
			if err != nil {
				t.Fatal(err)
			}
			r, err := sqloutbox.NewRelay(ob, &memPublisher{}, fastRelay(sqloutbox.RelayOptions{CleanupInterval: -1}))
			if err != nil {
				t.Fatal(err)
			}
			err = r.Run(testenv.Ctx(t))
			if err == nil || !strings.Contains(err.Error(), "Migrate") {
				t.Fatalf("Run: %v, want an error pointing to Migrate", err)
			}
		})
	}
}

// A relay stopped between publish and mark finishes the batch in flight
// (within ShutdownTimeout): its rows are marked, and a relay started
// afterwards publishes the rest, each message once.
func TestMariaDBRelayStoppedBetweenPublishAndMark(t *testing.T) {
	t.Parallel()
	db := mariaDB(t)
	ob := newOutbox(t, db, sqloutbox.MySQL, sqloutbox.Options{})
	var want []string
	for k := range 20 {
		want = append(want, enqueue(t, db, ob, msg("t", fmt.Sprintf("k%02d", k), "x"))...)
	}
	pub := &memPublisher{}
	r, err := sqloutbox.NewRelay(ob, pub, fastRelay(sqloutbox.RelayOptions{BatchSize: 5, CleanupInterval: -1}))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(testenv.Ctx(t))
	defer cancel()
	var batch []string
	sqloutbox.SetAfterPublish(r, func(_ *sql.Tx, msgs []*outbox.Message, _ error) {
		if batch == nil {
			for _, m := range msgs {
				batch = append(batch, m.ID)
			}
			cancel()
		}
	})
	if err := r.Run(ctx); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if len(batch) != 5 {
		t.Fatalf("first batch of %d, want 5", len(batch))
	}
	if n := countState(t, db, ob, 1); n != len(batch) {
		t.Fatalf("%d rows marked after the stop, want the %d of the batch in flight", n, len(batch))
	}
	sqloutbox.SetAfterPublish(r, nil)
	start(t, r)
	testenv.Eventually(t, 30*time.Second, "every row marked published", func() bool { return countState(t, db, ob, 1) == len(want) })
	got := pub.publishedIDs()
	for _, id := range want {
		if got[id] != 1 {
			t.Errorf("message %s published %d times, want 1", id, got[id])
		}
	}
}
