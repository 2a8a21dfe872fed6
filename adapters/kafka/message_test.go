package kafka

import (
	"errors"
	"testing"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/outbox"
)

// FuzzMessage checks the record mapping on arbitrary headers: it never
// panics, a record it accepts has a valid id equal to the last id header, and
// a record it refuses is an invalid key.
func FuzzMessage(f *testing.F) {
	f.Add(outbox.HeaderMessageID, "id-1", "other", "x", false)
	f.Add(outbox.HeaderMessageID, "", "", "", false)
	f.Add("nope", "id", outbox.HeaderMessageID, "a\x00b", true)
	f.Add(outbox.HeaderMessageID, "\xff\xfe", outbox.HeaderMessageID, "ok", false)
	f.Fuzz(func(t *testing.T, k1, v1, k2, v2 string, offsetID bool) {
		opts := Options{OffsetID: offsetID}
		if err := opts.setDefaults(1, 1); err != nil {
			t.Fatal(err)
		}
		p := &partition{c: &Consumer{group: "g", opts: opts}, partStr: "3"}
		km := &kafkago.Message{Topic: "t", Partition: 3, Offset: 9, Headers: []kafkago.Header{
			{Key: k1, Value: []byte(v1)}, {Key: k2, Value: []byte(v2)},
		}}
		msg, err := p.message(km)
		want, has := "", false
		for _, h := range km.Headers {
			if h.Key == outbox.HeaderMessageID {
				want, has = string(h.Value), true
			}
		}
		if !has && offsetID {
			want, has = "t/3/9", true
		}
		if err != nil {
			if !errors.Is(err, dedup.ErrInvalidKey) {
				t.Fatalf("error %v is not an invalid key", err)
			}
			if has && dedup.ValidateKey(dedup.Key{Scope: idScope, ID: want}, 0) == nil {
				t.Fatalf("valid id %q refused: %v", want, err)
			}
			return
		}
		if !has || msg.ID != want {
			t.Fatalf("id %q, want %q (present %v)", msg.ID, want, has)
		}
		if err := dedup.ValidateKey(dedup.Key{Scope: idScope, ID: msg.ID}, 0); err != nil {
			t.Fatalf("accepted an invalid id %q: %v", msg.ID, err)
		}
		if msg.Metadata[MetadataPartition] != "3" || msg.Metadata[MetadataOffset] != "9" || msg.Topic != "t" {
			t.Fatalf("metadata %v", msg.Metadata)
		}
	})
}
