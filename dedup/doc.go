// Package dedup holds idem's key model, the store interfaces for its two
// guarantees, the sentinel errors every store returns, and an injectable clock.
//
// A dedup key is (scope, id). The scope names who processes a message (a
// consumer group plus handler name, or an HTTP principal, method and route),
// so two consumers of the same event each process it once. The id is assigned
// by the producer and stays the same across retries. A fingerprint (SHA-256
// of the payload) travels with the key: the same key with another fingerprint
// is a conflict, reported as ErrFingerprintMismatch, never processed and
// never dropped silently.
//
// There are two guarantees:
//
//   - Transactional (TxStore, implemented by dedup/pgtable): the claim is a row
//     written in the same database transaction as the business change. Both
//     commit or neither does, so the effect on the database happens exactly
//     once, with no lease and no clock.
//   - Lease (LeaseStore, implemented by dedup/redisnx, dedup/memstore and the
//     lease mode of dedup/pgtable): for effects outside the database. A claim
//     takes a lease with a random token; Complete marks the key done, Release
//     gives it back when the handler fails so the redelivery runs again. An
//     owner whose lease expired gets ErrLeaseLost and never overwrites the new
//     owner.
//
// This package imports no driver; stores live in subpackages and every store
// passes the conformance suite in dedup/deduptest.
package dedup
