package idemamqp

import (
	"errors"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/dedup"
)

func TestNewMessage(t *testing.T) {
	t.Parallel()
	ts := time.Unix(1700000000, 0)
	d := amqp091.Delivery{
		MessageId: "prop-id", Body: []byte("body"), Exchange: "orders", RoutingKey: "eu.created",
		DeliveryTag: 7, ConsumerTag: "ctag", Redelivered: true, Timestamp: ts,
		Headers: amqp091.Table{"tenant": "t1", "n": int32(3), "raw": []byte("b"), "f": 1.5, HeaderAttempt: int32(3)},
	}
	msg, err := NewMessage(&d, MessageOptions{Queue: "work"})
	if err != nil {
		t.Fatal(err)
	}
	if msg.ID != "prop-id" || string(msg.Payload) != "body" || string(msg.Key) != "eu.created" || msg.Topic != "work" ||
		msg.Attempt != 3 || !msg.Redelivered || !msg.Time.Equal(ts) {
		t.Errorf("message %+v", msg)
	}
	if msg.Headers["tenant"] != "t1" || msg.Headers["n"] != "3" || msg.Headers["raw"] != "b" {
		t.Errorf("headers %v", msg.Headers)
	}
	if _, ok := msg.Headers["f"]; ok {
		t.Errorf("a float header was mapped: %v", msg.Headers)
	}
	if m := msg.Metadata; m["exchange"] != "orders" || m["routing_key"] != "eu.created" || m["delivery_tag"] != "7" || m["consumer_tag"] != "ctag" {
		t.Errorf("metadata %v", m)
	}

	for _, tc := range []struct {
		name    string
		headers amqp091.Table
		id      string
		invalid string
	}{
		{"header string", amqp091.Table{"x-id": "h-1"}, "h-1", ""},
		{"header bytes", amqp091.Table{"x-id": []byte("h-2")}, "h-2", ""},
		{"no header", nil, "prop-id", ""},
		{"header int", amqp091.Table{"x-id": int64(5)}, "", "holds a int64, not a string"},
		{"header nil", amqp091.Table{"x-id": nil}, "", "holds a <nil>, not a string"},
		{"header table", amqp091.Table{"x-id": amqp091.Table{"a": "b"}}, "", "not a string"},
		{"header empty", amqp091.Table{"x-id": ""}, "", "is empty"},
	} {
		d := amqp091.Delivery{MessageId: "prop-id", Headers: tc.headers}
		msg, err := NewMessage(&d, MessageOptions{IDHeader: "x-id"})
		switch {
		case tc.invalid == "" && err != nil:
			t.Errorf("%s: %v", tc.name, err)
		case tc.invalid != "" && (!errors.Is(err, dedup.ErrInvalidKey) || !strings.Contains(err.Error(), tc.invalid)):
			t.Errorf("%s: error %v, want ErrInvalidKey saying %q", tc.name, err, tc.invalid)
		}
		if msg == nil || msg.ID != tc.id {
			t.Errorf("%s: message %+v, want id %q", tc.name, msg, tc.id)
		}
	}
}

func FuzzNewMessage(f *testing.F) {
	f.Add("id", []byte("h"), int64(2), []byte("body"))
	f.Fuzz(func(t *testing.T, prop string, header []byte, attempt int64, body []byte) {
		d := amqp091.Delivery{MessageId: prop, Body: body,
			Headers: amqp091.Table{"x-id": header, HeaderAttempt: attempt}}
		msg, err := NewMessage(&d, MessageOptions{IDHeader: "x-id"})
		if msg == nil || msg.Attempt < 1 {
			t.Fatalf("message %+v", msg)
		}
		if (len(header) == 0) != (err != nil) || (err == nil && msg.ID != string(header)) {
			t.Fatalf("header %q: id %q, err %v", header, msg.ID, err)
		}
	})
}
