package main

import (
	"github.com/jackc/pgx/v5"

	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem/adapters/httpidem"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/outbox"
)

type apiTarget struct {
	ledger  *ledger
	handler http.Handler
}

// paymentBody is what a client sends.
type paymentBody struct {
	Payment  int    `json:"payment"`
	Customer string `json:"customer"`
	Cents    int64  `json:"amount_cents"`
}

// submit sends every payment of the plan to every API from clients
// goroutines.
func submit(ctx context.Context, clients int, pl *plan, apis []apiTarget, submitted *atomic.Int64) {
	next := make(chan *payment)
	var wg sync.WaitGroup
	for range clients {
		wg.Go(func() {
			httpClients := make([]*http.Client, len(apis))
			for i, a := range apis {
				t, err := httpidem.NewTransport(httpidem.TransportOptions{
					Base:        &inProcess{handler: a.handler},
					Backoff:     consumer.Backoff{Initial: time.Millisecond, Max: 10 * time.Millisecond},
					MaxAttempts: 10,
				})
				if err != nil {
					panic(err) // the options are constant
				}
				httpClients[i] = &http.Client{Transport: t}
			}
			for p := range next {
				for i, a := range apis {
					submitOne(ctx, httpClients[i], a.ledger, p)
				}
				submitted.Add(1)
			}
		})
	}
	defer wg.Wait()
	defer close(next)
	for n := range pl.cfg.payments {
		p := pl.payment(n)
		select {
		case next <- &p:
		case <-ctx.Done():
			return
		}
	}
}

// submitOne submits p once, or twice at once when it is double-clicked.
func submitOne(ctx context.Context, c *http.Client, l *ledger, p *payment) {
	body, _ := json.Marshal(paymentBody{Payment: p.n, Customer: p.customer, Cents: p.cents})
	clicks := 1
	if p.doubleClick {
		clicks = 2
	}
	var wg sync.WaitGroup
	for click := 1; click <= clicks; click++ {
		wg.Go(func() {
			cause := causeFirst
			if click == 2 {
				cause = causeDoubleClick
			}
			st := &attemptState{cause: cause, loseFirst: p.loseFirst && click == 1}
			req, err := http.NewRequestWithContext(context.WithValue(ctx, attemptKey{}, st),
				http.MethodPost, "http://payments.demo/payments", bytes.NewReader(body))
			if err != nil {
				return
			}
			req.Header.Set("Content-Type", "application/json")
			req.Header.Set("Idempotency-Key", p.key)
			resp, err := c.Do(req)
			if err != nil {
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			if resp.StatusCode/100 == 2 {
				l.accept(p.n)
			}
		})
	}
	wg.Wait()
}

type attemptKey struct{}

// attemptState follows one request through the Transport's attempts.
type attemptState struct {
	cause     string
	loseFirst bool
	attempts  atomic.Int32
}

// inProcess is an http.RoundTripper that serves requests with a handler in
// this process, and loses the response of a request's first attempt when
// told to: the server did the work, the client saw a timeout and retries
// with the same key.
type inProcess struct {
	handler http.Handler
}

var errResponseLost = errors.New("demo: response lost (client timeout)")

func (t *inProcess) RoundTrip(req *http.Request) (*http.Response, error) {
	st, _ := req.Context().Value(attemptKey{}).(*attemptState)
	attempt := int32(1)
	cause := causeFirst
	if st != nil {
		attempt = st.attempts.Add(1)
		cause = st.cause
	}
	if attempt > 1 {
		cause = causeRetry
	}
	req = req.Clone(req.Context())
	req.Header.Set(headerCause, cause)
	rec := httptest.NewRecorder()
	t.handler.ServeHTTP(rec, req)
	if req.Body != nil {
		_ = req.Body.Close()
	}
	if st != nil && st.loseFirst && attempt == 1 {
		return nil, errResponseLost
	}
	resp := rec.Result()
	resp.Request = req
	return resp, nil
}

// api is the payments endpoint: it accepts a payment and publishes it
// through the outbox. The naive one publishes every request it gets under a
// fresh id; the idem one runs behind the httpidem middleware, once per
// idempotency key, and publishes the key as the message id.
type api struct {
	path   string
	ledger *ledger
	sink   outboxSink
	seq    atomic.Int64
}

// outboxSink is where the APIs put their messages: the demo's in-memory
// relay, or pgoutbox with --postgres.
type outboxSink interface {
	enqueue(r *http.Request, p *paymentBody, msg *outbox.Message) error
}

func isClosed(c <-chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

func (a *api) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	var p paymentBody
	if err := json.Unmarshal(body, &p); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	id := r.Header.Get("Idempotency-Key")
	if a.path == pathNaive {
		id = fmt.Sprintf("naive-%d", a.seq.Add(1))
	}
	msg := &outbox.Message{
		ID:      id,
		Key:     []byte(p.Customer),
		Payload: body,
		Headers: map[string]string{headerPath: a.path, headerRequest: r.Header.Get(headerCause)},
	}
	if err := a.sink.enqueue(r, &p, msg); err != nil {
		http.Error(w, err.Error(), http.StatusServiceUnavailable)
		return
	}
	if httpidem.Tx[pgx.Tx](r.Context()) == nil {
		// Under httpidem.NewTx the payment is accepted when the
		// transaction commits: the client counts it on the response.
		a.ledger.accept(p.Payment)
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusCreated)
	fprintf(w, "{\"id\":%q}\n", id)
}

// relay publishes the outbox's messages in batches. The plan says which
// blocks of payments it crashes after (relayCrashes): it publishes their
// messages, "crashes" before marking them sent, and publishes them again,
// with the same ids, as a restarted relay does.
type relay struct {
	pub         outbox.Publisher
	queue       chan relayed
	closeOnce   sync.Once
	plan        *plan
	published   atomic.Int64
	republished atomic.Int64
	done        chan struct{}
}

// relayed is a message in the relay's queue, with its payment's number.
type relayed struct {
	msg     *outbox.Message
	payment int
}

func (r *relay) enqueue(req *http.Request, p *paymentBody, msg *outbox.Message) error {
	select {
	case r.queue <- relayed{msg: msg, payment: p.Payment}:
		return nil
	case <-req.Context().Done():
		return req.Context().Err()
	}
}

func (r *relay) closeQueue() { r.closeOnce.Do(func() { close(r.queue) }) }

const relayBatch = 100

func (r *relay) run(ctx context.Context) error {
	defer close(r.done)
	var batch, again []*outbox.Message
	for {
		batch, again = batch[:0], again[:0]
		add := func(m relayed) {
			batch = append(batch, m.msg)
			if r.plan.relayCrashes(m.payment / relayBatch) {
				again = append(again, m.msg)
			}
		}
		select {
		case m, ok := <-r.queue:
			if !ok {
				return nil
			}
			add(m)
		case <-ctx.Done():
			return nil
		}
	fill:
		for len(batch) < relayBatch {
			select {
			case m, ok := <-r.queue:
				if !ok {
					break fill
				}
				add(m)
			default:
				break fill
			}
		}
		if err := r.publish(ctx, batch); err != nil {
			return err
		}
		if len(again) > 0 {
			// Crashed after publishing, before marking: the restarted
			// relay finds these unmarked and publishes them again.
			if err := r.publish(ctx, again); err != nil {
				return err
			}
			r.republished.Add(int64(len(again)))
		}
	}
}

// relayAttempts bounds the sends of a message the broker keeps refusing
// (an outbox.PublishError: nacked, returned, unconfirmed).
const relayAttempts = 50

// publish sends batch until every message is confirmed. A message whose
// outcome is unknown is sent again, as the relay does: the whole batch
// after a lost connection or a timeout, the failed messages of an
// outbox.PublishError.
func (r *relay) publish(ctx context.Context, batch []*outbox.Message) error {
	for refused := 0; ; {
		err := r.pub.Publish(ctx, batch)
		if err == nil {
			r.published.Add(int64(len(batch)))
			return nil
		}
		if ctx.Err() != nil {
			return nil
		}
		var pe *outbox.PublishError
		if errors.As(err, &pe) {
			if refused++; refused >= relayAttempts {
				return fmt.Errorf("publish: %w", err)
			}
			r.published.Add(int64(len(batch) - len(pe.Failed)))
			failed := make([]*outbox.Message, 0, len(pe.Failed))
			for i, m := range batch {
				if _, ok := pe.Failed[i]; ok {
					failed = append(failed, m)
				}
			}
			batch = failed
		}
		select {
		case <-time.After(100 * time.Millisecond):
		case <-ctx.Done():
			return nil
		}
	}
}
