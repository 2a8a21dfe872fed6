package walrelay

import (
	"bytes"
	"testing"

	"github.com/google/uuid"

	"github.com/idemkit/idem/outbox"
)

func TestCodecRoundTrip(t *testing.T) {
	t.Parallel()
	in := []*outbox.Message{
		{ID: uuid.NewString(), Topic: "orders", Key: []byte("k"), Payload: []byte("p"), Headers: map[string]string{"a": "1", "traceparent": "x"}},
		{ID: uuid.NewString(), Topic: "", Payload: []byte{}},
	}
	out, err := decodeMessages(encodeMessages(in))
	if err != nil {
		t.Fatal(err)
	}
	if len(out) != len(in) {
		t.Fatalf("%d messages back, want %d", len(out), len(in))
	}
	for i := range in {
		a, b := in[i], out[i]
		if a.ID != b.ID || a.Topic != b.Topic || !bytes.Equal(a.Key, b.Key) || !bytes.Equal(a.Payload, b.Payload) || len(a.Headers) != len(b.Headers) {
			t.Fatalf("message %d: %+v, want %+v", i, b, a)
		}
		for k, v := range a.Headers {
			if b.Headers[k] != v {
				t.Fatalf("message %d: header %s = %q, want %q", i, k, b.Headers[k], v)
			}
		}
	}
	if out[1].Key != nil || out[1].Payload == nil {
		t.Fatalf("empty key must decode as nil, empty payload as non-nil: %+v", out[1])
	}
}

// The decoder never panics, never allocates without bound, and what it
// accepts encodes back to the same bytes.
func FuzzDecodeMessages(f *testing.F) {
	f.Add(encodeMessages([]*outbox.Message{{ID: uuid.NewString(), Topic: "t", Key: []byte("k"), Payload: []byte("p"), Headers: map[string]string{"h": "v"}}}))
	f.Add([]byte{1, 0})
	f.Add([]byte{1, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Add([]byte("not an outbox message"))
	f.Fuzz(func(t *testing.T, b []byte) {
		msgs, err := decodeMessages(b)
		if err != nil {
			return
		}
		if again := encodeMessages(msgs); !bytes.Equal(again, b) {
			// Header order and duplicate names may differ; the
			// messages must not.
			back, err := decodeMessages(again)
			if err != nil || len(back) != len(msgs) {
				t.Fatalf("re-encoded payload does not decode: %v", err)
			}
		}
	})
}
