package idemwatermill

import (
	"context"
	"errors"
	"fmt"

	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/idem/outbox"
)

// MetadataKey is the metadata field in which Publisher sends an outbox
// message's ordering key, when it has one.
const MetadataKey = "idem_key"

// Publisher is an outbox.Publisher that sends the outbox relay's messages
// through any Watermill message.Publisher (watermill-sql, Kafka, AMQP, NATS,
// gochannel, ...). Each Watermill message gets the outbox row id as its
// UUID — what Dedup and Transactional key on by default, so a re-publish
// after a relay crash is a duplicate downstream — the row's headers as
// metadata, the id again in outbox.HeaderMessageID and the ordering key in
// MetadataKey. The headers are copied as they are: the traceparent and
// tracestate the outbox stored at Enqueue reach the consumer unchanged
// (Publisher adds no trace context of its own: the relay's is not the
// message's), so Dedup and Transactional continue the producer's trace.
//
// Watermill's Publish has no per-message result: Publisher publishes each
// run of consecutive messages with the same topic in one call and treats a
// call's error as the failure of its messages. When a call fails, the later
// messages of the batch that share a key with a failed one are not sent
// (their order would break), and the others are. When nothing of a batch
// was sent, Publish returns the first error as it is (the relay retries the
// batch without counting an attempt); otherwise it returns an
// *outbox.PublishError naming the messages not sent.
type Publisher struct {
	pub message.Publisher
}

var _ outbox.Publisher = (*Publisher)(nil)

// NewPublisher returns a Publisher on pub. The relay calls Publish from one
// goroutine per session (pgoutbox.RelayOptions.Sessions): with more than one
// session, pub must be safe for concurrent use.
func NewPublisher(pub message.Publisher) (*Publisher, error) {
	if pub == nil {
		return nil, errors.New("watermill: NewPublisher: pub is nil")
	}
	return &Publisher{pub: pub}, nil
}

// Publish implements outbox.Publisher.
func (p *Publisher) Publish(ctx context.Context, msgs []*outbox.Message) error {
	var (
		failed    map[int]error
		failedKey map[string]bool
		firstErr  error
		sent      int
	)
	for start := 0; start < len(msgs); {
		end := start + 1
		for end < len(msgs) && msgs[end].Topic == msgs[start].Topic {
			end++
		}
		run := make([]*message.Message, 0, end-start)
		idx := make([]int, 0, end-start)
		for i := start; i < end; i++ {
			m := msgs[i]
			if len(m.Key) > 0 && failedKey[string(m.Key)] {
				if failed == nil {
					failed = make(map[int]error)
				}
				failed[i] = errors.New("watermill: not sent: an earlier message with the same key failed in this batch")
				continue
			}
			run = append(run, toWatermill(ctx, m))
			idx = append(idx, i)
		}
		start = end
		if len(run) == 0 {
			continue
		}
		err := ctx.Err() // the relay is stopping: send no more
		if err == nil {
			err = p.pub.Publish(msgs[idx[0]].Topic, run...)
		}
		if err != nil {
			err = fmt.Errorf("watermill: publish to %q: %w", msgs[idx[0]].Topic, err)
			if firstErr == nil {
				firstErr = err
			}
			if failed == nil {
				failed = make(map[int]error)
			}
			if failedKey == nil {
				failedKey = make(map[string]bool)
			}
			for _, i := range idx {
				failed[i] = err
				if len(msgs[i].Key) > 0 {
					failedKey[string(msgs[i].Key)] = true
				}
			}
			continue
		}
		sent += len(run)
	}
	switch {
	case len(failed) == 0:
		return nil
	case sent == 0:
		return firstErr
	}
	return &outbox.PublishError{Failed: failed}
}

// toWatermill converts an outbox message.
func toWatermill(ctx context.Context, m *outbox.Message) *message.Message {
	wm := message.NewMessageWithContext(ctx, m.ID, m.Payload)
	for k, v := range m.Headers {
		wm.Metadata.Set(k, v)
	}
	wm.Metadata.Set(outbox.HeaderMessageID, m.ID)
	if len(m.Key) > 0 {
		wm.Metadata.Set(MetadataKey, string(m.Key))
	}
	return wm
}
