package watermill

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"hash/fnv"
	"regexp"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/internal/sqlname"
)

// The repositories in this file are drop-in ExpiringKeyRepository
// implementations for Watermill's middleware.Deduplicator. They are shared
// across processes, which Watermill's in-memory repository is not, but they
// keep the Deduplicator's semantics, limitation included: see
// RedisKeyRepository.

// DefaultKeyWindow is the default window of the key repositories, the window
// of Watermill's own Deduplicator default.
const DefaultKeyWindow = time.Minute

// RedisKeyRepositoryOptions configure a RedisKeyRepository. The zero value is
// usable.
type RedisKeyRepositoryOptions struct {
	// Window is how long a key is remembered after it was first seen.
	// Rounded up to whole milliseconds. Defaults to DefaultKeyWindow (one
	// minute, like Watermill's default repository).
	Window time.Duration
	// Prefix starts every Redis key: "<Prefix>:<key>". 1 to 64 characters
	// from [A-Za-z0-9_.:-]. Defaults to "idem:wmdedup".
	Prefix string
}

// RedisKeyRepository is a Watermill middleware.ExpiringKeyRepository on
// Redis (a single node, Sentinel or Cluster through redis.UniversalClient),
// for users who keep Watermill's Deduplicator and need its marks shared by
// every instance of a service. IsDuplicate is one SET NX PX round trip.
//
// # The mark-before limitation
//
// The Deduplicator calls IsDuplicate before the handler runs, and nothing
// ever removes the mark: when the handler fails, the message is nacked and
// redelivered (or retried by the Retry middleware), and the retry finds the
// mark and is acknowledged without running. A message whose first attempt
// failed is therefore dropped, whatever repository holds the marks. Two more
// properties of the Deduplicator stay as they are: its default key is an
// Adler-32 checksum of the payload (two different messages with the same
// payload collide; set KeyFactory to return msg.UUID), and as router-level
// middleware it shares one key space between all handlers (the second
// handler of a message drops it).
//
// The same mark-before makes the Deduplicator's Timeout matter: a mark that
// times out after the server applied it returns an error (the message is
// retried) and leaves the mark behind, so the retry is dropped without the
// handler having run once. Set Timeout explicitly: on a non-nil
// Deduplicator its zero value means 5ms, not the one minute its
// documentation gives as the default (watermill v1.5.1), which is too short
// for a network round trip; the tests of this package lost messages that
// way against PostgreSQL.
//
// # Moving to the idem middleware
//
// Replace the Deduplicator with Dedup over a lease store, on the same Redis:
//
//	store, _ := redisnx.New(client, redisnx.Options{TTL: 24 * time.Hour})
//	mw, _ := watermill.Dedup(store, watermill.Options{})
//	router.AddMiddleware(retry.Middleware, mw)
//
// It claims the message with a lease, completes the key only when the
// handler succeeded and releases it when the handler failed, keys on
// msg.UUID, scopes keys per handler, and sends content conflicts to the
// poison queue. Its keys live under another prefix, so the two can run side
// by side during a rollout; a message marked by the Deduplicator alone is
// not known to Dedup.
//
// Redis marks are best effort: a restart without persistence, a failover or
// eviction under maxmemory loses them, and a lost mark lets a duplicate
// through.
type RedisKeyRepository struct {
	client redis.UniversalClient
	prefix string
	window time.Duration
}

var redisPrefix = regexp.MustCompile(`^[A-Za-z0-9_.:-]{1,64}$`)

// NewRedisKeyRepository returns a RedisKeyRepository on client. It does no
// I/O.
func NewRedisKeyRepository(client redis.UniversalClient, opts RedisKeyRepositoryOptions) (*RedisKeyRepository, error) {
	if client == nil {
		return nil, errors.New("watermill: NewRedisKeyRepository: client is nil")
	}
	w, err := keyWindow("NewRedisKeyRepository", opts.Window)
	if err != nil {
		return nil, err
	}
	if opts.Prefix == "" {
		opts.Prefix = "idem:wmdedup"
	}
	if !redisPrefix.MatchString(opts.Prefix) {
		return nil, fmt.Errorf("watermill: NewRedisKeyRepository: Prefix %q: use 1 to 64 characters from [A-Za-z0-9_.:-]", opts.Prefix)
	}
	return &RedisKeyRepository{client: client, prefix: opts.Prefix + ":", window: w}, nil
}

func keyWindow(who string, w time.Duration) (time.Duration, error) {
	switch {
	case w < 0:
		return 0, fmt.Errorf("watermill: %s: Window is %v; it must be positive (or zero for %v)", who, w, DefaultKeyWindow)
	case w == 0:
		return DefaultKeyWindow, nil
	case w < time.Millisecond:
		return 0, fmt.Errorf("watermill: %s: Window is %v; it must be at least a millisecond", who, w)
	}
	return w.Round(time.Millisecond), nil
}

// RedisKey returns the Redis key that holds key's mark.
func (r *RedisKeyRepository) RedisKey(key string) string { return r.prefix + key }

// IsDuplicate implements Watermill's middleware.ExpiringKeyRepository: it
// marks key for the window and returns false when key was not marked, and
// returns true when it already was. A Redis error is returned with false;
// the Deduplicator then returns it and the message is retried.
func (r *RedisKeyRepository) IsDuplicate(ctx context.Context, key string) (bool, error) {
	set, err := r.client.SetNX(ctx, r.prefix+key, "1", r.window).Result()
	if err != nil {
		return false, fmt.Errorf("watermill: redis key repository: %w", err)
	}
	return !set, nil
}

// PostgresDB is what a PostgresKeyRepository runs statements on: a
// *pgxpool.Pool or a *pgx.Conn (not safe for concurrent use).
type PostgresDB interface {
	Begin(ctx context.Context) (pgx.Tx, error)
	Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// PostgresKeyRepositoryOptions configure a PostgresKeyRepository. The zero
// value is usable.
type PostgresKeyRepositoryOptions struct {
	// Schema holds the table. Defaults to "public".
	Schema string
	// Table is the table name. Defaults to "watermill_dedup_keys".
	Table string
	// Window is how long a key is remembered after it was first seen.
	// Defaults to DefaultKeyWindow (one minute).
	Window time.Duration
	// CleanupBatch is the number of rows one cleanup statement deletes.
	// Defaults to 1000.
	CleanupBatch int
}

// PostgresKeyRepository is a Watermill middleware.ExpiringKeyRepository on a
// PostgreSQL table, for users who keep Watermill's Deduplicator and need its
// marks shared by every instance of a service and kept across restarts.
// IsDuplicate is one statement (an INSERT ... ON CONFLICT that takes over an
// expired mark), with times from the database clock.
//
// It has the Deduplicator's mark-before limitation: a message whose first
// attempt failed is dropped on retry. See RedisKeyRepository for the
// limitation and how to move to the idem middleware; on PostgreSQL the move
// is to Transactional on dedup/pgtable, which commits the claim with the
// handler's writes.
//
// Keys are stored as bytes (the Deduplicator's default keys are binary
// checksums); a key longer than 200 bytes is stored as its SHA-256.
// Expired rows are reused by later marks of the same key; Cleanup deletes the
// others.
type PostgresKeyRepository struct {
	db    PostgresDB
	opts  PostgresKeyRepositoryOptions
	table string
	mark  string
	clean string
	lock  int64
}

// NewPostgresKeyRepository returns a PostgresKeyRepository on db. It does
// not touch the database: call Migrate (or apply SQL) once before use.
func NewPostgresKeyRepository(db PostgresDB, opts PostgresKeyRepositoryOptions) (*PostgresKeyRepository, error) {
	if db == nil {
		return nil, errors.New("watermill: NewPostgresKeyRepository: db is nil")
	}
	w, err := keyWindow("NewPostgresKeyRepository", opts.Window)
	if err != nil {
		return nil, err
	}
	opts.Window = w
	if err := sqlname.SchemaTable("PostgresKeyRepositoryOptions", &opts.Schema, &opts.Table, "watermill_dedup_keys", 0); err != nil {
		return nil, fmt.Errorf("watermill: NewPostgresKeyRepository: %w", err)
	}
	if opts.CleanupBatch < 0 {
		return nil, fmt.Errorf("watermill: NewPostgresKeyRepository: CleanupBatch is %d; it must be positive (or zero for 1000)", opts.CleanupBatch)
	}
	if opts.CleanupBatch == 0 {
		opts.CleanupBatch = 1000
	}
	t := sqlname.Qualified(opts.Schema, opts.Table)
	h := fnv.New64a()
	_, _ = h.Write([]byte("idem watermill key repository " + t))
	return &PostgresKeyRepository{
		db:    db,
		opts:  opts,
		table: t,
		mark: "INSERT INTO " + t + " AS k (key, expires_at) VALUES ($1, now() + $2 * interval '1 millisecond')" +
			" ON CONFLICT (key) DO UPDATE SET expires_at = EXCLUDED.expires_at WHERE k.expires_at <= now()" +
			" RETURNING true",
		clean: "DELETE FROM " + t + " WHERE ctid = ANY (ARRAY(SELECT ctid FROM " + t +
			" WHERE expires_at <= now() LIMIT $1 FOR UPDATE SKIP LOCKED))",
		lock: int64(h.Sum64()), // a lock id: wrapping around is fine
	}, nil
}

// Table returns the quoted, schema-qualified table name.
func (p *PostgresKeyRepository) Table() string { return p.table }

// SQL returns the schema and table the repository needs, for users who apply
// schema changes with goose, golang-migrate or by hand.
func (p *PostgresKeyRepository) SQL() string {
	return "CREATE SCHEMA IF NOT EXISTS " + sqlname.Quote(p.opts.Schema) + ";\n" +
		"CREATE TABLE IF NOT EXISTS " + p.table + " (\n" +
		"\tkey bytea PRIMARY KEY,\n" +
		"\texpires_at timestamptz NOT NULL\n" +
		");\n" +
		"CREATE INDEX IF NOT EXISTS " + sqlname.Quote(p.opts.Table+"_expires_at_idx") + " ON " + p.table + " (expires_at);\n"
}

// Migrate creates the table when it does not exist, in one transaction under
// an advisory lock, so several processes may call it at once.
func (p *PostgresKeyRepository) Migrate(ctx context.Context) error {
	tx, err := p.db.Begin(ctx)
	if err != nil {
		return fmt.Errorf("watermill: migrate %s: %w", p.table, err)
	}
	defer func() { _ = tx.Rollback(context.WithoutCancel(ctx)) }()
	if _, err := tx.Exec(ctx, "SELECT pg_advisory_xact_lock($1)", p.lock); err != nil {
		return fmt.Errorf("watermill: migrate %s: %w", p.table, err)
	}
	if _, err := tx.Exec(ctx, p.SQL()); err != nil {
		return fmt.Errorf("watermill: migrate %s: %w", p.table, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return fmt.Errorf("watermill: migrate %s: %w", p.table, err)
	}
	return nil
}

// maxRawKey is the longest key stored as is; longer keys are stored as
// their SHA-256, which keeps index entries small.
const maxRawKey = 200

// storedKey returns the bytes stored for key: 'k' and the key, or 'h' and
// its SHA-256, so a hashed key never equals a raw one.
func storedKey(key string) []byte {
	if len(key) <= maxRawKey {
		b := make([]byte, 0, 1+len(key))
		return append(append(b, 'k'), key...)
	}
	sum := sha256.Sum256([]byte(key))
	return append([]byte{'h'}, sum[:]...)
}

// IsDuplicate implements Watermill's middleware.ExpiringKeyRepository: it
// marks key for the window and returns false when key was not marked (or its
// mark had expired), and returns true when it was. A concurrent mark of the
// same key waits for the first one's statement, then sees it. A database
// error is returned with false; the Deduplicator then returns it and the
// message is retried.
func (p *PostgresKeyRepository) IsDuplicate(ctx context.Context, key string) (bool, error) {
	var marked bool
	err := p.db.QueryRow(ctx, p.mark, storedKey(key), p.opts.Window.Milliseconds()).Scan(&marked)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return true, nil
	case err != nil:
		return false, fmt.Errorf("watermill: postgres key repository %s: %w", p.table, err)
	}
	return false, nil
}

// Cleanup deletes expired marks in batches of CleanupBatch, one statement per
// batch, until a batch comes back short, and returns the number deleted. Run
// it periodically; marks of keys seen again are reused without it.
func (p *PostgresKeyRepository) Cleanup(ctx context.Context) (int64, error) {
	var total int64
	for {
		tag, err := p.db.Exec(ctx, p.clean, p.opts.CleanupBatch)
		if err != nil {
			return total, fmt.Errorf("watermill: cleanup %s: %w", p.table, err)
		}
		total += tag.RowsAffected()
		if tag.RowsAffected() < int64(p.opts.CleanupBatch) {
			return total, nil
		}
		if err := ctx.Err(); err != nil {
			return total, err
		}
	}
}
