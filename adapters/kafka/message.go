package kafka

import (
	"context"
	"fmt"
	"slices"
	"strconv"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
)

// Metadata keys the Consumer sets on consumer.Message.Metadata.
const (
	// MetadataPartition is the partition number, in decimal.
	MetadataPartition = "kafka.partition"
	// MetadataOffset is the record's offset, in decimal.
	MetadataOffset = "kafka.offset"
	// MetadataGroup is the consumer group.
	MetadataGroup = "kafka.group"
)

// idScope stands in for the scope when a message id is validated: the
// adapter checks the id alone, the dedup middleware checks the whole key.
const idScope = "kafka"

// message turns a record into a consumer.Message. The error, when not nil,
// wraps dedup.ErrInvalidKey: the record has no usable id and is dead-lettered
// without reaching the handler.
func (p *partition) message(km *kafkago.Message) (*consumer.Message, error) {
	c := p.c
	msg := &consumer.Message{
		Key:     km.Key,
		Payload: km.Value,
		Topic:   km.Topic,
		Time:    km.Time,
		Metadata: map[string]string{
			MetadataPartition: p.partStr,
			MetadataOffset:    strconv.FormatInt(km.Offset, 10),
			MetadataGroup:     c.group,
		},
	}
	if len(km.Headers) > 0 {
		msg.Headers = make(map[string]string, len(km.Headers))
		for _, h := range km.Headers {
			msg.Headers[h.Key] = string(h.Value) // a repeated header: the last one wins
		}
	}
	if c.opts.IDFunc != nil {
		id, err := c.opts.IDFunc(km)
		if err != nil {
			return msg, fmt.Errorf("kafka: record %s/%d@%d: IDFunc: %w (%w)", km.Topic, km.Partition, km.Offset, err, dedup.ErrInvalidKey)
		}
		msg.ID = id
		if err := dedup.ValidateKey(dedup.Key{Scope: idScope, ID: id}, c.opts.MaxIDLen); err != nil {
			return msg, fmt.Errorf("kafka: record %s/%d@%d: IDFunc: %w", km.Topic, km.Partition, km.Offset, err)
		}
		return msg, nil
	}
	id, ok := msg.Headers[c.opts.IDHeader]
	if !ok && c.opts.OffsetID {
		id, ok = offsetID(km.Topic, km.Partition, km.Offset), true
	}
	if !ok {
		return msg, fmt.Errorf("kafka: record %s/%d@%d has no %q header (the producer sets it; see Options.IDHeader and Options.OffsetID): %w",
			km.Topic, km.Partition, km.Offset, c.opts.IDHeader, dedup.ErrInvalidKey)
	}
	msg.ID = id
	if err := dedup.ValidateKey(dedup.Key{Scope: idScope, ID: id}, c.opts.MaxIDLen); err != nil {
		return msg, fmt.Errorf("kafka: record %s/%d@%d: header %q: %w", km.Topic, km.Partition, km.Offset, c.opts.IDHeader, err)
	}
	return msg, nil
}

// offsetID is the fallback id of Options.OffsetID.
func offsetID(topic string, partition int, offset int64) string {
	return topic + "/" + strconv.Itoa(partition) + "/" + strconv.FormatInt(offset, 10)
}

// Position is how far a partition of a consumer group has been handled:
// every record before Offset is done, so consumption resumes at Offset.
type Position struct {
	Group     string
	Topic     string
	Partition int
	Offset    int64
}

// handlingKey is the context key of the records a handler is running on.
type handlingKey struct{}

// handling is what PositionAfter needs: the partition and the records handed
// to the current HandleBatch or Handle call.
type handling struct {
	p     *partition
	items []*item
}

// PositionAfter returns, inside a handler run by a Consumer, the position its
// partition will have once msgs are done: the offset before which every
// record is either already done or one of msgs. Without msgs it assumes every
// message handed to the current call (one for a consumer.Handler, the batch
// for a BatchHandler) is done.
//
// A handler that stores the position in the transaction of its effect (see
// the kafkapg package) calls it just before committing: if the transaction
// commits, the position is exact or behind, never ahead of unfinished work.
// With Options.Workers at 1 the position after a message is its offset + 1.
//
// ok is false outside a Consumer's handler, or when one of msgs was not
// handed to the current call. Call it only while the call runs.
func PositionAfter(ctx context.Context, msgs ...*consumer.Message) (pos Position, ok bool) {
	h, _ := ctx.Value(handlingKey{}).(*handling)
	if h == nil {
		return Position{}, false
	}
	seqs := make([]uint64, 0, max(len(msgs), len(h.items)))
	if len(msgs) == 0 {
		for _, it := range h.items {
			seqs = append(seqs, it.seq)
		}
	} else {
		for _, m := range msgs {
			i := slices.IndexFunc(h.items, func(it *item) bool { return it.msg == m })
			if i < 0 {
				return Position{}, false
			}
			seqs = append(seqs, h.items[i].seq)
		}
		slices.Sort(seqs)
	}
	return Position{
		Group:     h.p.c.group,
		Topic:     h.p.topic,
		Partition: h.p.id,
		Offset:    h.p.tr.nextAssuming(seqs),
	}, true
}
