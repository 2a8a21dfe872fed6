package pgtable

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sort"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemkit/idem/dedup"
)

const (
	stateInFlight = 1
	stateDone     = 2
)

// existing describes the row a claim found instead of winning.
type existing struct {
	state   int16
	fp      []byte
	result  []byte
	leaseMs int64
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

type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// claimOnce runs a claim statement (claimTx or leaseClaim). It returns nil when
// the claim won, or the verdict on the row found.
// digest is the key's digest, which args hold too.
func (s *Store) claimOnce(ctx context.Context, q querier, stmt string, key dedup.Key, digest pgtype.UUID, args ...any) error {
	const maxTries = 5
	for range maxTries {
		var (
			won bool
			e   existing
			st  *int16
			ms  *int64
		)
		err := q.QueryRow(ctx, stmt, args...).Scan(&won, &st, &e.fp, &e.result, &ms)
		switch {
		case err == nil && won:
			return nil
		case err == nil:
			e.state = deref(st)
			e.leaseMs = deref(ms)
			return verdict(key, e)
		case !errors.Is(err, pgx.ErrNoRows):
			return fmt.Errorf("pgtable: claim %s: %w", key, err)
		}
		// The insert waited on a concurrent claim that committed after
		// this statement's snapshot: read the row with a new snapshot.
		var expired bool
		err = q.QueryRow(ctx, s.sql.lookup, digest).Scan(&st, &e.fp, &e.result, &ms, &expired)
		if errors.Is(err, pgx.ErrNoRows) {
			continue // deleted in between (released, cleaned up): claim again
		}
		if err != nil {
			return fmt.Errorf("pgtable: claim %s: %w", key, err)
		}
		if expired {
			continue
		}
		e.state = deref(st)
		e.leaseMs = deref(ms)
		return verdict(key, e)
	}
	return fmt.Errorf("pgtable: claim %s: the row changed under %d claims in a row; retry", key, maxTries)
}

func deref[T any](p *T) T {
	var zero T
	if p == nil {
		return zero
	}
	return *p
}

func (s *Store) validate(key dedup.Key) error {
	return dedup.ValidateKey(key, s.opts.MaxKeyLen)
}

// ClaimTx claims key inside tx. It returns nil when this transaction is the
// first to process key: the row commits or rolls back with tx. Otherwise it
// returns an error wrapping dedup.ErrDuplicate (see dedup.StoredResult),
// dedup.ErrFingerprintMismatch, dedup.ErrInFlight (a lease-mode claim holds
// the key), dedup.ErrInvalidKey, or a database error.
//
// A concurrent claim of the same key waits until the other transaction ends.
// After an error other than the sentinels, tx is aborted: roll it back.
func (s *Store) ClaimTx(ctx context.Context, tx pgx.Tx, key dedup.Key) error {
	if tx == nil {
		return errors.New("pgtable: ClaimTx: tx is nil")
	}
	if err := s.validate(key); err != nil {
		return err
	}
	a := s.keyArgs(key)
	if s.opts.Partitioned {
		return s.claimPartitioned(ctx, tx, s.psql.claimTx, key, a, a.digest, key.Fingerprint.Bytes(), s.retentionArg, a.scope, a.id)
	}
	return s.claimOnce(ctx, tx, s.sql.claimTx, key, a.digest, a.digest, key.Fingerprint.Bytes(), s.retentionArg, a.scope, a.id)
}

// SetResultTx stores result with key's claim in tx, for later duplicates to
// read (dedup.StoredResult). Call it after ClaimTx succeeded, before commit.
func (s *Store) SetResultTx(ctx context.Context, tx pgx.Tx, key dedup.Key, result []byte) error {
	row, _ := s.rowKey(key)
	tag, err := tx.Exec(ctx, s.sql.setResult, row, result)
	if err != nil {
		return fmt.Errorf("pgtable: store result of %s: %w", key, err)
	}
	if tag.RowsAffected() != 1 {
		return fmt.Errorf("pgtable: store result of %s: the key is not claimed in this transaction", key)
	}
	return nil
}

// Process implements dedup.TxStore: it begins a transaction on the store's
// DB, claims key in it, runs fn in it, stores fn's result with the claim
// (when it is not nil) and commits.
//
// The claim is the first statement of the transaction, sent with BEGIN. A
// live row of the key is answered without running fn: an error wrapping
// dedup.ErrDuplicate (with the stored result, see dedup.StoredResult),
// dedup.ErrInFlight (a lease-mode claim holds the key) or
// dedup.ErrFingerprintMismatch. An expired row counts as absent. A
// concurrent claim of the same key (Process, ClaimTx, ClaimBatchTx, the
// lease mode) waits until this transaction ends, then replays its result
// (or runs, if it rolled back).
//
// When fn returns an error or panics, the transaction rolls back and nothing
// is written, so a redelivery runs fn again. fn must not end tx itself
// (Commit, Rollback): Process commits it once fn returns.
//
// With Options.Partitioned, the claim is the key's advisory lock and a read
// of its row, and the row is written at commit (see the package doc).
func (s *Store) Process(ctx context.Context, key dedup.Key, fn dedup.TxFunc[pgx.Tx]) (result []byte, err error) {
	if fn == nil {
		return nil, errors.New("pgtable: Process: fn is nil")
	}
	if err := s.validate(key); err != nil {
		return nil, err
	}
	r, err := s.begin(ctx, key, s.keyArgs(key))
	if err != nil {
		return nil, err
	}
	defer r.release()
	defer r.abort(ctx) // fn failed or panicked, or the commit failed
	result, err = fn(ctx, r.tx)
	if err != nil {
		return nil, err
	}
	if err := s.finish(ctx, r, key, result); err != nil {
		return nil, err
	}
	return result, nil
}

// ClaimBatchTx claims keys inside tx in one statement (two when some keys were
// already there). It returns one error per key, in order: nil for a key this
// transaction claimed first, else what ClaimTx would return. A key repeated in
// the batch is claimed by its first occurrence; the later ones get
// dedup.ErrDuplicate (or a fingerprint mismatch). The second return value is
// for the batch as a whole: then tx is aborted and no key was claimed.
func (s *Store) ClaimBatchTx(ctx context.Context, tx pgx.Tx, keys []dedup.Key) ([]error, error) {
	if tx == nil {
		return nil, errors.New("pgtable: ClaimBatchTx: tx is nil")
	}
	out := make([]error, len(keys))
	var b claimBatch
	pos := make([]int, 0, len(keys)) // index in b -> index in keys
	for i, k := range keys {
		if err := s.validate(k); err != nil {
			out[i] = err
			continue
		}
		b.add(s.keyArgs(k), k.Fingerprint.Bytes())
		pos = append(pos, i)
	}
	if len(pos) == 0 {
		return out, nil
	}
	won, err := s.claimBatchInsert(ctx, tx, &b)
	if err != nil {
		return nil, err
	}
	// Keys that did not win: read their rows with a fresh snapshot.
	var lost []pgtype.UUID
	for j, w := range won {
		if !w {
			lost = append(lost, b.digests[j])
		}
	}
	if len(lost) == 0 {
		return out, nil
	}
	found := make(map[[16]byte]existing, len(lost))
	rows, err := tx.Query(ctx, s.sql.claimBatchLookup, lost)
	if err != nil {
		return nil, fmt.Errorf("pgtable: batch claim lookup: %w", err)
	}
	var (
		d  pgtype.UUID
		e  existing
		st *int16
		ms *int64
	)
	_, err = pgx.ForEachRow(rows, []any{&d, &st, &e.fp, &e.result, &ms}, func() error {
		found[d.Bytes] = existing{state: deref(st), fp: e.fp, result: e.result, leaseMs: deref(ms)}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("pgtable: batch claim lookup: %w", err)
	}
	for j, w := range won {
		if w {
			continue
		}
		k := keys[pos[j]]
		row, ok := found[b.digests[j].Bytes]
		if !ok {
			// Inserted by a concurrent batch that rolled back after we
			// waited on it: not ours, not done. The caller retries.
			out[pos[j]] = &dedup.ClaimError{Err: dedup.ErrInFlight, Key: k}
			continue
		}
		out[pos[j]] = verdict(k, row)
	}
	return out, nil
}

// claimBatch is the arguments of a batch claim, one entry per valid key:
// scopes and ids stay nil unless the store keeps them.
type claimBatch struct {
	digests     []pgtype.UUID
	locks       []int64
	fps         [][]byte
	scopes, ids []*string
}

func (b *claimBatch) add(a keyArgs, fp []byte) {
	b.digests = append(b.digests, a.digest)
	b.locks = append(b.locks, a.lock)
	b.fps = append(b.fps, fp)
	if a.scope != nil {
		sc, id := a.scope.(string), a.id.(string)
		b.scopes, b.ids = append(b.scopes, &sc), append(b.ids, &id)
	}
}

func (s *Store) claimBatchInsert(ctx context.Context, tx pgx.Tx, b *claimBatch) ([]bool, error) {
	if s.opts.Partitioned {
		return s.claimBatchPartitioned(ctx, tx, b)
	}
	sorted, first := b.sorted()
	rows, err := tx.Query(ctx, s.sql.claimBatchSorted, sorted.digests, sorted.fps, s.retentionArg, sorted.scopes, sorted.ids)
	if err != nil {
		return nil, fmt.Errorf("pgtable: batch claim: %w", err)
	}
	won := make([]bool, len(b.digests))
	var d pgtype.UUID
	_, err = pgx.ForEachRow(rows, []any{&d}, func() error {
		if i, ok := first[d.Bytes]; ok {
			won[i] = true
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("pgtable: batch claim: %w", err)
	}
	return won, nil
}

// sorted returns b's distinct keys in a fixed (bytewise row key) order, so
// that overlapping batches take their keys in the same order and cannot
// deadlock, and the index in b of each key's first occurrence: a key
// repeated in the batch is claimed by its first occurrence.
func (b *claimBatch) sorted() (sorted claimBatch, first map[[16]byte]int) {
	first = make(map[[16]byte]int, len(b.digests))
	order := make([]int, 0, len(b.digests))
	for i, d := range b.digests {
		if _, dup := first[d.Bytes]; dup {
			continue
		}
		first[d.Bytes] = i
		order = append(order, i)
	}
	sort.Slice(order, func(x, y int) bool {
		return bytes.Compare(b.digests[order[x]].Bytes[:], b.digests[order[y]].Bytes[:]) < 0
	})
	sorted.digests = make([]pgtype.UUID, 0, len(order))
	sorted.fps = make([][]byte, 0, len(order))
	for _, i := range order {
		sorted.digests = append(sorted.digests, b.digests[i])
		sorted.fps = append(sorted.fps, b.fps[i])
		if b.scopes != nil {
			sorted.scopes, sorted.ids = append(sorted.scopes, b.scopes[i]), append(sorted.ids, b.ids[i])
		}
	}
	return sorted, first
}

// fingerprintFromBytes converts stored bytes back into a dedup.Fingerprint. Empty
// input gives the zero fingerprint; any other length is an error.
func fingerprintFromBytes(b []byte) (dedup.Fingerprint, error) {
	var f dedup.Fingerprint
	if len(b) == 0 {
		return f, nil
	}
	if len(b) != len(f) {
		return f, fmt.Errorf("dedup: stored fingerprint has %d bytes, want %d", len(b), len(f))
	}
	copy(f[:], b)
	return f, nil
}
