package walrelay

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"

	"github.com/google/uuid"

	"github.com/idemkit/idem/outbox"
)

// The payload of a logical decoding message written by Enqueue
// (SourceMessages) carries the messages of one Enqueue call:
//
//	version byte (1)
//	count   uvarint
//	count × { id [16]byte, topic, key, payload: uvarint length + bytes,
//	          headers: uvarint count × (name, value: uvarint length + bytes) }
//
// Headers are written sorted by name. An empty key means "no order".
const codecVersion = 1

// maxDecoded bounds the message count and the header count a payload may
// declare, so that a corrupt payload cannot make the decoder allocate
// without end.
const maxDecoded = 1 << 20

var errCorrupt = errors.New("walrelay: logical message payload is not an idem outbox message")

func encodeMessages(msgs []*outbox.Message) []byte {
	n := 1 + binary.MaxVarintLen64
	for _, m := range msgs {
		n += 16 + 4*binary.MaxVarintLen64 + len(m.Topic) + len(m.Key) + len(m.Payload)
		for k, v := range m.Headers {
			n += 2*binary.MaxVarintLen64 + len(k) + len(v)
		}
	}
	b := make([]byte, 0, n)
	b = append(b, codecVersion)
	b = binary.AppendUvarint(b, uint64(len(msgs)))
	for _, m := range msgs {
		id := uuid.MustParse(m.ID) // Enqueue set a UUID
		b = append(b, id[:]...)
		b = appendBytes(b, []byte(m.Topic))
		b = appendBytes(b, m.Key)
		b = appendBytes(b, m.Payload)
		names := make([]string, 0, len(m.Headers))
		for k := range m.Headers {
			names = append(names, k)
		}
		slices.Sort(names)
		b = binary.AppendUvarint(b, uint64(len(names)))
		for _, k := range names {
			b = appendBytes(b, []byte(k))
			b = appendBytes(b, []byte(m.Headers[k]))
		}
	}
	return b
}

func appendBytes(b, v []byte) []byte {
	b = binary.AppendUvarint(b, uint64(len(v)))
	return append(b, v...)
}

// decodeMessages reads a payload written by encodeMessages. The returned
// messages do not share memory with b.
func decodeMessages(b []byte) ([]*outbox.Message, error) {
	d := decoder{b: b}
	if len(b) == 0 || b[0] != codecVersion {
		return nil, fmt.Errorf("%w (unknown version)", errCorrupt)
	}
	d.b = d.b[1:]
	n := d.count()
	var out []*outbox.Message
	for i := uint64(0); i < n && d.err == nil; i++ {
		m := &outbox.Message{}
		var id uuid.UUID
		copy(id[:], d.take(16))
		m.ID = id.String()
		m.Topic = string(d.bytes())
		if k := d.bytes(); len(k) > 0 {
			m.Key = slices.Clone(k)
		}
		m.Payload = slices.Clone(d.bytes())
		if m.Payload == nil && d.err == nil {
			m.Payload = []byte{}
		}
		if nh := d.count(); nh > 0 {
			m.Headers = make(map[string]string, min(nh, 64))
			for j := uint64(0); j < nh && d.err == nil; j++ {
				k := string(d.bytes())
				m.Headers[k] = string(d.bytes())
			}
		}
		out = append(out, m)
	}
	if d.err == nil && len(d.b) > 0 {
		d.err = fmt.Errorf("%w (%d trailing bytes)", errCorrupt, len(d.b))
	}
	if d.err != nil {
		return nil, d.err
	}
	return out, nil
}

type decoder struct {
	b   []byte
	err error
}

func (d *decoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.err = fmt.Errorf("%w (bad length)", errCorrupt)
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *decoder) count() uint64 {
	n := d.uvarint()
	if n > maxDecoded || n > uint64(len(d.b)) {
		// Every element takes at least one byte.
		if d.err == nil {
			d.err = fmt.Errorf("%w (count %d)", errCorrupt, n)
		}
		return 0
	}
	return n
}

func (d *decoder) take(n uint64) []byte {
	if d.err != nil {
		return nil
	}
	if n > uint64(len(d.b)) {
		d.err = fmt.Errorf("%w (truncated)", errCorrupt)
		return nil
	}
	v := d.b[:n:n]
	d.b = d.b[n:]
	return v
}

func (d *decoder) bytes() []byte { return d.take(d.uvarint()) }
