// Package idemkafka is idem's Kafka adapter, on segmentio/kafka-go (imported as
// kafkago): a consumer-group Consumer that runs any idem handler chain and
// commits offsets only past finished work, and an outbox Publisher.
//
// # Consumer
//
// NewConsumer takes the kafkago.ReaderConfig a kafka-go user already has
// (Brokers, GroupID, Topic or GroupTopics, Dialer, group and fetch
// settings), a consumer.Handler and ConsumerOptions:
//
//	dd, _ := consumer.Dedup(store, consumer.DedupOptions{Scope: "billing/charge-card"})
//	c, _ := idemkafka.NewConsumer(kafkago.ReaderConfig{
//		Brokers: []string{"localhost:9092"},
//		GroupID: "billing",
//		Topic:   "payments",
//	}, consumer.Chain(charge, consumer.Recover(), dd), idemkafka.ConsumerOptions{DeadLetterTopic: "payments.dlq"})
//	err := c.Run(ctx) // until ctx is done
//
// Partitions are consumed in parallel, each by a partition Reader seeked to
// its start position. Within a partition records are handled one after
// another in offset order (ConsumerOptions.Workers = 1, the default), or by key with
// several workers: records with the same key in order, different keys in
// parallel.
//
// # Commits: the ACK rule
//
// Each partition has a commit tracker. A record is done when the handler's
// effect committed or the record was a duplicate (consumer.ActionAck), or
// once it is safely in the dead-letter topic. The offset committed is the
// contiguous-done watermark: the oldest record not done yet, so it never
// passes unfinished work, whatever order records finish in (a slow record
// at offset 5 holds the commit at 5 while 6–100 finish). Commits are batched:
// every ConsumerOptions.CommitEvery records done and every ConsumerOptions.CommitInterval.
//
// The Consumer acts on consumer.Process's Result:
//
//   - ActionAck: the record is done.
//   - ActionRetry (transient errors, an unavailable store, a key in flight
//     elsewhere): the record is run again in place after a backoff
//     (ConsumerOptions.Backoff, at least Result.RetryAfter up to
//     Backoff.Max), as long as the Consumer runs. Nothing is skipped: the
//     partition waits, so its order holds. Put a consumer.Retry middleware in
//     the chain to turn endless failures into retries_exhausted dead letters.
//   - ActionDeadLetter (consumer.Permanent errors, panics caught by
//     consumer.Recover, fingerprint mismatches, invalid ids, exhausted
//     retries): the record is published to the dead-letter topic, with its
//     key, value and headers and the dead-letter headers below. Only once
//     the write is confirmed (all in-sync replicas) is the record done;
//     until then the partition retries the write. A poison record never
//     stops its partition. The dead-letter topic must exist: Run checks it
//     before it consumes.
//
// The dead-letter headers, consumer's names for every adapter (those from
// an earlier dead-lettering, starting with consumer.HeaderPrefix
// "idem-dlq-", are replaced):
//
//   - idem-dlq-reason (consumer.HeaderReason): why, a consumer.Outcome:
//     permanent, panic, fingerprint_mismatch, invalid_key,
//     retries_exhausted;
//   - idem-dlq-error (consumer.HeaderError): the error's text, cut at 4 KiB;
//   - idem-dlq-source (consumer.HeaderSource), idem-dlq-partition
//     (HeaderPartition), idem-dlq-offset (HeaderOffset): where the original
//     record is, its topic, partition and offset;
//   - idem-dlq-attempts (consumer.HeaderAttempts): how many times the
//     handler ran on the record in its last delivery (the Consumer's
//     in-place retries, or the attempts of a consumer.Retry middleware that
//     gave up when that is more);
//   - idem-dlq-group (HeaderGroup): the consumer group that dead-lettered
//     it;
//   - idem-dlq-id (consumer.HeaderID): the dead letter's own message id.
//
// A crash or a rebalance between the dead-letter write and the offset
// commit dead-letters the record again. Every dead letter of one record
// carries the same consumer.HeaderID, "topic/partition/offset" of the record, so
// the consumer of the dead-letter topic deduplicates them with idem itself:
// a Consumer on the dead-letter topic with ConsumerOptions.IDHeader set to
// consumer.HeaderID
// and a consumer.Dedup (or Transactional) in its chain handles each poison
// record once. A BatchHandler's records without a valid id are
// dead-lettered after their batch, so a rebalance that cancels the batch
// does not dead-letter them twice.
//
// # Message ids
//
// The id half of the dedup key is read from a header, ConsumerOptions.IDHeader
// (default outbox.HeaderMessageID, which the outbox publishers set). A record
// without it, or with an id that is empty, longer than ConsumerOptions.MaxIDLen or
// holds control bytes, is dead-lettered with consumer.OutcomeInvalidKey
// without reaching the handler. ConsumerOptions.OffsetID instead gives such a record
// the id "topic/partition/offset": that catches the broker delivering the same
// record again, never a producer publishing the same message twice (two
// records, two offsets, two ids). ConsumerOptions.IDFunc takes the id from anywhere
// else in the record. The handler sees the key, value, headers,
// topic and timestamp in consumer.Message, the partition, offset and group in
// Message.Metadata under MetadataPartition ("kafka.partition") and
// MetadataOffset ("kafka.offset"), in decimal, and MetadataGroup
// ("kafka.group").
//
// # Your own kafka-go loop
//
// An application that keeps its own Reader loop uses MessageFrom (the same
// mapping and id rules as the Consumer, set by MessageOptions) and
// consumer.Process, and commits a record only once it is done:
//
//	km, err := r.FetchMessage(ctx)
//	msg, err := idemkafka.MessageFrom(&km, idemkafka.MessageOptions{Group: "billing"})
//	res := consumer.Process(ctx, h, msg) // if err is nil; else dead-letter the record
//	// ActionAck: r.CommitMessages(ctx, km). ActionRetry: run it again.
//	// ActionDeadLetter: publish it to a dead-letter topic, then commit.
//
// See the MessageFrom example. A group Reader's commits do not know about
// rebalances (next section): a record may come back after one, and the
// dedup claim drops it.
//
// # Rebalances and shutdown: why ConsumerGroup, not Reader
//
// kafka-go offers two ways to consume a group. A Reader with GroupID hides
// the group: FetchMessage merges all partitions, CommitMessages sends offsets
// to a commit loop that commits through whatever generation is current when
// it runs, and there is no callback when partitions are revoked. So a record
// fetched before a rebalance can be committed after it, by a member that no
// longer owns the partition, over the new owner's progress; records buffered
// from the old generation are still returned after it (kafka-go issues #1398,
// #1308, and the comment in Reader.unsubscribe); and a member cannot finish
// its in-flight work before the partition moves (#632, #1023).
//
// The Consumer therefore uses kafka-go's lower-level ConsumerGroup and
// Generation API. Each generation's assignment runs under Generation.Start:
// one partition Reader per assigned partition, seeked to the group's
// committed offset (or the OffsetStore's position), and one commit loop that
// commits through Generation.CommitOffsets, which carries the generation id.
// When the generation ends (a member joins or leaves, the coordinator moves,
// or Run's context is done), the Consumer stops fetching, gives running
// handlers ConsumerOptions.ShutdownTimeout to finish and then cancels their context,
// abandons records not started, commits what is done through the ending
// generation, and returns. kafka-go joins the next generation only after
// that, so no offset is ever committed through another generation than the
// one that fetched it: once the group has moved on, the broker refuses the
// old generation's commits (ILLEGAL_GENERATION), and a partition moved to
// another member is not committed by this one. When Run's context is done
// the Consumer then leaves the group, so its partitions move at once.
//
// What the group cannot prevent, idem's dedup handles: a member that missed
// its session timeout may still be running a record the new owner starts
// again, and records done but not committed before a crash are delivered
// again. The dedup claim (consumer.Dedup, or consumer.Transactional with
// dedup/pgtable, which is exact) turns those into acknowledged duplicates.
//
// # Batches and offsets in PostgreSQL
//
// NewBatchConsumer runs a BatchHandler over up to ConsumerOptions.BatchSize records
// of a partition at a time, and ConsumerOptions.Offsets keeps the group's positions
// in an OffsetStore, from which assigned partitions are consumed. PositionAfter
// tells a handler what to store. The kafkapg package implements both on
// PostgreSQL: a batch claim in one transaction, and offsets written in the
// transaction of the effect and the claim, so that effect, dedup and position
// commit atomically and a restart resumes exactly where the last transaction
// left off.
//
// # Telemetry
//
// Each handler run has an OpenTelemetry consumer span, "process <topic>",
// whose parent is the trace context in the record's headers (the W3C
// traceparent the outbox stored at Enqueue time and the Publisher sent),
// read through ConsumerOptions.Propagator and HeaderCarrier. The handler chain runs
// in the span's context, so the claim, handle and commit spans of
// consumer.Dedup and consumer.Transactional are its children, and a handler
// that enqueues to the outbox passes the trace on. A BatchHandler call has
// one span with a link to each record's trace. The verdict of each run is
// counted in idem.messages (idem.result ack, retry or dead_letter, and
// idem.reason for dead letters) and timed in messaging.process.duration,
// with messaging.system "kafka" and the topic as
// messaging.destination.name: never an id or a key. The providers default to
// the OpenTelemetry globals, no-ops until the application installs real
// ones. Logs give message ids only as message_id_hash (dedup.HashKey with an
// empty scope).
//
// # Outbox publisher
//
// NewPublisher turns a kafkago.Writer (RequiredAcks kafkago.RequireAll,
// synchronous) into an outbox.Publisher: each message carries its outbox id in
// the id header, so a re-publish after a relay crash is deduplicated by the
// Consumer downstream.
package idemkafka
