package sqloutbox_test

import (
	"bytes"
	"database/sql"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"go.opentelemetry.io/otel/propagation"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
	"github.com/idemkit/idem/outbox/sqloutbox"
)

func TestNewRefusesBadOptions(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		d    sqloutbox.Dialect
		opts sqloutbox.Options
		want string
	}{
		{"no dialect", 0, sqloutbox.Options{}, "dialect"},
		{"schema on mysql", sqloutbox.MySQL, sqloutbox.Options{Schema: "app"}, "Schema"},
		{"bad table", sqloutbox.SQLite, sqloutbox.Options{Table: "Out-box"}, "Table"},
		{"negative retention", sqloutbox.MySQL, sqloutbox.Options{Retention: -1}, "Retention"},
		{"negative batch", sqloutbox.Postgres, sqloutbox.Options{CleanupBatch: -1}, "CleanupBatch"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := sqloutbox.New(nil, c.d, c.opts)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("New: %v, want an error about %s", err, c.want)
			}
		})
	}
}

func TestNewRelayRefusesPostgresAndSQLiteSessions(t *testing.T) {
	t.Parallel()
	pg, err := sqloutbox.New(&sql.DB{}, sqloutbox.Postgres, sqloutbox.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sqloutbox.NewRelay(pg, &memPublisher{}, sqloutbox.RelayOptions{}); err == nil || !strings.Contains(err.Error(), "pgoutbox") {
		t.Fatalf("NewRelay on PostgreSQL: %v, want an error pointing to pgoutbox", err)
	}
	lite, err := sqloutbox.New(&sql.DB{}, sqloutbox.SQLite, sqloutbox.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := sqloutbox.NewRelay(lite, &memPublisher{}, sqloutbox.RelayOptions{Sessions: 2}); err == nil || !strings.Contains(err.Error(), "SKIP LOCKED") {
		t.Fatalf("NewRelay on SQLite with 2 sessions: %v, want a refusal", err)
	}
	if _, err := sqloutbox.NewRelay(lite, &memPublisher{}, sqloutbox.RelayOptions{}); err != nil {
		t.Fatalf("NewRelay on SQLite: %v", err)
	}
}

// The PostgreSQL migration is pgoutbox's, so that pgoutbox's relay reads
// the table sqloutbox writes.
func TestPostgresMigrationIsPgoutboxs(t *testing.T) {
	t.Parallel()
	mine, err := os.ReadFile("migrations/postgres/0001_outbox.sql")
	if err != nil {
		t.Fatal(err)
	}
	theirs, err := os.ReadFile("../pgoutbox/migrations/0001_outbox.sql")
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(mine, theirs) {
		t.Fatal("migrations/postgres/0001_outbox.sql differs from outbox/pgoutbox's; keep them identical")
	}
	entries, err := os.ReadDir("../pgoutbox/migrations")
	if err != nil {
		t.Fatal(err)
	}
	if len(entries) != 1 {
		t.Fatalf("pgoutbox has %d migrations; copy each into migrations/postgres", len(entries))
	}
}

// Migrate runs twice (and concurrently) without harm and records its
// version, on each dialect.
func TestMigrateIdempotent(t *testing.T) {
	t.Parallel()
	for _, d := range []sqloutbox.Dialect{sqloutbox.MySQL, sqloutbox.SQLite, sqloutbox.Postgres} {
		t.Run(d.String(), func(t *testing.T) {
			ctx := testenv.Ctx(t)
			var (
				db   *sql.DB
				opts sqloutbox.Options
			)
			switch d {
			case sqloutbox.MySQL:
				db = mariaDB(t)
			case sqloutbox.SQLite:
				db = sqliteDB(t)
			default:
				db, opts.Schema = postgresDB(t)
			}
			ob := newOutbox(t, db, d, opts)
			errs := make(chan error, 3)
			for range 3 {
				go func() { errs <- ob.Migrate(ctx) }()
			}
			for range 3 {
				if err := <-errs; err != nil {
					t.Fatalf("Migrate again: %v", err)
				}
			}
			st, err := ob.MigrationStatus(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(st, []string{"0001_outbox"}) {
				t.Fatalf("MigrationStatus = %v", st)
			}
			ids := enqueue(t, db, ob, msg("t", "k", "x"))
			if n, _, err := ob.Backlog(ctx); err != nil || n != 1 {
				t.Fatalf("Backlog = %d, %v; want 1 after enqueueing %v", n, err, ids)
			}
		})
	}
}

// Enqueue through database/sql on PostgreSQL writes pgoutbox's table:
// pgoutbox's relay publishes the committed messages, with their ids, keys,
// payloads and trace headers, and nothing of a rolled back transaction.
func TestPostgresEnqueuePublishedByPgoutboxRelay(t *testing.T) {
	t.Parallel()
	db, schema := postgresDB(t)
	ob := newOutbox(t, db, sqloutbox.Postgres, sqloutbox.Options{Schema: schema})
	pool := testenv.Pool(t, 4)
	pob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: schema, Table: ob.Options().Table, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	st, err := pob.MigrationStatus(testenv.Ctx(t))
	if err != nil || !slices.Equal(st, []string{"0001_outbox"}) {
		t.Fatalf("pgoutbox sees migrations %v, %v", st, err)
	}
	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	ctx := propagation.TraceContext{}.Extract(testenv.Ctx(t), propagation.MapCarrier{"traceparent": tp})
	var want []string
	for i := range 20 {
		key := []string{"a", "b", ""}[i%3]
		ids, err := enqueueTx(ctx, db, ob, true, msg("orders", key, key+"/"+string(rune('0'+i/3))))
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, ids...)
	}
	rolledBack, err := enqueueTx(ctx, db, ob, false, msg("orders", "a", "never"))
	if err != nil {
		t.Fatal(err)
	}
	pub := &memPublisher{}
	relay, err := pgoutbox.NewRelay(pob, pub, pgoutbox.RelayOptions{CleanupInterval: -1, Telemetry: consumer.Telemetry{Logger: quiet()}})
	if err != nil {
		t.Fatal(err)
	}
	start(t, relay)
	testenv.Eventually(t, 30*time.Second, "every committed message published", func() bool { return len(pub.published()) >= len(want) })
	got := pub.published()
	if len(got) != len(want) {
		t.Fatalf("published %d messages, want %d", len(got), len(want))
	}
	byID := map[string]outbox.Message{}
	for _, m := range got {
		byID[m.ID] = m
	}
	for _, id := range want {
		m, ok := byID[id]
		if !ok {
			t.Fatalf("message %s not published", id)
		}
		if _, err := uuid.Parse(m.ID); err != nil || uuid.MustParse(m.ID).Version() != 7 {
			t.Fatalf("id %s is not a UUIDv7", m.ID)
		}
		if m.Headers[outbox.HeaderTraceParent] != tp {
			t.Fatalf("message %s headers %v, want traceparent %s", id, m.Headers, tp)
		}
	}
	if _, ok := byID[rolledBack[0]]; ok {
		t.Fatal("the message of the rolled back transaction was published")
	}
	var payloads []string
	for _, m := range got {
		if len(m.Key) > 0 {
			payloads = append(payloads, string(m.Payload))
		}
	}
	if bad := orderViolations(payloads); len(bad) > 0 {
		t.Fatalf("per-key order violated: %v", bad)
	}
}

// Enqueue validates messages before it writes anything.
func TestEnqueueRefusesBadMessages(t *testing.T) {
	t.Parallel()
	db := sqliteDB(t)
	ob := newOutbox(t, db, sqloutbox.SQLite, sqloutbox.Options{})
	ctx := testenv.Ctx(t)
	for name, m := range map[string]outbox.Message{
		"id not a uuid":   {ID: "nope", Topic: "t"},
		"topic not utf8":  {Topic: "\xff"},
		"empty header":    {Topic: "t", Headers: map[string]string{"": "v"}},
		"header with NUL": {Topic: "t", Headers: map[string]string{"h": "a\x00b"}},
	} {
		if _, err := enqueueTx(ctx, db, ob, true, m); err == nil {
			t.Errorf("%s: Enqueue accepted it", name)
		}
	}
	if _, err := ob.Enqueue(ctx, nil, msg("t", "", "x")); err == nil {
		t.Error("Enqueue accepted a nil tx")
	}
	if n := countState(t, db, ob, 0); n != 0 {
		t.Fatalf("%d rows written", n)
	}
	// A given UUID is kept, in its canonical form.
	id := uuid.Must(uuid.NewV7())
	ids := enqueue(t, db, ob, outbox.Message{ID: strings.ToUpper(id.String()), Topic: "t"})
	if ids[0] != id.String() {
		t.Fatalf("id %s, want %s", ids[0], id)
	}
}
