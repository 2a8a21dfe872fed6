package pgtable_test

// Process writes the key's row once, at commit, under a transaction-scoped
// advisory lock. These tests run every way Process runs (plain and
// partitioned layout; a pool, and a DB that is neither a pool nor a conn,
// which takes the bound path) and count effects in an oracle table that has
// no unique constraint.

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/deduptest"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/internal/txflow"
)

// procVariant is one way Process runs.
type procVariant struct {
	name        string
	partitioned bool
	bound       bool // a DB that is neither a pool nor a conn: the bound path
}

var procVariants = []procVariant{
	{"plain", false, false},
	{"plain_bound", false, true},
	{"partitioned", true, false},
	{"partitioned_bound", true, true},
}

// boundDB hides a pool's type, so that Process takes its bound path (Begin,
// then batches on the pgx.Tx) on a real pool.
type boundDB struct{ *pgxpool.Pool }

// procWorld is a migrated store of one variant and its oracle table.
type procWorld struct {
	pool    *pgxpool.Pool
	s       *pgtable.Store
	effects string // oracle: one row per committed effect, no unique constraint
}

func newProcWorld(t *testing.T, pool *pgxpool.Pool, v procVariant, opts pgtable.Options) procWorld {
	t.Helper()
	opts.Schema = testenv.Schema(t, pool)
	opts.Partitioned = v.partitioned
	if v.partitioned && opts.Retention == 0 {
		opts.Retention = 48 * time.Hour
	}
	var db pgtable.DB = pool
	if v.bound {
		db = boundDB{pool}
	}
	s, err := pgtable.New(db, opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	eff := pgx.Identifier{opts.Schema, "effects"}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+eff+" (id text NOT NULL, by text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	return procWorld{pool: pool, s: s, effects: eff}
}

// effect writes one effect of id by who in tx.
func (w procWorld) effect(ctx context.Context, tx pgx.Tx, id, who string) error {
	_, err := tx.Exec(ctx, "INSERT INTO "+w.effects+" (id, by) VALUES ($1, $2)", id, who)
	return err
}

// count returns the committed effects of id, by writer.
func (w procWorld) count(t *testing.T, id string) map[string]int {
	t.Helper()
	rows, err := w.pool.Query(context.Background(), "SELECT by, count(*) FROM "+w.effects+" WHERE id = $1 GROUP BY by", id)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int{}
	var (
		by string
		n  int
	)
	if _, err := pgx.ForEachRow(rows, []any{&by, &n}, func() error { got[by] = n; return nil }); err != nil {
		t.Fatal(err)
	}
	return got
}

// rows returns the number of rows of key in the store's table.
func (w procWorld) rows(t *testing.T, key dedup.Key) int {
	t.Helper()
	var n int
	if err := w.pool.QueryRow(context.Background(), "SELECT count(*) FROM "+w.s.Table()+whereKey,
		key.Scope, key.ID).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func (w procWorld) result(t *testing.T, key dedup.Key) string {
	t.Helper()
	var res []byte
	if err := w.pool.QueryRow(context.Background(), "SELECT result FROM "+w.s.Table()+whereKey,
		key.Scope, key.ID).Scan(&res); err != nil {
		t.Fatal(err)
	}
	return string(res)
}

func (w procWorld) backdate(t *testing.T, key dedup.Key) {
	t.Helper()
	tag, err := w.pool.Exec(context.Background(), "UPDATE "+w.s.Table()+
		" SET expires_at = clock_timestamp() - interval '1 second'"+whereKey, key.Scope, key.ID)
	if err != nil || tag.RowsAffected() != 1 {
		t.Fatalf("back-dating %s: %v, %d rows", key, err, tag.RowsAffected())
	}
}

// waitLeaseRunOut waits until key's row is a lease whose time ran out on the
// server's clock: the row stays, and counts as absent.
func (w procWorld) waitLeaseRunOut(t *testing.T, key dedup.Key) {
	t.Helper()
	testenv.Eventually(t, 30*time.Second, "the lease to run out", func() bool {
		var out bool
		if err := w.pool.QueryRow(context.Background(), "SELECT token IS NOT NULL AND expires_at <= clock_timestamp() FROM "+w.s.Table()+
			" WHERE key = "+pgtable.KeySQL("$1::text", "$2::text"), key.Scope, key.ID).Scan(&out); err != nil {
			t.Fatalf("the lease row of %s: %v", key, err)
		}
		return out
	})
}

func equalCounts(got, want map[string]int) bool {
	if len(got) != len(want) {
		return false
	}
	for k, v := range want {
		if got[k] != v {
			return false
		}
	}
	return true
}

// blockedBy returns how many sessions wait for a lock that the session pid
// holds (an advisory lock, or the transaction of a row they must wait for).
func blockedBy(t *testing.T, pool *pgxpool.Pool, pid uint32) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(),
		`SELECT count(*) FROM pg_stat_activity WHERE $1::int = ANY (pg_blocking_pids(pid))`, int32(pid)).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestProcessConcurrentOneEffect: 100 concurrent Process calls of one key.
// fn runs once and its effect commits once; the 99 others wait for it and
// replay its result. fn holds the key until every connection the others
// could get waits for its transaction.
func TestProcessConcurrentOneEffect(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 20)
	watch := testenv.Pool(t, 1) // pool is all taken while fn holds the key
	for _, v := range procVariants {
		t.Run(v.name, func(t *testing.T) {
			w := newProcWorld(t, pool, v, pgtable.Options{})
			ctx := testenv.Ctx(t)
			key := dedup.NewKey("pay", testenv.UniqueID("k"), []byte(`{"amount":100}`))
			const n = 100
			var runs atomic.Int64
			holder := make(chan uint32, n) // fn's session, once it holds the key
			released := make(chan struct{})
			release := sync.OnceFunc(func() { close(released) })
			defer release()
			fn := func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				runs.Add(1)
				if err := w.effect(ctx, tx, key.ID, "process"); err != nil {
					return nil, err
				}
				var pid uint32
				if err := tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
					return nil, err
				}
				holder <- pid
				<-released
				return []byte("receipt"), nil
			}
			var (
				wg       sync.WaitGroup
				mu       sync.Mutex
				firsts   int
				replays  int
				problems []error
				start    = make(chan struct{})
				finished = make(chan struct{})
			)
			for range n {
				wg.Go(func() {
					<-start
					res, err := w.s.Process(ctx, key, fn)
					stored, dup := dedup.StoredResult(err)
					mu.Lock()
					defer mu.Unlock()
					switch {
					case err == nil && string(res) == "receipt":
						firsts++
					case dup && string(stored) == "receipt":
						replays++
					default:
						problems = append(problems, fmt.Errorf("res %q: %w", res, err))
					}
				})
			}
			close(start)
			go func() { wg.Wait(); close(finished) }()
			select {
			case pid := <-holder:
				// The others pile up on the key: every connection but
				// fn's waits there, the rest wait for a connection.
				want := min(n, int(pool.Config().MaxConns)) - 1
				testenv.Eventually(t, 30*time.Second, "the other calls to wait on the key", func() bool {
					return blockedBy(t, watch, pid) >= want
				})
			case <-finished: // fn never ran: the checks below say so
			}
			release()
			<-finished
			if len(problems) > 0 {
				t.Fatalf("%d calls got neither the receipt nor a replay of it; first: %v", len(problems), problems[0])
			}
			if firsts != 1 || replays != n-1 || runs.Load() != 1 {
				t.Fatalf("firsts=%d replays=%d fn runs=%d, want 1, %d, 1", firsts, replays, runs.Load(), n-1)
			}
			if got := w.count(t, key.ID); !equalCounts(got, map[string]int{"process": 1}) {
				t.Fatalf("effects %v, want exactly one", got)
			}
			if w.rows(t, key) != 1 {
				t.Fatalf("%d rows for the key, want 1", w.rows(t, key))
			}
		})
	}
}

// TestProcessLeaseRowIsInFlight: a live lease-mode row answers ErrInFlight
// without running fn; once the lease completes, its result replays.
func TestProcessLeaseRowIsInFlight(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 6)
	for _, v := range procVariants {
		t.Run(v.name, func(t *testing.T) {
			w := newProcWorld(t, pool, v, pgtable.Options{})
			ctx := testenv.Ctx(t)
			key := dedup.NewKey("mail", testenv.UniqueID("k"), []byte("p"))
			lease, err := w.s.Lease().Claim(ctx, key)
			if err != nil {
				t.Fatal(err)
			}
			fn := func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				t.Error("fn ran while a lease held the key")
				return nil, w.effect(ctx, tx, key.ID, "process")
			}
			_, err = w.s.Process(ctx, key, fn)
			if !errors.Is(err, dedup.ErrInFlight) {
				t.Fatalf("Process under a live lease = %v, want ErrInFlight", err)
			}
			if err := w.s.Lease().Complete(ctx, lease, []byte("sent")); err != nil {
				t.Fatal(err)
			}
			_, err = w.s.Process(ctx, key, fn)
			if res, ok := dedup.StoredResult(err); !ok || string(res) != "sent" {
				t.Fatalf("Process after the lease completed = %v (%q), want a replay of %q", err, res, "sent")
			}
			if got := w.count(t, key.ID); len(got) != 0 {
				t.Fatalf("effects %v, want none", got)
			}
		})
	}
}

// processInBackground starts Process of key whose fn writes an effect, then
// waits on cont before returning result. inFn is closed once fn holds the
// key.
type backgroundProcess struct {
	inFn, cont chan struct{}
	done       chan struct {
		res []byte
		err error
	}
}

// waitInFn waits until fn holds the key; it fails the test if Process
// returned first.
func (bp *backgroundProcess) waitInFn(t *testing.T) {
	t.Helper()
	select {
	case <-bp.inFn:
	case r := <-bp.done:
		t.Fatalf("Process returned (%q, %v) before fn ran", r.res, r.err)
	}
}

func (w procWorld) processInBackground(ctx context.Context, key dedup.Key, result string) *backgroundProcess {
	bp := &backgroundProcess{inFn: make(chan struct{}), cont: make(chan struct{}), done: make(chan struct {
		res []byte
		err error
	}, 1)}
	go func() {
		res, err := w.s.Process(ctx, key, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
			if err := w.effect(ctx, tx, key.ID, "process"); err != nil {
				return nil, err
			}
			close(bp.inFn)
			<-bp.cont
			return []byte(result), nil
		})
		bp.done <- struct {
			res []byte
			err error
		}{res, err}
	}()
	return bp
}

// claimOwnTx claims key with ClaimTx in a transaction of its own, writes an
// effect and stores result. The transaction is left open.
func (w procWorld) claimOwnTx(ctx context.Context, t *testing.T, key dedup.Key, result string) pgx.Tx {
	t.Helper()
	tx, err := w.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	if err := w.s.ClaimTx(ctx, tx, key); err != nil {
		t.Fatalf("ClaimTx = %v, want nil (a new key)", err)
	}
	if err := w.effect(ctx, tx, key.ID, "claimtx"); err != nil {
		t.Fatal(err)
	}
	if err := w.s.SetResultTx(ctx, tx, key, []byte(result)); err != nil {
		t.Fatal(err)
	}
	return tx
}

// TestProcessWaitsForAnOpenClaim: a claim of the key that is open in
// another transaction (ClaimTx, not committed yet) holds Process at its
// claim: fn does not run until that transaction ends. Then Process replays
// the other claim's result if it committed, or runs if it rolled back. The
// effect stays single.
func TestProcessWaitsForAnOpenClaim(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 8)
	for _, v := range procVariants {
		for _, commit := range []bool{true, false} {
			name := v.name + "/commits"
			if !commit {
				name = v.name + "/rolls_back"
			}
			t.Run(name, func(t *testing.T) {
				w := newProcWorld(t, pool, v, pgtable.Options{})
				ctx := testenv.Ctx(t)
				key := dedup.NewKey("pay", testenv.UniqueID("k"), []byte("p"))
				tx := w.claimOwnTx(ctx, t, key, "theirs")
				ran := make(chan struct{}, 1)
				done := make(chan struct {
					res []byte
					err error
				}, 1)
				go func() {
					res, err := w.s.Process(ctx, key, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
						ran <- struct{}{}
						return []byte("mine"), w.effect(ctx, tx, key.ID, "process")
					})
					done <- struct {
						res []byte
						err error
					}{res, err}
				}()
				pid := tx.Conn().PgConn().PID()
				testenv.Eventually(t, 30*time.Second, "Process to wait for the open claim", func() bool {
					return blockedBy(t, pool, pid) >= 1
				})
				select {
				case <-ran:
					t.Fatal("fn ran while another transaction held an open claim of the key")
				default:
				}
				want := map[string]int{"claimtx": 1}
				if commit {
					if err := tx.Commit(ctx); err != nil {
						t.Fatal(err)
					}
					r := <-done
					if res, ok := dedup.StoredResult(r.err); !ok || string(res) != "theirs" || r.res != nil {
						t.Fatalf("Process = %q, %v; want a duplicate replaying %q", r.res, r.err, "theirs")
					}
					if len(ran) != 0 {
						t.Fatal("fn ran for a duplicate")
					}
				} else {
					if err := tx.Rollback(ctx); err != nil {
						t.Fatal(err)
					}
					r := <-done
					if r.err != nil || string(r.res) != "mine" {
						t.Fatalf("Process after the open claim rolled back = %q, %v; want it to run and commit", r.res, r.err)
					}
					want = map[string]int{"process": 1}
				}
				if got := w.count(t, key.ID); !equalCounts(got, want) {
					t.Fatalf("effects %v, want %v", got, want)
				}
			})
		}
	}
}

// TestProcessWritersWait: ClaimTx and a lease claim of a key that Process
// holds wait for Process's transaction and then see its row (the plain
// layout's primary key, the partitioned layout's advisory lock).
func TestProcessWritersWait(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 8)
	for _, v := range procVariants {
		t.Run(v.name, func(t *testing.T) {
			w := newProcWorld(t, pool, v, pgtable.Options{})
			ctx := testenv.Ctx(t)
			key := dedup.NewKey("pay", testenv.UniqueID("k"), []byte("p"))
			bp := w.processInBackground(ctx, key, "mine")
			bp.waitInFn(t)
			claimed := make(chan error, 1)
			go func() {
				claimed <- pgx.BeginFunc(ctx, w.pool, func(tx pgx.Tx) error {
					if err := w.s.ClaimTx(ctx, tx, key); err != nil {
						return err
					}
					return w.effect(ctx, tx, key.ID, "claimtx")
				})
			}()
			leased := make(chan error, 1)
			go func() {
				_, err := w.s.Lease().Claim(ctx, key)
				leased <- err
			}()
			select {
			case err := <-claimed:
				t.Fatalf("ClaimTx returned %v while Process held the key", err)
			case err := <-leased:
				t.Fatalf("lease Claim returned %v while Process held the key", err)
			case <-time.After(200 * time.Millisecond):
			}
			close(bp.cont)
			if r := <-bp.done; r.err != nil || string(r.res) != "mine" {
				t.Fatalf("Process = %q, %v", r.res, r.err)
			}
			for name, ch := range map[string]chan error{"ClaimTx": claimed, "lease Claim": leased} {
				if res, ok := dedup.StoredResult(<-ch); !ok || string(res) != "mine" {
					t.Fatalf("%s after Process committed: want a duplicate replaying %q", name, "mine")
				}
			}
			if got := w.count(t, key.ID); !equalCounts(got, map[string]int{"process": 1}) {
				t.Fatalf("effects %v, want only Process's", got)
			}
		})
	}
}

// TestProcessExpiredRowRunsAgain: a row past its retention, or a lease that
// ran out, counts as absent. Cleanup while fn runs cannot take the key away:
// the plain layout's claim took the expired row over (Cleanup leaves it), and
// the partitioned layout's row deleted meanwhile counts as absent.
func TestProcessExpiredRowRunsAgain(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 6)
	for _, v := range procVariants {
		t.Run(v.name, func(t *testing.T) {
			w := newProcWorld(t, pool, v, pgtable.Options{Lease: 50 * time.Millisecond})
			ctx := testenv.Ctx(t)
			run := func(key dedup.Key, result string, during func()) error {
				res, err := w.s.Process(ctx, key, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
					if during != nil {
						during()
					}
					return []byte(result), w.effect(ctx, tx, key.ID, result)
				})
				if err == nil && string(res) != result {
					return fmt.Errorf("result %q, want %q", res, result)
				}
				return err
			}
			// Past its retention.
			key := dedup.NewKey("s", testenv.UniqueID("k"), []byte("p"))
			if err := run(key, "one", nil); err != nil {
				t.Fatal(err)
			}
			w.backdate(t, key)
			if err := run(key, "two", nil); err != nil {
				t.Fatalf("Process of an expired key = %v, want it to run", err)
			}
			if err := run(key, "three", nil); !errors.Is(err, dedup.ErrDuplicate) {
				t.Fatalf("then = %v, want ErrDuplicate", err)
			}
			if got := w.count(t, key.ID); !equalCounts(got, map[string]int{"one": 1, "two": 1}) {
				t.Fatalf("effects %v", got)
			}
			if w.rows(t, key) != 1 || w.result(t, key) != "two" {
				t.Fatalf("%d rows, result %q; want one row with the second run's result", w.rows(t, key), w.result(t, key))
			}

			// A lease that ran out.
			lkey := dedup.NewKey("s", testenv.UniqueID("k"), []byte("p"))
			if _, err := w.s.Lease().Claim(ctx, lkey); err != nil {
				t.Fatal(err)
			}
			w.waitLeaseRunOut(t, lkey)
			if err := run(lkey, "after-lease", nil); err != nil {
				t.Fatalf("Process after the lease ran out = %v, want it to run", err)
			}
			if w.rows(t, lkey) != 1 || w.result(t, lkey) != "after-lease" {
				t.Fatalf("lease key: %d rows, result %q", w.rows(t, lkey), w.result(t, lkey))
			}

			// Deleted by cleanup while fn runs.
			ckey := dedup.NewKey("s", testenv.UniqueID("k"), []byte("p"))
			if err := run(ckey, "first", nil); err != nil {
				t.Fatal(err)
			}
			w.backdate(t, ckey)
			err := run(ckey, "second", func() {
				if v.partitioned {
					// Cleanup leaves the current partition alone;
					// delete the row as a batch of the plain layout's
					// cleanup would.
					_, err := w.pool.Exec(context.Background(), "DELETE FROM "+w.s.Table()+whereKey, ckey.Scope, ckey.ID)
					if err != nil {
						t.Error(err)
					}
					return
				}
				if n, err := w.s.Cleanup(context.Background()); err != nil || n != 0 {
					t.Errorf("Cleanup while fn runs: %d rows, %v; want none (the claim took the expired row over)", n, err)
				}
			})
			if err != nil {
				t.Fatalf("Process whose expired row was deleted meanwhile = %v", err)
			}
			if w.rows(t, ckey) != 1 || w.result(t, ckey) != "second" {
				t.Fatalf("cleaned key: %d rows, result %q", w.rows(t, ckey), w.result(t, ckey))
			}
		})
	}
}

// TestProcessFailureWritesNothing: fn returning an error, panicking, or
// leaving a failed statement behind writes neither the key's row nor fn's
// effect, and releases the key's lock at once.
func TestProcessFailureWritesNothing(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 6)
	for _, v := range procVariants {
		t.Run(v.name, func(t *testing.T) {
			w := newProcWorld(t, pool, v, pgtable.Options{})
			ctx := testenv.Ctx(t)
			boom := errors.New("boom")
			cases := map[string]func(ctx context.Context, tx pgx.Tx, id string) ([]byte, error){
				"error": func(ctx context.Context, tx pgx.Tx, id string) ([]byte, error) {
					return nil, errors.Join(w.effect(ctx, tx, id, "process"), boom)
				},
				"panic": func(ctx context.Context, tx pgx.Tx, id string) ([]byte, error) {
					if err := w.effect(ctx, tx, id, "process"); err != nil {
						return nil, err
					}
					panic(boom)
				},
				"failed_statement": func(ctx context.Context, tx pgx.Tx, id string) ([]byte, error) {
					if err := w.effect(ctx, tx, id, "process"); err != nil {
						return nil, err
					}
					_, _ = tx.Exec(ctx, "SELECT 1 / 0") // fn swallows the error
					return []byte("r"), nil
				},
			}
			for name, fn := range cases {
				key := dedup.NewKey("s", testenv.UniqueID(name), []byte("p"))
				func() {
					defer func() {
						p := recover()
						if name == "panic" && p != boom || name != "panic" && p != nil {
							t.Errorf("%s: recovered %v", name, p)
						}
					}()
					_, err := w.s.Process(ctx, key, func(ctx context.Context, tx pgx.Tx) ([]byte, error) { return fn(ctx, tx, key.ID) })
					if err == nil || txflow.Held(err) {
						t.Errorf("%s: Process = %v, want fn's failure", name, err)
					}
					if name == "error" && !errors.Is(err, boom) {
						t.Errorf("%s: Process = %v, want fn's error", name, err)
					}
				}()
				if n := w.rows(t, key); n != 0 {
					t.Errorf("%s: %d rows for the key, want none", name, n)
				}
				if got := w.count(t, key.ID); len(got) != 0 {
					t.Errorf("%s: effects %v, want none", name, got)
				}
				// The lock went with the transaction: a redelivery runs
				// at once.
				rctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				res, err := w.s.Process(rctx, key, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
					return []byte("redelivered"), w.effect(ctx, tx, key.ID, "redelivery")
				})
				cancel()
				if err != nil || string(res) != "redelivered" {
					t.Errorf("%s: redelivery = %q, %v; want it to run", name, res, err)
				}
				if got := w.count(t, key.ID); !equalCounts(got, map[string]int{"redelivery": 1}) {
					t.Errorf("%s: effects after the redelivery %v", name, got)
				}
			}
		})
	}
}

// TestProcessWritesTheRowOnce: a first Process without a result writes one
// version of the key's row, completed: in a fresh table it sits at ctid
// (0,1). With a result, the plain layout (which claims first) adds the
// result in a second version, the partitioned layout (which writes the row at
// commit) still writes one. The row expires one retention after the claim.
func TestProcessWritesTheRowOnce(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 4)
	for _, v := range procVariants {
		t.Run(v.name, func(t *testing.T) {
			w := newProcWorld(t, pool, v, pgtable.Options{Retention: 72 * time.Hour})
			ctx := testenv.Ctx(t)
			key := dedup.NewKey("s", testenv.UniqueID("k"), []byte("p"))
			var before, after time.Time
			if err := pool.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&before); err != nil {
				t.Fatal(err)
			}
			if _, err := w.s.Process(ctx, key, func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil }); err != nil {
				t.Fatal(err)
			}
			withResult := dedup.NewKey("s", testenv.UniqueID("k"), []byte("p"))
			if _, err := w.s.Process(ctx, withResult, func(context.Context, pgx.Tx) ([]byte, error) { return []byte("stored"), nil }); err != nil {
				t.Fatal(err)
			}
			if err := pool.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&after); err != nil {
				t.Fatal(err)
			}
			var (
				ctid    string
				result  *string
				done    bool
				expires time.Time
			)
			err := pool.QueryRow(ctx, `SELECT ctid::text, convert_from(result, 'UTF8'), token IS NULL, expires_at
				FROM `+w.s.Table()+whereKey, key.Scope, key.ID).Scan(&ctid, &result, &done, &expires)
			if err != nil {
				t.Fatal(err)
			}
			if ctid != "(0,1)" {
				t.Errorf("the row is at ctid %s, want (0,1): it was written more than once", ctid)
			}
			if result != nil || !done {
				t.Errorf("row: result %v, done (no token) %v; want no result, done", result, done)
			}
			if claimed := expires.Add(-72 * time.Hour); claimed.Before(before) || claimed.After(after) {
				t.Errorf("expires_at - the retention (72h) = %v, want the time of the claim, between %v and %v", claimed, before, after)
			}
			if got := w.result(t, withResult); got != "stored" {
				t.Errorf("stored result %q, want %q", got, "stored")
			}
		})
	}
}

// TestProcessLockNamespace: the plain layout takes no advisory lock (its
// claim is the row); the partitioned layout locks the key with
// pg_advisory_xact_lock's single-bigint form (objsubid 1 in pg_locks) on the
// first 8 bytes of the key's digest XOR the table's seed, which its other
// writers take too.
func TestProcessLockNamespace(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 4)
	for _, v := range procVariants {
		t.Run(v.name, func(t *testing.T) {
			w := newProcWorld(t, pool, v, pgtable.Options{})
			ctx := testenv.Ctx(t)
			key := dedup.NewKey("sc'ope", testenv.UniqueID("k"), []byte("p"))
			var want int64
			if err := pool.QueryRow(ctx, "SELECT ('x' || left(replace(("+pgtable.KeySQL("$1::text", "$2::text")+")::text, '-', ''), 16))::bit(64)::bigint # $3",
				key.Scope, key.ID, pgtable.LockSeed(w.s)).Scan(&want); err != nil {
				t.Fatal(err)
			}
			_, err := w.s.Process(ctx, key, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
				var pid int32
				if err := tx.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
					return nil, err
				}
				rows, err := pool.Query(ctx, `SELECT classid::bigint, objid::bigint, objsubid FROM pg_locks
					WHERE locktype = 'advisory' AND pid = $1 AND granted`, pid)
				if err != nil {
					return nil, err
				}
				type lk struct{ classid, objid, objsubid int64 }
				var (
					locks []lk
					l     lk
				)
				if _, err := pgx.ForEachRow(rows, []any{&l.classid, &l.objid, &l.objsubid}, func() error {
					locks = append(locks, l)
					return nil
				}); err != nil {
					return nil, err
				}
				if !v.partitioned {
					if len(locks) != 0 {
						t.Errorf("advisory locks held in fn: %+v, want none", locks)
					}
					return nil, nil
				}
				wantLock := lk{int64(uint32(uint64(want) >> 32)), int64(uint32(uint64(want))), 1}
				if len(locks) != 1 || locks[0] != wantLock {
					t.Errorf("advisory locks held in fn: %+v, want exactly %+v", locks, wantLock)
				}
				return nil, nil
			})
			if err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestProcessCancelledWhileWaiting: a duplicate whose context ends while it
// waits for the first transaction's lock gives up without running fn, and
// leaves no connection busy; the first commits undisturbed.
func TestProcessCancelledWhileWaiting(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 4)
	for _, v := range procVariants {
		t.Run(v.name, func(t *testing.T) {
			w := newProcWorld(t, pool, v, pgtable.Options{})
			ctx := testenv.Ctx(t)
			key := dedup.NewKey("s", testenv.UniqueID("k"), []byte("p"))
			bp := w.processInBackground(ctx, key, "first")
			bp.waitInFn(t)
			wctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
			start := time.Now()
			_, err := w.s.Process(wctx, key, func(context.Context, pgx.Tx) ([]byte, error) {
				t.Error("the cancelled duplicate ran fn")
				return nil, nil
			})
			cancel()
			if err == nil || txflow.Held(err) {
				t.Fatalf("cancelled duplicate = %v, want a context error", err)
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Fatalf("the cancelled duplicate returned after %v", d)
			}
			close(bp.cont)
			if r := <-bp.done; r.err != nil || string(r.res) != "first" {
				t.Fatalf("first = %q, %v", r.res, r.err)
			}
			// A connection the cancelled wait closed is destroyed in the
			// background.
			testenv.Eventually(t, 2*time.Second, "every connection to be released", func() bool { return pool.Stat().AcquiredConns() == 0 })
			_, err = w.s.Process(ctx, key, func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil })
			if res, ok := dedup.StoredResult(err); !ok || string(res) != "first" {
				t.Fatalf("after: %v, want a replay of the first", err)
			}
		})
	}
}

// TestConformanceTxBoundPath runs the transactional conformance suite on
// Process's bound path (a DB that is neither a pool nor a conn), in both
// layouts.
func TestConformanceTxBoundPath(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 20)
	for _, partitioned := range []bool{false, true} {
		name := "plain"
		if partitioned {
			name = "partitioned"
		}
		t.Run(name, func(t *testing.T) {
			deduptest.RunTx(t, deduptest.TxHarness[pgx.Tx]{
				New: func(t testing.TB) dedup.TxStore[pgx.Tx] {
					s, err := pgtable.New(boundDB{pool}, pgtable.Options{Schema: testenv.Schema(t, pool), Partitioned: partitioned, Retention: 48 * time.Hour})
					if err != nil {
						t.Fatal(err)
					}
					if err := s.Migrate(context.Background()); err != nil {
						t.Fatal(err)
					}
					return s
				},
				Down: func(t testing.TB) dedup.TxStore[pgx.Tx] {
					s, err := pgtable.New(boundDB{downPool(t)}, pgtable.Options{Partitioned: partitioned})
					if err != nil {
						t.Fatal(err)
					}
					return s
				},
				Expire: func(t testing.TB, s dedup.TxStore[pgx.Tx]) {
					if _, err := pool.Exec(context.Background(), "UPDATE "+s.(*pgtable.Store).Table()+
						" SET expires_at = clock_timestamp() - interval '1 second'"); err != nil {
						t.Fatal(err)
					}
				},
			})
		})
	}
}
