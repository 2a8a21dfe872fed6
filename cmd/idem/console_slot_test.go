package main

import (
	"context"
	"fmt"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/walrelay"
)

// TestConsoleSlot: on a PostgreSQL with wal_level = logical, the WAL
// relay's slot exists and no relay streams it while messages are written:
// the slot page in Chromium shows it idle, with the WAL written since its
// confirmed position as lag and the WAL kept for it as retained. Before
// the slot exists, the page says there is none.
func TestConsoleSlot(t *testing.T) {
	b := newBrowser(t)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	pg, err := fault.StartLogicalPostgres(ctx)
	if err != nil {
		testenv.Unavailable(t, "a throwaway PostgreSQL with wal_level = logical cannot start: "+err.Error())
	}
	t.Cleanup(func() { _ = pg.Close() })
	pool, err := pgxpool.New(ctx, pg.URL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)

	srv := startConsole(t, "--postgres", pg.URL())
	b.open(srv.URL + "/slot")
	if body := b.text("main"); !strings.Contains(body, "There is no replication slot named idem_outbox_public_outbox") {
		t.Errorf("slot page before the slot:\n%s", body)
	}

	ob, err := walrelay.New(pool, walrelay.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	for i := range 20 {
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := ob.Enqueue(ctx, tx, outbox.Message{Topic: "payments", Key: fmt.Appendf(nil, "c%d", i), Payload: []byte(strings.Repeat("x", 500))})
			return err
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	b.open(srv.URL + "/slot")
	bytesOf := func(sel string) int64 {
		t.Helper()
		m := regexp.MustCompile(`^(\d+) bytes$`).FindStringSubmatch(b.text(sel))
		if m == nil {
			t.Fatalf("%s: %q, want N bytes\n%s", sel, b.text(sel), b.text("main"))
		}
		n, _ := strconv.ParseInt(m[1], 10, 64)
		return n
	}
	if lag, retained := bytesOf("#lag"), bytesOf("#retained"); lag < 20*500 || retained < lag {
		t.Errorf("lag %d bytes, retained %d: want at least the 10000 bytes of payload written since the slot's position, and retained >= lag", lag, retained)
	}
	if body := b.text("main"); !strings.Contains(body, "idle: no relay streams it") {
		t.Errorf("slot page:\n%s", body)
	}
	b.screenshot("slot")
}
