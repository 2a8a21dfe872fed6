package httpidem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"time"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/leasekeep"
)

// ErrNoKey is returned by Middleware.Check for a request that does not go
// through deduplication: its method is not in Options.Methods, or it has no
// key and Options.Optional is set.
var ErrNoKey = errors.New("httpidem: the request has no idempotency key and needs none")

// Middleware deduplicates requests by their Idempotency-Key. Build it with
// New (lease stores) or NewTx (transactional stores); it is safe for
// concurrent use.
type Middleware struct {
	opts  Options
	lease dedup.LeaseStore
	// keeper extends the leases of the handlers in flight (lease stores).
	keeper *leasekeep.Keeper
	tx     txStore
	// check builds a request's key: Check for the Idempotency-Key header,
	// the webhook's verifier for webhooks.
	check func(r *http.Request) (dedup.Key, error)
	// ins are the metrics.
	ins *instruments
}

// New returns a Middleware on a lease store: dedup/memstore,
// dedup/redisnx, the lease mode of dedup/pgtable (Store.Lease), or any
// other dedup.LeaseStore.
//
// Per request it claims the key before the handler runs, extends the lease
// while the handler runs, stores the encoded response as the lease's result
// when the handler returns (Complete), and releases the key when the
// response is not to be stored or the handler panicked. How long completed
// keys are kept is the store's retention (memstore and redisnx: 24 hours by
// default).
func New(store dedup.LeaseStore, opts Options) (*Middleware, error) {
	if store == nil {
		return nil, errors.New("httpidem: New: store is nil; pass a dedup.LeaseStore such as memstore.New, redisnx.New or pgtable.Store.Lease")
	}
	if err := opts.fill("New"); err != nil {
		return nil, err
	}
	m := &Middleware{opts: opts, lease: store}
	m.check = m.Check
	m.keeper = leasekeep.New(store, opts.Logger, "httpidem")
	m.setTelemetry(store)
	return m, nil
}

// NewTx returns a Middleware on a transactional store: a *pgtable.Store
// (Tx is pgx.Tx), a *sqltable.Store (Tx is *sql.Tx: PostgreSQL, MySQL,
// MariaDB or SQLite through database/sql), or a *twolevel.Store in front of
// either. The handler reaches the transaction with Tx[T](r.Context()).
//
// Per request it calls store.Process: the key's claim, everything the
// handler writes through Tx[T](r.Context()) and the encoded response commit in
// one transaction, and the response is sent to the client only after the
// commit. A response that is not to be stored, a handler whose statement
// failed (the transaction is aborted) and a panic roll everything back, so
// a retry runs the handler again. Set pgtable.Options.Retention to 24
// hours for HTTP keys; pgtable defaults to 7 days.
func NewTx[Tx any](store dedup.TxStore[Tx], opts Options) (*Middleware, error) {
	if store == nil {
		return nil, errors.New("httpidem: NewTx: store is nil; pass a *pgtable.Store or a *sqltable.Store")
	}
	if err := opts.fill("NewTx"); err != nil {
		return nil, err
	}
	m := &Middleware{opts: opts, tx: eraseTx(store)}
	m.check = m.Check
	m.setTelemetry(store)
	return m, nil
}

// Options returns the middleware's options with the defaults filled in.
func (m *Middleware) Options() Options { return m.opts }

// Handler returns next wrapped in the middleware. Requests whose method is
// not in Options.Methods go straight to next. It panics if next is nil, as
// http.Handle does.
func (m *Middleware) Handler(next http.Handler) http.Handler {
	if next == nil {
		panic("httpidem: Handler: next is nil")
	}
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		m.serve(w, r, next)
	})
}

func (m *Middleware) handles(method string) bool {
	return slices.Contains(m.opts.Methods, method)
}

// Check is the middleware's check on its own, for frameworks that do not
// use http.Handler or for code that answers itself. It validates the
// request's Idempotency-Key, reads the body (bounded by MaxBodyBytes) and
// puts it back in r.Body (and r.GetBody) for the handler, and returns the
// request's dedup key: scope from principal, method and route, the id, and
// the fingerprint.
//
// It returns ErrNoKey when the request needs no key, and a *Problem (400
// or 413) when it is to be rejected; write it with WriteProblem. Nothing is
// claimed or stored.
func (m *Middleware) Check(r *http.Request) (dedup.Key, error) {
	if !m.handles(r.Method) {
		return dedup.Key{}, ErrNoKey
	}
	vals := r.Header.Values(headerKey)
	switch {
	case len(vals) == 0 && m.opts.Optional:
		return dedup.Key{}, ErrNoKey
	case len(vals) == 0:
		return dedup.Key{}, newProblem(http.StatusBadRequest, problemKeyMissing, "Idempotency-Key header missing",
			fmt.Sprintf("%s requests to this resource need an Idempotency-Key header: a unique value per operation, the same on every retry of it", r.Method))
	case len(vals) > 1:
		return dedup.Key{}, newProblem(http.StatusBadRequest, problemKeyInvalid, "Invalid Idempotency-Key",
			"the request has more than one Idempotency-Key field")
	}
	id, err := ParseKey(vals[0], m.opts.MaxKeyLen)
	if err != nil {
		return dedup.Key{}, newProblem(http.StatusBadRequest, problemKeyInvalid, "Invalid Idempotency-Key", err.Error())
	}
	body, p := readBody(r, m.opts.MaxBodyBytes)
	if p != nil {
		return dedup.Key{}, p
	}
	route := m.opts.Route(r)
	return dedup.Key{
		Scope:       keyScope(m.opts.Principal(r), r.Method, route, dedup.DefaultMaxKeyLen),
		ID:          id,
		Fingerprint: m.opts.Fingerprint(r, route, body),
	}, nil
}

// readBody reads the whole body, at most limit bytes, and puts it back.
func readBody(r *http.Request, limit int64) ([]byte, *Problem) {
	if r.Body == nil || r.Body == http.NoBody {
		return nil, nil
	}
	tooLarge := func() *Problem {
		return newProblem(http.StatusRequestEntityTooLarge, problemBodyTooLarge, "Request body too large",
			fmt.Sprintf("the limit for requests with an Idempotency-Key is %d bytes", limit))
	}
	if r.ContentLength > limit {
		return nil, tooLarge()
	}
	// Room for the announced length and one byte more, so the read that
	// finds the end needs no larger buffer; 512 bytes when unknown.
	hint := int64(bytes.MinRead)
	if r.ContentLength > 0 {
		hint = r.ContentLength + 1
	}
	data, err := readAtMost(r.Body, make([]byte, 0, hint), limit+1)
	if int64(len(data)) > limit {
		return nil, tooLarge()
	}
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			return nil, tooLarge()
		}
		return nil, newProblem(http.StatusBadRequest, problemBodyUnreadable, "Request body unreadable", err.Error())
	}
	_ = r.Body.Close()
	r.Body = newBodyReader(data)
	r.GetBody = func() (io.ReadCloser, error) { return newBodyReader(data), nil }
	return data, nil
}

// readAtMost appends what src holds to buf until EOF, or until buf holds
// limit bytes. A reader that ends with io.EOF is no error.
func readAtMost(src io.Reader, buf []byte, limit int64) ([]byte, error) {
	for int64(len(buf)) < limit {
		if len(buf) == cap(buf) {
			buf = slices.Grow(buf, int(min(limit-int64(len(buf)), int64(max(len(buf), bytes.MinRead)))))
		}
		free := buf[len(buf):cap(buf)]
		if rest := limit - int64(len(buf)); int64(len(free)) > rest {
			free = free[:rest]
		}
		n, err := src.Read(free)
		buf = buf[:len(buf)+n]
		if errors.Is(err, io.EOF) {
			return buf, nil
		}
		if err != nil {
			return buf, err
		}
	}
	return buf, nil
}

// bodyReader is the request body put back after readBody: a bytes.Reader
// that closes, in one allocation (io.NopCloser around a bytes.Reader takes
// two).
type bodyReader struct{ bytes.Reader }

func newBodyReader(data []byte) *bodyReader {
	b := new(bodyReader)
	b.Reset(data)
	return b
}

// Close does nothing: the body is in memory.
func (*bodyReader) Close() error { return nil }

// report calls Options.OnOutcome.
func (m *Middleware) report(r *http.Request, o outcome, key dedup.Key, status int, waited time.Duration, err error) {
	if m.opts.OnOutcome != nil {
		m.opts.OnOutcome(r.Context(), consumer.Report{
			Outcome: o.public(m.tx != nil), Key: key, Status: status, Waited: waited, Err: err,
		})
	}
}

// done reports a request that went through the claim: its metrics, then
// Options.OnOutcome.
func (m *Middleware) done(rq *request, r *http.Request, o outcome, status int, err error) {
	m.finish(rq, o)
	m.report(r, o, rq.key, status, rq.waitedFor, err)
}

// rejected records the metrics of a request answered before any claim.
func (m *Middleware) rejected(r *http.Request, p *Problem, start time.Time) {
	claim, result, reason := rejection(p)
	tel := m.ins.Get(m.opts.MetricScope(r))
	if claim != "" {
		tel.Claimed(r.Context(), claim, 0)
	}
	m.ins.msgs.Result(r.Context(), tel.Scope(), result, reason, time.Since(start))
}

func (m *Middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	start := time.Now()
	key, err := m.check(r)
	if errors.Is(err, ErrNoKey) {
		if m.handles(r.Method) {
			m.report(r, outcomePassed, dedup.Key{}, 0, 0, nil)
		}
		next.ServeHTTP(w, r)
		return
	}
	if err != nil {
		var p *Problem
		if !errors.As(err, &p) {
			p = newProblem(http.StatusBadRequest, problemKeyInvalid, "Request rejected", err.Error())
		}
		WriteProblem(w, p)
		m.rejected(r, p, start)
		m.report(r, outcomeRejected, dedup.Key{}, p.Status, 0, err)
		return
	}
	if m.tx != nil {
		rq := m.begin(r, key, start) // escapes: Process's callback holds it
		m.serveTx(w, r, next, key, &rq)
		return
	}
	rq := m.begin(r, key, start) // stays on the stack
	m.serveLease(w, r, next, key, &rq)
}

// answer writes the answer to a claim that did not run the handler.
func (m *Middleware) answer(w http.ResponseWriter, r *http.Request, rq *request, err error) {
	key := rq.key
	if stored, ok := dedup.StoredResult(err); ok {
		rec, derr := decodeRecord(stored)
		if derr != nil {
			m.opts.Logger.ErrorContext(r.Context(), "httpidem: the stored response of a completed key cannot be decoded; answering 500",
				slog.String("key_hash", key.Hash()), slog.Any("error", derr))
			p := newProblem(http.StatusInternalServerError, problemStoredUnreadable, "Stored response unreadable",
				"the request with this key was processed, but its stored response cannot be replayed")
			WriteProblem(w, p)
			m.done(rq, r, outcomeStoreError, p.Status, derr)
			return
		}
		replay(w, rec)
		m.done(rq, r, outcomeReplayed, rec.status, nil)
		return
	}
	var (
		p *Problem
		o outcome
	)
	switch {
	case errors.Is(err, dedup.ErrFingerprintMismatch):
		p = newProblem(http.StatusUnprocessableEntity, problemKeyReused, "Idempotency-Key reused",
			"this key was used with another request (method, path or body); use a new key for a new request")
		o = outcomeMismatch
	case inFlight(err):
		p = newProblem(http.StatusConflict, problemInProgress, "Request in progress",
			"a request with this key is still being processed; retry after a while with the same key")
		p.RetryAfter = m.opts.RetryAfter
		o = outcomeInFlight
	case errors.Is(err, dedup.ErrInvalidKey):
		p = newProblem(http.StatusBadRequest, problemKeyInvalid, "Invalid Idempotency-Key", err.Error())
		o = outcomeRejected
	default:
		if r.Context().Err() == nil {
			m.opts.Logger.WarnContext(r.Context(), "httpidem: store failed; answering 503",
				slog.String("key_hash", key.Hash()), slog.Any("error", err))
		}
		// The claim failed: this request ran nothing. What an earlier
		// request with the key did (a commit whose reply was lost, a
		// response whose storing failed) the store cannot say now.
		p = newProblem(http.StatusServiceUnavailable, problemStoreUnavailable, "Idempotency store unavailable",
			"this request was not run: the idempotency store could not be reached. Whether an earlier request with this key was processed is unknown; retry with the same key: the stored response of a processed request is replayed")
		p.RetryAfter = m.opts.RetryAfter
		o = outcomeStoreError
	}
	WriteProblem(w, p)
	m.done(rq, r, o, p.Status, err)
}

func inFlight(err error) bool {
	return errors.Is(err, dedup.ErrInFlight) || isLockTimeout(err)
}

// clientLeft reports whether a claim retried during a wait failed because
// the request's context ended (the client went away, or a deadline set
// around the middleware passed) while it ran. Such a wait counts as
// cancelled, as if the context had ended during the pause.
func clientLeft(ctx context.Context, err error) bool {
	if err == nil || ctx.Err() == nil {
		return false
	}
	return errors.Is(err, ctx.Err()) || errors.Is(err, context.Cause(ctx))
}

// waitStep returns how long to sleep before asking the store again, or
// false when Options.Wait is spent.
func (m *Middleware) waitStep(start time.Time) (time.Duration, bool) {
	left := m.opts.Wait - time.Since(start)
	if left <= 0 {
		return 0, false
	}
	return min(left, m.opts.PollInterval), true
}

func tooLargeProblem(limit int) *Problem {
	return newProblem(http.StatusInternalServerError, problemResponseTooLarge, "Response too large to store",
		fmt.Sprintf("the response was larger than %d bytes, the limit for responses that are stored and replayed", limit))
}

// problemRecord is the stored form of a problem answer.
func problemRecord(p *Problem) *record {
	return &record{
		status: p.Status,
		header: [][2]string{{"Content-Type", contentTypeProblem}},
		body:   p.body(),
	}
}

// handlerCtx is the context the handler runs under (see
// Options.CancelWithClient).
func (m *Middleware) handlerCtx(ctx context.Context) context.Context {
	if m.opts.CancelWithClient {
		return ctx
	}
	return context.WithoutCancel(ctx)
}
