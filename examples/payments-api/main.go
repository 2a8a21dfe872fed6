// Command payments-api is a small payment API on PostgreSQL whose POST
// /payments is safe to retry: the Idempotency-Key middleware of
// adapters/httpidem runs in transactional mode, so the payment row, its
// outbox message and the stored response commit in one transaction, or
// none of them does.
//
//	go run ./examples/payments-api -postgres postgres://postgres@127.0.0.1:5432/test
//
// Endpoints (the caller is named by the X-User-ID header, a stand-in for
// real authentication):
//
//	POST /idempotency-keys   issue a key, for clients that cannot make one
//	POST /payments           {"amount":100,"currency":"EUR","customer":"cus_1"}, Idempotency-Key required
//	GET  /payments/{id}      read a payment back
package main

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strings"
	"sync"
	"syscall"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/adapters/httpidem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// retention is how long a key and its response are kept: Stripe's 24 hours.
const retention = 24 * time.Hour

func main() {
	var cfg config
	flag.StringVar(&cfg.postgres, "postgres", envOr("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"), "PostgreSQL URL (or DATABASE_URL)")
	flag.StringVar(&cfg.schema, "schema", "", "schema for the tables, kept at the end (default: a fresh payments_api_<random>, dropped at the end unless -keep)")
	flag.BoolVar(&cfg.keep, "keep", false, "keep the fresh schema and its rows at the end")
	flag.StringVar(&cfg.addr, "addr", "127.0.0.1:8080", "listen address")
	flag.BoolVar(&cfg.issuedKeysOnly, "issued-keys-only", false, "accept only keys issued by POST /idempotency-keys")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, cfg, nil)
	stop()
	if err != nil {
		log.Fatal(err)
	}
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

type config struct {
	postgres, schema, addr string
	// issuedKeysOnly refuses keys the server did not issue (for clients
	// whose own ids are not trusted).
	issuedKeysOnly bool
	// keySecret signs issued keys. Defaults to a random secret, so keys
	// issued before a restart are no longer "issued".
	keySecret []byte
	maxConns  int32
	// keep keeps the schema run made up at the end.
	keep bool
	// readTimeout bounds the reading of a request, body included: a client
	// that stalls mid-body is disconnected. Defaults to 15s.
	readTimeout time.Duration
}

// run serves until ctx ends. ready, if not nil, gets the listening address.
// With no schema it makes up a fresh one and drops it at the end, unless
// cfg.keep.
func run(ctx context.Context, cfg config, ready chan<- string) error {
	if cfg.schema == "" {
		cfg.schema = "payments_api_" + strings.ReplaceAll(uuid.NewString()[:8], "-", "")
		if !cfg.keep {
			defer dropSchema(cfg.postgres, cfg.schema)
		}
	}
	a, err := newApp(ctx, cfg)
	if err != nil {
		return err
	}
	defer a.close()
	ln, err := net.Listen("tcp", cfg.addr)
	if err != nil {
		return err
	}
	srv := a.server()
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	slog.Info("payments-api listening", "addr", ln.Addr().String(), "schema", cfg.schema)
	if ready != nil {
		ready <- ln.Addr().String()
	}
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		return err
	}
	if err := <-errc; !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// dropSchema drops the schema the run made up, and everything in it.
func dropSchema(url, schema string) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		slog.Error("payments-api: dropping the schema", "schema", schema, "error", err)
		return
	}
	defer func() { _ = conn.Close(ctx) }()
	if _, err := conn.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{schema}.Sanitize()+" CASCADE"); err != nil {
		slog.Error("payments-api: dropping the schema", "schema", schema, "error", err)
	}
}

// server is the API's HTTP server: a request, body included, must arrive
// within the read timeout, so a client that stalls cannot hold a
// connection (and a goroutine) forever.
func (a *app) server() *http.Server {
	return &http.Server{
		Handler:           a.routes(),
		ReadHeaderTimeout: 5 * time.Second,
		ReadTimeout:       a.cfg.readTimeout,
		WriteTimeout:      a.cfg.readTimeout + 30*time.Second,
		IdleTimeout:       2 * time.Minute,
	}
}

// app holds the API's dependencies.
type app struct {
	cfg      config
	pool     *pgxpool.Pool
	store    *pgtable.Store
	outbox   *pgoutbox.Outbox
	payments string // quoted table name
	idem     *httpidem.Middleware

	stopCleanup context.CancelFunc
	cleanup     sync.WaitGroup
}

func newApp(ctx context.Context, cfg config) (*app, error) {
	if cfg.maxConns == 0 {
		cfg.maxConns = 10
	}
	if cfg.readTimeout == 0 {
		cfg.readTimeout = 15 * time.Second
	}
	if cfg.keySecret == nil {
		cfg.keySecret = make([]byte, 32)
		_, _ = rand.Read(cfg.keySecret)
	}
	pcfg, err := pgxpool.ParseConfig(cfg.postgres)
	if err != nil {
		return nil, fmt.Errorf("-postgres: %w", err)
	}
	pcfg.MaxConns = cfg.maxConns
	// A duplicate that arrives while the first request's transaction is
	// open waits for it in PostgreSQL; past this it is answered 409 and
	// retries later.
	pcfg.ConnConfig.RuntimeParams["lock_timeout"] = "5s"
	pool, err := pgxpool.NewWithConfig(ctx, pcfg)
	if err != nil {
		return nil, err
	}
	a := &app{cfg: cfg, pool: pool}
	if err := a.migrate(ctx); err != nil {
		pool.Close()
		return nil, err
	}
	a.idem, err = httpidem.NewTx(a.store, httpidem.Options{
		Principal:   principal,
		Fingerprint: httpidem.FingerprintJSON, // a retry may re-encode the JSON body
		// The middleware's default replay headers, and the payment id.
		ReplayHeaders: []string{
			"Cache-Control", "Content-Encoding", "Content-Language", "Content-Location",
			"Content-Type", "ETag", "Last-Modified", "Link", "Location", "Vary", "X-Payment-Id",
		},
		Telemetry: consumer.Telemetry{
			Logger: slog.Default(),
		},
	})
	if err != nil {
		pool.Close()
		return nil, err
	}
	cctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	a.stopCleanup = cancel
	a.cleanup.Go(func() {
		// Keys (and their responses) are kept 24 hours, then deleted in
		// batches; published outbox rows likewise.
		_ = a.store.CleanupLoop(cctx, 10*time.Minute)
	})
	a.cleanup.Go(func() { _ = a.outbox.CleanupLoop(cctx, 10*time.Minute) })
	return a, nil
}

func (a *app) migrate(ctx context.Context) error {
	schema := pgx.Identifier{a.cfg.schema}.Sanitize()
	a.payments = pgx.Identifier{a.cfg.schema, "payments"}.Sanitize()
	if _, err := a.pool.Exec(ctx, "CREATE SCHEMA IF NOT EXISTS "+schema); err != nil {
		return err
	}
	// Deliberately no unique constraint on the idempotency key: the
	// middleware is the only thing keeping payments single here, so the
	// tests can count rows. In production a unique index on (principal,
	// idempotency_key) is a cheap second line of defence.
	if _, err := a.pool.Exec(ctx, `CREATE TABLE IF NOT EXISTS `+a.payments+` (
    id              uuid        PRIMARY KEY,
    principal       text        NOT NULL,
    idempotency_key text        NOT NULL,
    amount          bigint      NOT NULL CHECK (amount > 0),
    currency        text        NOT NULL,
    customer        text        NOT NULL,
    status          text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
)`); err != nil {
		return err
	}
	var err error
	a.store, err = pgtable.New(a.pool, pgtable.Options{Schema: a.cfg.schema, Retention: retention})
	if err != nil {
		return err
	}
	if err := a.store.Migrate(ctx); err != nil {
		return err
	}
	a.outbox, err = pgoutbox.New(a.pool, pgoutbox.Options{Schema: a.cfg.schema})
	if err != nil {
		return err
	}
	return a.outbox.Migrate(ctx)
}

func (a *app) close() {
	a.stopCleanup()
	a.cleanup.Wait()
	a.pool.Close()
}

// principal names the caller. X-User-ID stands in for real
// authentication; every route below requires it.
func principal(r *http.Request) string { return r.Header.Get("X-User-ID") }

func (a *app) routes() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("POST /payments", a.authenticated(a.keyPolicy(a.idem.Handler(http.HandlerFunc(a.createPayment)))))
	mux.Handle("GET /payments/{id}", a.authenticated(http.HandlerFunc(a.getPayment)))
	mux.Handle("POST /idempotency-keys", a.authenticated(http.HandlerFunc(a.issueKey)))
	return mux
}

func problem(w http.ResponseWriter, status int, title, detail string) {
	httpidem.WriteProblem(w, &httpidem.Problem{Type: "about:blank", Title: title, Status: status, Detail: detail})
}

func (a *app) authenticated(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		p := principal(r)
		if p == "" {
			problem(w, http.StatusUnauthorized, "Unauthenticated", "send X-User-ID")
			return
		}
		if len(p) > 64 || !utf8.ValidString(p) || strings.ContainsFunc(p, unicode.IsControl) {
			// A client error: retrying it changes nothing.
			problem(w, http.StatusBadRequest, "Invalid X-User-ID", "at most 64 bytes of UTF-8 text")
			return
		}
		next.ServeHTTP(w, r)
	})
}

// Issued keys are "ik_<uuid>_<mac>", the MAC binding the key to the
// principal it was issued to.
func (a *app) signKey(principal, id string) string {
	mac := hmac.New(sha256.New, a.cfg.keySecret)
	mac.Write([]byte(principal + "\x00" + id))
	return "ik_" + id + "_" + hex.EncodeToString(mac.Sum(nil)[:12])
}

func (a *app) issued(principal, key string) bool {
	rest, ok := strings.CutPrefix(key, "ik_")
	if !ok {
		return false
	}
	id, _, ok := strings.Cut(rest, "_")
	return ok && hmac.Equal([]byte(a.signKey(principal, id)), []byte(key))
}

// issueKey answers POST /idempotency-keys: a fresh key for a client that
// cannot make one (a "pre-order" number). The client stores it with its
// operation and sends it with every attempt.
func (a *app) issueKey(w http.ResponseWriter, r *http.Request) {
	key := a.signKey(principal(r), uuid.NewString())
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(http.StatusCreated)
	_ = json.NewEncoder(w).Encode(map[string]any{
		"idempotency_key": key,
		"expires_in":      int(retention.Seconds()),
	})
}

// keyPolicy refuses keys that claim to be issued but are not (or all
// keys not issued, with -issued-keys-only), before the middleware claims
// anything.
func (a *app) keyPolicy(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		key, err := httpidem.ParseKey(r.Header.Get("Idempotency-Key"), 0)
		if err == nil && (strings.HasPrefix(key, "ik_") || a.cfg.issuedKeysOnly) && !a.issued(principal(r), key) {
			problem(w, http.StatusBadRequest, "Idempotency-Key not issued by this server",
				"get a key from POST /idempotency-keys")
			return
		}
		next.ServeHTTP(w, r) // missing or malformed keys are the middleware's to answer
	})
}

type paymentIn struct {
	Amount   int64  `json:"amount"`
	Currency string `json:"currency"`
	Customer string `json:"customer"`
}

type paymentOut struct {
	ID        string    `json:"id"`
	Amount    int64     `json:"amount"`
	Currency  string    `json:"currency"`
	Customer  string    `json:"customer"`
	Status    string    `json:"status"`
	CreatedAt time.Time `json:"created_at"`
}

func (in paymentIn) validate() error {
	switch {
	case in.Amount <= 0:
		return errors.New("amount must be a positive number of minor units")
	case len(in.Currency) != 3 || strings.ToUpper(in.Currency) != in.Currency:
		return errors.New("currency must be an ISO 4217 code such as EUR")
	case in.Customer == "" || len(in.Customer) > 64:
		return errors.New("customer must be a customer id")
	}
	return nil
}

// createPayment runs under the transactional middleware: everything it
// writes through httpidem.Tx commits with the key's claim and this
// response.
func (a *app) createPayment(w http.ResponseWriter, r *http.Request) {
	ctx := r.Context()
	var in paymentIn
	dec := json.NewDecoder(r.Body)
	dec.DisallowUnknownFields()
	err := dec.Decode(&in)
	if err == nil {
		err = in.validate()
	}
	if err != nil {
		// Nothing happened: do not store this answer, so the same key
		// can be sent again with a corrected body.
		httpidem.Release(ctx)
		problem(w, http.StatusBadRequest, "Invalid payment", err.Error())
		return
	}
	key, _ := httpidem.RequestKey(ctx)
	tx := httpidem.Tx[pgx.Tx](ctx)
	p := paymentOut{ID: uuid.NewString(), Amount: in.Amount, Currency: in.Currency, Customer: in.Customer, Status: "succeeded"}
	err = tx.QueryRow(ctx, "INSERT INTO "+a.payments+
		" (id, principal, idempotency_key, amount, currency, customer, status) VALUES ($1, $2, $3, $4, $5, $6, $7) RETURNING created_at",
		p.ID, principal(r), key.ID, p.Amount, p.Currency, p.Customer, p.Status).Scan(&p.CreatedAt)
	if err == nil {
		event, _ := json.Marshal(map[string]any{"type": "payment.succeeded", "payment": p})
		_, err = a.outbox.Enqueue(ctx, tx, outbox.Message{Topic: "payments", Key: []byte(p.ID), Payload: event})
	}
	if err != nil {
		// Roll back the payment and do not store this answer: the
		// client's retry with the same key runs again.
		httpidem.Release(ctx)
		slog.ErrorContext(ctx, "payments-api: recording a payment failed", slog.Any("error", err))
		problem(w, http.StatusServiceUnavailable, "Payment not recorded", "try again with the same key")
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Location", "/payments/"+p.ID)
	w.Header().Set("X-Payment-Id", p.ID)
	w.WriteHeader(http.StatusCreated)
	_ = json.NewEncoder(w).Encode(p)
}

func (a *app) getPayment(w http.ResponseWriter, r *http.Request) {
	id, err := uuid.Parse(r.PathValue("id"))
	if err != nil {
		problem(w, http.StatusNotFound, "No such payment", "")
		return
	}
	var p paymentOut
	err = a.pool.QueryRow(r.Context(), "SELECT id, amount, currency, customer, status, created_at FROM "+a.payments+
		" WHERE id = $1 AND principal = $2", id, principal(r)).Scan(&p.ID, &p.Amount, &p.Currency, &p.Customer, &p.Status, &p.CreatedAt)
	if errors.Is(err, pgx.ErrNoRows) {
		problem(w, http.StatusNotFound, "No such payment", "")
		return
	}
	if err != nil {
		problem(w, http.StatusServiceUnavailable, "Database unavailable", "")
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(p)
}
