//go:build unix

package scenario

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/dedup/twolevel"
	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/internal/testkit/linear"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// pgPool opens a pool on cfg and pings it.
func pgPool(ctx context.Context, cfg *pgxpool.Config) (*pgxpool.Pool, error) {
	cfg.ConnConfig.ConnectTimeout = 2 * time.Second
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

// pgSchema opens a pool on url and creates a schema of its own in it;
// drop removes the schema and closes the pool.
func pgSchema(ctx context.Context, url string, maxConns int32) (pool *pgxpool.Pool, schema string, drop func(), err error) {
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, "", nil, err
	}
	cfg.MaxConns = maxConns
	if pool, err = pgPool(ctx, cfg); err != nil {
		return nil, "", nil, fmt.Errorf("%w: PostgreSQL at %s: %w", ErrUnavailable, cfg.ConnConfig.Host, err)
	}
	schema = testenv.Name("idemlinear")
	if _, err := pool.Exec(ctx, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		pool.Close()
		return nil, "", nil, err
	}
	drop = func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
		defer cancel()
		_, _ = pool.Exec(dctx, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
		pool.Close()
	}
	return pool, schema, drop, nil
}

// PgtableLease runs clients on pgtable's lease mode, on the PostgreSQL at url
// in a schema of their own, through a proxy that every 300ms spends 20ms
// cutting connections after forwarding a statement and before its reply
// reaches the client (the server ran it; the client cannot know). Reads
// are Store.Lookup. Checked under LeaseModel. Defaults: 8 clients, 8 keys
// (a reply cut leaves its operation unknown, and each unknown doubles
// what the check may try: more keys keep each key's history short), 30
// operations each.
func PgtableLease(ctx context.Context, url string, size Size) (*Outcome, error) {
	const lease, ttl = 300 * time.Millisecond, 300 * time.Millisecond
	direct, schema, drop, err := pgSchema(ctx, url, 4)
	if err != nil {
		return nil, err
	}
	defer drop()
	opts := pgtable.Options{Schema: schema, Lease: lease, Retention: ttl}
	mig, err := pgtable.New(direct, opts)
	if err != nil {
		return nil, err
	}
	if err := mig.Migrate(ctx); err != nil {
		return nil, err
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, err
	}
	proxy, err := fault.NewProxy(net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port))))
	if err != nil {
		return nil, err
	}
	defer func() { _ = proxy.Close() }()
	host, port, err := net.SplitHostPort(proxy.Addr())
	if err != nil {
		return nil, err
	}
	p, err := strconv.ParseUint(port, 10, 16)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.Host, cfg.ConnConfig.Port = host, uint16(p)
	cfg.MaxConns = 8
	proxied, err := pgPool(ctx, cfg)
	if err != nil {
		return nil, err
	}
	defer proxied.Close()
	s, err := pgtable.New(proxied, opts)
	if err != nil {
		return nil, err
	}
	read := func(ctx context.Context, k dedup.Key) (linear.State, error) {
		err := s.Lookup(ctx, k)
		switch {
		case err == nil:
			return linear.StateAbsent, nil
		case errors.Is(err, dedup.ErrInFlight):
			return linear.StateHeld, nil
		case errors.Is(err, dedup.ErrDuplicate):
			return linear.StateDone, nil
		}
		return 0, err
	}
	windows := 0
	w := linear.Workload{Scope: testenv.UniqueID("pg"), Lease: lease, TTL: ttl, Ops: 30, Keys: 8}
	size.apply(&w)
	h := linear.RunLease(ctx, linear.Target{Store: s.Lease(), Read: read}, w, func(fctx context.Context) {
		every(fctx, 300*time.Millisecond, func() bool {
			proxy.SetMode(fault.Cut, 0)
			time.Sleep(20 * time.Millisecond)
			proxy.SetMode(fault.Pass, 0)
			windows++
			return true
		})
	})
	st := proxy.Stats()
	return &Outcome{Name: "pgtable lease", Model: linear.LeaseModel(lease, ttl, Slack), History: h,
		Faults: int(st.Cuts),
		Note:   fmt.Sprintf("%d replies cut after PostgreSQL ran the statement, in %d windows of 20ms", st.Cuts, windows)}, nil
}

// Twolevel runs clients that process keys through twolevel (redisnx in front of
// pgtable on the PostgreSQL at url, in a schema of its own), while the
// cache, a throwaway Redis without persistence, is SIGKILLed and restarted
// empty every 100ms; one fn in eight fails. Checked under TxModel: each
// key's fn is committed at most once and every duplicate carries its
// result, whatever the cache forgot. Defaults: 8 clients, 40 keys, 100
// operations each.
func Twolevel(ctx context.Context, url string, size Size) (*Outcome, error) {
	pool, schema, drop, err := pgSchema(ctx, url, 8)
	if err != nil {
		return nil, err
	}
	defer drop()
	db, err := pgtable.New(pool, pgtable.Options{Schema: schema})
	if err != nil {
		return nil, err
	}
	if err := db.Migrate(ctx); err != nil {
		return nil, err
	}
	srv, err := startRedis(ctx)
	if err != nil {
		return nil, err
	}
	defer func() { _ = srv.Close() }()
	c := redis.NewClient(&redis.Options{Addr: srv.Addr()})
	defer func() { _ = c.Close() }()
	cache, err := redisnx.New(c, redisnx.Options{})
	if err != nil {
		return nil, err
	}
	s, err := twolevel.New(cache, db, twolevel.Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return nil, err
	}
	process := func(ctx context.Context, k dedup.Key, value string, fnErr error) ([]byte, error) {
		return s.Process(ctx, k, func(context.Context, pgx.Tx) ([]byte, error) {
			if fnErr != nil {
				return nil, fnErr
			}
			return []byte(value), nil
		})
	}
	kills := 0
	var ferr faultErr
	w := linear.Workload{Scope: testenv.UniqueID("2l"), Keys: 40, Ops: 100}
	size.apply(&w)
	h := linear.RunTx(ctx, process, w, func(fctx context.Context) {
		every(fctx, 100*time.Millisecond, func() bool {
			_ = srv.Kill()
			kills++
			if err := srv.Restart(ctx); err != nil {
				ferr.set(fmt.Errorf("restart: %w", err))
				return false
			}
			return true
		})
	})
	if err := ferr.get(); err != nil {
		return nil, err
	}
	return &Outcome{Name: "twolevel", Model: linear.TxModel(), History: h,
		Faults: kills, Restarts: kills,
		Note: fmt.Sprintf("cache Redis (no persistence) SIGKILLed and restarted empty %d times", kills)}, nil
}
