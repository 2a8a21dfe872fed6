package httpidem_test

import (
	"github.com/jackc/pgx/v5"

	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/adapters/httpidem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/dedup/pgtable"
)

// A payment endpoint behind the middleware, on the in-memory store. The
// client's retry (same key, same body) gets the first response again,
// marked Idempotent-Replayed, and the payment is made once; the same key
// with another body is refused.
func Example() {
	store, err := memstore.New(memstore.Options{})
	if err != nil {
		log.Fatal(err)
	}
	mw, err := httpidem.New(store, httpidem.Options{
		// Who is calling: keys are scoped per principal.
		Principal: func(r *http.Request) string { return r.Header.Get("X-Account") },
	})
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	var charges atomic.Int64
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n := charges.Add(1)
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", fmt.Sprintf("/payments/pay_%d", n))
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, `{"id":"pay_%d"}`, n)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	post := func(key, body string) {
		req, _ := http.NewRequest(http.MethodPost, srv.URL+"/payments", strings.NewReader(body))
		req.Header.Set("X-Account", "acct_1")
		if key != "" {
			req.Header.Set("Idempotency-Key", key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			fmt.Println(err)
			return
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.Header.Get("Content-Type") == "application/problem+json" {
			var p httpidem.Problem
			_ = json.Unmarshal(b, &p)
			fmt.Println(resp.StatusCode, p.Title)
			return
		}
		fmt.Println(resp.StatusCode, string(b), "replayed:", resp.Header.Get("Idempotent-Replayed") == "true")
	}
	post(`"8e03978e-40d5-43e8-bc93-6894a57f9324"`, `{"amount":100}`)
	post(`"8e03978e-40d5-43e8-bc93-6894a57f9324"`, `{"amount":100}`) // the retry
	post(`"8e03978e-40d5-43e8-bc93-6894a57f9324"`, `{"amount":900}`) // same key, other body
	post("", `{"amount":100}`)                                       // no key
	fmt.Println("charges:", charges.Load())
	// Output:
	// 201 {"id":"pay_1"} replayed: false
	// 201 {"id":"pay_1"} replayed: true
	// 422 Idempotency-Key reused
	// 400 Idempotency-Key header missing
	// charges: 1
}

// Check is the middleware's validation on its own: the key, the body (read
// and put back), the scope and the fingerprint, without claiming anything.
func ExampleMiddleware_Check() {
	store, _ := memstore.New(memstore.Options{})
	defer store.Close()
	mw, _ := httpidem.New(store, httpidem.Options{})

	r := httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(`{"amount":100}`))
	r.Header.Set("Idempotency-Key", `"order-17"`)
	key, err := mw.Check(r)
	fmt.Println(key.Scope, key.ID, err)
	body, _ := io.ReadAll(r.Body)
	fmt.Println("handler still reads:", string(body))

	r = httptest.NewRequest(http.MethodPost, "/payments", strings.NewReader(strings.Repeat("x", 2<<20)))
	r.Header.Set("Idempotency-Key", "order-18")
	_, err = mw.Check(r)
	var p *httpidem.Problem
	fmt.Println(errors.As(err, &p), p.Status)

	_, err = mw.Check(httptest.NewRequest(http.MethodGet, "/payments", nil))
	fmt.Println(errors.Is(err, httpidem.ErrNoKey))
	// Output:
	// http:0::POST:/payments order-17 <nil>
	// handler still reads: {"amount":100}
	// true 413
	// true
}

// Keys arrive as RFC 8941 strings (the IETF draft) or bare.
func ExampleParseKey() {
	for _, v := range []string{`"a1b2-c3"`, `a1b2-c3`, `"a\"b"`, "two words", strings.Repeat("k", 256)} {
		key, err := httpidem.ParseKey(v, 0)
		fmt.Printf("%q %v\n", key, err != nil)
	}
	// Output:
	// "a1b2-c3" false
	// "a1b2-c3" false
	// "a\"b" false
	// "" true
	// "" true
}

// A webhook receiver: the signature is checked before the event id is
// claimed, a redelivery is answered 2xx without running the handler, and a
// forged request is refused without touching the store.
func ExampleNewWebhook() {
	store, _ := memstore.New(memstore.Options{})
	secret := []byte("whsec_example")
	wh, err := httpidem.NewWebhook(store, httpidem.WebhookOptions{
		Secrets: [][]byte{secret},
		EventID: httpidem.EventIDJSON("id"),
	})
	if err != nil {
		log.Fatal(err)
	}
	defer store.Close()
	var handled atomic.Int64
	srv := httptest.NewServer(wh.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		handled.Add(1)
		w.WriteHeader(http.StatusOK)
	})))
	defer srv.Close()

	deliver := func(signingSecret []byte) {
		body := []byte(`{"id":"evt_1","type":"payment.succeeded"}`)
		req, _ := http.NewRequest(http.MethodPost, srv.URL, strings.NewReader(string(body)))
		req.Header.Set("Webhook-Signature", httpidem.SignWebhook(signingSecret, time.Now(), body))
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			fmt.Println(err)
			return
		}
		_ = resp.Body.Close()
		fmt.Println(resp.StatusCode, "replayed:", resp.Header.Get("Idempotent-Replayed") == "true")
	}
	deliver([]byte("forged")) // a forged request with the real event id
	deliver(secret)           // the real event
	deliver(secret)           // the provider's redelivery
	fmt.Println("handled:", handled.Load())
	// Output:
	// 401 replayed: false
	// 200 replayed: false
	// 200 replayed: true
	// handled: 1
}

// The client half: one key per operation, the same on every attempt; a
// server error is retried with backoff.
func ExampleNewTransport() {
	tr, err := httpidem.NewTransport(httpidem.TransportOptions{Backoff: consumer.Backoff{Initial: time.Millisecond}})
	if err != nil {
		log.Fatal(err)
	}
	var attempts atomic.Int64
	keys := make(chan string, 10)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		keys <- r.Header.Get("Idempotency-Key")
		if attempts.Add(1) < 3 {
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		w.WriteHeader(http.StatusCreated)
	}))
	defer srv.Close()

	client := &http.Client{Transport: tr}
	ctx := httpidem.WithKey(context.Background(), "order-17-payment")
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, srv.URL, strings.NewReader(`{"amount":100}`))
	resp, err := client.Do(req)
	if err != nil {
		fmt.Println(err)
		return
	}
	_ = resp.Body.Close()
	close(keys)
	fmt.Println(resp.StatusCode, "after", attempts.Load(), "attempts")
	for k := range keys {
		fmt.Println(k)
	}
	// Output:
	// 201 after 3 attempts
	// "order-17-payment"
	// "order-17-payment"
	// "order-17-payment"
}

// The transactional mode on PostgreSQL: the handler writes through the
// request's transaction, which also holds the key's claim and the stored
// response; the client gets the response after the commit. (Not run: it
// needs a database.)
func ExampleNewTx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://localhost/app")
	if err != nil {
		log.Fatal(err)
	}
	store, err := pgtable.New(pool, pgtable.Options{Retention: 24 * time.Hour})
	if err != nil {
		log.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	go func() { _ = store.CleanupLoop(ctx, time.Hour) }()

	mw, err := httpidem.NewTx(store, httpidem.Options{
		Principal: func(r *http.Request) string { return r.Header.Get("X-Account") },
	})
	if err != nil {
		log.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle("POST /payments", mw.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		tx := httpidem.Tx[pgx.Tx](r.Context())
		var id int64
		if err := tx.QueryRow(r.Context(), "INSERT INTO payments (amount) VALUES (100) RETURNING id").Scan(&id); err != nil {
			http.Error(w, "could not record the payment", http.StatusInternalServerError)
			return
		}
		w.WriteHeader(http.StatusCreated)
		_, _ = fmt.Fprintf(w, `{"id":%d}`, id)
	})))
	log.Fatal(http.ListenAndServe(":8080", mux))
}
