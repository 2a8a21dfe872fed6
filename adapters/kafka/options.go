package idemkafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/defaults"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/outbox"
	kafkago "github.com/segmentio/kafka-go"
	"go.opentelemetry.io/otel/propagation"
)

// ConsumerOptions configure a Consumer. Only the dead-letter topic is required:
// DeadLetterTopic, or a DeadLetterWriter whose Topic is set.
type ConsumerOptions struct {
	// IDHeader names the header that carries the producer-assigned message
	// id, the id half of the dedup key. Defaults to outbox.HeaderMessageID,
	// which the outbox publishers set.
	IDHeader string
	// OffsetID gives a record without the id header the id
	// "topic/partition/offset". Such an id catches only the broker
	// delivering the same record again (a crash or a rebalance before the
	// commit), never a producer that sends the same message twice: that is
	// two records at two offsets, with two ids. Defaults to false: a record
	// without an id is dead-lettered with consumer.OutcomeInvalidKey.
	OffsetID bool
	// IDFunc, if set, returns a record's id instead of the IDHeader header
	// and OffsetID: for an id carried elsewhere, a field of the payload for
	// example. An error, or an empty or malformed id, dead-letters the
	// record with consumer.OutcomeInvalidKey. It must be safe for concurrent
	// use.
	IDFunc func(km *kafkago.Message) (string, error)
	// MaxIDLen limits the id, in bytes; a longer one is dead-lettered with
	// consumer.OutcomeInvalidKey. Defaults to dedup.DefaultMaxKeyLen.
	MaxIDLen int

	// Workers is how many records of one partition are handled at once.
	// Defaults to 1: a partition's records are handled one after another,
	// in offset order. With more, records with the same key are still
	// handled in offset order and records with different keys in parallel
	// (records without a key share one key); the committed offset still
	// moves only past records whose every predecessor is done. Partitions
	// are always handled in parallel. Must be 1 with a BatchHandler.
	Workers int
	// BatchSize caps the records handed to one BatchHandler call (a
	// BatchHandler only): the records already fetched, never waiting for
	// more. Defaults to 100.
	BatchSize int
	// MaxInFlight bounds the records of one partition fetched but not done
	// when Workers is above 1 or with a BatchHandler; fetching pauses at the
	// bound. (With one worker the partition Reader's QueueCapacity is the
	// prefetch.) Defaults to 256.
	MaxInFlight int

	// CommitEvery commits once this many records of a partition are done
	// since the last commit. Defaults to 100.
	CommitEvery int
	// CommitInterval commits what is done at least this often. Defaults to
	// 1s.
	CommitInterval time.Duration

	// Backoff shapes the wait before each retry of a record the handler
	// asked to retry (consumer.ActionRetry): Backoff.Delay(n), drawn in its
	// upper half. A Result.RetryAfter hint longer than that is waited
	// instead, capped by Backoff.Max. Retries happen in place: the
	// partition waits, keeping its order. The same backoff spaces the
	// retries of failed fetches, commits and dead-letter writes. Defaults
	// to Initial 100ms, Max 10s, Factor 2.
	Backoff consumer.Backoff

	// DeadLetterTopic receives poison records (consumer.ActionDeadLetter:
	// permanent errors, panics, fingerprint mismatches, invalid ids,
	// exhausted retries) with the dead-letter headers added
	// (consumer.HeaderReason and the others; the package doc lists them).
	// Required unless DeadLetterWriter has its Topic set. The topic must
	// exist: Run checks it before consuming (ErrDeadLetterTopicMissing).
	DeadLetterTopic string
	// DeadLetterWriter publishes dead letters. It must be synchronous
	// (Async false) and wait for all in-sync replicas (RequiredAcks
	// kafkago.RequireAll); the Consumer does not close it. Defaults to a
	// Writer on the ReaderConfig's brokers and dialer, closed when Run
	// returns.
	DeadLetterWriter *kafkago.Writer

	// Offsets keeps the group's positions outside Kafka, for example in
	// PostgreSQL in the transaction of the effect (kafkapg.Offsets). When
	// set, a partition assigned to this member is consumed from the
	// position in Offsets (from Kafka's committed offset when Offsets has
	// none), and every commit also goes to Offsets. Defaults to nil: Kafka's
	// committed offsets only.
	Offsets OffsetStore

	// ShutdownTimeout is how long handlers running when a generation ends
	// (rebalance, or Run's context done) may take to finish before their
	// context is cancelled; a handler still running ShutdownTimeout after
	// that is left behind, its record not committed, and the generation
	// ends without it. Keep it well below the session timeout: the member
	// sends no heartbeat meanwhile. Defaults to a third of the smaller of
	// the session and rebalance timeouts (10s with kafka-go's defaults).
	ShutdownTimeout time.Duration

	// Telemetry: the Consumer's metrics, spans, logs and outcome reports
	// (consumer's block, shared by every adapter).
	//
	// Logger receives warnings (retries, dead letters, failed commits)
	// and debug messages (generations), with the context of the record's
	// span when there is one. Message ids appear only hashed
	// (message_id_hash, dedup.HashKey with an empty scope), keys and
	// payloads never. Defaults to slog.Default().
	//
	// OnOutcome, if set, is called once per settled record, after the
	// settlement: the record was acknowledged, or written to the
	// dead-letter topic, and its offset marked for the next commit. It
	// gets the record's Message, the consumer.Result the Consumer acted on
	// and its Outcome (Result.Outcome: for a dead letter, the same reason
	// as the consumer.HeaderReason header). A run that ends in a retry, and a record
	// abandoned at a rebalance or a stop, are not reported: the record
	// runs again and is reported when it settles. A record that comes back
	// after a crash or a rebalance that came before its offset commit
	// settles, and is reported, once more. It must be fast and safe for
	// concurrent use.
	//
	// MeterProvider receives idem.messages (each handler run's verdict:
	// ack, retry or dead_letter, with the dead-letter reason) and
	// messaging.process.duration, with the attributes messaging.system
	// "kafka" and messaging.destination.name the topic (README, "Operating
	// idem"). Defaults to the OpenTelemetry global, a no-op until the
	// application installs a provider.
	//
	// TracerProvider starts a consumer span "process <topic>" for each
	// handler run, continuing the trace found in the record's headers (the
	// traceparent the outbox stored at Enqueue time), and a span with links
	// to the records' traces for a batch. The handler chain runs in that
	// span's context, so consumer.Dedup's and consumer.Transactional's
	// spans are its children. Defaults to the OpenTelemetry global, a no-op
	// until the application installs a provider: until then (and with
	// OpenTelemetry's noop provider) no span is started and the headers are
	// not read.
	consumer.Telemetry

	// Propagator reads the trace context from the record's headers (see
	// HeaderCarrier). Defaults to W3C Trace Context (traceparent,
	// tracestate), what the outbox stores.
	Propagator propagation.TextMapPropagator
}

// OffsetStore keeps a consumer group's positions outside Kafka; see
// ConsumerOptions.Offsets. kafkapg.Offsets keeps them in PostgreSQL.
type OffsetStore interface {
	// LoadOffsets returns the stored position of each of partitions of
	// topic; a partition with nothing stored is absent from the map.
	LoadOffsets(ctx context.Context, group, topic string, partitions []int) (map[int]int64, error)
	// SaveOffsets stores positions (topic → partition → next offset). A
	// position must never move backwards: a store keeps the greater one.
	SaveOffsets(ctx context.Context, group string, offsets map[string]map[int]int64) error
}

// defaultBackoff is ConsumerOptions.Backoff's default.
var defaultBackoff = consumer.Backoff{Initial: 100 * time.Millisecond, Max: 10 * time.Second, Factor: 2}

func (o *ConsumerOptions) setDefaults(session, rebalance time.Duration) error {
	c := defaults.New("kafka: ConsumerOptions")
	c.Int("MaxIDLen", &o.MaxIDLen, dedup.DefaultMaxKeyLen)
	c.Int("Workers", &o.Workers, 1)
	c.Int("BatchSize", &o.BatchSize, 100)
	c.Int("MaxInFlight", &o.MaxInFlight, 256)
	c.Int("CommitEvery", &o.CommitEvery, 100)
	c.Duration("CommitInterval", &o.CommitInterval, time.Second)
	c.Duration("ShutdownTimeout", &o.ShutdownTimeout, min(session, rebalance)/3)
	var err error
	o.Backoff, err = o.Backoff.WithDefaults(defaultBackoff)
	c.Wrap("Backoff", err)
	if c.Err() == nil && o.MaxInFlight < o.Workers {
		c.Fail("MaxInFlight", "(%d) is less than Workers (%d)", o.MaxInFlight, o.Workers)
	}
	if err := c.Err(); err != nil {
		return err
	}
	if o.IDHeader == "" {
		o.IDHeader = outbox.HeaderMessageID
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	if o.Propagator == nil {
		o.Propagator = telemetry.DefaultPropagator
	}
	return nil
}

// checkWriter returns an error when w would not confirm writes.
func checkWriter(field string, w *kafkago.Writer) error {
	switch {
	case w.Addr == nil:
		return fmt.Errorf("kafka: %s has no Addr", field)
	case w.Async:
		return fmt.Errorf("kafka: %s is asynchronous: set Async to false, a write must be confirmed before the record is acknowledged", field)
	case w.RequiredAcks != kafkago.RequireAll:
		return fmt.Errorf("kafka: %s has RequiredAcks %v: set RequiredAcks to kafkago.RequireAll, a write must be on every in-sync replica before the record is acknowledged", field, w.RequiredAcks)
	}
	return nil
}

var errNoDeadLetterTopic = errors.New("kafka: ConsumerOptions.DeadLetterTopic is required: poison records are published there, then committed past, so that they never stop their partition")
