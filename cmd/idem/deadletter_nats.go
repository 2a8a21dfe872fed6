package main

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	idemnats "github.com/idemkit/idem/adapters/nats"
	"github.com/idemkit/idem/consumer"
)

// The NATS JetStream dead-letter stream. Letters are read by sequence, up
// to the last sequence the stream held when the command started; a removed
// letter is deleted from the stream (after its replay's PubAck came back).

type natsDLQ struct {
	name   string
	nc     *nats.Conn
	js     jetstream.JetStream
	stream jetstream.Stream
	seq    uint64 // the next sequence to read
	last   uint64 // the stream's last sequence when the command started
}

func openNATSDLQ(ctx context.Context, f *dlqFlags) (dlqBackend, error) {
	nc, err := nats.Connect(f.nats, nats.Timeout(10*time.Second), nats.Name("idem deadletter"))
	if err != nil {
		return nil, fmt.Errorf("NATS at %s is unreachable: %w", redactNATS(f.nats), err)
	}
	n := &natsDLQ{name: f.stream, nc: nc}
	if err := n.start(ctx); err != nil {
		nc.Close()
		return nil, fmt.Errorf("%s: %w", n.describe(), err)
	}
	return n, nil
}

// redactNATS is a NATS URL without its credentials.
func redactNATS(u string) string {
	if i := strings.LastIndex(u, "@"); i >= 0 {
		if j := strings.Index(u, "://"); j >= 0 && j < i {
			return u[:j+3] + u[i+1:]
		}
		return u[i+1:]
	}
	return u
}

func (n *natsDLQ) describe() string { return fmt.Sprintf("nats stream %q", n.name) }

func (n *natsDLQ) start(ctx context.Context) error {
	var err error
	if n.js, err = jetstream.New(n.nc); err != nil {
		return err
	}
	if n.stream, err = n.js.Stream(ctx, n.name); err != nil {
		return fmt.Errorf("the stream cannot be read (does it exist?): %w", err)
	}
	info, err := n.stream.Info(ctx)
	if err != nil {
		return err
	}
	n.seq, n.last = max(info.State.FirstSeq, 1), info.State.LastSeq
	return nil
}

func (n *natsDLQ) next(ctx context.Context) (*deadLetter, error) {
	if n.seq > n.last {
		return nil, nil
	}
	// The first message at or after seq, on any subject: deleted
	// sequences are skipped by the server.
	m, err := n.stream.GetMsg(ctx, n.seq, jetstream.WithGetMsgSubject(">"))
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		n.seq = n.last + 1
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("get sequence %d: %w", n.seq, err)
	}
	if m.Sequence > n.last {
		n.seq = n.last + 1
		return nil, nil
	}
	n.seq = m.Sequence + 1
	return natsLetter(m), nil
}

func natsLetter(m *jetstream.RawStreamMsg) *deadLetter {
	d := &deadLetter{pos: fmt.Sprintf("seq:%d", m.Sequence), at: m.Time, payload: m.Data, ref: m}
	names := make([]string, 0, len(m.Header))
	for k := range m.Header {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		for _, v := range m.Header[k] {
			d.headers = append(d.headers, header{k, v})
		}
	}
	d.id = m.Header.Get(idemnats.HeaderID)
	d.reason = m.Header.Get(idemnats.HeaderReason)
	d.errText = m.Header.Get(idemnats.HeaderError)
	d.attempts = m.Header.Get(idemnats.HeaderAttempts)
	d.source = m.Header.Get(idemnats.HeaderSubject)
	// The replay carries the original Nats-Msg-Id. A message that had
	// none is published without one, as it was: a Consumer's IDFunc
	// gives it its id again.
	d.msgID = m.Header.Get(idemnats.HeaderMessageID)
	return d
}

func (n *natsDLQ) replay(ctx context.Context, d *deadLetter) (string, error) {
	m := d.ref.(*jetstream.RawStreamMsg)
	if d.source == "" {
		return "it has no " + idemnats.HeaderSubject + " header: where it came from is not known", nil
	}
	h := nats.Header{}
	for k, vs := range m.Header {
		if strings.HasPrefix(k, consumer.HeaderPrefix) || k == nats.MsgIdHdr || strings.HasPrefix(k, "Nats-Expected-") {
			continue
		}
		h[k] = append([]string(nil), vs...)
	}
	if d.msgID != "" {
		h.Set(nats.MsgIdHdr, d.msgID)
	}
	pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	ack, err := n.js.PublishMsg(pctx, &nats.Msg{Subject: d.source, Header: h, Data: m.Data})
	if err != nil {
		return "", fmt.Errorf("publish to %s: %w", d.source, err)
	}
	if ack.Duplicate {
		return fmt.Sprintf("stream %s dropped it as a duplicate: it stored a message with Nats-Msg-Id %q within its duplicate window (2 minutes by default); replay it once the window has passed",
			ack.Stream, d.msgID), nil
	}
	return "", n.remove(ctx, m)
}

func (n *natsDLQ) discard(ctx context.Context, d *deadLetter) error {
	return n.remove(ctx, d.ref.(*jetstream.RawStreamMsg))
}

func (n *natsDLQ) remove(ctx context.Context, m *jetstream.RawStreamMsg) error {
	if err := n.stream.DeleteMsg(ctx, m.Sequence); err != nil {
		return fmt.Errorf("delete sequence %d: %w", m.Sequence, err)
	}
	return nil
}

func (n *natsDLQ) close(context.Context) error {
	n.nc.Close()
	return nil
}
