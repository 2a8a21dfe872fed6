// Package idemwatermill is idem's adapter for Watermill
// (github.com/ThreeDotsLabs/watermill): router middleware that makes
// at-least-once delivery safe without ever dropping a retry, drop-in
// repositories for Watermill's own Deduplicator, and an outbox publisher.
//
// Like idemkafka and idemamqp, its name is the wrapped library's with
// "idem" in front, so it imports beside Watermill's root package without
// a rename:
//
//	import "github.com/idemkit/idem/adapters/watermill"
//
// # Why not Watermill's Deduplicator
//
// middleware.Deduplicator marks a message in its repository before the
// handler runs and never removes the mark. A handler that fails once is
// nacked and redelivered (or retried by the Retry middleware), and the retry
// finds the mark and is acknowledged without running: the message is lost.
// Its default key is an Adler-32 checksum of the payload (two messages with
// the same payload collide), its only repository is in memory, and as
// router-level middleware it shares one key space between handlers, so the
// second handler of a message drops it. This package's middleware completes
// the key only after the handler succeeded.
//
// # Dedup: lease stores
//
// Dedup wraps handlers with a claim on a dedup.LeaseStore (dedup/redisnx,
// dedup/memstore, the lease mode of dedup/pgtable), for effects outside the
// database:
//
//	store, _ := redisnx.New(client, redisnx.Options{})
//	mw, _ := idemwatermill.Dedup(store, idemwatermill.Options{})
//	router.AddMiddleware(mw)
//
// The key is (scope, id): the scope defaults to the handler's name in the
// router (message.HandlerNameFromCtx), so two handlers of one topic each
// process a message once and every instance of a service shares its
// handlers' keys; the id defaults to msg.UUID (Options.KeyMetadata or
// Options.KeyFunc choose another), and the payload's SHA-256 travels with it
// as a fingerprint. Dedup claims before the handler, extends the lease while
// it runs, completes after it succeeded and releases when it failed or
// panicked. A completed duplicate is acknowledged without running the
// handler (the handler function returns nil, nil); a key in flight elsewhere
// or a store error returns an error, so Watermill retries or nacks: a store
// that is down never lets a message through.
//
// # Transactional: pgtable
//
// Transactional runs the handler inside dedup/pgtable's Process: a
// transaction holds the claim, the handler writes through Tx[T](msg.Context()),
// and both commit when the handler succeeds or roll back when it fails or
// panics, so the retry runs it again. With Options.Outbox (a
// *pgoutbox.Outbox), the messages the handler returns are written to the
// outbox in that transaction instead of being published by the router, and
// an outbox relay publishes them after the commit — through Publisher, to any
// Watermill publisher. Consume, write and produce then happen once.
//
// # Poison messages
//
// A key seen before with other content (fingerprint mismatch) or a message
// without a valid id (empty, too long, control bytes) is never processed.
// With Options.PoisonQueue (the middleware from Watermill's
// middleware.PoisonQueue or PoisonQueueWithFilter) the idem middleware hands
// such a message to the poison queue itself, which publishes it and lets it be
// acknowledged; otherwise it returns a poison error (IsPoison) marked consumer.Permanent
// and sets consumer.HeaderReason on the message. IsPoison is a filter for
// PoisonQueueWithFilter and Retryable a ShouldRetry for the Retry middleware.
//
// # Order of middleware
//
// Router.AddMiddleware runs the first middleware outermost. A router that
// retries in process and parks what keeps failing:
//
//	router.AddMiddleware(
//		poisonQueue,          // what is left after the retries
//		retry.Middleware,     // each attempt is claimed again
//		middleware.Recoverer, // a panic, after idem released the key, becomes an error
//		idemMiddleware,
//	)
//
// idem's middleware must be inside Retry: outside it, a failed attempt
// would keep its claim while Retry runs the handler again, unprotected.
//
// # Metrics, traces and logs
//
// With Options.MeterProvider (default: the OpenTelemetry global, a no-op
// until the application installs one) the middleware reports
// idem.claims by outcome (first, duplicate, in_flight,
// fingerprint_mismatch, invalid_key, error), idem.claim.duration,
// idem.handler.duration by how the handler ended (completed, released,
// lease_lost, complete_failed) and idem.lease.lost, with the scope (the
// handler name, or Options.Scope) and the store as attributes; and
// idem.messages and messaging.process.duration with each message's verdict
// by topic (messaging.system "watermill"):
//
//	ack          the handler succeeded, or the message was a duplicate
//	retry        an error was returned (the handler's, a key in flight
//	             elsewhere, a store error, a lost lease) or the handler
//	             panicked: the message is nacked or retried further out
//	dead_letter  poison (idem.reason fingerprint_mismatch or invalid_key),
//	             or an error marked consumer.Permanent (idem.reason
//	             permanent): it will never succeed
//
// Each run of the middleware counts once, so with Watermill's Retry
// middleware outside it every attempt is counted. No attribute carries a
// message id or a key.
//
// With Options.TracerProvider, each message gets a consumer span ("process
// <topic>") that continues the trace found in its metadata — the
// traceparent the outbox stored at Enqueue, which Publisher copies to the
// metadata unchanged — and the handler runs under it, with idem.claim,
// idem.handle and idem.complete (or idem.commit) as its children. If
// msg.Context() already holds a recording span, only the idem spans are
// added, under it. MetadataCarrier reads the metadata for a propagator and
// ignores values over 8 KiB.
//
// Logs (Options.Logger, discarded by default) name keys by their hash,
// dedup.Key.Hash, never by the raw id.
//
// # Moving from Watermill's Deduplicator
//
// The swap is one line: where the router had
//
//	router.AddMiddleware(retry.Middleware, (&middleware.Deduplicator{...}).Middleware)
//
// it takes
//
//	router.AddMiddleware(retry.Middleware, mw) // mw, _ := watermill.Dedup(store, watermill.Options{})
//
// with store a lease store (redisnx.New on the same Redis, shared by every
// instance). Dedup keys on msg.UUID, scopes keys per handler, completes the
// key only when the handler succeeded and releases it when the handler
// failed, so Watermill's Retry runs the handler again instead of dropping
// the message.
package idemwatermill
