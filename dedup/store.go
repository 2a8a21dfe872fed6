package dedup

import (
	"context"
	"time"
)

// Lease is the proof of ownership a LeaseStore hands out on a first claim.
type Lease struct {
	Key Key
	// Token identifies this owner. Extend, Complete and Release succeed
	// only while the stored token equals it.
	Token string
	// TTL is the lease duration granted; a caller extends the lease well
	// before it runs out (the consumer middleware does so every TTL/3).
	TTL time.Duration
}

// LeaseStore implements the lease guarantee for effects outside the
// database.
//
// Claim grants a Lease when the key is absent (or its previous lease
// expired). Otherwise it returns an error wrapping ErrDuplicate (completed;
// see StoredResult), ErrInFlight (another lease is live),
// ErrFingerprintMismatch, ErrInvalidKey, or a store error. A store error never
// grants a lease: callers fail closed.
//
// Extend renews the lease, Complete marks the key done and keeps it for the
// store's retention with the given result, Release deletes the claim so a
// redelivery runs again. All three return ErrLeaseLost when the token no
// longer owns the key. A call whose answer was lost after it may have
// reached the store returns an error, never ErrLeaseLost: a store never
// sends Complete or Release a second time, whose run would find the first
// run's effect and answer ErrLeaseLost to an owner whose call succeeded.
// When the store can tell that the call may have run, the error wraps
// ErrOutcomeUnknown (dedup/redisnx and the lease mode of dedup/pgtable do).
type LeaseStore interface {
	Claim(ctx context.Context, key Key) (*Lease, error)
	Extend(ctx context.Context, l *Lease) error
	Complete(ctx context.Context, l *Lease, result []byte) error
	Release(ctx context.Context, l *Lease) error
}

// BatchResult is one key's outcome in a batch claim: a Lease, or the error
// Claim would have returned for that key.
type BatchResult struct {
	Lease *Lease
	Err   error
}

// BatchLeaseStore is a LeaseStore that can claim many keys in one round trip.
// The results are in the order of keys. The returned error is for the batch
// as a whole (store down); then no key was granted.
type BatchLeaseStore interface {
	LeaseStore
	ClaimBatch(ctx context.Context, keys []Key) ([]BatchResult, error)
}

// TxFunc is the work done inside a transaction that holds a claim. The result
// it returns is stored with the claim and handed to later duplicates.
type TxFunc[Tx any] func(ctx context.Context, tx Tx) (result []byte, err error)

// TxStore implements the transactional guarantee: Process begins a
// transaction, claims key in it, runs fn with the transaction, stores fn's
// result and commits. If fn returns an error the transaction rolls back, the
// claim with it, and the error is returned unchanged.
//
// If key was already processed, fn does not run and Process returns an error
// wrapping ErrDuplicate (with the stored result), or ErrFingerprintMismatch. A
// concurrent duplicate waits until the first transaction ends.
type TxStore[Tx any] interface {
	Process(ctx context.Context, key Key, fn TxFunc[Tx]) ([]byte, error)
}
