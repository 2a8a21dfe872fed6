// Package twolevel puts a fast lease store (dedup/redisnx, or memstore) in
// front of dedup/pgtable: a cache answers hot
// duplicates and in-flight collisions without touching PostgreSQL, and the
// claim in the business transaction decides.
//
// Process first claims the key in the cache:
//
//   - a completed mark there is a duplicate, answered without the database;
//   - a live lease there is ErrInFlight, answered without the database;
//   - a fingerprint mismatch there is answered without the database;
//   - otherwise (a new lease, or the cache is unreachable) the database claim
//     runs in the transaction, exactly as pgtable.Store.Process does.
//
// After the database commits, the cache mark is completed with the result;
// when the database finds a duplicate the cache lost (a Redis restart without
// persistence, a failover, an eviction), the mark is written back. A lost or
// wrong-way cache can therefore cost a database round trip, never a duplicate
// effect: the database's primary key is the final word. An unreachable cache
// is logged and skipped, never a reason to let a message through unchecked.
package twolevel

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
)

// Options configure a Store. The zero value is usable.
type Options struct {
	// Logger receives cache failures. Defaults to slog.Default().
	Logger *slog.Logger
	// CacheTimeout bounds each cache call, so a slow cache costs at most
	// this before the database decides alone. Defaults to 250ms.
	CacheTimeout time.Duration
	// Stats, when set, is told where each answer came from.
	Stats func(source Source)
}

// Source says which level answered a Process call.
type Source string

// Sources reported to Options.Stats.
const (
	CacheDuplicate    Source = "cache_duplicate"   // completed mark in the cache
	CacheInFlight     Source = "cache_in_flight"   // live lease in the cache
	CacheMismatch     Source = "cache_mismatch"    // fingerprint mismatch in the cache
	CacheUnavailable  Source = "cache_unavailable" // cache failed; the database decided alone
	DatabaseFirst     Source = "db_first"          // the database claim won
	DatabaseDuplicate Source = "db_duplicate"      // duplicate the cache did not know
	DatabaseOther     Source = "db_other"          // mismatch, error or a failed fn
)

// Store is a two-level dedup.TxStore[pgx.Tx].
type Store struct {
	cache dedup.LeaseStore
	db    *pgtable.Store
	opts  Options
}

var _ dedup.TxStore[pgx.Tx] = (*Store)(nil)

// New returns a Store with cache in front of db.
func New(cache dedup.LeaseStore, db *pgtable.Store, opts Options) (*Store, error) {
	if cache == nil {
		return nil, errors.New("twolevel: cache is nil: pass a redisnx or memstore store")
	}
	if db == nil {
		return nil, errors.New("twolevel: db is nil: pass a *pgtable.Store")
	}
	if opts.CacheTimeout < 0 {
		return nil, fmt.Errorf("twolevel: Options.CacheTimeout is %v; it must not be negative", opts.CacheTimeout)
	}
	if opts.CacheTimeout == 0 {
		opts.CacheTimeout = 250 * time.Millisecond
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	return &Store{cache: cache, db: db, opts: opts}, nil
}

func (s *Store) stat(src Source) {
	if s.opts.Stats != nil {
		s.opts.Stats(src)
	}
}

func (s *Store) cacheCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), s.opts.CacheTimeout)
}

// Process implements dedup.TxStore. See the package doc for the order of the
// checks.
func (s *Store) Process(ctx context.Context, key dedup.Key, fn dedup.TxFunc[pgx.Tx]) ([]byte, error) {
	if fn == nil {
		return nil, errors.New("twolevel: Process: fn is nil")
	}
	if err := dedup.ValidateKey(key, s.db.Options().MaxKeyLen); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	cctx, cancel := s.cacheCtx(ctx)
	lease, cerr := s.cache.Claim(cctx, key)
	cancel()
	switch {
	case cerr == nil:
	case errors.Is(cerr, dedup.ErrDuplicate):
		s.stat(CacheDuplicate)
		return nil, cerr
	case errors.Is(cerr, dedup.ErrInFlight):
		s.stat(CacheInFlight)
		return nil, cerr
	case errors.Is(cerr, dedup.ErrFingerprintMismatch):
		s.stat(CacheMismatch)
		return nil, cerr
	default:
		s.stat(CacheUnavailable)
		s.opts.Logger.Warn("twolevel: cache unavailable; the database decides alone", "err", cerr)
		lease = nil
	}

	settled := false
	defer func() {
		// fn panicked: give the cache lease back so the redelivery is not
		// kept waiting for the lease to run out.
		if !settled && lease != nil {
			s.release(ctx, lease)
		}
	}()
	res, err := s.db.Process(ctx, key, fn)
	settled = true
	switch {
	case err == nil:
		s.stat(DatabaseFirst)
		s.complete(ctx, lease, res)
		return res, nil
	case errors.Is(err, dedup.ErrDuplicate):
		s.stat(DatabaseDuplicate)
		stored, _ := dedup.StoredResult(err)
		s.complete(ctx, lease, stored) // write the lost mark back
		return nil, err
	default:
		s.stat(DatabaseOther)
		if lease != nil {
			s.release(ctx, lease)
		}
		return nil, err
	}
}

func (s *Store) complete(ctx context.Context, lease *dedup.Lease, result []byte) {
	if lease == nil {
		return
	}
	cctx, cancel := s.cacheCtx(ctx)
	defer cancel()
	if err := s.cache.Complete(cctx, lease, result); err != nil {
		// The database holds the truth; the next duplicate costs a
		// database round trip and writes the mark back.
		s.opts.Logger.Warn("twolevel: completing the cache mark failed", "err", err)
	}
}

func (s *Store) release(ctx context.Context, lease *dedup.Lease) {
	cctx, cancel := s.cacheCtx(ctx)
	defer cancel()
	if err := s.cache.Release(cctx, lease); err != nil {
		s.opts.Logger.Warn("twolevel: releasing the cache lease failed; it runs out by itself", "err", err)
	}
}
