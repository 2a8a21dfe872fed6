package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	"github.com/idemkit/idem/adapters/httpidem"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m, testenv.LeakOptions()...) }

type testAPI struct {
	a   *app
	url string
}

func newTestAPI(t *testing.T, cfg config) *testAPI {
	t.Helper()
	admin := testenv.Pool(t, 2) // skips, or fails under CI=true, without PostgreSQL
	cfg.postgres = testenv.PostgresURL()
	cfg.schema = testenv.Schema(t, admin)
	a, err := newApp(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(a.close)
	srv := httptest.NewUnstartedServer(nil)
	srv.Config = a.server()
	srv.Start()
	t.Cleanup(srv.Close)
	return &testAPI{a: a, url: srv.URL}
}

func (api *testAPI) count(t *testing.T, table string) int {
	t.Helper()
	var n int
	if err := api.a.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

type reply struct {
	status int
	header http.Header
	body   []byte
}

func (r reply) replayed() bool { return r.header.Get("Idempotent-Replayed") == "true" }

func (api *testAPI) call(client *http.Client, method, path, user, key, body string) (reply, error) {
	req, err := http.NewRequest(method, api.url+path, strings.NewReader(body))
	if err != nil {
		return reply{}, err
	}
	if user != "" {
		req.Header.Set("X-User-ID", user)
	}
	if key != "" {
		req.Header.Set("Idempotency-Key", key)
	}
	if client == nil {
		client = http.DefaultClient
	}
	resp, err := client.Do(req)
	if err != nil {
		return reply{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return reply{resp.StatusCode, resp.Header, b}, err
}

func (api *testAPI) must(t *testing.T, method, path, user, key, body string) reply {
	t.Helper()
	r, err := api.call(nil, method, path, user, key, body)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func (api *testAPI) issueKey(t *testing.T, user string) string {
	t.Helper()
	r := api.must(t, http.MethodPost, "/idempotency-keys", user, "", "")
	var out struct {
		Key string `json:"idempotency_key"`
	}
	if err := json.Unmarshal(r.body, &out); err != nil || r.status != http.StatusCreated || out.Key == "" {
		t.Fatalf("issue key: %d %s", r.status, r.body)
	}
	return out.Key
}

const payBody = `{"amount":4200,"currency":"EUR","customer":"cus_8Rn2xM"}`

func TestPaymentFlow(t *testing.T) {
	api := newTestAPI(t, config{})
	key := api.issueKey(t, "alice")

	first := api.must(t, http.MethodPost, "/payments", "alice", key, payBody)
	if first.status != http.StatusCreated || first.replayed() {
		t.Fatalf("first: %d %s", first.status, first.body)
	}
	var p paymentOut
	if err := json.Unmarshal(first.body, &p); err != nil {
		t.Fatal(err)
	}
	// The retry (here with the same JSON re-encoded) gets the same payment.
	again := api.must(t, http.MethodPost, "/payments", "alice", key, `{ "customer": "cus_8Rn2xM", "currency": "EUR", "amount": 4200 }`)
	if again.status != http.StatusCreated || !again.replayed() || !bytes.Equal(again.body, first.body) ||
		again.header.Get("Location") != "/payments/"+p.ID || again.header.Get("X-Payment-Id") != p.ID {
		t.Fatalf("retry: %d replayed=%v %s %v", again.status, again.replayed(), again.body, again.header)
	}
	if r := api.must(t, http.MethodGet, "/payments/"+p.ID, "alice", "", ""); r.status != http.StatusOK {
		t.Fatalf("GET: %d", r.status)
	}
	if r := api.must(t, http.MethodGet, "/payments/"+p.ID, "bob", "", ""); r.status != http.StatusNotFound {
		t.Fatalf("bob reads alice's payment: %d", r.status)
	}
	// Same key, another amount → 422.
	if r := api.must(t, http.MethodPost, "/payments", "alice", key, strings.Replace(payBody, "4200", "9900", 1)); r.status != http.StatusUnprocessableEntity {
		t.Fatalf("other body: %d %s", r.status, r.body)
	}
	// No key → 400; no user → 401; a forged "issued" key → 400.
	if r := api.must(t, http.MethodPost, "/payments", "alice", "", payBody); r.status != http.StatusBadRequest {
		t.Fatalf("no key: %d", r.status)
	}
	if r := api.must(t, http.MethodPost, "/payments", "", "k-1", payBody); r.status != http.StatusUnauthorized {
		t.Fatalf("no user: %d", r.status)
	}
	if r := api.must(t, http.MethodPost, "/payments", "bob", key, payBody); r.status != http.StatusBadRequest {
		t.Fatalf("alice's issued key used by bob: %d", r.status)
	}
	// An invalid body is not stored: the same key works once corrected.
	if r := api.must(t, http.MethodPost, "/payments", "alice", "client-key-1", `{"amount":-5,"currency":"EUR","customer":"c"}`); r.status != http.StatusBadRequest {
		t.Fatalf("invalid payment: %d", r.status)
	}
	if r := api.must(t, http.MethodPost, "/payments", "alice", "client-key-1", payBody); r.status != http.StatusCreated || r.replayed() {
		t.Fatalf("corrected payment: %d replayed=%v", r.status, r.replayed())
	}
	if n, m := api.count(t, api.a.payments), api.count(t, api.a.outbox.Table()); n != 2 || m != 2 {
		t.Fatalf("%d payments and %d outbox messages, want 2 and 2", n, m)
	}
}

// A load of 2,000 requests with one key from 200 concurrent
// clients. Exactly one payment (and one outbox message); every answer is
// that payment.
func TestTwoThousandRequestsOneKey(t *testing.T) {
	api := newTestAPI(t, config{maxConns: 10})
	const total, concurrency = 2000, 200
	tr := &http.Transport{MaxIdleConns: concurrency, MaxIdleConnsPerHost: concurrency}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr}
	var (
		next       atomic.Int64
		first      atomic.Int64
		replays    atomic.Int64
		conflicts  atomic.Int64
		mu         sync.Mutex
		paymentIDs = map[string]int{}
		wg         sync.WaitGroup
	)
	for range concurrency {
		wg.Go(func() {
			for next.Add(1) <= total {
				r, err := api.call(client, http.MethodPost, "/payments", "user-42", "6ffb5b42-6c1e-4c45-8b93-9d9b7b6b3f01", payBody)
				if err != nil {
					t.Error(err)
					return
				}
				switch {
				case r.status == http.StatusConflict:
					conflicts.Add(1)
					continue
				case r.status != http.StatusCreated:
					t.Errorf("status %d: %s", r.status, r.body)
					return
				case r.replayed():
					replays.Add(1)
				default:
					first.Add(1)
				}
				var p paymentOut
				if err := json.Unmarshal(r.body, &p); err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				paymentIDs[p.ID]++
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	t.Logf("%d requests: %d processed, %d replayed, %d answered 409", total, first.Load(), replays.Load(), conflicts.Load())
	if first.Load() != 1 || len(paymentIDs) != 1 || first.Load()+replays.Load()+conflicts.Load() != total {
		t.Fatalf("processed %d, payment ids in answers %v", first.Load(), paymentIDs)
	}
	if n, m := api.count(t, api.a.payments), api.count(t, api.a.outbox.Table()); n != 1 || m != 1 {
		t.Fatalf("%d payment rows and %d outbox messages, want exactly 1 and 1", n, m)
	}
}

func TestTwoPrincipalsOneKey(t *testing.T) {
	api := newTestAPI(t, config{})
	a := api.must(t, http.MethodPost, "/payments", "alice", "shared-key", payBody)
	b := api.must(t, http.MethodPost, "/payments", "bob", "shared-key", payBody)
	if a.status != http.StatusCreated || b.status != http.StatusCreated || b.replayed() || bytes.Equal(a.body, b.body) {
		t.Fatalf("alice %d, bob %d replayed=%v", a.status, b.status, b.replayed())
	}
	if n := api.count(t, api.a.payments); n != 2 {
		t.Fatalf("%d payments, want 2", n)
	}
}

func TestIssuedKeysOnly(t *testing.T) {
	api := newTestAPI(t, config{issuedKeysOnly: true})
	if r := api.must(t, http.MethodPost, "/payments", "alice", "my-own-key", payBody); r.status != http.StatusBadRequest {
		t.Fatalf("a client's own key: %d", r.status)
	}
	if r := api.must(t, http.MethodPost, "/payments", "alice", api.issueKey(t, "alice"), payBody); r.status != http.StatusCreated {
		t.Fatalf("an issued key: %d %s", r.status, r.body)
	}
}

// TestRun starts the program as main does, on a free port, and pays
// through the retrying client.
//
// Without -schema it makes up a schema and drops it at the end.
func TestRun(t *testing.T) {
	admin := testenv.Pool(t, 2)
	schemas := func() []string {
		t.Helper()
		rows, _ := admin.Query(context.Background(), "SELECT nspname FROM pg_namespace WHERE nspname LIKE 'payments\\_api\\_%' ORDER BY 1")
		names, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return names
	}
	before := schemas()
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan string, 1)
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, config{postgres: testenv.PostgresURL(), addr: "127.0.0.1:0", maxConns: 4}, ready)
	}()
	var addr string
	select {
	case addr = <-ready:
	case err := <-done:
		t.Fatal(err)
	}
	tr, err := httpidem.NewTransport(httpidem.TransportOptions{})
	if err != nil {
		t.Fatal(err)
	}
	base := http.DefaultTransport.(*http.Transport)
	defer base.CloseIdleConnections()
	req, _ := http.NewRequest(http.MethodPost, fmt.Sprintf("http://%s/payments", addr), strings.NewReader(payBody))
	req.Header.Set("X-User-ID", "carol")
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		t.Fatalf("payment through the running server: %d", resp.StatusCode)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("run: %v", err)
	}
	if after := schemas(); !slices.Equal(after, before) {
		t.Errorf("schemas payments_api_* before the run %v, after %v: the run left its schema behind", before, after)
	}
}

// TestStalledBody sends the headers and 10 of the 50 bytes of a body, then
// nothing: the server must give up on the request and close the connection
// rather than hold it.
func TestStalledBody(t *testing.T) {
	api := newTestAPI(t, config{readTimeout: 200 * time.Millisecond})
	conn, err := net.Dial("tcp", strings.TrimPrefix(api.url, "http://"))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_, err = io.WriteString(conn, "POST /payments HTTP/1.1\r\nHost: api\r\nX-User-ID: dave\r\nIdempotency-Key: stall-1\r\n"+
		"Content-Type: application/json\r\nContent-Length: 50\r\n\r\n"+payBody[:10])
	if err != nil {
		t.Fatal(err)
	}
	// The deadline only keeps a failing test from hanging forever.
	_ = conn.SetReadDeadline(time.Now().Add(time.Minute))
	_, err = io.ReadAll(conn)
	if errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatal("the server still holds a connection whose body stalled")
	}
	if n := api.count(t, api.a.payments); n != 0 {
		t.Errorf("%d payments from a stalled request", n)
	}
}

// TestInvalidUserID checks that an X-User-ID that is not UTF-8 text is a
// client error (400), which a retrying client does not retry.
func TestInvalidUserID(t *testing.T) {
	api := newTestAPI(t, config{})
	for _, user := range []string{"\xff\xfe", strings.Repeat("u", 65)} {
		r := api.must(t, http.MethodPost, "/payments", user, "bad-user-1", payBody)
		if r.status != http.StatusBadRequest {
			t.Errorf("X-User-ID %q: %d %s, want 400", user, r.status, r.body)
		}
	}
	if n := api.count(t, api.a.payments); n != 0 {
		t.Errorf("%d payments from invalid callers", n)
	}
}
