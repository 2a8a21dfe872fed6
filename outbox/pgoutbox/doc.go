// Package pgoutbox is idem's transactional outbox on PostgreSQL (pgx/v5):
// Enqueue writes outgoing messages in the caller's transaction, and a Relay
// publishes the committed ones through an outbox.Publisher (adapters/amqp,
// adapters/kafka), marking each row published only after the broker
// confirmed it.
//
// # Enqueue
//
// Outbox.Enqueue inserts one row per message in the business transaction:
// a time-ordered id (UUIDv7, the message id downstream), topic, key,
// payload, headers (jsonb, with the trace context of ctx: its OpenTelemetry
// span context as W3C traceparent, see Options.Propagator), created and
// available times from the database clock, attempts, last error, published
// and dead times. Rows of a transaction that rolls back never exist; rows of
// one that commits are always published. Enqueue also notifies the relays
// (pg_notify, delivered at commit).
//
// A sequence column orders the rows. Because two transactions can commit in
// another order than they took their numbers, Enqueue takes a
// transaction-scoped advisory lock per distinct key: a second transaction
// enqueueing the same key waits until the first ends, so for one key the
// sequence order is the commit order. The cost is that transactions enqueueing
// the same key serialize from their Enqueue to their commit (see Enqueue).
// An empty key means "no order".
//
// # Relay
//
// A Relay runs one or more sessions, each on a dedicated connection. A
// session claims a batch with SELECT … FOR UPDATE SKIP LOCKED in a
// transaction, publishes it, and marks the confirmed rows published (or
// deletes them, RelayOptions.DeletePublished) and the failed ones for a retry
// in the same transaction; a crash between publish and mark rolls the claim
// back and the batch is published again — the consumer deduplicates on the
// message id. While the broker confirms a full batch, the session claims
// the next one in a second transaction on a second connection (the claim
// passes over the rows of the batch in flight, and so over their keys), then
// publishes it and marks the first: one batch per session awaits the broker
// at a time, and the database work hides behind the broker's. It is woken by
// LISTEN/NOTIFY right after a commit, polls every PollInterval in case a
// notification was lost, and reconnects with backoff when a connection
// dies.
//
// A message the publisher rejects (an *outbox.PublishError naming it) is
// retried with exponential backoff, its available time pushed forward, and
// parked as dead after MaxAttempts; a Publish error for the whole batch (the
// broker unreachable) counts no attempt and the session backs off. Nothing
// spins: an empty or all-failing outbox leaves the session waiting for a
// notification, the next due retry or the poll interval.
//
// # Order across relays
//
// The key space is split into RelayOptions.Shards shards (a hash of the key
// modulo Shards). Each shard is owned by one session at a time through a
// session-level advisory lock held on the session's own connection, so when
// a relay dies, its connections close, its locks and claims vanish together
// (a batch still locked on the session's second connection holds its keys
// back from the next owner until it ends), and the other
// relays take its shards over at their next rebalance (RebalanceInterval).
// Sessions count each other (a shared advisory lock) and each holds about
// Shards/sessions shards; a session that joins, or gives shards back, tells
// the others over the outbox's channel, so a planned hand-over leaves a
// shard without an owner for milliseconds only.
//
// Those locks and LISTEN need sessions of their own: through PgBouncer in
// transaction mode, Enqueue, Migrate and Cleanup work on the pool, and
// RelayOptions.ConnConfig gives the sessions a direct connection. Run
// refuses a session connection that goes through a pooler.
//
// Within its shards a session publishes a key's messages in sequence order,
// and at most PerKeyBatch (default 1) of them per batch: a key's next
// message is sent only after the previous one was confirmed and marked. A
// key whose oldest pending message waits for a retry is skipped entirely, so
// its later messages wait too; once that message is parked dead, the later
// ones proceed (Dead lists the dead messages, RequeueDead puts one back,
// DeleteDead deletes one; "idem outbox" and "idem deadletter" call them).
// Keys do not wait for one another: a batch takes the oldest messages of
// many keys, and a failing key never holds the others back.
//
// The claim also protects the order on its own: it takes a key's messages
// only from its oldest pending one, and drops a key whose oldest message is
// locked by another transaction, so even two sessions claiming the same
// shard during a hand-over cannot send a key's messages out of order. The
// resulting guarantee: for each key, the first delivery of a message comes
// after the first delivery of every message committed before it; a
// re-publish (after a crash or an unconfirmed publish) can arrive later and
// is a duplicate for the consumer's idem claim to drop.
//
// # Observability
//
// RelayOptions.MeterProvider (default: the OpenTelemetry global, a no-op
// until the application installs one) receives idem.outbox.published,
// .retried and .dead per table and topic, the publisher's latency per
// batch (idem.outbox.publish.duration), each message's delay from
// available to confirmed (idem.outbox.delay), and the backlog gauges
// idem.outbox.backlog and idem.outbox.oldest_age, sampled from the
// database when the provider collects but at most about once per
// MetricsInterval.
//
// The trace context of Enqueue's ctx travels in the row's headers and is
// published unchanged as the message's traceparent, so the consumer's span
// continues the producer's trace. RelayOptions.TracerProvider adds a
// producer span per batch, "publish <topic>", linked to each message's
// trace. Logs go to the Options.Logger (default slog.Default()) and carry
// a message id only as its hash, dedup.HashKey("", id).
//
// # Retention, schema
//
// Cleanup deletes published rows older than Options.Retention in bounded
// batches; a relay runs it every CleanupInterval. Dead rows are kept unless
// Options.DeadRetention is set. Schema and table names are options, checked
// against an allow-list and quoted; Migrate applies the embedded migrations
// under an advisory lock (safe to run from several processes at once) and
// SQL prints them for goose or golang-migrate.
package pgoutbox
