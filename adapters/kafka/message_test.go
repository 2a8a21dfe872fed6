package idemkafka

import (
	"errors"
	"maps"
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
		opts := ConsumerOptions{OffsetID: offsetID}
		if err := opts.setDefaults(1, 1); err != nil {
			t.Fatal(err)
		}
		p := &partition{c: &Consumer{group: "g", opts: opts, msgOpts: opts.messageOptions("g")}, partStr: "3"}
		km := &kafkago.Message{Topic: "t", Partition: 3, Offset: 9, Headers: []kafkago.Header{
			{Key: k1, Value: []byte(v1)}, {Key: k2, Value: []byte(v2)},
		}}
		msg, err := p.message(km)
		// MessageFrom, for an application's own loop, maps it the same.
		own, ownErr := MessageFrom(km, MessageOptions{OffsetID: offsetID, Group: "g"})
		if (err == nil) != (ownErr == nil) || own.ID != msg.ID || !maps.Equal(own.Metadata, msg.Metadata) || !maps.Equal(own.Headers, msg.Headers) {
			t.Fatalf("MessageFrom = %+v, %v; the Consumer maps %+v, %v", own, ownErr, msg, err)
		}
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
		if msg.Metadata[MetadataPartition] != "3" || msg.Metadata[MetadataOffset] != "9" || msg.Metadata[MetadataGroup] != "g" || msg.Topic != "t" {
			t.Fatalf("metadata %v", msg.Metadata)
		}
	})
}

// MessageFrom's options: the id header, IDFunc, the length limit and the
// group; a negative MaxIDLen is refused.
func TestMessageFromOptions(t *testing.T) {
	km := &kafkago.Message{Topic: "t", Partition: 1, Offset: 7, Key: []byte("k"), Value: []byte("v"),
		Headers: []kafkago.Header{{Key: "ce_id", Value: []byte("evt-1")}, {Key: outbox.HeaderMessageID, Value: []byte("out-1")}}}
	for _, tc := range []struct {
		opts    MessageOptions
		id      string
		invalid bool
	}{
		{MessageOptions{}, "out-1", false},
		{MessageOptions{IDHeader: "ce_id"}, "evt-1", false},
		{MessageOptions{IDHeader: "absent"}, "", true},
		{MessageOptions{IDHeader: "absent", OffsetID: true}, "t/1/7", false},
		{MessageOptions{IDFunc: func(m *kafkago.Message) (string, error) { return string(m.Key) + "-x", nil }}, "k-x", false},
		{MessageOptions{IDFunc: func(*kafkago.Message) (string, error) { return "", errors.New("no") }}, "", true},
		{MessageOptions{MaxIDLen: 3}, "out-1", true},
	} {
		msg, err := MessageFrom(km, tc.opts)
		if tc.invalid != (err != nil) || (err != nil && !errors.Is(err, dedup.ErrInvalidKey)) {
			t.Errorf("%+v: error %v", tc.opts, err)
		}
		if !tc.invalid && (msg.ID != tc.id || string(msg.Payload) != "v" || string(msg.Key) != "k" || msg.Metadata[MetadataOffset] != "7") {
			t.Errorf("%+v: %+v", tc.opts, msg)
		}
		if _, has := msg.Metadata[MetadataGroup]; has {
			t.Errorf("%+v: a group without MessageOptions.Group", tc.opts)
		}
	}
	if _, err := MessageFrom(km, MessageOptions{MaxIDLen: -1}); err == nil {
		t.Error("MessageFrom accepted MaxIDLen -1")
	}
}
