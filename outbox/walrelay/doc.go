// Package walrelay is idem's second outbox relay: it reads outbox messages
// from PostgreSQL's write-ahead log through logical replication
// (jackc/pglogrepl, the pgoutput plugin) instead of polling a table.
package walrelay
