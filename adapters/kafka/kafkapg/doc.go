// Package kafkapg holds the PostgreSQL modes of idem's Kafka consumer
// (package kafka): batch claims in one transaction, and offsets stored in
// PostgreSQL in the transaction of the effect. It is a package of its own so
// that a Kafka user who keeps marks elsewhere does not compile pgx.
//
// # Offsets in PostgreSQL
//
// Kafka commits an offset in a request of its own, after the effect: a crash
// between the two redelivers records whose effect committed, and only the
// dedup claim stops them from running twice. With Offsets the position is
// one more row written in the same transaction as the effect and the claim,
// so the three commit together, and a partition assigned to a Consumer is
// consumed from the stored position (kafka-go's ConsumerGroup hands the
// assignment over; the Consumer seeks its partition Reader there). After a
// crash, consumption resumes exactly after the last committed transaction:
// no record is fetched again whose effect committed, except duplicates and
// dead-lettered records, which run no transaction and whose position the
// Consumer's periodic commit stores.
//
//	offsets, _ := kafkapg.NewOffsets(pool, kafkapg.OffsetsOptions{})
//	_ = offsets.Migrate(ctx)
//	h, _ := kafkapg.Transactional(claims, offsets, consumer.TxOptions{Scope: "billing/ledger"}, ledger)
//	c, _ := idemkafka.NewConsumer(readerConfig, h, idemkafka.ConsumerOptions{Offsets: offsets, DeadLetterTopic: "billing.dlq"})
//
// A position only moves forward (the greater offset wins), so a late write
// from a member that lost the partition in a rebalance cannot move it back;
// the new owner then at worst reads a few records again and finds their
// claims.
//
// The Consumer also commits every position to Kafka, so that lag tools that
// read the group's committed offsets see the truth. A Kafka commit can fail
// where PostgreSQL's succeeded (Unknown Member ID after a rebalance): the
// Consumer tries it again with its next commit, and a member assigned a
// partition whose stored position is ahead of Kafka's committed offset
// commits that position to Kafka at once.
//
// # Batches
//
// Batch handles up to ConsumerOptions.BatchSize records of a partition in one
// transaction with one claim statement, with or without Offsets:
//
//	bh, _ := kafkapg.Batch(pool, claims, kafkapg.BatchOptions{Scope: "billing/ledger", Offsets: offsets}, ledger)
//	c, _ := idemkafka.NewBatchConsumer(readerConfig, bh, idemkafka.ConsumerOptions{Offsets: offsets, DeadLetterTopic: "billing.dlq"})
//
// Batch calls its handler once per record claimed first. BatchAll calls it
// once per batch with all of them, so that their effects are written in one
// statement (INSERT ... SELECT FROM unnest, or CopyFrom):
//
//	bh, _ := kafkapg.BatchAll(pool, claims, kafkapg.BatchOptions{Scope: "billing/ledger", Offsets: offsets},
//		func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error { return ledger.InsertAll(ctx, tx, msgs) })
//
// A batch's claim is pgtable's BeginBatch: BEGIN and a plain INSERT of the
// batch's keys in one round trip, and the position in the round trip of
// COMMIT, so that a batch of new records costs the round trips of a bare
// batch transaction (BEGIN, the handler's statements, COMMIT). A duplicate
// in the batch makes the INSERT fail with a unique violation; the batch is
// then claimed again, in a new transaction, with the statements that answer
// each key. With ids that are UUIDs of version 7 (idem's outbox writes
// them), pgtable.Options.TimeOrderedKeys keeps the claims' primary key in
// time order.
//
// # Offsets only
//
// OffsetsOnly is a BatchHandler whose only claim is the partition's
// position: each batch moves the stored position from at most its first
// offset to the position after it (one UPDATE, sent with BEGIN), and a
// record before the stored position is a duplicate. There is no row per
// message, so a batch costs the bare batch transaction and that UPDATE:
//
//	bh, _ := kafkapg.OffsetsOnly(pool, offsets, kafkapg.OffsetsOnlyOptions{}, ledger.InsertAll)
//	c, _ := idemkafka.NewBatchConsumer(readerConfig, bh, idemkafka.ConsumerOptions{Offsets: offsets, DeadLetterTopic: "billing.dlq"})
//
// It catches broker redelivery only (a crash or a rebalance before the
// Kafka commit, offsets reset), never a producer that sends the same
// message twice: that is two records at two offsets, and the handler runs
// for both, as with ids made of topic, partition and offset. Use Batch or
// BatchAll, whose claims are the message ids, where producers can send a
// message twice.
//
// # Schema
//
// Schema and table names are options, checked against an allow-list and
// quoted. Migrate applies the embedded SQL under an advisory lock; SQL prints
// it for goose or golang-migrate users.
package kafkapg
