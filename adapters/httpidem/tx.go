package httpidem

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/backoff"
	"github.com/idemkit/idem/internal/leasekeep"
	"github.com/idemkit/idem/internal/sqldialect"
	"github.com/idemkit/idem/internal/txflow"
)

var (
	errNotStored = errors.New("httpidem: response not stored")
	errTooLarge  = errors.New("httpidem: response too large")
)

// txStore is a transactional store with its transaction type erased, so
// that a Middleware is one type whatever the store's transaction is.
type txStore interface {
	// process is the store's Process, fn seeing the transaction as any.
	process(ctx context.Context, key dedup.Key, fn dedup.TxFunc[any]) ([]byte, error)
	// aborted reports whether tx is in a failed state: a statement of the
	// handler failed, so nothing it did can commit. False when the store
	// cannot tell.
	aborted(tx any) bool
}

// txAborter is implemented by stores that can tell an aborted transaction
// (pgtable, from the connection's transaction status).
type txAborter[Tx any] interface {
	TxAborted(tx Tx) bool
}

type typedTxStore[Tx any] struct {
	store dedup.TxStore[Tx]
}

func eraseTx[Tx any](store dedup.TxStore[Tx]) txStore { return typedTxStore[Tx]{store} }

func (s typedTxStore[Tx]) process(ctx context.Context, key dedup.Key, fn dedup.TxFunc[any]) ([]byte, error) {
	return s.store.Process(ctx, key, func(ctx context.Context, tx Tx) ([]byte, error) { return fn(ctx, tx) })
}

func (s typedTxStore[Tx]) aborted(tx any) bool {
	a, ok := s.store.(txAborter[Tx])
	if !ok {
		return false
	}
	t, ok := tx.(Tx)
	return ok && a.TxAborted(t)
}

// txRequest is one request's run on a transactional store. It is the
// dedup.TxStore the transaction flow (txflow.Process) runs on: its Process
// claims again while the key is in flight and Options.Wait allows, and
// finds out how a transaction whose commit failed ended, so that the flow
// sees one claim per request, by its final answer.
type txRequest struct {
	m     *Middleware
	ctx   context.Context // the request's
	rq    *request
	phase *atomic.Int32 // 0 claiming, 1 handler started, 2 client gone first
	ran   bool          // the handler started
	// stored: the handler's response was returned for the commit.
	stored bool
	// recheck is the verdict of the claim commitOutcome made after a
	// failed commit, nil when there was none.
	recheck error
}

// Process runs fn in the store's Process, again while the key is in
// flight and Options.Wait allows.
func (t *txRequest) Process(ctx context.Context, key dedup.Key, fn dedup.TxFunc[any]) ([]byte, error) {
	m, rq := t.m, t.rq
	run := func(ctx context.Context, tx any) ([]byte, error) {
		if !m.opts.CancelWithClient && !t.phase.CompareAndSwap(0, 1) {
			return nil, context.Canceled // the client left before the claim was won
		}
		t.ran = true
		return fn(ctx, tx)
	}
	_, err := m.tx.process(ctx, key, run)
	for !t.ran && err != nil && m.opts.Wait > 0 && inFlight(err) {
		d, ok := m.waitStep(rq.start)
		if !ok {
			break
		}
		rq.waited = true
		if !backoff.Sleep(t.ctx, d) {
			rq.wait = waitCancelled
			rq.waitedFor = time.Since(rq.start)
			break
		}
		_, nerr := m.tx.process(ctx, key, run)
		rq.waitedFor = time.Since(rq.start)
		// ctx ends with context.Canceled when the client leaves, whatever
		// ended the request's context (phase 2: the claim had not been
		// won).
		if !t.ran && (clientLeft(t.ctx, nerr) || t.phase.Load() == 2 && errors.Is(nerr, context.Canceled)) {
			rq.wait = waitCancelled
			break
		}
		err = nerr
	}
	switch {
	case !t.ran && isLockTimeout(err):
		return nil, lockTimeout{err}
	case t.ran && t.stored && err != nil && !txflow.Held(err) && t.ctx.Err() == nil:
		// Storing the response or the commit failed after the handler
		// ran. When the connection broke during COMMIT, the transaction
		// may have committed all the same: the key's row says.
		t.recheck = m.commitOutcome(t.ctx, key)
		if txflow.Held(t.recheck) {
			m.opts.Logger.WarnContext(t.ctx, "httpidem: the commit failed after the handler ran; the key's row shows how the request ended, answering from it",
				slog.String("key_hash", key.Hash()), slog.Any("error", err))
		}
		if _, committed := dedup.StoredResult(t.recheck); committed {
			return nil, nil // committed: the flow records it completed
		}
	}
	return nil, err
}

// lockTimeout is a PostgreSQL lock_timeout of a transactional claim that
// waited too long for an in-flight first request: an in-flight answer.
type lockTimeout struct{ err error }

func (e lockTimeout) Error() string { return e.err.Error() }
func (e lockTimeout) Unwrap() []error {
	return []error{dedup.ErrInFlight, e.err}
}

// serveTx runs a request on a transactional store: the claim, the handler
// and its stored response in one transaction (txflow.Process), answered
// after the commit.
func (m *Middleware) serveTx(w http.ResponseWriter, r *http.Request, next http.Handler, key dedup.Key, rq *request) {
	ctx := r.Context()
	cw := newCapture(m.opts.MaxResponseBytes)
	c := &call{key: key}
	t := &txRequest{m: m, ctx: ctx, rq: rq, phase: new(atomic.Int32)}
	returned := false
	defer func() {
		if !returned { // the handler panicked: Process rolled back
			m.done(rq, r, outcomePanicked, 0, leasekeep.ErrPanicked)
		}
	}()
	// The claim may wait in PostgreSQL for an in-flight first request. If
	// the client goes away during that wait, the wait is cancelled; once
	// the handler started, it is not (Options.CancelWithClient aside).
	pctx := m.handlerCtx(ctx)
	if !m.opts.CancelWithClient {
		var cancel context.CancelFunc
		pctx, cancel = context.WithCancel(pctx)
		defer cancel()
		stop := context.AfterFunc(ctx, func() {
			if t.phase.CompareAndSwap(0, 2) {
				cancel()
			}
		})
		defer stop()
	}
	res := txflow.Process(pctx, t, key, rq.tel, func(ctx context.Context, tx any) ([]byte, error) {
		c.tx = tx
		next.ServeHTTP(cw, r.WithContext(withCall(ctx, c)))
		status, header := cw.final()
		switch {
		case cw.tooLarge:
			return nil, errTooLarge
		case c.released.Load() || !m.opts.StoreResponse(status) || m.tx.aborted(tx):
			return nil, errNotStored
		}
		t.stored = true
		return encodeResponse(status, header, m.opts.ReplayHeaders, cw.body), nil
	})
	returned = true
	m.settleTx(w, r, rq, t, cw, res)
}

// settleTx answers a request after its transaction flow ended.
func (m *Middleware) settleTx(w http.ResponseWriter, r *http.Request, rq *request, t *txRequest, cw *capture, res txflow.Result) {
	status, _ := cw.final()
	switch {
	case res.Verdict() != nil:
		// The claim lost; or the handler ran but a claim that does not
		// wait for this transaction (pgtable's lease mode on the same
		// table) took the key meanwhile: the transaction rolled back,
		// and the verdict on that claim is answered as if it had come
		// first: a replay of its response, 409 or 422.
		m.answer(w, r, rq, res.Verdict())
	case t.recheck != nil && txflow.Held(t.recheck):
		// The commit failed, and the key's row says how the request
		// ended: committed (its stored response is replayed) or, having
		// rolled back, another request with the key got it since
		// (answered as a duplicate of that one).
		m.answer(w, r, rq, t.recheck)
	case res.Err == nil:
		cw.send(w)
		m.done(rq, r, outcomeProcessed, status, nil)
	case errors.Is(res.Err, errNotStored):
		cw.send(w)
		m.done(rq, r, outcomeNotStored, status, nil)
	case errors.Is(res.Err, errTooLarge):
		p := tooLargeProblem(m.opts.MaxResponseBytes)
		WriteProblem(w, p)
		m.done(rq, r, outcomeTooLarge, p.Status, nil)
	default:
		m.notCommitted(w, r, rq, t, res.Err)
	}
}

// notCommitted answers 503 for a transaction that failed after the handler
// ran (its statement, storing the response or the commit failed).
func (m *Middleware) notCommitted(w http.ResponseWriter, r *http.Request, rq *request, t *txRequest, err error) {
	ctx := r.Context()
	detail := "the request's transaction did not commit; retry with the same key"
	if t.recheck != nil && !errors.Is(t.recheck, errNotCommitted) {
		detail = "the outcome of the request's transaction is unknown; retry with the same key: the response is replayed if it committed"
	}
	if ctx.Err() == nil {
		m.opts.Logger.WarnContext(ctx, "httpidem: the transaction failed after the handler ran; answering 503",
			slog.String("key_hash", rq.key.Hash()), slog.Any("error", err))
	}
	p := newProblem(http.StatusServiceUnavailable, problemStoreUnavailable, "Request not completed", detail)
	p.RetryAfter = m.opts.RetryAfter
	WriteProblem(w, p)
	m.done(rq, r, outcomeStoreError, p.Status, err)
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
	_, err := m.tx.process(ctx, key, func(context.Context, any) ([]byte, error) {
		return nil, errNotCommitted
	})
	return err
}

// isLockTimeout reports a lock wait the database gave up on: PostgreSQL's
// lock_timeout (lock_not_available), or MySQL's and MariaDB's
// innodb_lock_wait_timeout (error 1205): a transactional claim that waited
// too long for an in-flight first request.
func isLockTimeout(err error) bool {
	if sqldialect.SQLState(err) == "55P03" {
		return true
	}
	n, ok := sqldialect.MySQLNumber(err)
	return ok && n == 1205
}
