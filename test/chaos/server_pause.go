//go:build unix

package chaos

// pause/ cells: a consumer process frozen with SIGSTOP past its lease, then
// resumed (internal/testkit/fault.Pause and Resume). A child process (this binary,
// RegisterChild "server-pause-worker") consumes messages with consumer.Dedup
// on a lease store; the parent hands it messages, and a delivery it does not
// answer within srvPauseTimeout goes to a local consumer in the parent, like
// a broker giving a silent consumer's messages to another. The local
// consumer takes the key over once the frozen owner's lease ran out; when the
// child resumes, its heartbeat, its fencing check or its Complete gets
// dedup.ErrLeaseLost: a stale owner caught.
//
//   - pause/pgtable-lease: dedup/pgtable's lease mode. The effect is written
//     in the Complete's transaction (Complete runs on a pgtable store bound
//     to that transaction): a stale owner's Complete fails on the token and
//     its effect rolls back with it. Promise: 0 duplicate effects, 0 lost.
//   - pause/redisnx: dedup/redisnx. The effect (in PostgreSQL) cannot share
//     a transaction with the Redis mark, so the handler checks its lease
//     (Extend) just before writing it; a freeze between that check and the
//     write still lets a stale owner's effect through. Duplicates are
//     expected; the cell fails if there are more of them than stale owners
//     caught after they started writing their effect.
//
// Both cells fail when no stale owner was caught at all: the pauses then
// missed the handlers and proved nothing.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/testkit/fault"
)

const (
	srvPauseChildName = "server-pause-worker"
	srvPauseEnv       = "IDEM_CHAOS_SRV_PAUSE" // the child's srvPauseConfig, JSON
	srvPauseConc      = 4                      // handlers running at once in the child
	srvPauseLease     = 300 * time.Millisecond
	srvPauseTimeout   = 500 * time.Millisecond // a delivery the child does not answer in time goes local
)

func init() {
	Register(Cell{Name: "pause/pgtable-lease", Run: func(ctx context.Context, env *Env) (Result, error) {
		return srvPause(ctx, env, "pause/pgtable-lease", "pg")
	}})
	Register(Cell{Name: "pause/redisnx", ExpectDuplicates: true, Run: func(ctx context.Context, env *Env) (Result, error) {
		return srvPause(ctx, env, "pause/redisnx", "redis")
	}})
	RegisterChild(srvPauseChildName, srvPauseChild)
}

// srvPauseConfig is what a pause worker (child or local) runs on.
type srvPauseConfig struct {
	Store   string        // "pg" or "redis"
	PGURL   string        // shared PostgreSQL: the oracle, and pgtable's table
	Schema  string        // the oracle's schema (pgtable's table is there)
	Effects string        // the oracle's quoted effects table
	Redis   string        // shared Redis (redis store)
	Prefix  string        // the cell's key prefix on it
	Scope   string        // dedup scope
	Lease   time.Duration // lease of both stores
	WorkLo  time.Duration // the handler's work takes between WorkLo
	WorkHi  time.Duration // and WorkHi
	Worker  string        // written in the effect rows
}

// srvPauseWorker runs the cell's handler chain in one process.
type srvPauseWorker struct {
	cfg    srvPauseConfig
	h      consumer.Handler
	wrote  sync.Map // id → true: this worker started writing the effect (redis store)
	closer func() error
}

func newSrvPauseWorker(ctx context.Context, cfg srvPauseConfig) (*srvPauseWorker, error) {
	pool, err := srvPool(ctx, cfg.PGURL, 4)
	if err != nil {
		return nil, err
	}
	w := &srvPauseWorker{cfg: cfg, closer: func() error { pool.Close(); return nil }}
	var (
		store   dedup.LeaseStore
		handler consumer.HandlerFunc
	)
	switch cfg.Store {
	case "pg":
		opts := pgtable.Options{Schema: cfg.Schema, Lease: cfg.Lease, Logger: srvQuiet}
		pt, err := pgtable.New(pool, opts)
		if err != nil {
			pool.Close()
			return nil, err
		}
		store = &srvFencedLease{LeaseStore: pt.Lease(), pool: pool, opts: opts, effects: cfg.Effects, worker: cfg.Worker}
		handler = func(ctx context.Context, _ *consumer.Message) error {
			// The work; the effect is written by Complete (srvFencedLease).
			return srvWork(ctx, cfg)
		}
	case "redis":
		client := srvRedisClient(cfg.Redis)
		w.closer = func() error { pool.Close(); return client.Close() }
		rs, err := redisnx.New(client, redisnx.Options{Lease: cfg.Lease, TTL: time.Hour, Prefix: cfg.Prefix})
		if err != nil {
			_ = w.closer()
			return nil, err
		}
		tap := &srvLeaseTap{LeaseStore: rs, leases: map[string]*dedup.Lease{}}
		store = tap
		handler = func(ctx context.Context, m *consumer.Message) error {
			if err := srvWork(ctx, cfg); err != nil {
				return err
			}
			// Fencing check: still the owner right before the effect?
			// (Not atomic with the write below: see the package note.)
			if err := rs.Extend(ctx, tap.lease(m.ID)); err != nil {
				return err
			}
			// Marked before the write: an INSERT whose context is
			// cancelled may still have committed.
			w.wrote.Store(m.ID, true)
			_, err := pool.Exec(ctx, "INSERT INTO "+cfg.Effects+" (id, worker) VALUES ($1, $2)", m.ID, cfg.Worker)
			return err
		}
	default:
		pool.Close()
		return nil, fmt.Errorf("pause worker: unknown store %q", cfg.Store)
	}
	dd, err := consumer.Dedup(store, consumer.DedupOptions{Scope: cfg.Scope, FinishTimeout: 5 * time.Second})
	if err != nil {
		_ = w.closer()
		return nil, err
	}
	w.h = consumer.Chain(handler, consumer.Recover(), dd)
	return w, nil
}

// srvWork is the handler's work: a sleep of WorkLo to WorkHi.
func srvWork(ctx context.Context, cfg srvPauseConfig) error {
	d := cfg.WorkLo
	if cfg.WorkHi > cfg.WorkLo {
		d += time.Duration(time.Now().UnixNano() % int64(cfg.WorkHi-cfg.WorkLo))
	}
	if !srvSleep(ctx, d) {
		return context.Cause(ctx)
	}
	return nil
}

// handle runs one delivery and returns its verdict line:
// "<action> <id> <stale>", stale being "-", "fenced" (a stale owner caught
// before it wrote its effect), "late" (caught after it started writing
// it: the effect may have landed) or "failed" (it started writing its
// effect, and then the write or its Complete failed otherwise, a Redis
// timeout say: the effect may have landed without the key completed, so
// the redelivery writes it again, the window consumer.Dedup documents).
func (w *srvPauseWorker) handle(ctx context.Context, id string, attempt int) (consumer.Result, string) {
	r := consumer.Process(ctx, w.h, &consumer.Message{ID: id, Payload: srvPayload(id), Attempt: attempt, Topic: "chaos"})
	_, wrote := w.wrote.LoadAndDelete(id)
	stale := "-"
	switch {
	case errors.Is(r.Err, dedup.ErrLeaseLost) && wrote:
		stale = "late"
	case errors.Is(r.Err, dedup.ErrLeaseLost):
		stale = "fenced"
	case wrote && r.Err != nil:
		stale = "failed"
	}
	return r, fmt.Sprintf("%s %s %s", r.Action, id, stale)
}

// srvLeaseTap remembers the leases it grants, so the handler can check its
// own lease before writing its effect.
type srvLeaseTap struct {
	dedup.LeaseStore
	mu     sync.Mutex
	leases map[string]*dedup.Lease
}

func (t *srvLeaseTap) Claim(ctx context.Context, key dedup.Key) (*dedup.Lease, error) {
	l, err := t.LeaseStore.Claim(ctx, key)
	if err == nil {
		t.mu.Lock()
		t.leases[key.ID] = l
		t.mu.Unlock()
	}
	return l, err
}

func (t *srvLeaseTap) lease(id string) *dedup.Lease {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.leases[id]
}

func (t *srvLeaseTap) forget(id string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.leases, id)
}

func (t *srvLeaseTap) Complete(ctx context.Context, l *dedup.Lease, result []byte) error {
	defer t.forget(l.Key.ID)
	return t.LeaseStore.Complete(ctx, l, result)
}

func (t *srvLeaseTap) Release(ctx context.Context, l *dedup.Lease) error {
	defer t.forget(l.Key.ID)
	return t.LeaseStore.Release(ctx, l)
}

// srvFencedLease is pgtable's lease mode whose Complete also writes the
// effect, in one transaction: the Complete (a pgtable store bound to the
// transaction) checks the token and the lease, so a stale owner gets
// dedup.ErrLeaseLost and its effect is rolled back with the failed Complete.
type srvFencedLease struct {
	dedup.LeaseStore
	pool    *pgxpool.Pool
	opts    pgtable.Options
	effects string
	worker  string
}

func (s *srvFencedLease) Complete(ctx context.Context, l *dedup.Lease, result []byte) error {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return err
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	st, err := pgtable.New(tx, s.opts)
	if err != nil {
		return err
	}
	if err := st.Lease().Complete(ctx, l, result); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, "INSERT INTO "+s.effects+" (id, worker) VALUES ($1, $2)", l.Key.ID, s.worker); err != nil {
		return err
	}
	return tx.Commit(ctx)
}

// srvPauseChild is the child process: it reads message ids on stdin, one a
// line, handles srvPauseConc at a time and writes a verdict line for each.
func srvPauseChild(ctx context.Context) error {
	var cfg srvPauseConfig
	if err := json.Unmarshal([]byte(os.Getenv(srvPauseEnv)), &cfg); err != nil {
		return fmt.Errorf("%s: %w", srvPauseEnv, err)
	}
	w, err := newSrvPauseWorker(ctx, cfg)
	if err != nil {
		return err
	}
	defer func() { _ = w.closer() }()
	var outMu sync.Mutex
	out := bufio.NewWriter(os.Stdout)
	ids := make(chan string)
	var wg sync.WaitGroup
	for range srvPauseConc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for id := range ids {
				_, line := w.handle(ctx, id, 1)
				outMu.Lock()
				_, _ = out.WriteString(line + "\n")
				_ = out.Flush()
				outMu.Unlock()
			}
		}()
	}
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		if id := strings.TrimSpace(in.Text()); id != "" {
			ids <- id
		}
	}
	close(ids)
	wg.Wait()
	return in.Err()
}

// srvPauseRun is the parent's bookkeeping of one pause cell.
type srvPauseRun struct {
	mu           sync.Mutex
	acked        map[string]bool
	ackOrder     []string
	remote       map[string]time.Time // delivered to the child, not answered, not handed over
	handedOver   map[string]bool
	local        chan string
	fenced, late int
	failed       int // wrote the effect, then failed other than by a lost lease
	childAcks    int
	localAcks    int
	handovers    int
	localRetries int
	badLines     []string
}

func (p *srvPauseRun) ack(id string) {
	if !p.acked[id] {
		p.acked[id] = true
		p.ackOrder = append(p.ackOrder, id)
	}
}

func (p *srvPauseRun) stale(s string) {
	switch s {
	case "fenced":
		p.fenced++
	case "late":
		p.late++
	case "failed":
		p.failed++
	}
}

// handOver gives id to the local consumer; call with mu held.
func (p *srvPauseRun) handOver(id string) {
	delete(p.remote, id)
	if p.handedOver[id] || p.acked[id] {
		return
	}
	p.handedOver[id] = true
	p.handovers++
	p.local <- id // buffered for every id
}

func srvPause(ctx context.Context, env *Env, name, kind string) (res Result, err error) {
	n := env.Pick(500, 3000)
	pauses := env.Pick(5, 40)
	shared, err := srvPool(ctx, env.PGURL, 4)
	if err != nil {
		return res, err
	}
	defer shared.Close()
	o, err := NewOracle(ctx, shared, name, env.Seed)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, o.Drop(context.WithoutCancel(ctx))) }()
	cfg := srvPauseConfig{
		Store: kind, PGURL: env.PGURL, Schema: o.Schema(), Effects: o.Table(),
		Redis: env.RedisAddr, Prefix: srvRedisPrefix(name, env.Seed), Scope: "chaos/" + name,
		Lease: srvPauseLease, WorkLo: 30 * time.Millisecond, WorkHi: 60 * time.Millisecond,
	}
	switch kind {
	case "pg":
		if _, err := srvMigratedStore(ctx, shared, o.Schema()); err != nil {
			return res, err
		}
	case "redis":
		direct := srvRedisClient(env.RedisAddr)
		defer func() { err = errors.Join(err, direct.Close()) }()
		if err := direct.Ping(ctx).Err(); err != nil {
			return res, fmt.Errorf("redis at %s: %w", env.RedisAddr, err)
		}
		defer func(c *redis.Client) { err = errors.Join(err, srvRedisCleanup(ctx, c, cfg.Prefix)) }(direct)
	}
	lcfg := cfg
	lcfg.Worker = "local"
	local, err := newSrvPauseWorker(ctx, lcfg)
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, local.closer()) }()

	ccfg := cfg
	ccfg.Worker = "child"
	js, err := json.Marshal(ccfg)
	if err != nil {
		return res, err
	}
	cmd := exec.Command(env.Exe)
	cmd.Env = append(os.Environ(), ChildEnv+"="+srvPauseChildName, srvPauseEnv+"="+string(js))
	childproc.SetDeathSignal(cmd, syscall.SIGKILL) // never left behind stopped
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		return res, err
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		return res, err
	}
	if err := cmd.Start(); err != nil {
		return res, fmt.Errorf("start the child: %w", err)
	}
	childDone := make(chan error, 1)
	var readers sync.WaitGroup
	run := &srvPauseRun{
		acked: map[string]bool{}, remote: map[string]time.Time{}, handedOver: map[string]bool{},
		local: make(chan string, n),
	}
	readers.Add(1)
	go func() {
		defer readers.Done()
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			f := strings.Fields(sc.Text())
			run.mu.Lock()
			if len(f) != 3 {
				run.badLines = append(run.badLines, sc.Text())
				run.mu.Unlock()
				continue
			}
			action, id, stale := f[0], f[1], f[2]
			run.stale(stale)
			if action == consumer.ActionAck.String() {
				delete(run.remote, id)
				run.ack(id)
				run.childAcks++
			} else {
				run.handOver(id)
			}
			run.mu.Unlock()
		}
		_, _ = io.Copy(io.Discard, stdout)
		childDone <- cmd.Wait()
	}()
	var paused sync.Mutex // held while the child is stopped
	stopChild := func() error {
		paused.Lock()
		_ = fault.Resume(cmd.Process)
		paused.Unlock()
		_ = stdin.Close()
		var werr error
		select {
		case werr = <-childDone:
		case <-time.After(30 * time.Second):
			_ = cmd.Process.Kill()
			werr = errors.Join(errors.New("the child did not exit within 30s of its input's end; killed"), <-childDone)
		}
		readers.Wait()
		if werr != nil {
			return fmt.Errorf("child: %w: %s", werr, strings.TrimSpace(stderr.String()))
		}
		return nil
	}
	var stopOnce sync.Once
	var stopErr error
	stop := func() error {
		stopOnce.Do(func() { stopErr = stopChild() })
		return stopErr
	}
	defer func() { err = errors.Join(err, stop()) }()

	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var g srvGroup
	ids := srvIDs(n)
	// The broker: hand the child its messages, at most 2×srvPauseConc
	// unanswered at a time.
	g.Go("dispatch", func() error {
		for _, id := range ids {
			for {
				run.mu.Lock()
				room := len(run.remote) < 2*srvPauseConc
				if room {
					run.remote[id] = time.Now()
				}
				run.mu.Unlock()
				if room {
					break
				}
				if !srvSleep(wctx, 5*time.Millisecond) {
					return nil
				}
			}
			if _, err := io.WriteString(stdin, id+"\n"); err != nil {
				run.mu.Lock()
				run.handOver(id)
				run.mu.Unlock()
				return fmt.Errorf("write to the child: %w", err)
			}
		}
		return nil
	})
	// The broker's delivery timeout: a silent child's messages go local.
	g.Go("watchdog", func() error {
		for srvSleep(wctx, 20*time.Millisecond) {
			run.mu.Lock()
			for id, sent := range run.remote {
				if time.Since(sent) > srvPauseTimeout {
					run.handOver(id)
				}
			}
			run.mu.Unlock()
		}
		return nil
	})
	for i := range 2 {
		g.Go(fmt.Sprintf("local %d", i), func() error {
			for {
				var id string
				select {
				case id = <-run.local:
				case <-wctx.Done():
					return nil
				}
				for attempt := 1; ; attempt++ {
					r, line := local.handle(wctx, id, attempt)
					run.mu.Lock()
					run.stale(strings.Fields(line)[2])
					if r.Action == consumer.ActionAck {
						run.ack(id)
						run.localAcks++
						run.mu.Unlock()
						break
					}
					run.localRetries++
					run.mu.Unlock()
					if !srvSleep(wctx, srvBackoff(attempt, r.RetryAfter)) {
						return nil
					}
				}
			}
		})
	}
	// The fault: freeze the child past its lease, then let it go on.
	rnd := srvRand(env)
	var done atomic.Int64
	g.Go("pauses", func() error {
		for done.Load() < int64(pauses) {
			if !srvSleep(wctx, srvBetween(rnd, 400*time.Millisecond, 900*time.Millisecond)) {
				return nil
			}
			paused.Lock()
			if err := fault.Pause(cmd.Process); err != nil {
				paused.Unlock()
				return err
			}
			srvSleep(wctx, srvBetween(rnd, 1000*time.Millisecond, 1400*time.Millisecond))
			err := fault.Resume(cmd.Process)
			paused.Unlock()
			if err != nil {
				return err
			}
			done.Add(1)
		}
		env.Logf("%d pauses done", done.Load())
		return nil
	})
	// Wait until every message is acknowledged and the pauses are over.
	plan := time.Duration(pauses) * 1800 * time.Millisecond
	deadline := time.Now().Add(plan + srvDrain(env))
	var runErr error
	for {
		run.mu.Lock()
		acked := len(run.acked)
		run.mu.Unlock()
		if acked == n && done.Load() >= int64(pauses) {
			break
		}
		if time.Now().After(deadline) {
			runErr = fmt.Errorf("stalled: %d of %d messages acknowledged, %d of %d pauses, after %v", acked, n, done.Load(), pauses, plan+srvDrain(env))
			break
		}
		if !srvSleep(ctx, 20*time.Millisecond) {
			runErr = ctx.Err()
			break
		}
	}
	cancel()
	runErr = errors.Join(runErr, g.Wait(), stop())

	run.mu.Lock()
	defer run.mu.Unlock()
	res.Messages = n
	res.Redeliveries = run.handovers + run.localRetries
	if err := srvCheck(ctx, o, run.ackOrder, &res); err != nil {
		return res, errors.Join(runErr, err)
	}
	caught := run.fenced + run.late
	res.Note = fmt.Sprintf("%d pauses of 1-1.4s (lease %v); %d stale owners caught with ErrLeaseLost: %d with no effect written (fenced), %d after starting to write it; %d failed otherwise after starting to write their effect; acked by the child %d, by the local consumer %d",
		done.Load(), srvPauseLease, caught, run.fenced, run.late, run.failed, run.childAcks, run.localAcks)
	if len(run.badLines) > 0 {
		runErr = errors.Join(runErr, fmt.Errorf("%d unreadable line(s) from the child, first %q", len(run.badLines), run.badLines[0]))
	}
	if runErr == nil && caught == 0 {
		runErr = errors.New("no stale owner was caught: the pauses never froze a handler past its lease")
	}
	// Every duplicate needs a writer whose effect may have landed without
	// its Complete: one caught late, or one whose write or Complete failed.
	if kind == "redis" && res.Duplicates > run.late+run.failed {
		runErr = errors.Join(runErr, fmt.Errorf("%d duplicate effects but only %d stale owners caught after starting their effect and %d failed after starting it (%s)",
			res.Duplicates, run.late, run.failed, srvDupDetail(ctx, shared, o)))
	}
	return res, runErr
}
