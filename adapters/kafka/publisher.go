package idemkafka

import (
	"context"
	"errors"
	"fmt"
	"sort"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/outbox"
)

// PublisherOptions configure a Publisher. The zero value is usable.
type PublisherOptions struct {
	// IDHeader names the header that carries the outbox id. Defaults to
	// outbox.HeaderMessageID, which the Consumer reads by default.
	IDHeader string
}

// Publisher is an outbox.Publisher on a kafka-go Writer: each outbox message
// becomes a record with the message's topic, key, payload and headers, and
// its outbox id in the IDHeader header, so that a re-publish after a relay
// crash is deduplicated by the consumers. The headers carry what the outbox
// stored with the message, the W3C traceparent and tracestate of the context
// given to Outbox.Enqueue among them, so the Consumer's span continues the
// producer's trace.
type Publisher struct {
	w        *kafkago.Writer
	idHeader string
}

var _ outbox.Publisher = (*Publisher)(nil)

// NewPublisher returns a Publisher on w. w must be synchronous (Async false)
// and wait for every in-sync replica (RequiredAcks kafkago.RequireAll): Publish
// returns nil only for records the brokers confirmed. The Publisher does not
// close w.
//
// kafka-go's Writer sends a partition's batch when it holds BatchSize records
// or BatchTimeout has passed (1s by default), so a synchronous write of a
// small batch waits BatchTimeout: set it low, for example 10ms.
//
// With w.Topic set, every message must have that topic or none; otherwise
// every message needs its own.
//
// A Publisher is safe for concurrent use, as the Writer is.
func NewPublisher(w *kafkago.Writer, opts PublisherOptions) (*Publisher, error) {
	if w == nil {
		return nil, errors.New("kafka: NewPublisher: writer is nil")
	}
	if err := checkWriter("NewPublisher: the writer", w); err != nil {
		return nil, err
	}
	if opts.IDHeader == "" {
		opts.IDHeader = outbox.HeaderMessageID
	}
	return &Publisher{w: w, idHeader: opts.IDHeader}, nil
}

// Publish writes msgs and waits for the brokers' confirmation. It returns nil
// when every record was confirmed, a *outbox.PublishError naming the records
// that were not (a message without id or topic, a record too large, a
// partition whose write failed: kafka-go's kafkago.WriteErrors), or another
// error when the outcome of every record is unknown (the context ended, the
// cluster was unreachable), in which case the relay sends them again.
func (p *Publisher) Publish(ctx context.Context, msgs []*outbox.Message) error {
	failed := map[int]error{}
	recs := make([]kafkago.Message, 0, len(msgs))
	idx := make([]int, 0, len(msgs)) // recs[i] is msgs[idx[i]]
	for i, m := range msgs {
		rec, err := p.record(m)
		if err != nil {
			failed[i] = err
			continue
		}
		recs = append(recs, rec)
		idx = append(idx, i)
	}
	for len(recs) > 0 {
		err := p.w.WriteMessages(ctx, recs...)
		var (
			tooLarge kafkago.MessageTooLargeError
			werrs    kafkago.WriteErrors
		)
		switch {
		case err == nil:
			recs = nil
		case errors.As(err, &tooLarge):
			// Nothing was sent: drop the record too large, send the rest.
			j := indexOf(recs, tooLarge.Message)
			if j < 0 {
				return fmt.Errorf("kafka: publish: %w", err)
			}
			failed[idx[j]] = fmt.Errorf("kafka: record too large for the writer's BatchBytes: %w", err)
			recs = append(recs[:j:j], recs[j+1:]...)
			idx = append(idx[:j:j], idx[j+1:]...)
		case errors.As(err, &werrs) && len(werrs) == len(recs):
			for j, e := range werrs {
				if e != nil {
					failed[idx[j]] = e
				}
			}
			recs = nil
		default:
			return fmt.Errorf("kafka: publish: %w", err)
		}
	}
	if len(failed) > 0 {
		return &outbox.PublishError{Failed: failed}
	}
	return nil
}

func (p *Publisher) record(m *outbox.Message) (kafkago.Message, error) {
	switch {
	case m == nil:
		return kafkago.Message{}, errors.New("kafka: nil message")
	case m.ID == "":
		return kafkago.Message{}, errors.New("kafka: message has no id; the outbox sets it")
	case p.w.Topic == "" && m.Topic == "":
		return kafkago.Message{}, fmt.Errorf("kafka: message #%s has no topic and the writer has none", dedup.HashKey("", m.ID))
	case p.w.Topic != "" && m.Topic != "" && m.Topic != p.w.Topic:
		return kafkago.Message{}, fmt.Errorf("kafka: message #%s is for topic %q but the writer writes to %q", dedup.HashKey("", m.ID), m.Topic, p.w.Topic)
	}
	keys := make([]string, 0, len(m.Headers))
	for k := range m.Headers {
		if k != p.idHeader {
			keys = append(keys, k)
		}
	}
	sort.Strings(keys)
	hs := make([]kafkago.Header, 0, len(keys)+1)
	for _, k := range keys {
		hs = append(hs, kafkago.Header{Key: k, Value: []byte(m.Headers[k])})
	}
	hs = append(hs, kafkago.Header{Key: p.idHeader, Value: []byte(m.ID)})
	rec := kafkago.Message{Key: m.Key, Value: m.Payload, Headers: hs}
	if p.w.Topic == "" {
		rec.Topic = m.Topic
	}
	return rec, nil
}

// indexOf finds the record kafka-go reported in a MessageTooLargeError. Every
// record has its own header slice (the id header at least), so the slice's
// backing array identifies it.
func indexOf(recs []kafkago.Message, m kafkago.Message) int {
	if len(m.Headers) == 0 {
		return -1
	}
	for i := range recs {
		if len(recs[i].Headers) == len(m.Headers) && &recs[i].Headers[0] == &m.Headers[0] {
			return i
		}
	}
	return -1
}
