package sqltable

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"

	"github.com/idemkit/idem/dedup"
)

// LeaseStore is the lease mode of a Store: a dedup.LeaseStore on the same
// table, for effects outside the database. Every statement runs on its own
// (autocommit) and takes its times from the database clock.
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
	if err := s.ready(ctx); err != nil {
		return nil, err
	}
	token := newToken()
	if err := s.claim(ctx, s.db, s.leaseClaim(token), key, s.keyArgs(key)); err != nil {
		return nil, err
	}
	return &dedup.Lease{Key: key, Token: token, TTL: s.opts.Lease}, nil
}

// ClaimBatch implements dedup.BatchLeaseStore with one Claim per key, in
// order: database/sql has no pipeline to send them in one round trip.
func (l *LeaseStore) ClaimBatch(ctx context.Context, keys []dedup.Key) ([]dedup.BatchResult, error) {
	out := make([]dedup.BatchResult, len(keys))
	for i := range keys {
		lease, err := l.Claim(ctx, keys[i])
		if err != nil && !isVerdict(err) {
			return nil, err
		}
		out[i] = dedup.BatchResult{Lease: lease, Err: err}
	}
	return out, nil
}

func (l *LeaseStore) change(ctx context.Context, op, stmt string, lease *dedup.Lease, args ...any) error {
	if lease == nil {
		return fmt.Errorf("sqltable: %s: nil lease: %w", op, dedup.ErrLeaseLost)
	}
	args = append(args, keyDigest(lease.Key.Scope, lease.Key.ID), lease.Token)
	res, err := l.s.db.ExecContext(ctx, stmt, args...)
	if err != nil {
		return l.s.wrap(op, lease.Key, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return l.s.wrap(op, lease.Key, err)
	}
	if n == 0 {
		return fmt.Errorf("sqltable: %s %s: %w", op, lease.Key, dedup.ErrLeaseLost)
	}
	return nil
}

// Extend implements dedup.LeaseStore.
func (l *LeaseStore) Extend(ctx context.Context, lease *dedup.Lease) error {
	return l.change(ctx, "extend", l.s.sql.extend, lease, l.s.leaseMs)
}

// Complete implements dedup.LeaseStore.
func (l *LeaseStore) Complete(ctx context.Context, lease *dedup.Lease, result []byte) error {
	return l.change(ctx, "complete", l.s.sql.complete, lease, result, l.s.retentionMs)
}

// Release implements dedup.LeaseStore.
func (l *LeaseStore) Release(ctx context.Context, lease *dedup.Lease) error {
	return l.change(ctx, "release", l.s.sql.release, lease)
}
