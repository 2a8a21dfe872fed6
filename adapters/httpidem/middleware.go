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
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/backoff"
	"github.com/idemkit/idem/internal/leasekeep"
	"github.com/idemkit/idem/internal/telemetry"
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
	tx     dedup.TxStore[pgx.Tx]
	// check builds a request's key: Check for the Idempotency-Key header,
	// the webhook's verifier for webhooks.
	check func(r *http.Request) (dedup.Key, error)
	// claim claims a key on the lease store, batched or not.
	claim func(ctx context.Context, key dedup.Key) (*dedup.Lease, error)
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
	m.setClaim()
	m.setTelemetry(store)
	return m, nil
}

// setClaim picks how lease claims are sent, batched (Options.BatchClaims)
// or one by one, and makes the keeper of the leases.
func (m *Middleware) setClaim() {
	m.keeper = leasekeep.New(m.lease, m.opts.Logger, "httpidem")
	m.claim = m.lease.Claim
	if bs, ok := m.lease.(dedup.BatchLeaseStore); ok && m.opts.BatchClaims > 0 {
		b := &batcher{store: bs, lanes: m.opts.BatchClaims, timeout: m.opts.FinishTimeout}
		m.claim = b.claim
	}
}

// NewTx returns a Middleware on a transactional store: a *pgtable.Store (or
// a *twolevel.Store in front of one).
//
// Per request it calls store.Process: the key's claim, everything the
// handler writes through Tx(r.Context()) and the encoded response commit in
// one transaction, and the response is sent to the client only after the
// commit. A response that is not to be stored, a handler whose statement
// failed (the transaction is aborted) and a panic roll everything back, so
// a retry runs the handler again. Set pgtable.Options.Retention to
// DefaultRetention (24 hours) for HTTP keys; pgtable defaults to 7 days.
func NewTx(store dedup.TxStore[pgx.Tx], opts Options) (*Middleware, error) {
	if store == nil {
		return nil, errors.New("httpidem: NewTx: store is nil; pass a *pgtable.Store")
	}
	if err := opts.fill("NewTx"); err != nil {
		return nil, err
	}
	m := &Middleware{opts: opts, tx: store}
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
	vals := r.Header.Values(HeaderKey)
	switch {
	case len(vals) == 0 && m.opts.Optional:
		return dedup.Key{}, ErrNoKey
	case len(vals) == 0:
		return dedup.Key{}, newProblem(http.StatusBadRequest, ProblemKeyMissing, "Idempotency-Key header missing",
			fmt.Sprintf("%s requests to this resource need an Idempotency-Key header: a unique value per operation, the same on every retry of it", r.Method))
	case len(vals) > 1:
		return dedup.Key{}, newProblem(http.StatusBadRequest, ProblemKeyInvalid, "Invalid Idempotency-Key",
			"the request has more than one Idempotency-Key field")
	}
	id, err := ParseKey(vals[0], m.opts.MaxKeyLen)
	if err != nil {
		return dedup.Key{}, newProblem(http.StatusBadRequest, ProblemKeyInvalid, "Invalid Idempotency-Key", err.Error())
	}
	body, p := readBody(r, m.opts.MaxBodyBytes)
	if p != nil {
		return dedup.Key{}, p
	}
	route := m.opts.Route(r)
	return dedup.Key{
		Scope:       Scope(m.opts.Principal(r), r.Method, route, dedup.DefaultMaxKeyLen),
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
		return newProblem(http.StatusRequestEntityTooLarge, ProblemBodyTooLarge, "Request body too large",
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
		return nil, newProblem(http.StatusBadRequest, ProblemBodyUnreadable, "Request body unreadable", err.Error())
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

func (m *Middleware) report(r *http.Request, o Outcome, status int, waited time.Duration) {
	if m.opts.OnOutcome != nil {
		m.opts.OnOutcome(r, Report{Outcome: o, Status: status, Waited: waited})
	}
}

// done reports a request that went through the claim: its metrics, then
// Options.OnOutcome.
func (m *Middleware) done(rq *request, r *http.Request, o Outcome, status int, waited time.Duration) {
	m.finish(rq, o, waited)
	m.report(r, o, status, waited)
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
			m.report(r, OutcomePassed, 0, 0)
		}
		next.ServeHTTP(w, r)
		return
	}
	if err != nil {
		var p *Problem
		if !errors.As(err, &p) {
			p = newProblem(http.StatusBadRequest, ProblemKeyInvalid, "Request rejected", err.Error())
		}
		WriteProblem(w, p)
		m.rejected(r, p, start)
		m.report(r, OutcomeRejected, p.Status, 0)
		return
	}
	if m.tx != nil {
		rq := m.begin(r, start) // escapes: Process's callback holds it
		m.serveTx(w, r, next, key, &rq)
		return
	}
	rq := m.begin(r, start) // stays on the stack
	m.serveLease(w, r, next, key, &rq)
}

// answer writes the answer to a claim that did not run the handler.
func (m *Middleware) answer(w http.ResponseWriter, r *http.Request, rq *request, key dedup.Key, err error, waited time.Duration) {
	if stored, ok := dedup.StoredResult(err); ok {
		rec, derr := decodeRecord(stored)
		if derr != nil {
			m.opts.Logger.ErrorContext(r.Context(), "httpidem: the stored response of a completed key cannot be decoded; answering 500",
				slog.String("key_hash", key.Hash()), slog.Any("error", derr))
			p := newProblem(http.StatusInternalServerError, ProblemStoredUnreadable, "Stored response unreadable",
				"the request with this key was processed, but its stored response cannot be replayed")
			WriteProblem(w, p)
			m.done(rq, r, OutcomeStoreError, p.Status, waited)
			return
		}
		replay(w, rec)
		m.done(rq, r, OutcomeReplayed, rec.status, waited)
		return
	}
	var (
		p       *Problem
		outcome Outcome
	)
	switch {
	case errors.Is(err, dedup.ErrFingerprintMismatch):
		p = newProblem(http.StatusUnprocessableEntity, ProblemKeyReused, "Idempotency-Key reused",
			"this key was used with another request (method, path or body); use a new key for a new request")
		outcome = OutcomeMismatch
	case errors.Is(err, dedup.ErrInFlight) || isLockTimeout(err):
		p = newProblem(http.StatusConflict, ProblemInProgress, "Request in progress",
			"a request with this key is still being processed; retry after a while with the same key")
		p.RetryAfter = m.opts.RetryAfter
		outcome = OutcomeInFlight
	case errors.Is(err, dedup.ErrInvalidKey):
		p = newProblem(http.StatusBadRequest, ProblemKeyInvalid, "Invalid Idempotency-Key", err.Error())
		outcome = OutcomeRejected
	default:
		if r.Context().Err() == nil {
			m.opts.Logger.WarnContext(r.Context(), "httpidem: store failed; answering 503",
				slog.String("key_hash", key.Hash()), slog.Any("error", err))
		}
		p = newProblem(http.StatusServiceUnavailable, ProblemStoreUnavailable, "Idempotency store unavailable",
			"the request was not processed; retry with the same key")
		p.RetryAfter = m.opts.RetryAfter
		outcome = OutcomeStoreError
	}
	WriteProblem(w, p)
	m.done(rq, r, outcome, p.Status, waited)
}

// isLockTimeout reports a PostgreSQL lock_timeout (lock_not_available):
// a transactional claim that waited too long for an in-flight first
// request.
func isLockTimeout(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "55P03"
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
	return newProblem(http.StatusInternalServerError, ProblemResponseTooLarge, "Response too large to store",
		fmt.Sprintf("the response was larger than %d bytes, the limit for responses that are stored and replayed", limit))
}

// problemRecord is the stored form of a problem answer.
func problemRecord(p *Problem) *record {
	return &record{
		status: p.Status,
		header: [][2]string{{"Content-Type", ContentTypeProblem}},
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

// Handler outcomes (idem.outcome of idem.handler.duration).
const (
	handledCompleted      = "completed"
	handledReleased       = "released"
	handledLeaseLost      = "lease_lost"
	handledCompleteFailed = "complete_failed"
)

var errPanicked = errors.New("httpidem: the handler panicked")

// serveLease runs a request on a lease store.
func (m *Middleware) serveLease(w http.ResponseWriter, r *http.Request, next http.Handler, key dedup.Key, rq *request) {
	ctx := r.Context()
	start := time.Now()
	var waited time.Duration
	cctx, endClaim := rq.startClaim(ctx, key)
	lease, err := m.claim(cctx, key)
	for err != nil && m.opts.Wait > 0 && inFlight(err) {
		d, ok := m.waitStep(start)
		if !ok {
			break
		}
		rq.waited = true
		if !backoff.Sleep(ctx, d) {
			rq.wait = waitCancelled
			waited = time.Since(start)
			break
		}
		l, nerr := m.claim(cctx, key)
		waited = time.Since(start)
		if clientLeft(ctx, nerr) {
			// The request's context ended during this claim rather than
			// during the pause: the wait was cancelled, and the last
			// answer (in flight) stands.
			rq.wait = waitCancelled
			break
		}
		lease, err = l, nerr
	}
	if err == nil && lease == nil {
		err = errors.New("the store returned neither a lease nor an error")
	}
	o := claimOutcome(err)
	rq.claimed(o, start)
	if endClaim != nil {
		endClaim(spanErr(err), telemetry.AttrOutcome.String(o))
	}
	if err != nil {
		m.answer(w, r, rq, key, err, waited)
		return
	}

	rq.hstart = time.Now()
	c := &call{key: key}
	c.hctx.Init(withCall(m.handlerCtx(ctx), c))
	defer c.hctx.Cancel(nil)
	every := m.opts.ExtendEvery
	if every == 0 {
		every = lease.TTL / 3
	}
	// The beats live as long as the handler runs, not as long as the
	// request's context: a handler that finishes after its client went
	// away keeps its lease until it returns.
	hold := &c.hold
	m.keeper.Start(ctx, hold, lease, every, &c.hctx)
	hctx, endHandle := rq.startSpan(&c.hctx, "idem.handle")
	cw := newCapture(m.opts.MaxResponseBytes)
	returned := false
	defer func() {
		if returned {
			return
		}
		// The handler panicked (or called runtime.Goexit): give the key
		// back so a retry runs, and let the panic go on to the server.
		endSpan(endHandle, errPanicked)
		if hold.Stop() == nil {
			m.release(ctx, c, lease, "the handler panicked")
			rq.handled(handledReleased)
		} else {
			rq.handled(handledLeaseLost)
		}
		m.done(rq, r, OutcomePanicked, 0, waited)
	}()
	next.ServeHTTP(cw, r.WithContext(hctx))
	returned = true
	lost := hold.Stop()
	endSpan(endHandle, nil)

	status, header := cw.final()
	switch {
	case lost != nil:
		// Another request may own the key now: this response cannot be
		// stored. The client still gets it: the effect happened.
		m.opts.Logger.WarnContext(ctx, "httpidem: the lease ran out while the handler ran; its response is sent but not stored",
			slog.String("key_hash", key.Hash()), slog.Any("error", lost))
		cw.send(w)
		rq.handled(handledLeaseLost)
		m.done(rq, r, OutcomeLeaseLost, status, waited)
	case cw.tooLarge:
		p := tooLargeProblem(m.opts.MaxResponseBytes)
		rq.handled(completion(m.complete(ctx, rq, c, lease, problemRecord(p).encode())))
		WriteProblem(w, p)
		m.done(rq, r, OutcomeTooLarge, p.Status, waited)
	case c.released.Load() || !m.opts.StoreResponse(status):
		m.release(ctx, c, lease, "the response is not stored")
		rq.handled(handledReleased)
		cw.send(w)
		m.done(rq, r, OutcomeNotStored, status, waited)
	default:
		rq.handled(completion(m.complete(ctx, rq, c, lease, encodeResponse(status, header, m.opts.ReplayHeaders, cw.body))))
		cw.send(w)
		m.done(rq, r, OutcomeProcessed, status, waited)
	}
}

// completion is the handler outcome of a Complete that returned err.
func completion(err error) string {
	if err != nil {
		return handledCompleteFailed
	}
	return handledCompleted
}

// complete stores the response, in an idem.complete span when traced.
func (m *Middleware) complete(ctx context.Context, rq *request, c *call, lease *dedup.Lease, result []byte) error {
	c.fin.Init(ctx, m.opts.FinishTimeout)
	defer c.fin.Close()
	fctx, end := rq.startSpan(&c.fin, "idem.complete")
	err := m.lease.Complete(fctx, lease, result)
	endSpan(end, err)
	if err != nil {
		// The key stays in flight until its lease runs out; a retry
		// after that runs the handler again. Nothing better can be done
		// for an effect outside a transaction.
		m.opts.Logger.WarnContext(ctx, "httpidem: storing the response failed; the key stays in flight until its lease runs out",
			slog.String("key_hash", lease.Key.Hash()), slog.Any("error", err))
	}
	return err
}

func (m *Middleware) release(ctx context.Context, c *call, lease *dedup.Lease, why string) {
	c.fin.Init(ctx, m.opts.FinishTimeout)
	defer c.fin.Close()
	if err := m.lease.Release(&c.fin, lease); err != nil {
		m.opts.Logger.WarnContext(ctx, "httpidem: releasing the key failed; it stays claimed until its lease runs out",
			slog.String("key_hash", lease.Key.Hash()), slog.String("why", why), slog.Any("error", err))
	}
}

var (
	errNotStored = errors.New("httpidem: response not stored")
	errTooLarge  = errors.New("httpidem: response too large")
)

// txFailed reports whether tx is in a failed state: a statement of the
// handler failed, so nothing it did can commit.
func txFailed(tx pgx.Tx) bool {
	conn := tx.Conn()
	return conn != nil && conn.PgConn().TxStatus() == 'E'
}

// serveTx runs a request on a transactional store.
func (m *Middleware) serveTx(w http.ResponseWriter, r *http.Request, next http.Handler, key dedup.Key, rq *request) {
	ctx := r.Context()
	cw := newCapture(m.opts.MaxResponseBytes)
	c := &call{key: key}
	var (
		ran       bool
		stored    bool // the handler's response was returned for the commit
		waited    time.Duration
		endHandle spanEnd
		hEnd      time.Time
	)
	returned := false
	defer func() {
		if !returned { // the handler panicked: Process rolled back
			endSpan(endHandle, errPanicked)
			if ran {
				rq.handled(handledReleased)
			}
			m.done(rq, r, OutcomePanicked, 0, waited)
		}
	}()
	// The claim may wait in PostgreSQL for an in-flight first request. If
	// the client goes away during that wait, the wait is cancelled; once
	// the handler started, it is not (Options.CancelWithClient aside).
	pctx := m.handlerCtx(ctx)
	var phase atomic.Int32 // 0 claiming, 1 handler started, 2 client gone first
	if !m.opts.CancelWithClient {
		var cancel context.CancelFunc
		pctx, cancel = context.WithCancel(pctx)
		defer cancel()
		stop := context.AfterFunc(ctx, func() {
			if phase.CompareAndSwap(0, 2) {
				cancel()
			}
		})
		defer stop()
	}
	start := time.Now()
	fn := func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		if !m.opts.CancelWithClient && !phase.CompareAndSwap(0, 1) {
			return nil, context.Canceled // the client left before the claim was won
		}
		ran = true
		rq.hstart = time.Now()
		rq.claimed(telemetry.ClaimFirst, start)
		rq.recordClaim(key, start, rq.hstart, telemetry.ClaimFirst, nil)
		c.tx = tx
		hctx, end := rq.startSpan(withCall(ctx, c), "idem.handle")
		endHandle = end
		next.ServeHTTP(cw, r.WithContext(hctx))
		endHandle = nil
		endSpan(end, nil)
		hEnd = time.Now()
		status, header := cw.final()
		switch {
		case cw.tooLarge:
			return nil, errTooLarge
		case c.released.Load() || !m.opts.StoreResponse(status) || txFailed(tx):
			return nil, errNotStored
		}
		stored = true
		return encodeResponse(status, header, m.opts.ReplayHeaders, cw.body), nil
	}
	_, err := m.tx.Process(pctx, key, fn)
	for !ran && err != nil && m.opts.Wait > 0 && inFlight(err) {
		d, ok := m.waitStep(start)
		if !ok {
			break
		}
		rq.waited = true
		if !backoff.Sleep(ctx, d) {
			rq.wait = waitCancelled
			waited = time.Since(start)
			break
		}
		_, nerr := m.tx.Process(pctx, key, fn)
		waited = time.Since(start)
		// pctx ends with context.Canceled when the client leaves, whatever
		// ended ctx (phase 2: the claim had not been won).
		if !ran && (clientLeft(ctx, nerr) || phase.Load() == 2 && errors.Is(nerr, context.Canceled)) {
			rq.wait = waitCancelled
			break
		}
		err = nerr
	}
	returned = true
	end := time.Now()
	if stored && rq.traced {
		telemetry.RecordSpan(rq.ctx, rq.tel.Tracer, "idem.commit", hEnd, end, err)
	}
	switch {
	case !ran:
		o := claimOutcome(err)
		rq.claimed(o, start)
		rq.recordClaim(key, start, end, o, spanErr(err))
		m.answer(w, r, rq, key, err, waited)
	case err == nil:
		rq.handled(handledCompleted)
		cw.send(w)
		status, _ := cw.final()
		m.done(rq, r, OutcomeProcessed, status, waited)
	case dedup.Held(err):
		// The handler ran, but a claim that does not wait for this
		// transaction (pgtable's lease mode on the same table) took the
		// key meanwhile: the transaction rolled back, and err is the
		// verdict on that claim. It is answered as if it had come first:
		// a replay of its response, 409 or 422.
		rq.handled(handledReleased)
		m.answer(w, r, rq, key, err, waited)
	case errors.Is(err, errNotStored):
		rq.handled(handledReleased)
		cw.send(w)
		status, _ := cw.final()
		m.done(rq, r, OutcomeNotStored, status, waited)
	case errors.Is(err, errTooLarge):
		rq.handled(handledReleased)
		p := tooLargeProblem(m.opts.MaxResponseBytes)
		WriteProblem(w, p)
		m.done(rq, r, OutcomeTooLarge, p.Status, waited)
	default:
		// Storing the response or the commit failed after the handler
		// ran. When the connection broke during COMMIT, the transaction
		// may have committed all the same: the key's row says.
		detail := "the request's transaction did not commit; retry with the same key"
		if stored && ctx.Err() == nil {
			rerr := m.commitOutcome(ctx, key)
			if dedup.Held(rerr) {
				// Committed: its stored response is replayed. (Or,
				// having rolled back, another request with the key got
				// it since: answered as a duplicate of that one.)
				if _, committed := dedup.StoredResult(rerr); committed {
					rq.handled(handledCompleted)
				} else {
					rq.handled(handledCompleteFailed)
				}
				m.opts.Logger.WarnContext(ctx, "httpidem: the commit failed after the handler ran; the key's row shows how the request ended, answering from it",
					slog.String("key_hash", key.Hash()), slog.Any("error", err))
				m.answer(w, r, rq, key, rerr, waited)
				return
			}
			if !errors.Is(rerr, errNotCommitted) {
				detail = "the outcome of the request's transaction is unknown; retry with the same key: the response is replayed if it committed"
			}
		}
		rq.handled(handledCompleteFailed)
		if ctx.Err() == nil {
			m.opts.Logger.WarnContext(ctx, "httpidem: the transaction failed after the handler ran; answering 503",
				slog.String("key_hash", key.Hash()), slog.Any("error", err))
		}
		p := newProblem(http.StatusServiceUnavailable, ProblemStoreUnavailable, "Request not completed", detail)
		p.RetryAfter = m.opts.RetryAfter
		WriteProblem(w, p)
		m.done(rq, r, OutcomeStoreError, p.Status, waited)
	}
}

// errNotCommitted is returned by commitOutcome when the transaction of the
// request did not commit.
var errNotCommitted = errors.New("httpidem: the transaction did not commit")

// commitOutcome finds out whether the transaction that ran the handler for
// key committed although its commit failed (the connection broke during
// COMMIT). It claims the key again, in a new transaction on a connection of
// its own, without running the handler: the claim waits until the first
// transaction has ended, then answers with the verdict on its row (a
// duplicate with the stored response: it committed) or wins (it did not:
// errNotCommitted, and the claim is rolled back). Any other error leaves
// the outcome unknown. The wait is bounded by FinishTimeout: a first
// transaction whose backend the server still holds (a network partition)
// must not hold the client for as long as TCP keepalive takes.
func (m *Middleware) commitOutcome(ctx context.Context, key dedup.Key) error {
	ctx, cancel := context.WithTimeout(ctx, m.opts.FinishTimeout)
	defer cancel()
	_, err := m.tx.Process(ctx, key, func(context.Context, pgx.Tx) ([]byte, error) {
		return nil, errNotCommitted
	})
	return err
}
