// Package grafana_test checks the Grafana dashboard of this directory
// against the metrics idem really exports: it drives idem's components with
// a MeterProvider backed by the OpenTelemetry Prometheus exporter, scrapes
// the exporter over HTTP, and requires every metric a dashboard query names,
// and every metric idem declares (telemetry.Metrics), to be in the scrape.
package grafana_test

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	otelprom "go.opentelemetry.io/otel/exporters/prometheus"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.uber.org/goleak"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/twolevel"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/clocktest"
	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
	"github.com/idemkit/idem/outbox/walrelay"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m, testenv.LeakOptions()...) }

// TestDashboardNamesExportedMetrics is the dashboard's contract: every
// metric its queries name is a series idem's components export through the
// Prometheus exporter, and every metric idem declares is exported.
func TestDashboardNamesExportedMetrics(t *testing.T) {
	queries := dashboardQueries(t, "dashboard.json")
	if len(queries) < 10 {
		t.Fatalf("found %d queries in dashboard.json; the parser is broken", len(queries))
	}
	scrape := exportAll(t)
	series, families := parseScrape(t, scrape)

	// Every metric named in a query is a series of the scrape.
	used := map[string][]string{} // metric -> panels
	for _, q := range queries {
		names := metricNames(q.expr)
		if len(names) == 0 {
			t.Errorf("panel %q: no metric found in %q", q.panel, q.expr)
		}
		for _, n := range names {
			used[n] = append(used[n], q.panel)
		}
	}
	for _, n := range sortedKeys(used) {
		if !series[n] {
			t.Errorf("dashboard metric %s (panels %q) is not exported by idem; the scrape has: %s",
				n, used[n], strings.Join(idemFamilies(families), ", "))
		}
	}

	// Every declared metric is exported, under its Prometheus name: the
	// relay's outbox metrics and the WAL relay's slot gauges alike.
	for _, name := range append(slices.Clone(telemetry.Metrics), telemetry.SlotMetrics...) {
		prom, ok := prometheusName(name, families)
		if !ok {
			t.Errorf("metric %s (telemetry.Metrics) is declared but not in the scrape: nothing emits it", name)
			continue
		}
		t.Logf("%-30s -> %s (%s)", name, prom, families[prom])
	}

	// The dashboard covers what an operator watches (the list).
	for _, want := range []string{
		"idem_claims_total", "idem_lease_wait_duration_seconds_bucket", "idem_lease_lost_total",
		"idem_messages_total", "idem_outbox_backlog", "idem_outbox_oldest_age_seconds",
		"idem_outbox_publish_duration_seconds_bucket", "idem_outbox_delay_seconds_bucket", "idem_outbox_dead_total",
		"idem_outbox_slot_lag_bytes", "idem_outbox_slot_retained_bytes", "idem_outbox_slot_lag_age_seconds",
	} {
		if _, ok := used[want]; !ok {
			t.Errorf("the dashboard has no panel on %s", want)
		}
	}
	// No attribute carries an id or a key.
	for _, secret := range []string{"order-", "pay-", "evt-"} {
		for line := range strings.Lines(scrape) {
			if !strings.HasPrefix(line, "#") && strings.Contains(line, secret) {
				t.Errorf("a series carries an id or key (%q): %s", secret, strings.TrimSpace(line))
			}
		}
	}
}

// prometheusName finds the family a metric was exported as: dots become
// underscores, then the unit suffix (_seconds, _bytes) and _total on
// counters may follow. Exactly one candidate must exist.
func prometheusName(name string, families map[string]string) (string, bool) {
	base := strings.ReplaceAll(name, ".", "_")
	var found []string
	for _, c := range []string{base, base + "_total", base + "_seconds", base + "_seconds_total", base + "_bytes"} {
		if _, ok := families[c]; ok {
			found = append(found, c)
		}
	}
	if len(found) != 1 {
		return "", false
	}
	return found[0], true
}

type query struct{ panel, expr string }

// dashboardQueries returns the PromQL of every panel target (rows'
// nested panels included) and of every templating query.
func dashboardQueries(t *testing.T, path string) []query {
	t.Helper()
	raw, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	type target struct {
		Expr string `json:"expr"`
	}
	type panel struct {
		Title   string   `json:"title"`
		Type    string   `json:"type"`
		Targets []target `json:"targets"`
		Panels  []panel  `json:"panels"`
	}
	var d struct {
		Title      string  `json:"title"`
		UID        string  `json:"uid"`
		Panels     []panel `json:"panels"`
		Templating struct {
			List []struct {
				Name  string          `json:"name"`
				Type  string          `json:"type"`
				Query json.RawMessage `json:"query"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("%s is not valid JSON: %v", path, err)
	}
	if d.Title == "" || d.UID == "" {
		t.Errorf("%s: title %q, uid %q: a dashboard needs both", path, d.Title, d.UID)
	}
	var out []query
	var walk func([]panel)
	walk = func(ps []panel) {
		for _, p := range ps {
			if p.Type != "row" && len(p.Targets) == 0 {
				t.Errorf("panel %q has no query", p.Title)
			}
			for _, tg := range p.Targets {
				if strings.TrimSpace(tg.Expr) == "" {
					t.Errorf("panel %q has a target without expr", p.Title)
					continue
				}
				out = append(out, query{p.Title, tg.Expr})
			}
			walk(p.Panels)
		}
	}
	walk(d.Panels)
	for _, v := range d.Templating.List {
		if v.Type != "query" {
			continue
		}
		var q struct {
			Query string `json:"query"`
		}
		var s string
		switch {
		case json.Unmarshal(v.Query, &s) == nil:
		case json.Unmarshal(v.Query, &q) == nil:
			s = q.Query
		}
		if s == "" {
			t.Errorf("templating variable %q has no query", v.Name)
			continue
		}
		// label_values(metric, label): the metric is the first argument.
		if m := labelValues.FindStringSubmatch(s); m != nil {
			s = m[1]
		}
		out = append(out, query{"variable " + v.Name, s})
	}
	return out
}

var (
	labelValues = regexp.MustCompile(`^\s*label_values\(\s*([^,]+?)\s*,`)
	quoted      = regexp.MustCompile(`"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|` + "`[^`]*`")
	braces      = regexp.MustCompile(`\{[^{}]*\}`)
	brackets    = regexp.MustCompile(`\[[^\[\]]*\]`)
	grouping    = regexp.MustCompile(`\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)`)
	identifier  = regexp.MustCompile(`[a-zA-Z_:][a-zA-Z0-9_:]*`)
	keywords    = map[string]bool{"by": true, "without": true, "on": true, "ignoring": true, "group_left": true,
		"group_right": true, "and": true, "or": true, "unless": true, "offset": true, "bool": true, "inf": true, "nan": true}
)

// metricNames extracts the metric names of a PromQL expression: what is
// left once strings, label matchers, ranges and groupings are removed, and
// is neither a function call nor a keyword.
func metricNames(expr string) []string {
	s := quoted.ReplaceAllString(expr, `""`)
	s = braces.ReplaceAllString(s, " ")
	s = brackets.ReplaceAllString(s, " ")
	s = grouping.ReplaceAllString(s, " ")
	var out []string
	for _, loc := range identifier.FindAllStringIndex(s, -1) {
		name := s[loc[0]:loc[1]]
		if loc[0] > 0 && (s[loc[0]-1] == '$' || (s[loc[0]-1] >= '0' && s[loc[0]-1] <= '9') || s[loc[0]-1] == '.') {
			continue // a variable ($scope) or part of a number (1e3)
		}
		rest := strings.TrimLeft(s[loc[1]:], " \t\n")
		if strings.HasPrefix(rest, "(") || keywords[strings.ToLower(name)] {
			continue // a function or an aggregation
		}
		if !slices.Contains(out, name) {
			out = append(out, name)
		}
	}
	return out
}

// parseScrape returns the series names of a Prometheus text scrape (with
// their _bucket, _sum and _count suffixes) and its families with their
// types.
func parseScrape(t *testing.T, scrape string) (series map[string]bool, families map[string]string) {
	t.Helper()
	series, families = map[string]bool{}, map[string]string{}
	sc := bufio.NewScanner(strings.NewReader(scrape))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if f, ok := strings.CutPrefix(line, "# TYPE "); ok {
			if parts := strings.Fields(f); len(parts) == 2 {
				families[parts[0]] = parts[1]
			}
			continue
		}
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		if i := strings.IndexAny(line, "{ "); i > 0 {
			series[line[:i]] = true
		}
	}
	if err := sc.Err(); err != nil {
		t.Fatal(err)
	}
	return series, families
}

func idemFamilies(families map[string]string) []string {
	var out []string
	for f := range families {
		if strings.HasPrefix(f, "idem_") || strings.HasPrefix(f, "messaging_") {
			out = append(out, f)
		}
	}
	sort.Strings(out)
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// exportAll drives idem's components with a MeterProvider on the
// Prometheus exporter (its own registry), then scrapes it over HTTP.
func exportAll(t *testing.T) string {
	t.Helper()
	reg := prometheus.NewRegistry()
	exp, err := otelprom.New(otelprom.WithRegisterer(reg))
	if err != nil {
		t.Fatal(err)
	}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(exp))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })

	leaseClaims(t, mp)
	leaseLost(t, mp)
	txClaims(t, mp)
	twoLevelAnswers(t, mp)
	adapterResults(mp)
	stopRelay := relay(t, mp)
	defer stopRelay()
	stopWAL := walRelay(t, mp)
	defer stopWAL()

	srv := httptest.NewServer(promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	defer srv.Close()
	// The slot gauges appear once the WAL relay has sampled its slot:
	// scrape until they are there.
	var (
		body    string
		missing []string
	)
	defer func() {
		if len(missing) > 0 {
			t.Logf("the last scrape lacks %q", missing)
		}
	}()
	testenv.Eventually(t, 30*time.Second, "the WAL relay's slot gauges in the scrape", func() bool {
		body = scrape(t, srv)
		_, families := parseScrape(t, body)
		missing = missing[:0]
		for _, name := range telemetry.SlotMetrics {
			if _, ok := prometheusName(name, families); !ok {
				missing = append(missing, name)
			}
		}
		return len(missing) == 0
	})
	return body
}

// scrape reads the exporter's /metrics once.
func scrape(t *testing.T, srv *httptest.Server) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, srv.URL+"/metrics", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = resp.Body.Close() }()
	body, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape: %d %v\n%s", resp.StatusCode, err, body)
	}
	return string(body)
}

// walRelay runs a walrelay relay, which reports the replication slot's
// gauges, on a throwaway PostgreSQL with wal_level = logical (the shared
// one need not have it), and publishes one message through it. It returns
// with the relay running (the gauges exist only while it runs); the
// returned function stops it and the server.
func walRelay(t *testing.T, mp *sdkmetric.MeterProvider) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	pg, err := fault.StartPostgres(ctx, fault.PostgresOptions{Settings: map[string]string{
		"wal_level": "logical", "max_wal_senders": "4", "max_replication_slots": "4",
	}})
	if err != nil {
		testenv.Unavailable(t, "a throwaway PostgreSQL with wal_level = logical: "+err.Error())
	}
	closePG := func() {
		if err := pg.Close(); err != nil {
			t.Errorf("stop the throwaway PostgreSQL: %v", err)
		}
	}
	pool, err := pgxpool.New(ctx, pg.URL())
	if err == nil {
		err = pool.Ping(ctx)
	}
	if err != nil {
		closePG()
		t.Fatal(err)
	}
	stopAll := func() { pool.Close(); closePG() }
	ob, err := walrelay.New(pool, walrelay.Options{Schema: "grafana", Logger: quiet()})
	if err == nil {
		_, err = pool.Exec(ctx, "CREATE SCHEMA grafana")
	}
	if err == nil {
		err = ob.Migrate(ctx)
	}
	if err != nil {
		stopAll()
		t.Fatal(err)
	}
	pub := &memPublisher{}
	r, err := walrelay.NewRelay(ob, pub, walrelay.RelayOptions{Telemetry: consumer.Telemetry{MeterProvider: mp, Logger: quiet()}, MetricsInterval: 10 * time.Millisecond})
	if err != nil {
		stopAll()
		t.Fatal(err)
	}
	rctx, rcancel := context.WithCancel(t.Context())
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	stop = func() {
		rcancel()
		if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
			t.Errorf("walrelay Relay.Run: %v", err)
		}
		stopAll()
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := ob.Enqueue(ctx, tx, outbox.Message{Topic: "payments", Key: []byte("pay-4"), Payload: []byte("ok")})
		return err
	})
	if err != nil {
		stop()
		t.Fatal(err)
	}
	select {
	case <-pub.attempted():
	case <-ctx.Done():
		stop()
		t.Fatal("walrelay: the message was not published within 2 minutes")
	}
	return stop
}

func msg(id, payload string) *consumer.Message {
	return &consumer.Message{ID: id, Payload: []byte(payload)}
}

// leaseClaims: Dedup inside Retry over memstore — a first claim, a
// duplicate, and a delivery that waits on a key in flight elsewhere until
// the other owner completes it.
func leaseClaims(t *testing.T, mp *sdkmetric.MeterProvider) {
	t.Helper()
	store, err := memstore.New(memstore.Options{SweepInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = store.Close() })
	ctx := t.Context()
	held, err := store.Claim(ctx, dedup.NewKey("billing/charge", "order-2", []byte("p")))
	if err != nil {
		t.Fatal(err)
	}
	sleeps := 0
	retry, err := consumer.Retry(consumer.RetryOptions{MaxAttempts: 5, MeterProvider: mp,
		Sleep: func(context.Context, time.Duration) error {
			sleeps++
			if sleeps == 1 { // the other owner finishes while we wait
				return store.Complete(ctx, held, nil)
			}
			return nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	dd, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "billing/charge", Telemetry: consumer.Telemetry{MeterProvider: mp}})
	if err != nil {
		t.Fatal(err)
	}
	h := consumer.Chain(consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil }), retry, dd)
	if r := consumer.Process(ctx, h, msg("order-1", "p")); r.Err != nil {
		t.Fatalf("first delivery: %v", r.Err)
	}
	if r := consumer.Process(ctx, h, msg("order-1", "p")); !errors.Is(r.Err, dedup.ErrDuplicate) {
		t.Fatalf("redelivery: %v, want a duplicate", r.Err)
	}
	if r := consumer.Process(ctx, h, msg("order-2", "p")); !errors.Is(r.Err, dedup.ErrDuplicate) {
		t.Fatalf("delivery in flight elsewhere: %v, want a duplicate once the owner completed", r.Err)
	}
}

// leaseLost: the handler outlives its lease and another owner claims the
// key.
func leaseLost(t *testing.T, mp *sdkmetric.MeterProvider) {
	t.Helper()
	clock := clocktest.NewManual(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	store, err := memstore.New(memstore.Options{Lease: time.Second, Clock: clock, SweepInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = store.Close() })
	started := make(chan struct{})
	dd, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "mail/send", ExtendEvery: 2 * time.Millisecond, Telemetry: consumer.Telemetry{MeterProvider: mp}})
	if err != nil {
		t.Fatal(err)
	}
	h := consumer.Chain(consumer.HandlerFunc(func(ctx context.Context, _ *consumer.Message) error {
		close(started)
		<-ctx.Done()
		return ctx.Err()
	}), dd)
	var wg sync.WaitGroup
	var r consumer.Result
	wg.Go(func() { r = consumer.Process(t.Context(), h, msg("evt-1", "p")) })
	<-started
	clock.Advance(2 * time.Second)
	if _, err := store.Claim(t.Context(), dedup.NewKey("mail/send", "evt-1", []byte("p"))); err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	if !errors.Is(r.Err, dedup.ErrLeaseLost) {
		t.Fatalf("handler past its lease: %v, want ErrLeaseLost", r.Err)
	}
}

// txClaims: Transactional over pgtable on the real PostgreSQL, a first
// delivery and a duplicate.
func txClaims(t *testing.T, mp *sdkmetric.MeterProvider) {
	t.Helper()
	pool := testenv.Pool(t, 4)
	store, err := pgtable.New(pool, pgtable.Options{Schema: testenv.Schema(t, pool)})
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	h, err := consumer.Transactional(store, consumer.TxOptions{Scope: "ledger/post", Telemetry: consumer.Telemetry{MeterProvider: mp}},
		func(context.Context, pgx.Tx, *consumer.Message) error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	if r := consumer.Process(ctx, h, msg("pay-1", "p")); r.Err != nil {
		t.Fatalf("first delivery: %v", r.Err)
	}
	if r := consumer.Process(ctx, h, msg("pay-1", "p")); !errors.Is(r.Err, dedup.ErrDuplicate) {
		t.Fatalf("redelivery: %v, want a duplicate", r.Err)
	}
}

// twoLevelAnswers: a two-level store (memstore in front of pgtable)
// answers a first claim from the database and a duplicate from the cache.
func twoLevelAnswers(t *testing.T, mp *sdkmetric.MeterProvider) {
	t.Helper()
	pool := testenv.Pool(t, 4)
	db, err := pgtable.New(pool, pgtable.Options{Schema: testenv.Schema(t, pool)})
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	if err := db.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	cache, err := memstore.New(memstore.Options{SweepInterval: -1})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cache.Close() })
	store, err := twolevel.New(cache, db, twolevel.Options{MeterProvider: mp, Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	key := dedup.NewKey("ledger/post", "pay-2", []byte("p"))
	fn := func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil }
	if _, err := store.Process(ctx, key, fn); err != nil {
		t.Fatalf("first claim: %v", err)
	}
	if _, err := store.Process(ctx, key, fn); !errors.Is(err, dedup.ErrDuplicate) {
		t.Fatalf("second claim: %v, want a duplicate", err)
	}
}

// adapterResults: the verdicts an adapter records.
func adapterResults(mp *sdkmetric.MeterProvider) {
	a := telemetry.NewAdapter(mp, nil, "kafka")
	ctx := context.Background()
	a.Result(ctx, "payments", "ack", "", 3*time.Millisecond)
	a.Result(ctx, "payments", "retry", "", 5*time.Millisecond)
	a.Result(ctx, "payments", "dead_letter", "fingerprint_mismatch", time.Millisecond)
}

// relay runs a pgoutbox relay on the real PostgreSQL, publishing to memory:
// one message published, one retried then published, one parked dead. It
// returns once they are, with the relay still running (its backlog gauges
// exist only while it runs); the returned function stops it.
func relay(t *testing.T, mp *sdkmetric.MeterProvider) (stop func()) {
	t.Helper()
	pool := testenv.Pool(t, 6)
	ctx := t.Context()
	ob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: testenv.Schema(t, pool), Logger: quiet()})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := ob.Enqueue(ctx, tx,
			outbox.Message{Topic: "payments", Key: []byte("pay-1"), Payload: []byte("ok")},
			outbox.Message{Topic: "payments", Key: []byte("pay-2"), Payload: []byte("retry")},
			outbox.Message{Topic: "payments", Key: []byte("pay-3"), Payload: []byte("dead")},
		)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	pub := &memPublisher{}
	r, err := pgoutbox.NewRelay(ob, pub, pgoutbox.RelayOptions{
		Telemetry: consumer.Telemetry{MeterProvider: mp, Logger: quiet()}, MaxAttempts: 2, Backoff: consumer.Backoff{Initial: 10 * time.Millisecond, Max: 20 * time.Millisecond},
		PollInterval: 50 * time.Millisecond, MetricsInterval: 10 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	rctx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	stop = func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Relay.Run: %v", err)
		}
	}
	var published, dead int
	settled := false
	defer func() {
		if !settled { // Eventually or the query failed the test
			stop()
			t.Logf("relay: %d published, %d dead; want 2 and 1", published, dead)
		}
	}()
	testenv.Eventually(t, 30*time.Second, "the relay to publish two messages and park one dead", func() bool {
		err := pool.QueryRow(ctx, "SELECT count(*) FILTER (WHERE state = 1), count(*) FILTER (WHERE state = 2) FROM "+ob.Table()).Scan(&published, &dead)
		if err != nil {
			t.Fatal(err)
		}
		return published == 2 && dead == 1
	})
	settled = true
	return stop
}

func quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

// memPublisher confirms "ok", fails "retry" once and "dead" always.
type memPublisher struct {
	mu    sync.Mutex
	tries map[string]int
	tried chan struct{} // closed at the first publish attempt
}

// initLocked makes p's map and channel; p.mu is held.
func (p *memPublisher) initLocked() {
	if p.tries == nil {
		p.tries = map[string]int{}
		p.tried = make(chan struct{})
	}
}

// attempted is closed once a message was offered to p.
func (p *memPublisher) attempted() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.initLocked()
	return p.tried
}

func (p *memPublisher) Publish(_ context.Context, msgs []*outbox.Message) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.initLocked()
	if len(p.tries) == 0 && len(msgs) > 0 {
		close(p.tried)
	}
	var pe outbox.PublishError
	for i, m := range msgs {
		p.tries[m.ID]++
		switch string(m.Payload) {
		case "retry":
			if p.tries[m.ID] > 1 {
				continue
			}
		case "dead":
		default:
			continue
		}
		if pe.Failed == nil {
			pe.Failed = map[int]error{}
		}
		pe.Failed[i] = fmt.Errorf("nacked (%s)", m.Payload)
	}
	if pe.Failed != nil {
		return &pe
	}
	return nil
}

func TestMetricNames(t *testing.T) {
	for expr, want := range map[string][]string{
		`sum by (idem_scope) (rate(idem_claims_total{idem_outcome="duplicate", idem_scope=~"$scope"}[$__rate_interval]))`: {"idem_claims_total"},
		`histogram_quantile(0.99, sum by (le) (rate(idem_outbox_delay_seconds_bucket[5m])))`:                              {"idem_outbox_delay_seconds_bucket"},
		`max by (idem_outbox_table) (idem_outbox_oldest_age_seconds) > 1e3`:                                               {"idem_outbox_oldest_age_seconds"},
		`sum(rate(a_total[1m])) / on (job) group_left sum(rate(b_total{x="y (z)"}[1m])) or vector(0)`:                     {"a_total", "b_total"},
		`idem_outbox_backlog`: {"idem_outbox_backlog"},
		`increase(idem_outbox_dead_total[$__range]) offset 1h`: {"idem_outbox_dead_total"},
	} {
		if got := metricNames(expr); !slices.Equal(got, want) {
			t.Errorf("metricNames(%s) = %q, want %q", expr, got, want)
		}
	}
}
