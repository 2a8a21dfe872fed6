package sqltable

import (
	"bytes"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/idemkit/idem/dedup"
)

const (
	stateInFlight = 1
	stateDone     = 2
)

// existing describes the row a claim found instead of winning.
type existing struct {
	state   int64
	fp      []byte
	result  []byte
	leaseMs int64
	expired bool
}

// verdict turns a found row into the claim error.
func verdict(key dedup.Key, e existing) error {
	stored, err := fingerprintFromBytes(e.fp)
	if err != nil {
		return err
	}
	if !key.Fingerprint.Matches(stored) {
		return &dedup.ClaimError{Err: dedup.ErrFingerprintMismatch, Key: key}
	}
	if e.state == stateDone {
		return &dedup.ClaimError{Err: dedup.ErrDuplicate, Key: key, Result: e.result}
	}
	return &dedup.ClaimError{Err: dedup.ErrInFlight, Key: key, RetryAfter: max(time.Duration(e.leaseMs)*time.Millisecond, 0)}
}

// fingerprintFromBytes converts stored bytes back into a dedup.Fingerprint.
// Empty input gives the zero fingerprint; any other length is an error.
func fingerprintFromBytes(b []byte) (dedup.Fingerprint, error) {
	var f dedup.Fingerprint
	if len(b) == 0 {
		return f, nil
	}
	if len(b) != len(f) {
		return f, fmt.Errorf("sqltable: stored fingerprint has %d bytes, want %d", len(b), len(f))
	}
	copy(f[:], b)
	return f, nil
}

// querier is a *sql.DB or a *sql.Tx.
type querier interface {
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
}

// claimStmts are the statements of one kind of claim: a done row (a
// transaction's claim) or an in-flight one (the lease mode).
type claimStmts struct {
	insert, takeover string
	// insertArgs and takeoverArgs return the statements' arguments.
	insertArgs, takeoverArgs func(a keyArgs) []any
}

func (s *Store) doneClaim() claimStmts {
	return claimStmts{
		insert:   s.sql.insertDone,
		takeover: s.sql.takeoverDone,
		insertArgs: func(a keyArgs) []any {
			return []any{a.digest, s.retentionMs, a.fp, a.scope, a.id}
		},
		takeoverArgs: func(a keyArgs) []any {
			return []any{s.retentionMs, a.fp, a.scope, a.id, a.digest}
		},
	}
}

func (s *Store) leaseClaim(token string) claimStmts {
	return claimStmts{
		insert:   s.sql.insertLease,
		takeover: s.sql.takeoverLease,
		insertArgs: func(a keyArgs) []any {
			return []any{a.digest, s.leaseMs, a.fp, token, a.scope, a.id}
		},
		takeoverArgs: func(a keyArgs) []any {
			return []any{s.leaseMs, a.fp, token, a.scope, a.id, a.digest}
		},
	}
}

// claim inserts key's row on q (a transaction, or the DB for the lease
// mode). It returns nil when the claim won, the verdict on a live row of
// the key, or a database error.
//
// The insert comes first: a concurrent claim of the key waits on the
// table's primary key until the transaction that inserted the row ends.
// When the key has a row, it is read (on MySQL with a locking read, which
// sees the latest committed row whatever the transaction's snapshot) and
// taken over if it expired, else answered.
func (s *Store) claim(ctx context.Context, q querier, c claimStmts, key dedup.Key, a keyArgs) error {
	const maxTries = 5
	for range maxTries {
		res, err := q.ExecContext(ctx, c.insert, c.insertArgs(a)...)
		won := false
		switch {
		case err == nil:
			n, rerr := res.RowsAffected()
			if rerr != nil {
				return s.wrap("claim", key, rerr)
			}
			won = n == 1
		case s.dialect.UniqueViolation(err):
			// MySQL: the key has a row (the statement rolled back, the
			// transaction goes on).
		default:
			return s.wrap("claim", key, err)
		}
		if won {
			return nil
		}
		e, found, err := s.lookup(ctx, q, a.digest)
		if err != nil {
			return s.wrap("claim", key, err)
		}
		if !found {
			continue // deleted in between (released, cleaned up): claim again
		}
		if !e.expired {
			return verdict(key, e)
		}
		res, err = q.ExecContext(ctx, c.takeover, c.takeoverArgs(a)...)
		if err != nil {
			return s.wrap("claim", key, err)
		}
		n, err := res.RowsAffected()
		if err != nil {
			return s.wrap("claim", key, err)
		}
		if n == 1 {
			return nil
		}
		// Taken over or deleted by another claim in between: look again.
	}
	return fmt.Errorf("sqltable: claim %s: the row changed under %d claims in a row: %w", key, maxTries, ErrTransient)
}

// lookup reads the row of digest.
func (s *Store) lookup(ctx context.Context, q querier, digest []byte) (existing, bool, error) {
	var (
		e       existing
		expired int64
	)
	err := q.QueryRowContext(ctx, s.sql.lookup, digest).Scan(&e.state, &e.fp, &e.result, &e.leaseMs, &expired)
	if errors.Is(err, sql.ErrNoRows) {
		return e, false, nil
	}
	if err != nil {
		return e, false, err
	}
	e.expired = expired != 0
	return e, true, nil
}

func (s *Store) validate(key dedup.Key) error {
	return dedup.ValidateKey(key, s.opts.MaxKeyLen)
}

// ClaimTx claims key inside tx, a transaction the caller began on the
// store's database. It returns nil when this transaction is the first to
// process key: the row commits or rolls back with tx. Otherwise it returns
// an error wrapping dedup.ErrDuplicate (see dedup.StoredResult),
// dedup.ErrFingerprintMismatch, dedup.ErrInFlight (a lease-mode claim holds
// the key), dedup.ErrInvalidKey, or a database error (wrapping ErrTransient
// when the server gave up on a deadlock or a lock wait: roll back and run
// the transaction again).
//
// A concurrent claim of the same key waits until the other transaction ends.
// After an error other than the sentinels, roll tx back.
func (s *Store) ClaimTx(ctx context.Context, tx *sql.Tx, key dedup.Key) error {
	if tx == nil {
		return errors.New("sqltable: ClaimTx: tx is nil")
	}
	if err := s.validate(key); err != nil {
		return err
	}
	if err := s.ready(ctx); err != nil {
		return err
	}
	return s.claim(ctx, tx, s.doneClaim(), key, s.keyArgs(key))
}

// SetResultTx stores result with key's claim in tx, for later duplicates to
// read (dedup.StoredResult). Call it after ClaimTx succeeded, before commit.
func (s *Store) SetResultTx(ctx context.Context, tx *sql.Tx, key dedup.Key, result []byte) error {
	if tx == nil {
		return errors.New("sqltable: SetResultTx: tx is nil")
	}
	res, err := tx.ExecContext(ctx, s.sql.setResult, result, keyDigest(key.Scope, key.ID))
	if err != nil {
		return s.wrap("store result of", key, err)
	}
	n, err := res.RowsAffected()
	if err != nil {
		return s.wrap("store result of", key, err)
	}
	if n != 1 {
		return fmt.Errorf("sqltable: store result of %s: the key is not claimed in this transaction", key)
	}
	return nil
}

// ClaimBatchTx claims keys inside tx, one statement per key, in the order
// of their digests (so overlapping batches take the keys' locks in the same
// order). It returns one error per key, in the order of keys: nil for a key
// this transaction claimed first, else what ClaimTx would return. A key
// repeated in the batch is claimed by its first occurrence; the later ones
// get dedup.ErrDuplicate (or a fingerprint mismatch). The second return
// value is for the batch as a whole (a database error): then roll tx back,
// no key was claimed.
func (s *Store) ClaimBatchTx(ctx context.Context, tx *sql.Tx, keys []dedup.Key) ([]error, error) {
	if tx == nil {
		return nil, errors.New("sqltable: ClaimBatchTx: tx is nil")
	}
	out := make([]error, len(keys))
	type item struct {
		i int
		a keyArgs
	}
	var items []item
	first := make(map[string]int, len(keys))
	for i, k := range keys {
		if err := s.validate(k); err != nil {
			out[i] = err
			continue
		}
		a := s.keyArgs(k)
		if j, dup := first[string(a.digest)]; dup {
			out[i] = repeatVerdict(k, keys[j])
			continue
		}
		first[string(a.digest)] = i
		items = append(items, item{i, a})
	}
	if len(items) == 0 {
		return out, nil
	}
	if err := s.ready(ctx); err != nil {
		return nil, err
	}
	sort.Slice(items, func(x, y int) bool { return bytes.Compare(items[x].a.digest, items[y].a.digest) < 0 })
	c := s.doneClaim()
	for _, it := range items {
		err := s.claim(ctx, tx, c, keys[it.i], it.a)
		if err != nil && !isVerdict(err) {
			return nil, err
		}
		out[it.i] = err
	}
	return out, nil
}

// repeatVerdict is the answer to a key repeated in a batch after its first
// occurrence: a duplicate of it, or a fingerprint mismatch.
func repeatVerdict(k, first dedup.Key) error {
	if !k.Fingerprint.Matches(first.Fingerprint) {
		return &dedup.ClaimError{Err: dedup.ErrFingerprintMismatch, Key: k}
	}
	return &dedup.ClaimError{Err: dedup.ErrDuplicate, Key: k}
}

func isVerdict(err error) bool {
	return errors.Is(err, dedup.ErrDuplicate) || errors.Is(err, dedup.ErrInFlight) ||
		errors.Is(err, dedup.ErrFingerprintMismatch) || errors.Is(err, dedup.ErrInvalidKey)
}

// Process implements dedup.TxStore: it begins a transaction on the store's
// database, claims key in it (the transaction's first statement, an INSERT
// of the key's row), runs fn in it, stores fn's result with the claim (when
// it is not nil) and commits.
//
// A live row of the key is answered without running fn: an error wrapping
// dedup.ErrDuplicate (with the stored result, see dedup.StoredResult),
// dedup.ErrInFlight (a lease-mode claim holds the key) or
// dedup.ErrFingerprintMismatch. An expired row counts as absent. A
// concurrent claim of the same key (Process, ClaimTx, the lease mode)
// waits until this transaction ends, then replays its result (or runs, if
// it rolled back). A deadlock or lock wait the server gave up on is an
// error wrapping ErrTransient: nothing was written, run Process again.
//
// When fn returns an error or panics, the transaction rolls back and nothing
// is written, so a redelivery runs fn again. fn must not end tx itself
// (Commit, Rollback): Process commits it once fn returns.
func (s *Store) Process(ctx context.Context, key dedup.Key, fn dedup.TxFunc[*sql.Tx]) ([]byte, error) {
	if fn == nil {
		return nil, errors.New("sqltable: Process: fn is nil")
	}
	if err := s.validate(key); err != nil {
		return nil, err
	}
	if err := s.ready(ctx); err != nil {
		return nil, err
	}
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return nil, s.wrap("begin", key, err)
	}
	committed := false
	defer func() {
		if !committed {
			_ = tx.Rollback() // ErrTxDone when the commit failed or ctx ended
		}
	}()
	a := s.keyArgs(key)
	if err := s.claim(ctx, tx, s.doneClaim(), key, a); err != nil {
		return nil, err
	}
	result, err := fn(ctx, tx)
	if err != nil {
		return nil, err
	}
	if result != nil {
		if _, err := tx.ExecContext(ctx, s.sql.setResult, result, a.digest); err != nil {
			return nil, s.wrap("store result of", key, err)
		}
	}
	committed = true
	if err := tx.Commit(); err != nil {
		return nil, s.wrap("commit", key, err)
	}
	return result, nil
}
