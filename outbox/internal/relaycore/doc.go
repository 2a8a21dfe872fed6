// Package relaycore holds the machinery the outbox relays (outbox/pgoutbox,
// outbox/sqloutbox, outbox/walrelay) share: the checks and defaults of
// their options, their publish spans and metrics, the publish step around
// an outbox.Publisher, the run and reconnect loops, and cleanup in bounded
// batches. What a relay does alone (claiming rows, decoding the WAL,
// holding shard locks) stays in its package; this package knows no
// database.
package relaycore
