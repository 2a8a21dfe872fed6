package main

import (
	"context"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/chromedp"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestConsoleDedupLookup claims keys through a real pgtable store and a
// real redisnx store, and looks them up in the console's form in
// Chromium: a processed key reads done with its result, a claimed one in
// flight, an unknown one absent; the rows by state count the pgtable
// table's rows.
func TestConsoleDedupLookup(t *testing.T) {
	b := newBrowser(t)
	ctx := context.Background()
	pool := testenv.Pool(t, 4)
	schema := testenv.Schema(t, pool)
	pg, err := pgtable.New(pool, pgtable.Options{Schema: schema, KeepKeys: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := pg.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	rc := testenv.Redis(t)
	prefix := testenv.Name("idemconsole")
	t.Cleanup(func() { deleteRedisKeys(rc, prefix+":") })
	rs, err := redisnx.New(rc, redisnx.Options{Prefix: prefix, TTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}

	done := dedup.Key{Scope: "billing/charge", ID: testenv.UniqueID("pay")}
	if _, err := pg.Process(ctx, done, func(context.Context, pgx.Tx) ([]byte, error) { return []byte("receipt-7"), nil }); err != nil {
		t.Fatal(err)
	}
	pgFlight := dedup.Key{Scope: "billing/charge", ID: testenv.UniqueID("pay")}
	if _, err := pg.Lease().Claim(ctx, pgFlight); err != nil {
		t.Fatal(err)
	}
	flight := dedup.Key{Scope: "email/welcome", ID: testenv.UniqueID("user")}
	if _, err := rs.Claim(ctx, flight); err != nil {
		t.Fatal(err)
	}

	srv := startConsole(t, "--postgres", testenv.PostgresURL(), "--schema", schema, "--keep-keys", "--redis", testenv.RedisAddr(), "--prefix", prefix)
	b.open(srv.URL + "/dedup")
	if row := b.text("table.list tr:nth-child(2)"); !strings.Contains(row, "pgtable") || !strings.Contains(row, "1\t1\t0\t2") {
		t.Errorf("pgtable's rows by state: %q, want 1 done, 1 in flight, 0 expired, 2 rows", row)
	}
	lookup := func(store string, key dedup.Key) string {
		t.Helper()
		b.do(chromedp.SetValue(chromedp.CSS("select[name=store]"), store),
			chromedp.SetValue(chromedp.CSS("#scope"), key.Scope),
			chromedp.SetValue(chromedp.CSS("#id"), key.ID))
		b.submit("#lookup")
		return b.text("#state")
	}
	if st := lookup("pgtable", done); st != "done" {
		t.Errorf("pgtable, processed key: state %q, want done", st)
	}
	if r := b.text("#result"); r != `9 bytes: "receipt-7"` {
		t.Errorf("pgtable, processed key: result %q", r)
	}
	if kept := b.text("#keystate"); !strings.Contains(kept, `id "`+done.ID+`"`) {
		t.Errorf("pgtable keeps the key's scope and id:\n%s", kept)
	}
	b.screenshot("dedup")
	if st := lookup("pgtable", pgFlight); st != "in flight" {
		t.Errorf("pgtable, claimed key: state %q, want in flight", st)
	}
	if st := lookup("redisnx", flight); st != "in flight" {
		t.Errorf("redisnx, claimed key: state %q, want in flight", st)
	}
	if st := lookup("redisnx", done); st != "absent" {
		t.Errorf("redisnx, a key it never saw: state %q, want absent", st)
	}
	// By digest: the page's own form, filled with the digest alone.
	b.open(srv.URL + "/dedup?" + url.Values{"store": {"pgtable"}, "digest": {done.Digest().String()}}.Encode())
	if st := b.text("#state"); st != "done" {
		t.Errorf("pgtable by digest: state %q, want done", st)
	}
}
