// Package kafkasql keeps the positions of idem's Kafka consumer (package
// kafka) in a database reached through database/sql: MySQL 8 and MariaDB
// 10.6 or later first, PostgreSQL and SQLite as well. It is the
// database/sql twin of kafkapg's offsets, for applications whose claims
// live in dedup/sqltable. It imports no driver: open the *sql.DB with the
// driver of your choice and name its dialect.
//
// # Offsets in the transaction of the effect
//
// Kafka commits an offset in a request of its own, after the effect: a
// crash between the two redelivers records whose effect committed, and only
// the dedup claim stops them from running twice. With Offsets the position
// is one more row written in the same transaction as the effect and the
// claim, so the three commit together, and a partition assigned to a
// Consumer is consumed from the stored position. After a crash,
// consumption resumes exactly after the last committed transaction: no
// record is fetched again whose effect committed, except duplicates and
// dead-lettered records, which run no transaction and whose position the
// Consumer's periodic commit stores.
//
//	db, _ := sql.Open("mysql", "app@tcp(db:3306)/app")
//	claims, _ := sqltable.New(db, sqltable.MySQL, sqltable.Options{})
//	offsets, _ := kafkasql.New(db, kafkasql.MySQL, kafkasql.Options{})
//	_ = errors.Join(claims.Migrate(ctx), offsets.Migrate(ctx))
//	h, _ := kafkasql.Transactional(claims, offsets, consumer.TxOptions{Scope: "billing/ledger"}, ledger)
//	c, _ := idemkafka.NewConsumer(readerConfig, h, idemkafka.ConsumerOptions{Offsets: offsets, DeadLetterTopic: "billing.dlq"})
//
// A position only moves forward (the greater offset wins: ON DUPLICATE KEY
// UPDATE with GREATEST on MySQL, ON CONFLICT ... WHERE on PostgreSQL and
// SQLite), so a late write from a member that lost the partition in a
// rebalance cannot move it back; the new owner then at worst reads a few
// records again and finds their claims.
//
// The Consumer also commits positions to Kafka, so that lag tools that
// read the group's committed offsets see them; a member assigned a
// partition whose stored position is ahead of Kafka's committed offset
// commits that position to Kafka at once. Kafka's committed offsets may lag
// behind the table: the table is the truth.
//
// # Locks
//
// On MySQL and MariaDB a position's row is locked from its write until the
// transaction ends. Each partition is handled by one member at a time, so
// two transactions meet on a row only during a rebalance. A deadlock or a
// lock wait the server gave up on is an error wrapping ErrTransient: the
// Consumer retries the message, and its claim rolled back with it. On
// SQLite every write transaction waits for the single writer, as for
// sqltable's claims (see its package doc for the DSN).
//
// # Schema
//
// Schema and table names are options, checked against an allow-list and
// quoted. The columns are group_id, topic, partition_id, next_offset and
// updated_at (UTC, from the database clock), with the primary key (group_id,
// topic, partition_id); on MySQL group and topic names compare byte for
// byte, as Kafka compares them. Migrate applies the embedded SQL of the
// dialect (under GET_LOCK on MySQL, an advisory lock on PostgreSQL, BEGIN
// IMMEDIATE on SQLite); SQL prints it for goose or golang-migrate users. To
// rewind a group, update or delete its rows while no member runs.
package kafkasql
