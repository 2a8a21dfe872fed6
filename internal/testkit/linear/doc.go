// Package linear checks histories of dedup stores for linearizability with
// Porcupine (github.com/anishathalye/porcupine).
//
// RunLease drives concurrent clients against a dedup.LeaseStore (claim,
// extend, complete, release, and a read of the key's state when the store
// offers one), and RunTx against a dedup.TxStore's Process, while the
// caller injects faults. Every operation is recorded with its call and
// return times from one clock and the answer its client saw; an error that
// does not prove the call had no effect is recorded as Unknown, and may
// take effect at any later time (as Jepsen counts indeterminate
// operations).
//
// LeaseModel and TxModel are the sequential specifications the histories
// are checked against, key by key; their docs say what each promises and
// what it does not cover. Check fails a test on a history that no order
// of its operations explains, printing the failing key's sub-history and
// the path of Porcupine's visualization of it; Search returns the same
// violation to a caller without a testing.T (the chaos matrix). The
// scenarios that produce the histories are in the scenario subpackage.
//
// This package is test-only: nothing in the library imports it.
package linear
