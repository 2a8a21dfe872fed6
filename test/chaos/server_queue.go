//go:build unix

package chaos

// The server-fault cells (server_*.go: pg/, redis/, proxy/, pause/) crash,
// cut or freeze the server a store talks to, not the consumer. Their
// workload is srvQueue, an in-memory at-least-once broker: it delivers each
// message until a delivery is acknowledged (consumer.ActionAck), redelivers
// on anything else after a backoff, and, like a broker whose ACK was lost,
// delivers some acknowledged messages once more. The consumers are goroutines
// of this process running the real idem handler chain (consumer.Process); the
// fault hits the server between them and the store.
//
// Every identifier of these files starts with srv, so they never collide with
// the other cells of the package.

import (
	"container/heap"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// srvQuiet is the logger of the libraries under test: their warnings are
// expected under faults, and the cell's line says what happened.
var srvQuiet = slog.New(slog.NewTextHandler(io.Discard, nil))

type srvItem struct {
	id  string
	at  time.Time
	seq uint64
}

type srvHeap []srvItem

func (h srvHeap) Len() int { return len(h) }
func (h srvHeap) Less(i, j int) bool {
	if !h[i].at.Equal(h[j].at) {
		return h[i].at.Before(h[j].at)
	}
	return h[i].seq < h[j].seq
}
func (h srvHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }
func (h *srvHeap) Push(x any)   { *h = append(*h, x.(srvItem)) }
func (h *srvHeap) Pop() any {
	old := *h
	it := old[len(old)-1]
	*h = old[:len(old)-1]
	return it
}

// srvQueue is the in-memory at-least-once broker of the server-fault cells.
type srvQueue struct {
	mu         sync.Mutex
	rnd        *rand.Rand
	heap       srvHeap
	seq        uint64
	released   int
	closed     bool // no more messages will be released
	inflight   int
	acked      map[string]bool
	ackOrder   []string
	deliveries map[string]int
	reinjected map[string]bool
	dupProb    float64       // chance an acknowledged message is delivered once more
	dupDelay   time.Duration // within this long after its ACK
	firstDup   int           // messages whose first ACK was a duplicate answer
	dead       []string
	wake       chan struct{}
}

func newSrvQueue(rnd *rand.Rand, dupProb float64, dupDelay time.Duration) *srvQueue {
	return &srvQueue{
		rnd: rnd, dupProb: dupProb, dupDelay: dupDelay,
		acked: map[string]bool{}, deliveries: map[string]int{}, reinjected: map[string]bool{},
		wake: make(chan struct{}),
	}
}

// signal wakes the takers; call with mu held.
func (q *srvQueue) signal() {
	close(q.wake)
	q.wake = make(chan struct{})
}

func (q *srvQueue) pushLocked(id string, at time.Time) {
	q.seq++
	heap.Push(&q.heap, srvItem{id: id, at: at, seq: q.seq})
}

// add releases messages for delivery.
func (q *srvQueue) add(ids ...string) {
	q.mu.Lock()
	defer q.mu.Unlock()
	now := time.Now()
	for _, id := range ids {
		q.pushLocked(id, now)
	}
	q.released += len(ids)
	q.signal()
}

// closeInput says no more messages will be released: takers return once
// everything released is acknowledged (or dead) and nothing is due.
func (q *srvQueue) closeInput() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.closed = true
	q.signal()
}

// take returns the next due delivery and its attempt number, blocking until
// one is due. ok is false once the queue is drained or ctx is done.
func (q *srvQueue) take(ctx context.Context) (id string, attempt int, ok bool) {
	for {
		q.mu.Lock()
		now := time.Now()
		if len(q.heap) > 0 && !q.heap[0].at.After(now) {
			it := heap.Pop(&q.heap).(srvItem)
			q.inflight++
			q.deliveries[it.id]++
			n := q.deliveries[it.id]
			q.mu.Unlock()
			return it.id, n, true
		}
		if q.closed && len(q.heap) == 0 && q.inflight == 0 {
			q.mu.Unlock()
			return "", 0, false
		}
		wait := 50 * time.Millisecond
		if len(q.heap) > 0 {
			wait = min(wait, q.heap[0].at.Sub(now))
		}
		wake := q.wake
		q.mu.Unlock()
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return "", 0, false
		case <-wake:
		case <-t.C:
		}
		t.Stop()
	}
}

// srvBackoff is the redelivery delay after the n-th failed delivery: 20ms
// doubling to 500ms, or the store's RetryAfter hint (up to 2s).
func srvBackoff(n int, hint time.Duration) time.Duration {
	d := 20 * time.Millisecond << min(n, 5)
	d = min(d, 500*time.Millisecond)
	if hint > d {
		d = min(hint, 2*time.Second)
	}
	return d
}

// finish records the verdict of a delivery taken with take.
func (q *srvQueue) finish(id string, r consumer.Result) {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.inflight--
	now := time.Now()
	switch r.Action {
	case consumer.ActionAck:
		if !q.acked[id] {
			q.acked[id] = true
			q.ackOrder = append(q.ackOrder, id)
			if r.Duplicate {
				// The effect committed in an earlier delivery whose
				// acknowledgement was lost (a commit whose reply never
				// came back, a Complete cut after the request).
				q.firstDup++
			}
		}
		if q.dupProb > 0 && !q.reinjected[id] && q.rnd.Float64() < q.dupProb {
			q.reinjected[id] = true
			q.pushLocked(id, now.Add(time.Duration(q.rnd.Int64N(int64(q.dupDelay)+1))))
		}
	case consumer.ActionDeadLetter:
		q.dead = append(q.dead, fmt.Sprintf("%s (%s: %v)", id, r.Reason, r.Err))
	default:
		q.pushLocked(id, now.Add(srvBackoff(q.deliveries[id], r.RetryAfter)))
	}
	q.signal()
}

// srvQueueReport is what a drained (or abandoned) queue tells the cell.
type srvQueueReport struct {
	released, deliveries, redeliveries, firstDup int
	acked                                        []string
	dead                                         []string
}

func (q *srvQueue) report() srvQueueReport {
	q.mu.Lock()
	defer q.mu.Unlock()
	r := srvQueueReport{released: q.released, firstDup: q.firstDup, acked: append([]string(nil), q.ackOrder...), dead: append([]string(nil), q.dead...)}
	for _, n := range q.deliveries {
		r.deliveries += n
		r.redeliveries += n - 1
	}
	return r
}

// err is the queue's verdict on the run: dead-lettered messages, or
// messages never acknowledged (a stall).
func (r srvQueueReport) err(drain time.Duration) error {
	var errs []error
	if len(r.dead) > 0 {
		errs = append(errs, fmt.Errorf("%d message(s) dead-lettered, first %s", len(r.dead), r.dead[0]))
	}
	if n := r.released - len(r.acked) - len(r.dead); n > 0 {
		errs = append(errs, fmt.Errorf("stalled: %d of %d messages not acknowledged within %v", n, r.released, drain))
	}
	return errors.Join(errs...)
}

// srvPayload is the body of message id (its fingerprint is the default
// one, the SHA-256 of the payload).
func srvPayload(id string) []byte { return []byte("chaos server message " + id) }

// srvIDs returns n message ids.
func srvIDs(n int) []string {
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("m%07d", i)
	}
	return ids
}

// srvGroup runs goroutines and keeps the first error.
type srvGroup struct {
	wg   sync.WaitGroup
	mu   sync.Mutex
	errs []error
}

func (g *srvGroup) Go(name string, f func() error) {
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		if err := f(); err != nil {
			g.mu.Lock()
			g.errs = append(g.errs, fmt.Errorf("%s: %w", name, err))
			g.mu.Unlock()
		}
	}()
}

func (g *srvGroup) Wait() error {
	g.wg.Wait()
	g.mu.Lock()
	defer g.mu.Unlock()
	return errors.Join(g.errs...)
}

// srvSleep waits d or until ctx is done; it reports whether ctx is still
// alive.
func srvSleep(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// srvBetween returns a duration uniformly in [lo, hi].
func srvBetween(r *rand.Rand, lo, hi time.Duration) time.Duration {
	if hi <= lo {
		return lo
	}
	return lo + time.Duration(r.Int64N(int64(hi-lo)+1))
}

// srvRand derives an independent random source from the cell's (Env.Rand is
// not safe for concurrent use).
func srvRand(env *Env) *rand.Rand {
	return rand.New(rand.NewPCG(env.Rand.Uint64(), env.Rand.Uint64()))
}

// srvFeed releases ids into q evenly over d, then closes q's input.
func srvFeed(ctx context.Context, q *srvQueue, ids []string, d time.Duration) {
	defer q.closeInput()
	start := time.Now()
	sent := 0
	for sent < len(ids) {
		want := len(ids)
		if d > 0 {
			want = min(len(ids), int(float64(len(ids))*float64(time.Since(start))/float64(d))+1)
		}
		if want > sent {
			q.add(ids[sent:want]...)
			sent = want
		}
		if !srvSleep(ctx, 10*time.Millisecond) {
			return
		}
	}
}

// srvWorkers runs n consumers of q through h until q is drained or ctx is
// done.
func srvWorkers(ctx context.Context, g *srvGroup, q *srvQueue, n int, h consumer.Handler) {
	for i := range n {
		g.Go(fmt.Sprintf("worker %d", i), func() error {
			for {
				id, attempt, ok := q.take(ctx)
				if !ok {
					return nil
				}
				msg := &consumer.Message{ID: id, Payload: srvPayload(id), Attempt: attempt, Topic: "chaos"}
				q.finish(id, consumer.Process(ctx, h, msg))
			}
		})
	}
}

// srvChain is the handler chain of the cells' consumers around h: panic
// recovery and a per-attempt deadline, so a server that hangs costs a
// retry, never a stuck worker.
func srvChain(h consumer.Handler, mws ...consumer.Middleware) consumer.Handler {
	return consumer.Chain(h, append([]consumer.Middleware{consumer.Recover(), consumer.Timeout(10 * time.Second)}, mws...)...)
}

// srvCounts counts outcomes by name; safe for concurrent use.
type srvCounts struct {
	mu sync.Mutex
	m  map[string]int
}

func (c *srvCounts) add(name string, n int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = map[string]int{}
	}
	c.m[name] += n
}

func (c *srvCounts) get(name string) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.m[name]
}

// outcome is a consumer OnOutcome hook.
func (c *srvCounts) outcome(_ context.Context, r consumer.Report) {
	c.add(string(r.Outcome), 1)
}

func (c *srvCounts) String() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	names := make([]string, 0, len(c.m))
	for k := range c.m {
		names = append(names, k)
	}
	sort.Strings(names)
	parts := make([]string, 0, len(names))
	for _, k := range names {
		parts = append(parts, fmt.Sprintf("%s %d", k, c.m[k]))
	}
	return strings.Join(parts, ", ")
}

// srvPool opens a small pool on url and checks it answers.
func srvPool(ctx context.Context, url string, maxConns int32) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = maxConns
	cfg.ConnConfig.ConnectTimeout = 3 * time.Second
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, fmt.Errorf("PostgreSQL at %s: %w", cfg.ConnConfig.Host, err)
	}
	return pool, nil
}

// srvRetry runs f until it succeeds, for up to d: the reads that follow a
// fault may first meet a connection the fault broke.
func srvRetry(ctx context.Context, d time.Duration, f func(ctx context.Context) error) error {
	deadline := time.Now().Add(d)
	for {
		fctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := f(fctx)
		cancel()
		if err == nil || ctx.Err() != nil || time.Now().After(deadline) {
			return err
		}
		if !srvSleep(ctx, 100*time.Millisecond) {
			return err
		}
	}
}

// srvCheck runs the oracle with retries and fills res.
func srvCheck(ctx context.Context, o *Oracle, must []string, res *Result) error {
	return srvRetry(ctx, 30*time.Second, func(ctx context.Context) error {
		d, l, err := o.Check(ctx, must)
		if err == nil {
			res.Duplicates, res.Lost = d, l
		}
		return err
	})
}

// srvDrain is how long a cell's workload may take to drain after its
// faults end before the cell fails as stalled.
func srvDrain(env *Env) time.Duration {
	return time.Duration(env.Scale.Pick(60, 180)) * time.Second
}

// srvRun runs a queue workload under faults: ids are released evenly over
// feedFor, workers consumers run h, and faults runs alongside until it
// returns. Once the faults are over the workload has srvDrain (plus feedFor)
// to finish; what is not acknowledged by then is a stall (srvQueueReport.err).
// An error from faults (a server that would not come back) ends the
// workload at once.
func srvRun(ctx context.Context, env *Env, q *srvQueue, ids []string, feedFor time.Duration, workers int,
	h consumer.Handler, faults func(ctx context.Context) error,
) (srvQueueReport, error) {
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var work srvGroup
	work.Go("feed", func() error { srvFeed(wctx, q, ids, feedFor); return nil })
	srvWorkers(wctx, &work, q, workers, h)
	var fg srvGroup
	fg.Go("faults", func() error { return faults(wctx) })
	start := time.Now()
	ferr := fg.Wait()
	if ferr != nil {
		cancel()
	}
	env.Logf("faults over after %v", time.Since(start).Round(time.Millisecond))
	drain := srvDrain(env) + feedFor
	t := time.AfterFunc(drain, cancel)
	werr := work.Wait()
	t.Stop()
	rep := q.report()
	env.Logf("workload over after %v: %d of %d acknowledged, %d deliveries", time.Since(start).Round(time.Millisecond), len(rep.acked), rep.released, rep.deliveries)
	if err := errors.Join(ferr, werr); err != nil {
		return rep, err
	}
	if ctx.Err() != nil {
		return rep, ctx.Err()
	}
	return rep, rep.err(drain)
}

// srvDupDetail lists up to five duplicated ids of o with the workers that
// wrote their effect rows, for the error of a cell whose duplicates break a
// bound.
func srvDupDetail(ctx context.Context, pool *pgxpool.Pool, o *Oracle) string {
	rows, err := pool.Query(ctx, "SELECT id, string_agg(worker, '+' ORDER BY at) FROM "+o.Table()+
		" GROUP BY id HAVING count(*) > 1 ORDER BY id LIMIT 5")
	if err != nil {
		return err.Error()
	}
	defer rows.Close()
	var parts []string
	for rows.Next() {
		var id, workers string
		if err := rows.Scan(&id, &workers); err != nil {
			return err.Error()
		}
		parts = append(parts, id+" by "+workers)
	}
	if err := rows.Err(); err != nil {
		return err.Error()
	}
	return strings.Join(parts, ", ")
}

// srvMigratedStore returns a migrated dedup/pgtable store on pool in schema.
func srvMigratedStore(ctx context.Context, pool pgtable.DB, schema string) (*pgtable.Store, error) {
	st, err := pgtable.New(pool, pgtable.Options{Schema: schema, Logger: srvQuiet})
	if err != nil {
		return nil, err
	}
	if err := st.Migrate(ctx); err != nil {
		return nil, err
	}
	return st, nil
}

// srvMigratedOutbox returns a migrated pgoutbox on pool in schema ("" for the
// default).
func srvMigratedOutbox(ctx context.Context, pool *pgxpool.Pool, schema string) (*pgoutbox.Outbox, error) {
	ob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: schema, Logger: srvQuiet})
	if err != nil {
		return nil, err
	}
	if err := ob.Migrate(ctx); err != nil {
		return nil, err
	}
	return ob, nil
}
