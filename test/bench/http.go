package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/adapters/httpidem"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/redisnx"
)

// httpClients is the number of concurrent clients of the HTTP rows.
const httpClients = 8

// httpSide serves h and has httpClients clients POST a payment to it for
// a round. Each request carries a fresh Idempotency-Key, or key when set
// (a replay of a completed request).
func httpSide(e *env, h http.Handler, key string) side {
	return func(ctx context.Context, warm bool) (float64, error) {
		srv := httptest.NewServer(h)
		defer srv.Close()
		tr := &http.Transport{MaxIdleConns: 64, MaxIdleConnsPerHost: 64}
		defer tr.CloseIdleConnections()
		client := &http.Client{Transport: tr}
		return closedLoop(ctx, httpClients, warmedFor(e.size.duration, warm), func(ctx context.Context) error {
			k := key
			if k == "" {
				k = e.id("k-")
			}
			return post(ctx, client, srv.URL, k)
		})
	}
}

func post(ctx context.Context, client *http.Client, url, key string) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/payments", strings.NewReader(string(payload)))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Idempotency-Key", key)
	resp, err := client.Do(req)
	if err != nil {
		return err
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusCreated {
		return fmt.Errorf("POST /payments: %s", resp.Status)
	}
	return nil
}

// payments is the HTTP rows' handler: it decodes the order, runs insert
// (nil: no database) and answers 201 with the payment.
func payments(insert func(ctx context.Context, o order) (int64, error)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var o order
		if err := json.NewDecoder(r.Body).Decode(&o); err != nil {
			http.Error(w, "bad request", http.StatusBadRequest)
			return
		}
		var id int64
		if insert != nil {
			var err error
			if id, err = insert(r.Context(), o); err != nil {
				http.Error(w, err.Error(), http.StatusInternalServerError)
				return
			}
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Location", "/payments/"+strconv.FormatInt(id, 10))
		w.WriteHeader(http.StatusCreated)
		_ = json.NewEncoder(w).Encode(map[string]any{"id": id, "status": "succeeded"})
	})
}

func httpPgRow() row {
	return row{
		path:     "HTTP, first request on pgtable (httpidem.NewTx)",
		baseline: "the handler's own tx (INSERT ... RETURNING), 8 clients",
		target:   0.80, unit: "req/s", floor: httpFloor,
		build: func(ctx context.Context, e *env) (side, side, error) {
			const cols = "id bigserial PRIMARY KEY, amount bigint NOT NULL, currency text NOT NULL, customer text NOT NULL"
			bareT, err := e.table(ctx, "http_bare", cols)
			if err != nil {
				return nil, nil, err
			}
			idemT, err := e.table(ctx, "http_idem", cols)
			if err != nil {
				return nil, nil, err
			}
			claims, err := e.claims(ctx, "http_claims", pgtable.Options{Retention: 24 * time.Hour}) // the middleware's default retention
			if err != nil {
				return nil, nil, err
			}
			mw, err := httpidem.NewTx(claims, httpidem.Options{})
			if err != nil {
				return nil, nil, err
			}
			const ins = " (amount, currency, customer) VALUES ($1, $2, $3) RETURNING id"
			bare := payments(func(ctx context.Context, o order) (id int64, err error) {
				err = pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
					return tx.QueryRow(ctx, "INSERT INTO "+bareT+ins, o.Amount, o.Currency, o.Customer).Scan(&id)
				})
				return id, err
			})
			idem := mw.Handler(payments(func(ctx context.Context, o order) (id int64, err error) {
				err = httpidem.Tx(ctx).QueryRow(ctx, "INSERT INTO "+idemT+ins, o.Amount, o.Currency, o.Customer).Scan(&id)
				return id, err
			}))
			return httpSide(e, bare, ""), httpSide(e, idem, ""), nil
		},
	}
}

func httpReplayRow() row {
	return row{
		path:     "HTTP, replay on redisnx (httpidem.New)",
		baseline: "the bare handler (decode, answer 201), 8 clients",
		target:   0.80, unit: "req/s",
		build: func(ctx context.Context, e *env) (side, side, error) {
			store, err := redisnx.New(e.rdb, redisnx.Options{Prefix: e.redisPrefix("http"), TTL: 10 * time.Minute})
			if err != nil {
				return nil, nil, err
			}
			mw, err := httpidem.New(store, httpidem.Options{})
			if err != nil {
				return nil, nil, err
			}
			idem := mw.Handler(payments(nil))
			// The replayed key: completed once, then every request of the
			// idem side is its replay.
			hot := e.id("hot-")
			srv := httptest.NewServer(idem)
			defer srv.Close()
			if err := post(ctx, srv.Client(), srv.URL, hot); err != nil {
				return nil, nil, err
			}
			return httpSide(e, payments(nil), ""), httpSide(e, idem, hot), nil
		},
	}
}
