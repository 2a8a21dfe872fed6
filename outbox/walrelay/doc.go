// Package walrelay is idem's outbox relay that reads the write-ahead log:
// it streams outbox messages from a PostgreSQL logical replication slot
// (jackc/pglogrepl, the built-in pgoutput plugin) and publishes them
// through an outbox.Publisher (adapters/kafka, adapters/amqp, or any
// other), with the same message ids, headers and trace context as the
// poll relay of outbox/pgoutbox. PostgreSQL does no work per message
// beyond writing it: no claim, no mark, no index update; order is commit
// order and a message is published right after its commit, without
// polling.
//
// # Set-up
//
// Logical replication needs PostgreSQL 14 or later, wal_level = logical
// (a restart), max_replication_slots and max_wal_senders of at least one
// each, and a role with the REPLICATION attribute. Outbox.Check verifies
// all of them and says exactly what to change; Outbox.Migrate runs Check,
// then creates what is missing: the outbox table (SourceTable), the dead
// table <table>_dead, the publication, and the replication slot. A slot
// starts at the end of the WAL when it is created, so create it (Migrate)
// before the first Enqueue; a relay that finds no slot creates one and
// logs a warning, and what was committed before is not published. Slots
// are cluster-wide: give each outbox its own (Options.Slot).
//
// The pool may go through PgBouncer in transaction mode (Enqueue, Migrate
// and the relay's queries hold nothing across transactions); the
// replication connection cannot, and RelayOptions.ConnConfig gives it a
// direct one.
//
//	ob, err := walrelay.New(pool, walrelay.Options{})
//	err = ob.Migrate(ctx)
//	ids, err := ob.Enqueue(ctx, tx, outbox.Message{Topic: "orders", Key: key, Payload: body})
//	relay, err := walrelay.NewRelay(ob, publisher, walrelay.RelayOptions{})
//	err = relay.Run(ctx)
//
// # Sources
//
// SourceMessages (the default) writes the messages of an Enqueue call as
// one logical decoding message, pg_logical_emit_message(true, prefix,
// payload), in the caller's transaction: the message exists only in the
// WAL, is decoded only when the transaction commits, and a new UUIDv7 per
// message (or Message.ID) travels in the payload. The business transaction
// writes no row, no index entry, and leaves nothing to delete or vacuum;
// QueueEnqueue adds the write to the caller's pgx.Batch, so it costs no
// extra round trip either. The server decodes one logical message per
// Enqueue call rather than one row per message: in BenchmarkRelayToKafka
// the relay reads this source several times faster than the table. That
// is why it is the default.
//
// SourceTable inserts one row per message into the outbox table of
// outbox/pgoutbox's layout (its Enqueue, without the per-key lock the poll
// relay needs) and streams the inserts from a publication on that table.
// It costs a row and its indexes per message, but keeps a copy of every
// message for Options.Retention: to inspect, and to fall back on when the
// slot is lost (below).
//
// # Position, crashes and duplicates
//
// The relay confirms a position (a standby status update; the slot's
// confirmed_flush_lsn) only when every message of every transaction up to
// it is confirmed by the broker or parked. After a crash, a lost
// connection or a hand-over, PostgreSQL streams again everything after the
// confirmed position: the messages that were in flight are published again
// with the same ids, and the consumers' idem claims drop the copies. A
// clean stop (Run's context ends) lets the batches in flight finish and
// reports the final position, so nothing is sent twice.
//
// # Order
//
// Transactions arrive in commit order. The relay has at most
// PublishesInFlight (default 1) Publish calls waiting for the broker at
// once; a batch holds at most PerKeyBatch (default 1) messages of a key,
// and a key's next message waits until the previous one is confirmed (or
// parked), also when it would go in another call, so the first publication
// of each message of a key follows commit order, while other keys go on.
// A message without a key has no order. With a Publisher safe for
// concurrent use (the adapters/amqp and adapters/kafka ones are), a second
// call in flight lets the next batch go out while the broker confirms one.
//
// # One relay per slot
//
// PostgreSQL lets one connection stream a slot at a time. Run as many
// relays of an outbox as wanted: one streams; the others find the slot
// active, wait, and try again every TakeoverInterval, so one of them takes
// over within about that long after the active one's connection ends (a
// killed process closes its socket at once; a vanished host is noticed by
// the server after wal_sender_timeout).
//
// # A message the broker refuses
//
// A message the Publisher reports failed (an *outbox.PublishError naming
// it) is retried with exponential backoff (RelayOptions.Backoff) while
// the other keys are published; after MaxAttempts it is parked: copied to
// the dead table with its id, topic, key, payload, headers, attempts, last
// error and commit LSN, and the relay moves past it. The WAL cannot skip a
// message silently; a parked message is counted (idem.outbox.dead) and
// logged, and RequeueDead enqueues it again with its id. A logical message
// with the outbox's prefix that cannot be decoded is parked at once, with
// its raw payload and an id derived from its position. A Publish error for
// the whole batch (the broker down) counts no attempt: the batch is sent
// again after ReconnectBackoff's growing delay. Nothing spins: a waiting relay
// sleeps until the next retry falls due.
//
// # When the relay stops: WAL retention
//
// While no relay confirms, PostgreSQL keeps the WAL from the slot's
// position on, however much is written meanwhile: a stopped relay fills
// the disk. The relay samples the slot every MetricsInterval and exports
// idem.outbox.slot.lag (bytes after the confirmed position),
// idem.outbox.slot.retained (bytes kept for the slot) and
// idem.outbox.slot.lag_age (seconds since the oldest unconfirmed commit it
// holds), logs a warning past LagWarnBytes, and Outbox.Slot shows the same
// (for a CLI). Bound the damage with max_slot_wal_keep_size: past it
// PostgreSQL invalidates the slot (wal_status "lost") instead of keeping
// WAL, and the relay can no longer stream it (Run returns an error). To
// recover: DropSlot; with SourceTable, run the poll relay (outbox/pgoutbox)
// over the table once, which publishes every row still kept (copies of
// published ones included: consumers drop them); then Migrate to create a
// new slot and start the WAL relay again. With SourceMessages the messages
// committed after the slot's last confirmed position are lost to the
// relay, as they are when a failover to a physical standby leaves the slot
// behind (logical slots are not replicated before PostgreSQL 17's failover
// slots). DropSlot, too, makes PostgreSQL forget the position.
//
// # Retention of the table
//
// With SourceTable the relay never marks rows: the slot's position is its
// cursor, and a row's insert stays in the WAL whether the row exists or
// not. Cleanup (run by the relay every CleanupInterval) deletes rows older
// than Options.Retention in bounded batches. Do not run the poll relay on
// the same table while the WAL relay runs: both would publish every
// message.
//
// # Observability
//
// RelayOptions.MeterProvider receives the poll relay's outbox metrics
// (idem.outbox.published, .retried, .dead, .publish.duration, .delay: from
// commit to the broker's confirmation), the slot gauges above and
// idem.outbox.backlog (the messages received from the slot and not yet
// published or parked); RelayOptions.TracerProvider a producer span per
// batch linked to each message's trace. Logs carry message ids only as
// dedup.HashKey("", id).
package walrelay
