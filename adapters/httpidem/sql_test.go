package httpidem_test

import (
	"context"
	"database/sql"
	"net/http"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/idemkit/idem/adapters/httpidem"
	"github.com/idemkit/idem/dedup/sqltable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestTxMariaDB: the transactional middleware on the database/sql store
// over MariaDB. A payment's charge, written through the request's *sql.Tx,
// commits with the claim and the stored response: 20 concurrent requests
// with one key charge once, and every other answer is the replay of the
// first (or a 409 while it ran); another key charges again.
func TestTxMariaDB(t *testing.T) {
	t.Parallel()
	db := testenv.MySQL(t, "")
	db.SetMaxOpenConns(40)
	ctx := testenv.Ctx(t)
	table := testenv.Name("hk")
	charges := testenv.Name("charges")
	t.Cleanup(func() {
		_, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS `"+table+"`, `"+table+"_migrations`, `"+charges+"`")
	})
	// The oracle: no unique key, so a second charge would be a second row.
	if _, err := db.ExecContext(ctx, "CREATE TABLE `"+charges+"` (payment VARCHAR(64) NOT NULL, amount INT NOT NULL) ENGINE=InnoDB"); err != nil {
		t.Fatal(err)
	}
	store, err := sqltable.New(db, sqltable.MySQL, sqltable.Options{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	mw, err := httpidem.NewTx(store, httpidem.Options{Wait: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	srv := quietServer(t, mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx := httpidem.Tx[*sql.Tx](r.Context())
		if tx == nil {
			http.Error(w, "no transaction", http.StatusInternalServerError)
			return
		}
		key, _ := httpidem.RequestKey(r.Context())
		if _, err := tx.ExecContext(r.Context(), "INSERT INTO `"+charges+"` (payment, amount) VALUES (?, 100)", key.ID); err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write([]byte("charged " + key.ID))
	})))

	const n = 20
	var (
		wg       sync.WaitGroup
		mu       sync.Mutex
		statuses = map[int]int{}
		replays  int
	)
	for range n {
		wg.Go(func() {
			resp, err := send(ctx, nil, srv.URL, req{key: "pay-1", body: `{"amount":100}`})
			if err != nil {
				t.Error(err)
				return
			}
			mu.Lock()
			defer mu.Unlock()
			statuses[resp.status]++
			if resp.replayed() {
				replays++
				if string(resp.body) != "charged pay-1" {
					t.Errorf("replayed body %q, want the first response's", resp.body)
				}
			}
		})
	}
	wg.Wait()
	if statuses[http.StatusCreated] != n || replays != n-1 {
		t.Errorf("statuses %v with %d replays, want %d × 201 of which %d replayed", statuses, replays, n, n-1)
	}
	if r := do(t, nil, srv.URL, req{key: "pay-2", body: `{"amount":100}`}); r.status != http.StatusCreated || r.replayed() {
		t.Errorf("another key: status %d replayed %v, want a first 201", r.status, r.replayed())
	}
	if r := do(t, nil, srv.URL, req{key: "pay-1", body: `{"amount":999}`}); r.status != http.StatusUnprocessableEntity {
		t.Errorf("same key, other body: status %d, want 422", r.status)
	}
	rows, err := db.QueryContext(ctx, "SELECT payment, COUNT(*) FROM `"+charges+"` GROUP BY payment ORDER BY payment")
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	got := map[string]int{}
	for rows.Next() {
		var p string
		var c int
		if err := rows.Scan(&p, &c); err != nil {
			t.Fatal(err)
		}
		got[p] = c
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || got["pay-1"] != 1 || got["pay-2"] != 1 {
		t.Fatalf("charges %v, want pay-1 and pay-2 charged once each", got)
	}
}

// TestRedisOnlyCompilesNoDatabaseDriver: a service that uses httpidem on
// Redis alone (testdata/redisonly) compiles no database driver: neither
// pgx nor a database/sql driver is among its packages.
func TestRedisOnlyCompilesNoDatabaseDriver(t *testing.T) {
	t.Parallel()
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("the go command is not on PATH")
	}
	out, err := exec.Command(gobin, "list", "-deps", "./testdata/redisonly").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	pkgs := strings.Fields(string(out))
	if len(pkgs) < 10 || !strings.Contains(string(out), "github.com/idemkit/idem/adapters/httpidem\n") {
		t.Fatalf("go list -deps listed %d packages without httpidem: %s", len(pkgs), out)
	}
	for _, p := range pkgs {
		for _, driver := range []string{"github.com/jackc/", "github.com/go-sql-driver/", "github.com/lib/pq", "modernc.org/sqlite"} {
			if strings.HasPrefix(p, driver) {
				t.Errorf("a Redis-only httpidem program compiles %s", p)
			}
		}
	}
}
