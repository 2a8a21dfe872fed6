// Package twolevel puts a fast lease store (dedup/redisnx, or memstore) in
// front of dedup/pgtable: a cache answers hot duplicates without touching
// PostgreSQL, and the claim in the business transaction decides.
//
// Process first claims the key in the cache:
//
//   - a completed mark there is a duplicate, answered without the database;
//   - a fingerprint mismatch there is answered without the database;
//   - a live lease there is checked with one read of the key's committed
//     row in the database, which does not wait for the lease's holder
//     (pgtable.Store.Lookup): a committed row is the answer (a duplicate
//     with its stored result), without one the answer is ErrInFlight, and
//     when the database cannot be read, its error.
//     A lease whose completion failed (the cache was unreachable after the
//     commit) stays live until it runs out; the read keeps it from hiding
//     the committed row meanwhile;
//   - otherwise (a new lease, or the cache is unreachable) the database claim
//     runs in the transaction, exactly as pgtable.Store.Process does.
//
// After the database commits, the cache mark is completed with the result;
// when the database finds a duplicate the cache lost (a Redis restart without
// persistence, a failover, an eviction), the mark is written back. A lost or
// wrong-way cache can therefore cost a database round trip, never a duplicate
// effect: the database's primary key is the final word. An unreachable cache
// is logged and skipped, never a reason to let a message through unchecked.
//
// Each Process call is counted by the level that answered it: the
// OpenTelemetry counter idem.twolevel.answers, whose idem.source attribute is
// cache_duplicate (a completed mark in the cache), cache_in_flight (a live
// lease in the cache, and no committed row in the database), cache_mismatch
// (a fingerprint mismatch in the cache), cache_unavailable (the cache
// failed; the database decided alone), db_first (the database claim won),
// db_duplicate (a duplicate the cache did not know, or held as in flight)
// or db_other (a mismatch, an error or a failed fn). A high db_duplicate
// share means the cache loses its marks or fails to complete them.
package twolevel

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"go.opentelemetry.io/otel/metric"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/telemetry"
)

// Options configure a Store. The zero value is usable.
type Options struct {
	// Logger receives cache failures. Defaults to slog.Default().
	Logger *slog.Logger
	// CacheTimeout bounds each cache call, so a slow cache costs at most
	// this before the database decides alone. Defaults to 250ms.
	CacheTimeout time.Duration
	// MeterProvider receives idem.twolevel.answers, the Process calls by
	// the level that answered (see the package documentation). Defaults to
	// otel.GetMeterProvider(), a no-op until the application installs a
	// provider.
	MeterProvider metric.MeterProvider
	// MaxKeyLen is the longest key, in bytes of scope plus id, that is
	// claimed; a longer one is refused before the cache is asked. Set it
	// to the database store's own when that is not the default. Defaults
	// to dedup.DefaultMaxKeyLen.
	MaxKeyLen int
}

// DB is the transactional store behind the cache: a *pgtable.Store (Tx is
// pgx.Tx) or a *sqltable.Store (Tx is *sql.Tx, on PostgreSQL, MySQL,
// MariaDB or SQLite). Lookup reads a key's committed row without claiming
// it and without waiting for a transaction that holds it, answering as a
// claim would (nil when there is no live row).
type DB[Tx any] interface {
	dedup.TxStore[Tx]
	Lookup(ctx context.Context, key dedup.Key) error
}

// Store is a two-level dedup.TxStore[Tx]: fn runs in the database store's
// transaction type.
type Store[Tx any] struct {
	cache dedup.LeaseStore
	db    DB[Tx]
	opts  Options
	tel   *telemetry.TwoLevel
}

// New returns a Store with cache in front of db. The transaction type
// follows from db: New(cache, pgStore, opts) is a *Store[pgx.Tx].
func New[Tx any](cache dedup.LeaseStore, db DB[Tx], opts Options) (*Store[Tx], error) {
	if cache == nil {
		return nil, errors.New("twolevel: cache is nil: pass a redisnx or memstore store")
	}
	if db == nil {
		return nil, errors.New("twolevel: db is nil: pass a *pgtable.Store or a *sqltable.Store")
	}
	if opts.MaxKeyLen < 0 {
		return nil, fmt.Errorf("twolevel: Options.MaxKeyLen is %d; it must not be negative", opts.MaxKeyLen)
	}
	if opts.MaxKeyLen == 0 {
		opts.MaxKeyLen = dedup.DefaultMaxKeyLen
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
	return &Store[Tx]{cache: cache, db: db, opts: opts, tel: telemetry.NewTwoLevel(opts.MeterProvider)}, nil
}

// TxAborted reports whether tx is in a failed state, when the database
// store can tell (pgtable can); false otherwise.
func (s *Store[Tx]) TxAborted(tx Tx) bool {
	a, ok := s.db.(interface{ TxAborted(Tx) bool })
	return ok && a.TxAborted(tx)
}

func (s *Store[Tx]) cacheCtx(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), s.opts.CacheTimeout)
}

// Process implements dedup.TxStore. See the package doc for the order of the
// checks.
func (s *Store[Tx]) Process(ctx context.Context, key dedup.Key, fn dedup.TxFunc[Tx]) ([]byte, error) {
	if fn == nil {
		return nil, errors.New("twolevel: Process: fn is nil")
	}
	if err := dedup.ValidateKey(key, s.opts.MaxKeyLen); err != nil {
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
		s.tel.Answered(ctx, telemetry.SourceCacheDuplicate)
		return nil, cerr
	case errors.Is(cerr, dedup.ErrInFlight):
		return nil, s.checkInFlight(ctx, key, cerr)
	case errors.Is(cerr, dedup.ErrFingerprintMismatch):
		s.tel.Answered(ctx, telemetry.SourceCacheMismatch)
		return nil, cerr
	default:
		s.tel.Answered(ctx, telemetry.SourceCacheUnavailable)
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
		s.tel.Answered(ctx, telemetry.SourceDatabaseFirst)
		s.complete(ctx, lease, res)
		return res, nil
	case errors.Is(err, dedup.ErrDuplicate):
		s.tel.Answered(ctx, telemetry.SourceDatabaseDuplicate)
		stored, _ := dedup.StoredResult(err)
		s.complete(ctx, lease, stored) // write the lost mark back
		return nil, err
	default:
		s.tel.Answered(ctx, telemetry.SourceDatabaseOther)
		if lease != nil {
			s.release(ctx, lease)
		}
		return nil, err
	}
}

// checkInFlight answers a key whose lease the cache holds (cerr, its
// ErrInFlight) from the key's committed row in the database, when there is
// one: the lease's holder may have committed and failed to complete the
// mark. Without a committed row the cache's in-flight answer stands; when
// the database cannot be read, its error is the answer.
func (s *Store[Tx]) checkInFlight(ctx context.Context, key dedup.Key, cerr error) error {
	err := s.db.Lookup(ctx, key)
	switch {
	case err == nil, errors.Is(err, dedup.ErrInFlight):
		s.tel.Answered(ctx, telemetry.SourceCacheInFlight)
		return cerr
	case errors.Is(err, dedup.ErrDuplicate):
		s.tel.Answered(ctx, telemetry.SourceDatabaseDuplicate)
		return err
	case errors.Is(err, dedup.ErrFingerprintMismatch):
		s.tel.Answered(ctx, telemetry.SourceDatabaseOther)
		return err
	default:
		// Whether the lease's holder committed is unknown: the
		// database's error says so better than "in flight".
		s.tel.Answered(ctx, telemetry.SourceDatabaseOther)
		return err
	}
}

func (s *Store[Tx]) complete(ctx context.Context, lease *dedup.Lease, result []byte) {
	if lease == nil {
		return
	}
	cctx, cancel := s.cacheCtx(ctx)
	defer cancel()
	if err := s.cache.Complete(cctx, lease, result); err != nil {
		// The database holds the truth. The lease stays live until it
		// runs out: meanwhile a duplicate finds it in flight and reads
		// the committed row (checkInFlight); after it, the duplicate's
		// database claim finds the row and writes the mark back.
		s.opts.Logger.Warn("twolevel: completing the cache mark failed", "err", err)
	}
}

func (s *Store[Tx]) release(ctx context.Context, lease *dedup.Lease) {
	cctx, cancel := s.cacheCtx(ctx)
	defer cancel()
	if err := s.cache.Release(cctx, lease); err != nil {
		s.opts.Logger.Warn("twolevel: releasing the cache lease failed; it runs out by itself", "err", err)
	}
}
