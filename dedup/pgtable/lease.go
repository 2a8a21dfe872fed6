package pgtable

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem/dedup"
)

// LeaseStore is the lease mode of a Store: a dedup.LeaseStore on the same
// table, for effects outside the database. Every statement runs on its own
// (autocommit on a pool or conn) and takes its times from the database clock.
type LeaseStore struct{ s *Store }

var (
	_ dedup.LeaseStore      = (*LeaseStore)(nil)
	_ dedup.BatchLeaseStore = (*LeaseStore)(nil)
)

// Lease returns the lease mode of s. Leases last Options.Lease; completed keys
// are kept for Options.Retention.
func (s *Store) Lease() *LeaseStore { return &LeaseStore{s: s} }

func newToken() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// Claim implements dedup.LeaseStore.
func (l *LeaseStore) Claim(ctx context.Context, key dedup.Key) (*dedup.Lease, error) {
	s := l.s
	if err := s.validate(key); err != nil {
		return nil, err
	}
	token := newToken()
	a := s.keyArgs(key)
	if s.opts.Partitioned {
		if err := s.leaseClaimPartitioned(ctx, key, a, token); err != nil {
			return nil, err
		}
		return &dedup.Lease{Key: key, Token: token, TTL: s.opts.Lease}, nil
	}
	err := s.claimOnce(ctx, s.db, s.sql.leaseClaim, key, a.digest, a.digest, key.Fingerprint.Bytes(), token, millis(s.opts.Lease), a.scope, a.id)
	if err != nil {
		return nil, err
	}
	return &dedup.Lease{Key: key, Token: token, TTL: s.opts.Lease}, nil
}

// ClaimBatch implements dedup.BatchLeaseStore. The claims travel in one
// pipelined pgx batch (one round trip); a key whose claim raced with a
// concurrent one is settled afterwards with its own statement.
func (l *LeaseStore) ClaimBatch(ctx context.Context, keys []dedup.Key) ([]dedup.BatchResult, error) {
	s := l.s
	if s.opts.Partitioned {
		return l.claimEach(ctx, keys)
	}
	out := make([]dedup.BatchResult, len(keys))
	tokens := make([]string, len(keys))
	var b pgx.Batch
	var queued []int
	for i, k := range keys {
		if err := s.validate(k); err != nil {
			out[i].Err = err
			continue
		}
		tokens[i] = newToken()
		a := s.keyArgs(k)
		b.Queue(s.sql.leaseClaim, a.digest, k.Fingerprint.Bytes(), tokens[i], millis(s.opts.Lease), a.scope, a.id)
		queued = append(queued, i)
	}
	if len(queued) == 0 {
		return out, nil
	}
	var retry []int
	br := s.db.SendBatch(ctx, &b)
	for _, i := range queued {
		var (
			won bool
			e   existing
			st  *int16
			ms  *int64
		)
		err := br.QueryRow().Scan(&won, &st, &e.fp, &e.result, &ms)
		switch {
		case err == nil && won:
			out[i].Lease = &dedup.Lease{Key: keys[i], Token: tokens[i], TTL: s.opts.Lease}
		case err == nil:
			e.state, e.leaseMs = deref(st), deref(ms)
			out[i].Err = verdict(keys[i], e)
		case errors.Is(err, pgx.ErrNoRows):
			retry = append(retry, i)
		default:
			_ = br.Close()
			return nil, fmt.Errorf("pgtable: batch claim: %w", err)
		}
	}
	if err := br.Close(); err != nil {
		return nil, fmt.Errorf("pgtable: batch claim: %w", err)
	}
	for _, i := range retry {
		lease, err := l.Claim(ctx, keys[i])
		if err != nil && !isClaimVerdict(err) {
			return nil, err
		}
		out[i] = dedup.BatchResult{Lease: lease, Err: err}
	}
	return out, nil
}

// claimEach claims keys one at a time (the partitioned layout, whose claim
// is a locked transaction of its own).
func (l *LeaseStore) claimEach(ctx context.Context, keys []dedup.Key) ([]dedup.BatchResult, error) {
	out := make([]dedup.BatchResult, len(keys))
	for i := range keys {
		lease, err := l.Claim(ctx, keys[i])
		if err != nil && !isClaimVerdict(err) {
			return nil, err
		}
		out[i] = dedup.BatchResult{Lease: lease, Err: err}
	}
	return out, nil
}

func isClaimVerdict(err error) bool {
	return errors.Is(err, dedup.ErrDuplicate) || errors.Is(err, dedup.ErrInFlight) ||
		errors.Is(err, dedup.ErrFingerprintMismatch) || errors.Is(err, dedup.ErrInvalidKey)
}

func (l *LeaseStore) change(ctx context.Context, op, stmt string, lease *dedup.Lease, args ...any) error {
	if lease == nil {
		return fmt.Errorf("pgtable: %s: nil lease: %w", op, dedup.ErrLeaseLost)
	}
	row, _ := l.s.rowKey(lease.Key)
	tag, err := l.s.db.Exec(ctx, stmt, append([]any{row, lease.Token}, args...)...)
	if err != nil {
		if op != "extend" && mayHaveRun(err) {
			return fmt.Errorf("pgtable: %s %s: %w: %w", op, lease.Key, dedup.ErrOutcomeUnknown, err)
		}
		return fmt.Errorf("pgtable: %s %s: %w", op, lease.Key, err)
	}
	if tag.RowsAffected() == 0 {
		return fmt.Errorf("pgtable: %s %s: %w", op, lease.Key, dedup.ErrLeaseLost)
	}
	return nil
}

// mayHaveRun reports whether a statement that failed with err may have run:
// the server did not answer it with an error, and pgx cannot tell that it
// was never sent (pgconn.SafeToRetry). pgx never sends a statement twice.
func mayHaveRun(err error) bool {
	var pe *pgconn.PgError
	return !errors.As(err, &pe) && !pgconn.SafeToRetry(err)
}

// Extend implements dedup.LeaseStore.
func (l *LeaseStore) Extend(ctx context.Context, lease *dedup.Lease) error {
	stmt := l.s.sql.leaseExtend
	if l.s.opts.Partitioned {
		stmt = l.s.psql.leaseExtend
	}
	return l.change(ctx, "extend", stmt, lease, millis(l.s.opts.Lease))
}

// Complete implements dedup.LeaseStore.
func (l *LeaseStore) Complete(ctx context.Context, lease *dedup.Lease, result []byte) error {
	stmt := l.s.sql.leaseComplete
	if l.s.opts.Partitioned {
		stmt = l.s.psql.leaseComplete
	}
	return l.change(ctx, "complete", stmt, lease, millis(l.s.opts.Retention), result)
}

// Release implements dedup.LeaseStore.
func (l *LeaseStore) Release(ctx context.Context, lease *dedup.Lease) error {
	return l.change(ctx, "release", l.s.sql.leaseRelease, lease)
}
