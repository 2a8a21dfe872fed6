package idemkafka

import (
	"context"
	"fmt"
	"slices"
	"strconv"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/outbox"
)

// Keys of consumer.Message.Metadata that the Consumer and MessageFrom set.
const (
	// MetadataPartition is the record's partition number, in decimal.
	MetadataPartition = "kafka.partition"
	// MetadataOffset is the record's offset, in decimal.
	MetadataOffset = "kafka.offset"
	// MetadataGroup is the consumer group: the Consumer's, or
	// MessageOptions.Group (absent when that is empty).
	MetadataGroup = "kafka.group"
)

// idScope stands in for the scope when a message id is validated: the
// adapter checks the id alone, the dedup middleware checks the whole key.
const idScope = "kafka"

// MessageOptions configure MessageFrom: how a record's id is found, as the
// Consumer's ConsumerOptions say. The zero value is usable.
type MessageOptions struct {
	// IDHeader names the header that carries the message id. Defaults to
	// outbox.HeaderMessageID, which the outbox publishers set. (For
	// records of the CloudEvents Kafka binding, set it to "ce_id".)
	IDHeader string
	// OffsetID gives a record without the IDHeader header the id
	// "topic/partition/offset"; see ConsumerOptions.OffsetID for what such an id
	// catches. Defaults to false: such a record is an error.
	OffsetID bool
	// IDFunc, if set, returns the id instead of IDHeader and OffsetID.
	IDFunc func(km *kafkago.Message) (string, error)
	// MaxIDLen limits the id, in bytes. Defaults to
	// dedup.DefaultMaxKeyLen.
	MaxIDLen int
	// Group, if set, is stored in Metadata[MetadataGroup].
	Group string
}

// MessageFrom turns a record fetched by the application's own kafka-go
// loop into the consumer.Message that idem's handlers take, as the Consumer
// does: key, value, topic, timestamp and headers (a repeated header: the
// last one), the partition and offset in Metadata[MetadataPartition] and
// Metadata[MetadataOffset] (in decimal) and the group in
// Metadata[MetadataGroup], and the id from opts (by default the
// outbox.HeaderMessageID header).
//
// A negative opts.MaxIDLen is a configuration error: MessageFrom then
// returns a nil message. Otherwise the error, when not nil, wraps
// dedup.ErrInvalidKey: the record has no usable id (none, empty, too long,
// control bytes, or IDFunc failed). The message is returned all the same, without an id, for the dead-letter
// path: treat the record as consumer.ActionDeadLetter with
// consumer.OutcomeInvalidKey, never run the handler on it. See the example
// for the loop around it.
func MessageFrom(km *kafkago.Message, opts MessageOptions) (*consumer.Message, error) {
	if opts.MaxIDLen < 0 {
		return nil, fmt.Errorf("kafka: MessageOptions.MaxIDLen is %d; it must be positive (or zero for %d)", opts.MaxIDLen, dedup.DefaultMaxKeyLen)
	}
	if opts.IDHeader == "" {
		opts.IDHeader = outbox.HeaderMessageID
	}
	if opts.MaxIDLen == 0 {
		opts.MaxIDLen = dedup.DefaultMaxKeyLen
	}
	return toMessage(km, strconv.Itoa(km.Partition), &opts)
}

// messageOptions are the Consumer's MessageOptions (its ConsumerOptions with the
// defaults filled in).
func (o *ConsumerOptions) messageOptions(group string) MessageOptions {
	return MessageOptions{IDHeader: o.IDHeader, OffsetID: o.OffsetID, IDFunc: o.IDFunc, MaxIDLen: o.MaxIDLen, Group: group}
}

// message turns a record of the partition into a consumer.Message; see
// MessageFrom.
func (p *partition) message(km *kafkago.Message) (*consumer.Message, error) {
	return toMessage(km, p.partStr, &p.c.msgOpts)
}

// toMessage is MessageFrom with opts' defaults filled in; partStr is the
// partition number in decimal.
func toMessage(km *kafkago.Message, partStr string, opts *MessageOptions) (*consumer.Message, error) {
	msg := &consumer.Message{
		Key:     km.Key,
		Payload: km.Value,
		Topic:   km.Topic,
		Time:    km.Time,
		Metadata: map[string]string{
			MetadataPartition: partStr,
			MetadataOffset:    strconv.FormatInt(km.Offset, 10),
		},
	}
	if opts.Group != "" {
		msg.Metadata[MetadataGroup] = opts.Group
	}
	if len(km.Headers) > 0 {
		msg.Headers = make(map[string]string, len(km.Headers))
		for _, h := range km.Headers {
			msg.Headers[h.Key] = string(h.Value) // a repeated header: the last one wins
		}
	}
	if opts.IDFunc != nil {
		id, err := opts.IDFunc(km)
		if err != nil {
			return msg, fmt.Errorf("kafka: record %s/%d@%d: IDFunc: %w (%w)", km.Topic, km.Partition, km.Offset, err, dedup.ErrInvalidKey)
		}
		msg.ID = id
		if err := dedup.ValidateKey(dedup.Key{Scope: idScope, ID: id}, opts.MaxIDLen); err != nil {
			return msg, fmt.Errorf("kafka: record %s/%d@%d: IDFunc: %w", km.Topic, km.Partition, km.Offset, err)
		}
		return msg, nil
	}
	id, ok := msg.Headers[opts.IDHeader]
	if !ok && opts.OffsetID {
		id, ok = offsetID(km.Topic, km.Partition, km.Offset), true
	}
	if !ok {
		return msg, fmt.Errorf("kafka: record %s/%d@%d has no %q header (the producer sets it; see ConsumerOptions.IDHeader and ConsumerOptions.OffsetID): %w",
			km.Topic, km.Partition, km.Offset, opts.IDHeader, dedup.ErrInvalidKey)
	}
	msg.ID = id
	if err := dedup.ValidateKey(dedup.Key{Scope: idScope, ID: id}, opts.MaxIDLen); err != nil {
		return msg, fmt.Errorf("kafka: record %s/%d@%d: header %q: %w", km.Topic, km.Partition, km.Offset, opts.IDHeader, err)
	}
	return msg, nil
}

// offsetID is the fallback id of ConsumerOptions.OffsetID.
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
// to the current BatchHandler or Handler call.
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
// With ConsumerOptions.Workers at 1 the position after a message is its offset + 1.
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
