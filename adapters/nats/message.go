package idemnats

import (
	"fmt"
	"strconv"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
)

// Keys of consumer.Message.Metadata that the Consumer and NewMessage set.
const (
	// MetadataStream is the stream the message is stored in.
	MetadataStream = "nats.stream"
	// MetadataConsumer is the durable consumer that delivered it.
	MetadataConsumer = "nats.consumer"
	// MetadataSequence is the message's sequence in the stream, in
	// decimal: the same on every delivery of the message.
	MetadataSequence = "nats.sequence"
	// MetadataDeliveries is JetStream's count of the message's
	// deliveries, this one included (NumDelivered), in decimal. It is
	// also consumer.Message.Attempt.
	MetadataDeliveries = "nats.deliveries"
)

// idScope stands in for the scope when a message id is validated: the
// adapter checks the id alone, the dedup middleware checks the whole key.
const idScope = "nats"

// MessageOptions configure NewMessage: how a message's id is found, as the
// Consumer's ConsumerOptions say. The zero value is usable.
type MessageOptions struct {
	// IDFunc, if set, returns the id of a message without a Nats-Msg-Id
	// header.
	IDFunc func(m jetstream.Msg) (string, error)
	// MaxIDLen limits the id, in bytes. Defaults to
	// dedup.DefaultMaxKeyLen.
	MaxIDLen int
}

// NewMessage turns a message pulled by the application's own JetStream
// loop into the consumer.Message that idem's handlers take, as the
// Consumer does: the payload, the subject (Topic), the headers (a repeated
// header: its first value), the stream, consumer, stream sequence and
// delivery count in Metadata, NumDelivered as Attempt (and Redelivered
// when it is above 1), the stream's timestamp as Time, and the id: the
// Nats-Msg-Id header, else opts.IDFunc's.
//
// A negative opts.MaxIDLen is a configuration error: NewMessage then
// returns a nil message. Otherwise the error, when not nil, wraps
// dedup.ErrInvalidKey: the message has no usable id (none, empty, too
// long, control bytes, or IDFunc failed). The message is returned all the
// same, without an id: settle it as consumer.ActionDeadLetter with
// consumer.OutcomeInvalidKey and never run the handler on it. See the
// example for the loop around it.
func NewMessage(m jetstream.Msg, opts MessageOptions) (*consumer.Message, error) {
	if opts.MaxIDLen < 0 {
		return nil, fmt.Errorf("nats: MessageOptions.MaxIDLen is %d; it must be positive (or zero for %d)", opts.MaxIDLen, dedup.DefaultMaxKeyLen)
	}
	if opts.MaxIDLen == 0 {
		opts.MaxIDLen = dedup.DefaultMaxKeyLen
	}
	md, _ := m.Metadata() // nil for a message JetStream did not deliver
	return toMessage(m, md, &opts)
}

// toMessage is NewMessage with opts' defaults filled in.
func toMessage(m jetstream.Msg, md *jetstream.MsgMetadata, opts *MessageOptions) (*consumer.Message, error) {
	msg := &consumer.Message{Payload: m.Data(), Topic: m.Subject(), Attempt: 1}
	if md != nil {
		seq := strconv.FormatUint(md.Sequence.Stream, 10)
		msg.Metadata = map[string]string{
			MetadataStream:     md.Stream,
			MetadataConsumer:   md.Consumer,
			MetadataSequence:   seq,
			MetadataDeliveries: strconv.FormatUint(md.NumDelivered, 10),
		}
		msg.Attempt = int(min(max(md.NumDelivered, 1), 1<<30))
		msg.Redelivered = md.NumDelivered > 1
		msg.Time = md.Timestamp
	}
	hs := m.Headers()
	if len(hs) > 0 {
		msg.Headers = make(map[string]string, len(hs))
		for k, vs := range hs {
			if len(vs) > 0 {
				msg.Headers[k] = vs[0]
			}
		}
	}
	if vs, ok := hs[nats.MsgIdHdr]; ok {
		id := ""
		if len(vs) > 0 {
			id = vs[0]
		}
		msg.ID = id
		if err := dedup.ValidateKey(dedup.Key{Scope: idScope, ID: id}, opts.MaxIDLen); err != nil {
			msg.ID = ""
			return msg, fmt.Errorf("nats: message %s: %s header: %w", where(md), nats.MsgIdHdr, err)
		}
		return msg, nil
	}
	if opts.IDFunc == nil {
		return msg, fmt.Errorf("nats: message %s has no %s header (and ConsumerOptions.IDFunc is not set): %w", where(md), nats.MsgIdHdr, dedup.ErrInvalidKey)
	}
	id, err := opts.IDFunc(m)
	if err != nil {
		return msg, fmt.Errorf("nats: message %s: IDFunc: %w (%w)", where(md), err, dedup.ErrInvalidKey)
	}
	if err := dedup.ValidateKey(dedup.Key{Scope: idScope, ID: id}, opts.MaxIDLen); err != nil {
		return msg, fmt.Errorf("nats: message %s: IDFunc: %w", where(md), err)
	}
	msg.ID = id
	return msg, nil
}

// where names a message by stream and sequence, never by subject or id.
func where(md *jetstream.MsgMetadata) string {
	if md == nil {
		return "(no JetStream metadata)"
	}
	return md.Stream + "#" + strconv.FormatUint(md.Sequence.Stream, 10)
}
