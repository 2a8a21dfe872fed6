package idemkafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/backoff"
)

// Headers added to a dead-lettered record, besides consumer's
// (consumer.HeaderReason, HeaderError, HeaderAttempts, HeaderSource, the
// record's topic, and HeaderID); the package doc lists them all. The record
// keeps its key, value and headers (the message id among them); headers
// with consumer.HeaderPrefix from an earlier dead-lettering are replaced.
const (
	// HeaderPartition and HeaderOffset locate the original record in
	// consumer.HeaderSource, its topic.
	HeaderPartition = consumer.HeaderPrefix + "partition"
	HeaderOffset    = consumer.HeaderPrefix + "offset"
	// HeaderGroup is the consumer group that dead-lettered the record.
	HeaderGroup = consumer.HeaderPrefix + "group"
)

const maxErrorHeader = 4 << 10

// ErrDeadLetterTopicMissing is wrapped by the error of Run when the brokers
// answer that the dead-letter topic does not exist: a poison record could
// not be parked and would stop its partition, so the Consumer does not
// start. Create the topic, or name an existing one in
// ConsumerOptions.DeadLetterTopic (or DeadLetterWriter.Topic). A DeadLetterWriter
// with AllowAutoTopicCreation set is not checked.
var ErrDeadLetterTopicMissing = errors.New("kafka: the dead-letter topic does not exist")

// checkDeadLetterTopic asks the brokers, through the dead-letter Writer's
// address and transport, whether the dead-letter topic exists. It retries
// while they cannot be reached, until ctx is done.
func (c *Consumer) checkDeadLetterTopic(ctx context.Context) error {
	if c.dlq.AllowAutoTopicCreation {
		return nil // the Writer creates it
	}
	cl := &kafkago.Client{Addr: c.dlq.Addr, Transport: c.dlq.Transport, Timeout: 10 * time.Second}
	for n := 1; ; n++ {
		md, err := cl.Metadata(ctx, &kafkago.MetadataRequest{Topics: []string{c.dlqTopic}})
		if err == nil {
			for _, t := range md.Topics {
				switch {
				case t.Name != c.dlqTopic:
				case errors.Is(t.Error, kafkago.UnknownTopicOrPartition):
					return fmt.Errorf("%w: %q: create it (kafka-topics.sh --create --topic %s) or set ConsumerOptions.DeadLetterTopic to a topic that exists; poison records of group %q are parked there: %w",
						ErrDeadLetterTopicMissing, c.dlqTopic, c.dlqTopic, c.group, t.Error)
				case t.Error != nil:
					err = t.Error
				default:
					return nil
				}
			}
			if err == nil {
				err = fmt.Errorf("the brokers did not answer for topic %q", c.dlqTopic)
			}
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		c.log.LogAttrs(ctx, slog.LevelWarn, "idem: checking the dead-letter topic failed; trying again",
			slog.String("group", c.group), slog.String("dead_letter_topic", c.dlqTopic), slog.Int("try", n), slog.Any("error", err))
		if !backoff.Sleep(ctx, c.backoff(n, 0)) {
			return ctx.Err()
		}
	}
}

// deadLetterTimeout bounds one dead-letter write.
const deadLetterTimeout = 30 * time.Second

// deadLetterAttempts is the attempt count of the header.
func deadLetterAttempts(attempts int, r consumer.Result) int {
	var exhausted *consumer.RetriesExhaustedError
	if errors.As(r.Err, &exhausted) {
		attempts = max(attempts, exhausted.Attempts)
	}
	return attempts
}

func (c *Consumer) deadLetterRecord(km *kafkago.Message, attempts int, r consumer.Result) kafkago.Message {
	hs := make([]kafkago.Header, 0, len(km.Headers)+8)
	for _, h := range km.Headers {
		if !strings.HasPrefix(h.Key, consumer.HeaderPrefix) {
			hs = append(hs, h)
		}
	}
	errText := ""
	if r.Err != nil {
		errText = r.Err.Error()
		if len(errText) > maxErrorHeader {
			errText = errText[:maxErrorHeader]
		}
	}
	reason := string(r.Reason)
	if reason == "" {
		reason = string(consumer.OutcomePermanent)
	}
	hs = append(hs,
		kafkago.Header{Key: consumer.HeaderReason, Value: []byte(reason)},
		kafkago.Header{Key: consumer.HeaderError, Value: []byte(errText)},
		kafkago.Header{Key: consumer.HeaderSource, Value: []byte(km.Topic)},
		kafkago.Header{Key: HeaderPartition, Value: []byte(strconv.Itoa(km.Partition))},
		kafkago.Header{Key: HeaderOffset, Value: []byte(strconv.FormatInt(km.Offset, 10))},
		kafkago.Header{Key: consumer.HeaderAttempts, Value: []byte(strconv.Itoa(attempts))},
		kafkago.Header{Key: HeaderGroup, Value: []byte(c.group)},
		kafkago.Header{Key: consumer.HeaderID, Value: []byte(offsetID(km.Topic, km.Partition, km.Offset))},
	)
	out := kafkago.Message{Key: km.Key, Value: km.Value, Headers: hs}
	if c.dlq.Topic == "" {
		out.Topic = c.dlqTopic
	}
	return out
}

// deadLetter publishes the record to the dead-letter topic, retrying with
// backoff until the write is confirmed. It returns false, without the record
// being parked, when stop is done first: the record is then not committed and
// comes back.
func (p *partition) deadLetter(stop, logCtx context.Context, it *item, attempts int, r consumer.Result) bool {
	c := p.c
	attempts = deadLetterAttempts(attempts, r)
	rec := c.deadLetterRecord(&it.km, attempts, r)
	for n := 1; ; n++ {
		ctx, cancel := context.WithTimeout(p.workCtx, deadLetterTimeout)
		err := c.dlq.WriteMessages(ctx, rec)
		cancel()
		if err == nil {
			c.log.LogAttrs(logCtx, slog.LevelWarn, "idem: record dead-lettered",
				slog.String("topic", it.km.Topic), slog.Int("partition", it.km.Partition), slog.Int64("offset", it.km.Offset),
				slog.String("message_id_hash", dedup.HashKey("", it.msg.ID)), slog.String("reason", string(r.Reason)), slog.Int("attempts", attempts),
				slog.String("dead_letter_topic", c.dlqTopic), slog.Any("error", r.Err))
			return true
		}
		c.log.LogAttrs(logCtx, slog.LevelError, "idem: publishing to the dead-letter topic failed; the partition waits and tries again",
			slog.String("topic", it.km.Topic), slog.Int("partition", it.km.Partition), slog.Int64("offset", it.km.Offset),
			slog.String("dead_letter_topic", c.dlqTopic), slog.Int("try", n), slog.Any("error", err))
		if !backoff.Sleep(stop, c.backoff(n, 0)) {
			return false
		}
	}
}
