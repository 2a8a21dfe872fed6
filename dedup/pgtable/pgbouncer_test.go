package pgtable_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/deduptest"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/pgbouncer"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// The store through PgBouncer in transaction mode (a pool of 4 server
// connections shared by every client of the test): the conformance suites
// and oracle runs of both layouts, in the exec modes that work through it.
// Cleanup of a partitioned table needs a session and refuses a pooled
// connection.

// layouts are the table layouts, by name.
var layouts = map[string]pgtable.Options{
	"plain":       {},
	"partitioned": {Partitioned: true, Retention: 48 * time.Hour},
}

func TestPgBouncerConformanceTx(t *testing.T) {
	b := pgbouncer.New(t, pgbouncer.Options{})
	pool := b.Pool(t, 20)
	direct := testenv.Pool(t, 4)
	for name, opts := range layouts {
		t.Run(name, func(t *testing.T) {
			deduptest.RunTx(t, deduptest.TxHarness[pgx.Tx]{
				New: func(t testing.TB) dedup.TxStore[pgx.Tx] {
					o := opts
					o.Schema = testenv.Schema(t, direct)
					return newStore(t, pool, o)
				},
				Down: func(t testing.TB) dedup.TxStore[pgx.Tx] {
					s, err := pgtable.New(downPool(t), opts)
					if err != nil {
						t.Fatal(err)
					}
					return s
				},
				Expire: func(t testing.TB, s dedup.TxStore[pgx.Tx]) {
					if !opts.Partitioned {
						expireAll(t, pool, s.(*pgtable.Store))
						return
					}
					if _, err := pool.Exec(context.Background(), "UPDATE "+s.(*pgtable.Store).Table()+
						" SET expires_at = clock_timestamp() - interval '1 second'"); err != nil {
						t.Fatal(err)
					}
				},
			})
		})
	}
}

func TestPgBouncerConformanceLease(t *testing.T) {
	b := pgbouncer.New(t, pgbouncer.Options{})
	pool := b.Pool(t, 20)
	direct := testenv.Pool(t, 4)
	for name, opts := range layouts {
		t.Run(name, func(t *testing.T) {
			deduptest.RunLease(t, deduptest.LeaseHarness{
				New: func(t testing.TB, cfg deduptest.Config) deduptest.LeaseInstance {
					o := opts
					o.Schema, o.Lease, o.Retention = testenv.Schema(t, direct), cfg.Lease, cfg.TTL
					return deduptest.LeaseInstance{Store: newStore(t, pool, o).Lease()}
				},
				Down: func(t testing.TB) dedup.LeaseStore {
					s, err := pgtable.New(downPool(t), opts)
					if err != nil {
						t.Fatal(err)
					}
					return s.Lease()
				},
			})
		})
	}
}

// oracleTable creates a table of effects with no unique constraint in
// schema: a duplicate effect is a second row of its id.
func oracleTable(t testing.TB, direct *pgxpool.Pool, schema string) string {
	t.Helper()
	table := pgx.Identifier{schema, "effects"}.Sanitize()
	if _, err := direct.Exec(context.Background(), "CREATE TABLE "+table+" (id text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	return table
}

// tally counts the ids in want with more than one effect row and with
// none, and the rows of ids not in want.
func tally(t testing.TB, direct *pgxpool.Pool, table string, want []string) (dups, lost, unexpected int) {
	t.Helper()
	rows, err := direct.Query(context.Background(), "SELECT id, count(*) FROM "+table+" GROUP BY id")
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]int64{}
	var (
		id string
		n  int64
	)
	if _, err := pgx.ForEachRow(rows, []any{&id, &n}, func() error { got[id] = n; return nil }); err != nil {
		t.Fatal(err)
	}
	for _, id := range want {
		switch n := got[id]; {
		case n == 0:
			lost++
		case n > 1:
			dups++
		}
		delete(got, id)
	}
	return dups, lost, len(got)
}

// deliveries returns each id copies times, shuffled: the duplicates a
// broker delivers.
func deliveries(ids []string, copies int) []string {
	var out []string
	for range copies {
		out = append(out, ids...)
	}
	rand.Shuffle(len(out), func(i, j int) { out[i], out[j] = out[j], out[i] })
	return out
}

// Process through PgBouncer: 8 workers take 3 deliveries of each of 150
// ids; the handler writes the effect in the claim's transaction and, on a
// tenth of the attempts, fails after it (the transaction rolls back and
// the delivery is retried). The oracle finds each id's effect once.
func TestPgBouncerProcessOracle(t *testing.T) {
	b := pgbouncer.New(t, pgbouncer.Options{})
	direct := testenv.Pool(t, 4)
	for _, mode := range []string{"cache_describe", "exec", "simple_protocol"} {
		for name, opts := range layouts {
			t.Run(mode+"/"+name, func(t *testing.T) {
				pool := b.PoolMode(t, 8, mode)
				opts.Schema = testenv.Schema(t, direct)
				s := newStore(t, pool, opts)
				effects := oracleTable(t, direct, opts.Schema)
				ids := make([]string, 150)
				for i := range ids {
					ids[i] = testenv.UniqueID("m")
				}
				queue := make(chan string, 3*len(ids))
				for _, id := range deliveries(ids, 3) {
					queue <- id
				}
				close(queue)
				var (
					firsts, dupHits, failures atomic.Int64
					wg                        sync.WaitGroup
					errMu                     sync.Mutex
					errs                      []error
				)
				errBoom := errors.New("handler failed after its effect")
				for range 8 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						ctx := testenv.Ctx(t)
						for id := range queue {
							for {
								_, err := s.Process(ctx, dedup.Key{Scope: "pgbouncer", ID: id}, func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
									if _, err := tx.Exec(ctx, "INSERT INTO "+effects+" (id) VALUES ($1)", id); err != nil {
										return nil, err
									}
									if rand.IntN(10) == 0 {
										failures.Add(1)
										return nil, errBoom
									}
									return []byte("ok"), nil
								})
								switch {
								case err == nil:
									firsts.Add(1)
								case errors.Is(err, dedup.ErrDuplicate):
									dupHits.Add(1)
								case errors.Is(err, errBoom), errors.Is(err, dedup.ErrInFlight):
									continue // redelivered
								default:
									errMu.Lock()
									errs = append(errs, err)
									errMu.Unlock()
								}
								break
							}
						}
					}()
				}
				wg.Wait()
				if len(errs) > 0 {
					t.Fatalf("%d deliveries failed, the first: %v", len(errs), errs[0])
				}
				dups, lost, unexpected := tally(t, direct, effects, ids)
				if dups != 0 || lost != 0 || unexpected != 0 || firsts.Load() != int64(len(ids)) {
					t.Fatalf("oracle: %d ids, %d processed first, %d with a duplicate effect, %d lost, %d unexpected",
						len(ids), firsts.Load(), dups, lost, unexpected)
				}
				if failures.Load() == 0 || dupHits.Load() != int64(2*len(ids)) {
					t.Fatalf("%d failures injected, %d duplicates answered (want some, and %d)", failures.Load(), dupHits.Load(), 2*len(ids))
				}
				t.Logf("oracle: %d ids, %d deliveries, %d handler failures rolled back, %d duplicates answered, 0 duplicate effects, 0 lost",
					len(ids), 3*len(ids), failures.Load(), dupHits.Load())
			})
		}
	}
}

// The lease mode through PgBouncer: 8 workers take 3 deliveries of each
// of 150 ids; a delivery claims, writes the effect outside any transaction
// and completes, or, a tenth of the time, fails before the effect and
// releases (the delivery is retried). A claim in flight is retried. The
// oracle finds each id's effect once.
func TestPgBouncerLeaseOracle(t *testing.T) {
	b := pgbouncer.New(t, pgbouncer.Options{})
	pool := b.Pool(t, 8)
	direct := testenv.Pool(t, 4)
	for name, opts := range layouts {
		t.Run(name, func(t *testing.T) {
			opts.Schema, opts.Lease = testenv.Schema(t, direct), 10*time.Second
			ls := newStore(t, pool, opts).Lease()
			effects := oracleTable(t, direct, opts.Schema)
			ids := make([]string, 150)
			for i := range ids {
				ids[i] = testenv.UniqueID("l")
			}
			queue := make(chan string, 3*len(ids))
			for _, id := range deliveries(ids, 3) {
				queue <- id
			}
			close(queue)
			var (
				completed, dupHits, released atomic.Int64
				wg                           sync.WaitGroup
				errMu                        sync.Mutex
				errs                         []error
			)
			fail := func(err error) {
				errMu.Lock()
				errs = append(errs, err)
				errMu.Unlock()
			}
			for range 8 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					ctx := testenv.Ctx(t)
					for id := range queue {
						for {
							l, err := ls.Claim(ctx, dedup.Key{Scope: "pgbouncer", ID: id})
							if errors.Is(err, dedup.ErrInFlight) {
								time.Sleep(time.Millisecond)
								continue
							}
							if errors.Is(err, dedup.ErrDuplicate) {
								dupHits.Add(1)
								break
							}
							if err != nil {
								fail(err)
								break
							}
							if rand.IntN(10) == 0 {
								released.Add(1)
								if err := ls.Release(ctx, l); err != nil {
									fail(err)
									break
								}
								continue
							}
							if _, err := pool.Exec(ctx, "INSERT INTO "+effects+" (id) VALUES ($1)", id); err != nil {
								fail(err)
								break
							}
							if err := ls.Complete(ctx, l, nil); err != nil {
								fail(err)
								break
							}
							completed.Add(1)
							break
						}
					}
				}()
			}
			wg.Wait()
			if len(errs) > 0 {
				t.Fatalf("%d deliveries failed, the first: %v", len(errs), errs[0])
			}
			dups, lost, unexpected := tally(t, direct, effects, ids)
			if dups != 0 || lost != 0 || unexpected != 0 || completed.Load() != int64(len(ids)) {
				t.Fatalf("oracle: %d ids, %d completed, %d with a duplicate effect, %d lost, %d unexpected",
					len(ids), completed.Load(), dups, lost, unexpected)
			}
			if released.Load() == 0 || dupHits.Load() != int64(2*len(ids)) {
				t.Fatalf("%d releases, %d duplicates answered (want some, and %d)", released.Load(), dupHits.Load(), 2*len(ids))
			}
			t.Logf("oracle: %d ids, %d deliveries, %d released and retried, %d duplicates answered, 0 duplicate effects, 0 lost",
				len(ids), 3*len(ids), released.Load(), dupHits.Load())
		})
	}
}

// Migrate from six clients at once through PgBouncer: its
// transaction-scoped advisory lock lets one apply and the others find
// nothing to do.
func TestPgBouncerMigrateConcurrently(t *testing.T) {
	b := pgbouncer.New(t, pgbouncer.Options{})
	pool := b.Pool(t, 8)
	direct := testenv.Pool(t, 2)
	for name, opts := range layouts {
		t.Run(name, func(t *testing.T) {
			opts.Schema = testenv.Schema(t, direct)
			s, err := pgtable.New(pool, opts)
			if err != nil {
				t.Fatal(err)
			}
			var wg sync.WaitGroup
			errs := make(chan error, 6)
			for range 6 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					errs <- s.Migrate(testenv.Ctx(t))
				}()
			}
			wg.Wait()
			close(errs)
			for err := range errs {
				if err != nil {
					t.Fatalf("Migrate through PgBouncer: %v", err)
				}
			}
			ms, err := s.Migrations()
			if err != nil {
				t.Fatal(err)
			}
			var n int
			if err := direct.QueryRow(context.Background(), "SELECT count(*) FROM "+pgx.Identifier{opts.Schema, "processed_events_migrations"}.Sanitize()).Scan(&n); err != nil {
				t.Fatal(err)
			}
			if n != len(ms) {
				t.Fatalf("%d versions recorded, %d migrations", n, len(ms))
			}
		})
	}
}

// Cleanup of a plain table works through PgBouncer.
func TestPgBouncerCleanupPlain(t *testing.T) {
	b := pgbouncer.New(t, pgbouncer.Options{})
	pool := b.Pool(t, 4)
	direct := testenv.Pool(t, 2)
	s := newStore(t, pool, pgtable.Options{Schema: testenv.Schema(t, direct), CleanupBatch: 7})
	ctx := testenv.Ctx(t)
	for i := range 30 {
		if _, err := s.Process(ctx, dedup.Key{Scope: "s", ID: fmt.Sprint(i)}, func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil }); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := direct.Exec(ctx, "UPDATE "+s.Table()+" SET expires_at = clock_timestamp() - interval '1 second'"); err != nil {
		t.Fatal(err)
	}
	n, err := s.Cleanup(ctx)
	if err != nil || n != 30 {
		t.Fatalf("Cleanup through PgBouncer = %d, %v; want the 30 expired rows", n, err)
	}
}

// Cleanup of a partitioned table refuses a pooled connection before it
// sets anything on it, and names what to do; a store with the same options
// on a direct pool drops the past partitions.
func TestPgBouncerCleanupPartitionedNeedsDirect(t *testing.T) {
	b := pgbouncer.New(t, pgbouncer.Options{PoolSize: 1})
	pool := b.Pool(t, 2)
	direct := testenv.Pool(t, 2)
	opts := pgtable.Options{Schema: testenv.Schema(t, direct), Partitioned: true, Retention: 24 * time.Hour}
	s := newStore(t, pool, opts)
	ctx := testenv.Ctx(t)
	day := time.Now().UTC().AddDate(0, 0, -2)
	addPastPartition(t, direct, s, day.Format("20060102"), day.Format(time.DateOnly), day.AddDate(0, 0, 1).Format(time.DateOnly), 5)

	_, err := s.Cleanup(ctx)
	if err == nil {
		t.Fatal("Cleanup of a partitioned table through PgBouncer succeeded")
	}
	for _, want := range []string{"needs a session of its own", "pool_mode=transaction", "on a pool that connects to PostgreSQL itself"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("Cleanup's error does not say %q: %v", want, err)
		}
	}
	// Nothing stayed on PgBouncer's one server connection.
	var timeout string
	if err := pool.QueryRow(ctx, "SELECT current_setting('lock_timeout')").Scan(&timeout); err != nil {
		t.Fatal(err)
	}
	if timeout != "0" {
		t.Fatalf("lock_timeout %s left on PgBouncer's server connection", timeout)
	}
	var locks int
	if err := pool.QueryRow(ctx, "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()").Scan(&locks); err != nil {
		t.Fatal(err)
	}
	if locks != 0 {
		t.Fatalf("%d advisory locks left on PgBouncer's server connection", locks)
	}

	ds, err := pgtable.New(direct, opts)
	if err != nil {
		t.Fatal(err)
	}
	if n, err := ds.Cleanup(ctx); err != nil || n != 5 {
		t.Fatalf("Cleanup on a direct pool = %d, %v; want the 5 rows of the past partition", n, err)
	}
	// EnsurePartitions (which CleanupLoop also runs) works through it.
	if err := s.EnsurePartitions(ctx); err != nil {
		t.Fatalf("EnsurePartitions through PgBouncer: %v", err)
	}
}
