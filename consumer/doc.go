// Package consumer is idem's broker-neutral consumer pipeline: a Message, a
// Handler, middleware that makes redelivered messages safe, and the ACK rule
// every adapter (Kafka, RabbitMQ, Watermill) follows.
//
// # Messages and handlers
//
// An adapter turns each delivery into a *Message: the producer-assigned ID
// (the id of the dedup key), the partition or routing Key, Payload, Headers,
// Topic, broker Metadata (partition, offset, delivery tag), the Attempt
// counted by the adapter and the broker's Redelivered flag — a hint only,
// never used to decide anything. A Handler processes it; Middleware wraps a
// Handler and Chain composes them, the first middleware outermost.
//
// # The ACK rule
//
// Process runs the chain and Decide turns its error into a Result:
//
//   - ActionAck: the handler's effect committed (nil), the message was a
//     completed duplicate (dedup.ErrDuplicate), or it was dead-lettered by
//     the DeadLetter middleware. Only then is the message acknowledged or its
//     offset committed.
//   - ActionRetry: a transient error, an unavailable store (fail closed: a
//     store error never lets a message through undeduplicated), a timeout,
//     a lost lease, or the key in flight elsewhere (dedup.ErrInFlight; wait
//     Result.RetryAfter, then retry — Kafka keeps partition order by
//     retrying in place, RabbitMQ requeues with a delay). No ACK.
//   - ActionDeadLetter: a poison message — marked with Permanent, a panic, a
//     fingerprint mismatch (same key, different content), an invalid key, or
//     retries exhausted. The adapter parks it and then acknowledges it, when
//     no DeadLetter middleware already did.
//
// Every error is transient unless marked with Permanent or permanent by
// nature (dedup.ErrFingerprintMismatch, dedup.ErrInvalidKey, a PanicError,
// RetriesExhaustedError). Errors about the key's state outrank the mark:
// Permanent(dedup.ErrDuplicate) is still acknowledged and
// Permanent(dedup.ErrInFlight) still retried. A cancelled context is
// transient: when the consumer stops, the message is simply not
// acknowledged, and Process and DeadLetter never dead-letter while the
// consumer's context is done. Decide documents the precedence when one error
// matches several rules.
//
// # Middleware and order
//
//   - Dedup: claim a lease on (scope, id) in a dedup.LeaseStore, extend it
//     while the handler runs, complete it on success, release it on failure.
//     For effects outside the database.
//   - Transactional: not a middleware but a Handler: claims the key in the
//     caller's transaction (dedup.TxStore, e.g. dedup/pgtable) and hands the
//     transaction to the handler, so the claim and the business writes
//     commit together. For effects in the database; exact.
//   - Retry: in-process retries with exponential backoff and full jitter.
//   - Recover: a panic becomes a Permanent *PanicError (poison).
//   - Timeout: a per-message deadline; hitting it is transient.
//   - DeadLetter: hands poison messages to a hook, then acknowledges them.
//
// The recommended order, outermost first:
//
//	h := consumer.Chain(handler,
//		deadLetter,                       // sees the final verdict, after retries
//		retry,                            // each attempt re-runs everything below
//		consumer.Recover(),               // a panic becomes an error Retry will not retry
//		consumer.Timeout(30*time.Second), // per attempt; bounds the claim too
//		dd,                               // innermost: each attempt claims afresh
//	)
//
// where
//
//	deadLetter, err := consumer.DeadLetter(parkInDLQ)
//	retry, err := consumer.Retry(consumer.RetryOptions{MaxAttempts: 5})
//	dd, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "billing/charge-card"})
//
// With Dedup inside Retry, a failed attempt releases the key and the next
// attempt claims it again; a message in flight elsewhere is retried until
// the other owner completes it (then it is a duplicate and acknowledged) or
// its lease expires (then this consumer runs it); if Retry gives up while
// the key is still in flight, the result stays ActionRetry, never a dead
// letter, and the broker's redelivery carries on. Recover must be outside
// Dedup: Dedup releases the lease as the panic passes through it.
//
// For the transactional guarantee the handler itself is the innermost
// piece:
//
//	tx, err := consumer.Transactional(pgStore, consumer.TxOptions{Scope: "billing/ledger"},
//		func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
//			_, err := tx.Exec(ctx, "UPDATE accounts SET balance = balance - $1 WHERE id = $2", amount, account)
//			return err
//		})
//	h := consumer.Chain(tx, deadLetter, retry, consumer.Recover(), consumer.Timeout(30*time.Second))
//
// A handler passes a result to later duplicates with SetResult; they read it
// with dedup.StoredResult(result.Err).
//
// This package imports no broker or database driver: adapters and stores
// live elsewhere.
package consumer
