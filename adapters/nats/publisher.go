package idemnats

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/outbox"
)

// PublisherOptions configure a Publisher. The zero value is usable.
type PublisherOptions struct {
	// Subject returns the subject a message is published to. Defaults to
	// the message's Topic.
	Subject func(m *outbox.Message) string
	// ExpectStream, if set, is the stream every message must be stored
	// in: a PubAck from another stream fails the message (JetStream's
	// Nats-Expected-Stream header). Defaults to "": any stream that
	// stores the subject.
	ExpectStream string
}

// Publisher is an outbox.Publisher for JetStream: each outbox message is
// published to its subject (PublisherOptions.Subject, by default its
// Topic) with its payload, its headers (the W3C traceparent the outbox
// stored at Enqueue time among them) and its outbox id as Nats-Msg-Id, and
// counts as published only once JetStream's PubAck came back.
//
// JetStream remembers the Nats-Msg-Id of the messages a stream stored
// within its duplicate window (StreamConfig.Duplicates, 2 minutes by
// default) and drops a second message with the same id, answering with a
// PubAck whose Duplicate is set: a relay that published, crashed before it
// marked the row sent and publishes again stores nothing twice. A
// re-publish after the window is stored again; the Consumer's idem claim
// drops it. So the window is a saving, not the guarantee.
//
// Within one Publish, messages with the same non-empty Key are published
// one after another, each once the previous one's PubAck came back, and a
// message whose predecessor of the same key failed is not sent (it fails
// too), so a key's order holds; messages with different keys, or none,
// are in flight together. It is safe for concurrent use.
type Publisher struct {
	js         jetstream.JetStream
	opts       PublisherOptions
	published  atomic.Int64
	duplicates atomic.Int64
}

var _ outbox.Publisher = (*Publisher)(nil)

// PublisherStats are counters since the Publisher was created.
type PublisherStats struct {
	// Published counts messages JetStream confirmed; Duplicates those
	// among them it had stored already (the PubAck's Duplicate).
	Published, Duplicates int64
}

// NewPublisher returns a Publisher on js. The streams that store the
// subjects are the application's; a message no stream stores fails.
func NewPublisher(js jetstream.JetStream, opts PublisherOptions) (*Publisher, error) {
	if js == nil {
		return nil, errors.New("nats: NewPublisher: js is nil")
	}
	if opts.ExpectStream != "" {
		if err := checkName("PublisherOptions.ExpectStream", opts.ExpectStream); err != nil {
			return nil, err
		}
	}
	return &Publisher{js: js, opts: opts}, nil
}

// Stats returns the counters.
func (p *Publisher) Stats() PublisherStats {
	return PublisherStats{Published: p.published.Load(), Duplicates: p.duplicates.Load()}
}

// errPredecessor fails a message whose predecessor of the same key was
// not confirmed.
var errPredecessor = errors.New("nats: not sent: an earlier message with the same key was not confirmed")

// Publish publishes msgs and waits for their PubAcks. It returns nil when
// every message was confirmed, a *outbox.PublishError naming those that
// were not (a message without id or subject, one no stream stores, one
// whose predecessor of the same key failed), or another error when the
// outcome of every unconfirmed message is unknown (ctx ended while PubAcks
// were awaited), in which case the relay sends them again.
func (p *Publisher) Publish(ctx context.Context, msgs []*outbox.Message) error {
	failed := map[int]error{}
	// Rounds: round k sends the k-th message of each key (a message
	// without a key is a key of its own).
	var rounds [][]int
	depth := map[string]int{}
	for i, m := range msgs {
		r := 0
		if len(m.Key) > 0 {
			r = depth[string(m.Key)]
			depth[string(m.Key)] = r + 1
		}
		if r == len(rounds) {
			rounds = append(rounds, nil)
		}
		rounds[r] = append(rounds[r], i)
	}
	broken := map[string]bool{} // keys with a failed message
	for _, round := range rounds {
		futures := make([]jetstream.PubAckFuture, len(round))
		for j, i := range round {
			m := msgs[i]
			if len(m.Key) > 0 && broken[string(m.Key)] {
				failed[i] = errPredecessor
				continue
			}
			nm, err := p.natsMsg(m)
			if err == nil {
				futures[j], err = p.js.PublishMsgAsync(nm)
			}
			if err != nil {
				failed[i] = err
				if len(m.Key) > 0 {
					broken[string(m.Key)] = true
				}
			}
		}
		for j, f := range futures {
			if f == nil {
				continue
			}
			i := round[j]
			select {
			case ack := <-f.Ok():
				p.published.Add(1)
				if ack.Duplicate {
					p.duplicates.Add(1)
				}
			case err := <-f.Err():
				failed[i] = fmt.Errorf("nats: publish to %s: %w", f.Msg().Subject, err)
				if k := msgs[i].Key; len(k) > 0 {
					broken[string(k)] = true
				}
			case <-ctx.Done():
				return fmt.Errorf("nats: publish: waiting for PubAcks: %w", ctx.Err())
			}
		}
	}
	if len(failed) > 0 {
		return &outbox.PublishError{Failed: failed}
	}
	return nil
}

// natsMsg is the NATS message of m.
func (p *Publisher) natsMsg(m *outbox.Message) (*nats.Msg, error) {
	if m.ID == "" {
		return nil, errors.New("nats: the message has no id")
	}
	subject := m.Topic
	if p.opts.Subject != nil {
		subject = p.opts.Subject(m)
	}
	if subject == "" {
		return nil, errors.New("nats: the message has no subject (Topic is empty)")
	}
	hdr := make(nats.Header, len(m.Headers)+2)
	for k, v := range m.Headers {
		hdr[k] = []string{v}
	}
	hdr[nats.MsgIdHdr] = []string{m.ID}
	if p.opts.ExpectStream != "" {
		hdr[jetstream.ExpectedStreamHeader] = []string{p.opts.ExpectStream}
	}
	return &nats.Msg{Subject: subject, Data: m.Payload, Header: hdr}, nil
}
