// Package sqloutbox is idem's transactional outbox on database/sql:
// Enqueue writes outgoing messages in the caller's *sql.Tx, and a Relay
// publishes them after commit through an outbox.Publisher, each with its
// row id (a time-ordered UUIDv7) as its message id, so that a re-publish
// is dropped by the consumer's idem claim.
//
// One Outbox value names a table and the dialect of its database:
//
//	ob, err := sqloutbox.New(db, sqloutbox.MySQL, sqloutbox.Options{Table: "outbox"})
//	err = ob.Migrate(ctx) // once, or apply ob.SQL() with your migration tool
//	ids, err := ob.Enqueue(ctx, tx, outbox.Message{Topic: "orders", Key: []byte("o-42"), Payload: body})
//
// What each dialect offers:
//
//   - MySQL 8 and MariaDB 10.6 or later (go-sql-driver/mysql): Enqueue,
//     Migrate and a polling Relay. The relay claims batches with SELECT
//     ... FOR UPDATE SKIP LOCKED in READ COMMITTED transactions, which is
//     why it needs those versions; any number of relays (and
//     RelayOptions.Sessions per relay) may run on one table at once. A
//     message is claimed only when no earlier message of its key is
//     pending, so a key's next message is published only after the
//     previous one was confirmed and marked, whichever relay holds it.
//     Enqueue locks a slot row of the key in <Table>_keys until the
//     business transaction ends, so that one key's rows are numbered in
//     commit order. There is no LISTEN/NOTIFY: an idle relay looks for
//     work every RelayOptions.PollInterval. A claim walks the pending rows
//     in order until it has BatchSize claimable ones, so a large backlog
//     on a few keys makes claims slower, not wrong. Writing in READ
//     COMMITTED needs binlog_format ROW or MIXED where the binary log is
//     on (the defaults of MySQL 8 and MariaDB). Cleanup deletes published
//     rows with DELETE ... ORDER BY ... LIMIT in a loop.
//   - SQLite 3.42 or later (modernc.org/sqlite or another driver):
//     Enqueue, Migrate and a polling Relay, one relay with one session per
//     table: SQLite has no SKIP LOCKED, and two relays would publish the
//     same rows twice (the consumers' claims would drop the copies, but
//     per-key order would no longer hold). The relay never holds the
//     write lock while it publishes. Set a busy timeout on the connection
//     (_pragma=busy_timeout(5000) with modernc.org/sqlite) so that the
//     relay's marks and the business transactions wait for each other
//     instead of failing with SQLITE_BUSY.
//   - PostgreSQL through database/sql (pgx's stdlib driver or lib/pq):
//     Enqueue and Migrate write outbox/pgoutbox's table, with its
//     migrations, its per-key advisory locks and its notification, so the
//     relay is pgoutbox's Relay on the same Schema and Table (it needs a
//     pgxpool.Pool); NewRelay refuses a PostgreSQL outbox and says so.
//
// Failed messages (named by an *outbox.PublishError) are retried with
// exponential backoff and parked as dead (state 2) after
// RelayOptions.MaxAttempts; meanwhile the later messages of their key
// wait, and every other key goes on. RequeueDead makes dead messages
// pending again. A relay that stops between publish and mark (a crash, a
// lost connection) leaves its rows pending: they are published again with
// the same ids.
//
// Trace context present at Enqueue time travels with the message as in
// outbox/pgoutbox (Options.Propagator). The relay counts its messages
// published, retried and parked dead, times each Publish and starts a
// producer span per batch, as outbox/pgoutbox's does
// (RelayOptions.MeterProvider and TracerProvider); it has no backlog
// gauges: Backlog returns the pending count and the oldest message's
// age.
//
// This package imports no driver.
package sqloutbox
