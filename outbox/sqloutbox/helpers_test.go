package sqloutbox_test

import (
	"context"
	"database/sql"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	_ "github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/stdlib"
	_ "modernc.org/sqlite"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/outboxtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/sqloutbox"
)

// mysqlDSN is the test MariaDB (or MySQL), IDEM_TEST_MYSQL_DSN when set.
func mysqlDSN() string {
	if v := os.Getenv("IDEM_TEST_MYSQL_DSN"); v != "" {
		return v
	}
	return "root@tcp(127.0.0.1:3306)/test?parseTime=true"
}

// mariaDB opens the test MariaDB, closed when the test ends.
func mariaDB(t testing.TB) *sql.DB {
	t.Helper()
	db, err := sql.Open("mysql", mysqlDSN())
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := db.PingContext(ctx); err != nil {
		_ = db.Close()
		testenv.Unavailable(t, fmt.Sprintf("MariaDB at %s is unreachable: %v (start it with `make up`, or see README.md)", mysqlDSN(), err))
	}
	db.SetMaxOpenConns(32)
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// sqliteDB opens a fresh SQLite database in the test's temporary directory.
func sqliteDB(t testing.TB) *sql.DB {
	t.Helper()
	path := filepath.Join(t.TempDir(), "outbox.db")
	db, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = db.Close() })
	return db
}

// postgresDB opens the test PostgreSQL through database/sql (pgx's stdlib
// driver) and returns it with a fresh schema, dropped when the test ends.
func postgresDB(t testing.TB) (*sql.DB, string) {
	t.Helper()
	pool := testenv.Pool(t, 8)
	schema := testenv.Schema(t, pool)
	db := stdlib.OpenDBFromPool(pool)
	t.Cleanup(func() { _ = db.Close() })
	return db, schema
}

// newOutbox creates an outbox on a fresh table (dropped after the test on
// MariaDB) and migrates it.
func newOutbox(t testing.TB, db *sql.DB, d sqloutbox.Dialect, opts sqloutbox.Options) *sqloutbox.Outbox {
	t.Helper()
	if opts.Table == "" {
		opts.Table = testenv.Name("idemtest_ob")
	}
	if opts.Logger == nil {
		opts.Logger = quiet()
	}
	ob, err := sqloutbox.New(db, d, opts)
	if err != nil {
		t.Fatal(err)
	}
	if d == sqloutbox.MySQL {
		dropTables(t, db, opts.Table, opts.Table+"_keys", opts.Table+"_migrations")
	}
	if err := ob.Migrate(testenv.Ctx(t)); err != nil {
		t.Fatal(err)
	}
	return ob
}

// dropTables drops MariaDB tables when the test ends.
func dropTables(t testing.TB, db *sql.DB, names ...string) {
	t.Helper()
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		for _, n := range names {
			if _, err := db.ExecContext(ctx, "DROP TABLE IF EXISTS `"+n+"`"); err != nil {
				t.Errorf("drop %s: %v", n, err)
			}
		}
	})
}

// enqueue writes msgs in one committed transaction.
func enqueue(t testing.TB, db *sql.DB, ob *sqloutbox.Outbox, msgs ...outbox.Message) []string {
	t.Helper()
	ids, err := enqueueTx(testenv.Ctx(t), db, ob, true, msgs...)
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

// enqueueTx writes msgs in one transaction that commits, or rolls back
// when commit is false.
func enqueueTx(ctx context.Context, db *sql.DB, ob *sqloutbox.Outbox, commit bool, msgs ...outbox.Message) ([]string, error) {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return nil, err
	}
	ids, err := ob.Enqueue(ctx, tx, msgs...)
	if err != nil {
		_ = tx.Rollback()
		return nil, err
	}
	if !commit {
		return ids, tx.Rollback()
	}
	return ids, tx.Commit()
}

// fastRelay are relay options that make tests quick.
func fastRelay(o sqloutbox.RelayOptions) sqloutbox.RelayOptions {
	if o.PollInterval == 0 {
		o.PollInterval = 20 * time.Millisecond
	}
	if o.Backoff == (consumer.Backoff{}) {
		o.Backoff = consumer.Backoff{Initial: 10 * time.Millisecond, Max: 50 * time.Millisecond}
	}
	if o.ReconnectBackoff == (consumer.Backoff{}) {
		o.ReconnectBackoff = consumer.Backoff{Initial: 10 * time.Millisecond, Max: 100 * time.Millisecond}
	}
	if o.Logger == nil {
		o.Logger = quiet()
	}
	return o
}

// memPublisher records what it publishes. fail, when set, fails single
// messages.
type memPublisher struct {
	mu   sync.Mutex
	got  []outbox.Message // confirmed, in order
	fail func(m *outbox.Message) error
}

func (p *memPublisher) Publish(_ context.Context, msgs []*outbox.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	var pe outbox.PublishError
	for i, m := range msgs {
		if p.fail != nil {
			if err := p.fail(m); err != nil {
				if pe.Failed == nil {
					pe.Failed = map[int]error{}
				}
				pe.Failed[i] = err
				continue
			}
		}
		c := *m
		c.Headers = maps.Clone(m.Headers)
		p.got = append(p.got, c)
	}
	if pe.Failed != nil {
		return &pe
	}
	return nil
}

func (p *memPublisher) published() []outbox.Message {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]outbox.Message(nil), p.got...)
}

func (p *memPublisher) publishedIDs() map[string]int {
	out := map[string]int{}
	for _, m := range p.published() {
		out[m.ID]++
	}
	return out
}

// countState is the number of rows in state (0 pending, 1 published, 2
// dead).
func countState(t testing.TB, db *sql.DB, ob *sqloutbox.Outbox, state int) int {
	t.Helper()
	var n int
	if err := db.QueryRowContext(context.Background(), "SELECT COUNT(*) FROM "+ob.Table()+" WHERE state = ?", state).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// orderViolations returns, for messages whose payload is "<key>/<n>" and
// which must arrive in increasing n per key, the arrivals whose first
// delivery comes before the first delivery of an earlier n of its key.
func orderViolations(payloads []string) []string {
	last := map[string]int{}
	seen := map[string]bool{}
	var bad []string
	for _, p := range payloads {
		if seen[p] {
			continue // a repeat of a delivered message
		}
		seen[p] = true
		i := strings.LastIndexByte(p, '/')
		var n int
		_, _ = fmt.Sscanf(p[i+1:], "%d", &n)
		k := p[:i]
		if prev, ok := last[k]; ok && n < prev {
			bad = append(bad, fmt.Sprintf("%s after %s/%d", p, k, prev))
		}
		last[k] = n
	}
	return bad
}

// The helpers every relay's tests share.
var (
	quiet = outboxtest.Quiet
	msg   = outboxtest.Msg
)

// running is a relay started by start, ended by stop (or the end of the test).
type running struct{ *outboxtest.Running }

func (rr *running) stop(t testing.TB) { t.Helper(); rr.Stop(t) }

func start(t testing.TB, r interface{ Run(context.Context) error }) *running {
	t.Helper()
	return &running{outboxtest.Start(t, r)}
}
