package kafkasql_test

import (
	"context"
	"database/sql"
	"path/filepath"
	"strings"
	"testing"
	"time"

	// The drivers the tests run Offsets on.
	_ "github.com/go-sql-driver/mysql"
	_ "github.com/jackc/pgx/v5/stdlib"
	_ "modernc.org/sqlite"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/adapters/kafka/kafkasql"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/sqltable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// backend is one server Offsets runs on.
type backend struct {
	name    string
	dialect kafkasql.Dialect
	// open returns a database and a schema of the test's own ("" for the
	// connection's), dropped when the test ends.
	open func(t testing.TB) (*sql.DB, string)
}

var backends = []backend{
	{name: "mysql", dialect: kafkasql.MySQL, open: func(t testing.TB) (*sql.DB, string) {
		return testenv.MySQL(t, ""), ""
	}},
	{name: "postgres", dialect: kafkasql.Postgres, open: func(t testing.TB) (*sql.DB, string) {
		testenv.Pool(t, 1) // skips, or fails under CI, when PostgreSQL is down
		db, err := sql.Open("pgx", testenv.PostgresURL())
		if err != nil {
			t.Fatal(err)
		}
		schema := testenv.Name("kafkasql")
		t.Cleanup(func() {
			_, _ = db.ExecContext(context.Background(), `DROP SCHEMA IF EXISTS "`+schema+`" CASCADE`)
			_ = db.Close()
		})
		return db, schema
	}},
	{name: "sqlite", dialect: kafkasql.SQLite, open: func(t testing.TB) (*sql.DB, string) {
		db, err := sql.Open("sqlite", "file:"+filepath.Join(t.TempDir(), "idem.db")+
			"?_txlock=immediate&_pragma=busy_timeout(30000)&_pragma=journal_mode(WAL)")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		return db, ""
	}},
}

// newOffsets makes an Offsets on a table of the test's own and migrates it.
func newOffsets(t testing.TB, b backend, db *sql.DB, schema string) *kafkasql.Offsets {
	t.Helper()
	table := testenv.Name("ko")
	if b.dialect == kafkasql.MySQL {
		t.Cleanup(func() {
			_, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS `"+table+"`, `"+table+"_migrations`")
		})
	}
	o, err := kafkasql.New(db, b.dialect, kafkasql.Options{Schema: schema, Table: table})
	if err != nil {
		t.Fatal(err)
	}
	for range 2 { // idempotent
		if err := o.Migrate(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	return o
}

func TestOffsets(t *testing.T) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			db, schema := b.open(t)
			o := newOffsets(t, b, db, schema)
			ctx := context.Background()
			if got, err := o.LoadOffsets(ctx, "g", "t", []int{0, 1}); err != nil || len(got) != 0 {
				t.Fatalf("LoadOffsets on an empty table = %v, %v", got, err)
			}
			if err := o.SaveOffsets(ctx, "g", map[string]map[int]int64{"t": {0: 10, 1: 20}, "u": {0: 5}}); err != nil {
				t.Fatal(err)
			}
			// Never backwards: 1 moves forward, 0 stays.
			if err := o.SaveOffsets(ctx, "g", map[string]map[int]int64{"t": {0: 3, 1: 25}}); err != nil {
				t.Fatal(err)
			}
			got, err := o.LoadOffsets(ctx, "g", "t", []int{0, 1, 2})
			if err != nil || got[0] != 10 || got[1] != 25 || len(got) != 2 {
				t.Fatalf("LoadOffsets = %v, %v; want map[0:10 1:25]", got, err)
			}
			if other, _ := o.LoadOffsets(ctx, "other", "t", []int{0}); len(other) != 0 {
				t.Fatalf("another group sees %v", other)
			}
			// Group names compare byte for byte, as in Kafka.
			if upper, _ := o.LoadOffsets(ctx, "G", "t", []int{0}); len(upper) != 0 {
				t.Fatalf("group G sees group g's positions %v", upper)
			}
			if u, _ := o.LoadOffsets(ctx, "g", "u", []int{0}); u[0] != 5 {
				t.Fatalf("topic u's position %v, want 5", u)
			}

			// SaveTx commits with the transaction, or not at all.
			pos := idemkafka.Position{Group: "g", Topic: "t", Partition: 0, Offset: 50}
			tx, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := o.SaveTx(ctx, tx, pos); err != nil {
				t.Fatal(err)
			}
			if err := tx.Rollback(); err != nil {
				t.Fatal(err)
			}
			if got, _ := o.LoadOffsets(ctx, "g", "t", []int{0}); got[0] != 10 {
				t.Fatalf("a rolled-back SaveTx moved the position to %d", got[0])
			}
			tx, err = db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			if err := o.SaveTx(ctx, tx, pos); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(); err != nil {
				t.Fatal(err)
			}
			if got, _ := o.LoadOffsets(ctx, "g", "t", []int{0}); got[0] != 50 {
				t.Fatalf("position %d after SaveTx, want 50", got[0])
			}
			script, err := o.SQL()
			if err != nil || !strings.Contains(script, o.Table()) {
				t.Fatalf("SQL() = %q, %v", script, err)
			}
		})
	}
}

// SaveOffsets of positions already stored writes nothing, so it does not
// wait for a transaction that holds their rows (a handler's SaveTx).
func TestSaveOffsetsBehind(t *testing.T) {
	for _, b := range backends {
		t.Run(b.name, func(t *testing.T) {
			db, schema := b.open(t)
			o := newOffsets(t, b, db, schema)
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			if err := o.SaveOffsets(ctx, "g", map[string]map[int]int64{"t": {0: 100, 1: 7}}); err != nil {
				t.Fatal(err)
			}
			holder, err := db.BeginTx(ctx, nil)
			if err != nil {
				t.Fatal(err)
			}
			defer func() { _ = holder.Rollback() }()
			lock := "SELECT next_offset FROM " + o.Table() + " WHERE partition_id = 0 FOR UPDATE"
			if b.dialect == kafkasql.SQLite {
				// A write takes the database's one write lock.
				lock = "UPDATE " + o.Table() + " SET next_offset = next_offset WHERE partition_id = 0"
			}
			if _, err := holder.ExecContext(ctx, lock); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { done <- o.SaveOffsets(ctx, "g", map[string]map[int]int64{"t": {0: 100, 1: 5}}) }()
			select {
			case err := <-done:
				if err != nil {
					t.Fatal(err)
				}
			case <-time.After(20 * time.Second):
				t.Fatal("SaveOffsets of stored positions waited for the transaction holding their rows")
			}
			if err := holder.Rollback(); err != nil {
				t.Fatal(err)
			}
			if err := o.SaveOffsets(ctx, "g", map[string]map[int]int64{"t": {0: 90, 1: 8, 2: 3}}); err != nil {
				t.Fatal(err)
			}
			got, err := o.LoadOffsets(ctx, "g", "t", []int{0, 1, 2})
			if err != nil || got[0] != 100 || got[1] != 8 || got[2] != 3 {
				t.Fatalf("LoadOffsets = %v, %v; want map[0:100 1:8 2:3]", got, err)
			}
		})
	}
}

func TestOptions(t *testing.T) {
	db, err := sql.Open("sqlite", "file::memory:")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = db.Close() }()
	for _, opts := range []kafkasql.Options{
		{Table: "Bad"}, {Table: "x; DROP TABLE y"}, {Table: "a`b"}, {Schema: "1abc"}, {Schema: `a"b`}, {Table: strings.Repeat("t", 51)},
	} {
		if _, err := kafkasql.New(db, kafkasql.MySQL, opts); err == nil {
			t.Errorf("New accepted %+v", opts)
		}
	}
	if _, err := kafkasql.New(nil, kafkasql.MySQL, kafkasql.Options{}); err == nil {
		t.Error("New accepted a nil db")
	}
	for _, d := range []kafkasql.Dialect{0, 7} {
		if _, err := kafkasql.New(db, d, kafkasql.Options{}); err == nil {
			t.Errorf("New accepted dialect %v", d)
		}
	}
	o, err := kafkasql.New(db, kafkasql.SQLite, kafkasql.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if o.Table() != `"kafka_offsets"` {
		t.Errorf("default table %s", o.Table())
	}
	claims, err := sqltable.New(db, sqltable.SQLite, sqltable.Options{})
	if err != nil {
		t.Fatal(err)
	}
	h := func(context.Context, *sql.Tx, *consumer.Message) error { return nil }
	if _, err := kafkasql.Transactional(claims, nil, consumer.TxOptions{Scope: "s"}, h); err == nil {
		t.Error("Transactional accepted nil offsets")
	}
	if _, err := kafkasql.Transactional(claims, o, consumer.TxOptions{Scope: "s"}, nil); err == nil {
		t.Error("Transactional accepted a nil handler")
	}
	if _, err := kafkasql.Transactional(claims, o, consumer.TxOptions{}, h); err == nil {
		t.Error("Transactional accepted an empty scope")
	}
}

// Outside a Consumer there is no position to store: the handler's
// transaction rolls back (effect and claim) and the error is permanent.
func TestTransactionalWithoutConsumer(t *testing.T) {
	b := backends[0]
	db, schema := b.open(t)
	o := newOffsets(t, b, db, schema)
	ctx := context.Background()
	e := newEffects(t, db)
	claims := newClaims(t, db)
	h, err := kafkasql.Transactional(claims, o, consumer.TxOptions{Scope: "test/no-consumer"}, e.insert)
	if err != nil {
		t.Fatal(err)
	}
	err = h.Handle(ctx, &consumer.Message{ID: "a", Payload: []byte("1")})
	if consumer.Decide(err).Action != consumer.ActionDeadLetter {
		t.Fatalf("handler outside a Consumer = %v; want a permanent error", err)
	}
	var n int
	if err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+e.table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("%d effects; the transaction without a position must roll back", n)
	}
	if err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+claims.Table()).Scan(&n); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Fatalf("%d claims; the transaction without a position must roll back", n)
	}
}
