package bench

import (
	"context"
	"crypto/sha256"
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
				err = httpidem.Tx[pgx.Tx](ctx).QueryRow(ctx, "INSERT INTO "+idemT+ins, o.Amount, o.Currency, o.Customer).Scan(&id)
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
			store, err := redisnx.New(e.rdb, redisnx.Options{Prefix: e.redisPrefix("http"), TTL: redisTTL})
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
		byHand: func(ctx context.Context, e *env) (side, error) {
			h := newHandRedis(e.rdb, e.redisPrefix("httphand"))
			hot := e.id("hot-")
			key, _ := h.keys(replayScope, hot)
			if err := h.rdb.Set(ctx, key, handReplayRecord(), redisTTL).Err(); err != nil {
				return nil, err
			}
			return httpSide(e, replayByHand(h), hot), nil
		},
	}
}

// replayScope is the scope httpidem gives the requests of the HTTP rows:
// no principal, POST, the route /payments.
const replayScope = "http:0::POST:/payments"

// requestDigest is the commands-by-hand side's own fingerprint of a
// request: SHA-256 of its method, path and body, of the size and about the
// cost of httpidem's (which digests the request otherwise).
func requestDigest(method, path string, body []byte) [sha256.Size]byte {
	d := sha256.New()
	_, _ = io.WriteString(d, method+" "+path+"\n")
	_, _ = d.Write(body)
	var sum [sha256.Size]byte
	d.Sum(sum[:0])
	return sum
}

// handReplayRecord is the done record of the HTTP rows' first request, as
// the commands-by-hand side stores it by hand: 'D', the request's fingerprint, then
// the response's status, Content-Type and Location, one line each, and its
// body (what payments answers).
func handReplayRecord() string {
	fp := requestDigest(http.MethodPost, "/payments", payload)
	return "D" + string(fp[:]) + "201\napplication/json\n/payments/0\n" + `{"id":0,"status":"succeeded"}` + "\n"
}

// replayByHand answers a replay with what httpidem.New sends to Redis for
// one: it reads the body, sends redisnx's claim pipeline for the request's
// key and fingerprint (one round trip), whose SET NX GET returns the
// stored record, checks it is done with the same fingerprint, and answers
// the stored response (see handReplayRecord).
func replayByHand(h *handRedis) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, "bad request", http.StatusBadRequest)
			return
		}
		key, old := h.keys(replayScope, r.Header.Get("Idempotency-Key"))
		fp := requestDigest(r.Method, r.URL.Path, body)
		stored, found, err := h.claim(r.Context(), key, old, inFlight(&fp, handToken()))
		if err != nil {
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
			return
		}
		if !found || len(stored) < 1+sha256.Size || stored[0] != 'D' || stored[1:1+sha256.Size] != string(fp[:]) {
			http.Error(w, "not a replay of a completed request", http.StatusInternalServerError)
			return
		}
		fields := strings.SplitN(stored[1+sha256.Size:], "\n", 4)
		if len(fields) != 4 {
			http.Error(w, "stored response unreadable", http.StatusInternalServerError)
			return
		}
		status, err := strconv.Atoi(fields[0])
		if err != nil {
			http.Error(w, "stored response unreadable", http.StatusInternalServerError)
			return
		}
		hd := w.Header()
		hd.Set("Content-Type", fields[1])
		hd.Set("Location", fields[2])
		hd.Set("Idempotent-Replayed", "true")
		hd.Set("Content-Length", strconv.Itoa(len(fields[3])))
		w.WriteHeader(status)
		_, _ = io.WriteString(w, fields[3])
	})
}
