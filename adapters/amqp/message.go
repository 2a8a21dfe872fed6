package idemamqp

import (
	"fmt"
	"strconv"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
)

// MessageOptions configure NewMessage. The zero value is usable.
type MessageOptions struct {
	// IDHeader, when set, names the application header that carries the
	// message id instead of the message-id property; see
	// ConsumerOptions.IDHeader. Defaults to "": the id is the message-id
	// property.
	IDHeader string
	// Queue is the queue the delivery came from, reported as
	// consumer.Message.Topic. Defaults to "".
	Queue string
}

// NewMessage maps a delivery to the consumer.Message that idem's
// middleware (consumer.Dedup, consumer.Transactional) and consumer.Process
// take, for a program that keeps its own amqp091-go loop and its own Ack:
//
//	msg, err := idemamqp.NewMessage(&d, idemamqp.MessageOptions{Queue: queue})
//	r := consumer.Decide(err) // err: dead-letter it (invalid_key)
//	if err == nil {
//		r = consumer.Process(ctx, h, msg)
//	}
//	// act on r.Action: ActionAck -> d.Ack(false), ActionRetry -> retry
//	// later, ActionDeadLetter -> park it, then d.Ack(false)
//
// The id is the IDHeader header when opts.IDHeader is set and the delivery
// has it, else the message-id property. The payload is the body; headers
// whose values are strings, []byte or integers become Headers (others are
// left out); Attempt is HeaderAttempt (1 when absent); the exchange,
// routing key (those kept in HeaderExchange and HeaderRoutingKey on a
// retried copy), delivery tag, consumer tag and redelivered flag are in
// Metadata, and the routing key is Key.
//
// A delivery whose IDHeader header is present but is not a non-empty
// string (or []byte) gets no silent fallback to the message-id: NewMessage
// returns the message with an empty ID and an error wrapping
// dedup.ErrInvalidKey that says why, which consumer.Decide dead-letters
// with reason invalid_key.
func NewMessage(d *amqp091.Delivery, opts MessageOptions) (*consumer.Message, error) {
	id := d.MessageId
	var err error
	if opts.IDHeader != "" {
		if v, present := d.Headers[opts.IDHeader]; present {
			s, ok := consHeaderString(v)
			switch {
			case !ok:
				id, err = "", fmt.Errorf("amqp: header %q holds a %T, not a string: %w", opts.IDHeader, v, dedup.ErrInvalidKey)
			case s == "":
				id, err = "", fmt.Errorf("amqp: header %q is empty: %w", opts.IDHeader, dedup.ErrInvalidKey)
			default:
				id = s
			}
		}
	}
	attempt := 1
	if n, ok := consHeaderInt(d.Headers[HeaderAttempt]); ok && n > 1 {
		attempt = int(min(n, 1<<30))
	}
	exchange, key := d.Exchange, d.RoutingKey
	if v, ok := consHeaderString(d.Headers[HeaderExchange]); ok {
		exchange = v
		if k, ok := consHeaderString(d.Headers[HeaderRoutingKey]); ok {
			key = k
		}
	}
	var headers map[string]string
	if len(d.Headers) > 0 {
		headers = make(map[string]string, len(d.Headers))
		for k, v := range d.Headers {
			if s, ok := consHeaderString(v); ok {
				headers[k] = s
			} else if n, ok := consHeaderInt(v); ok {
				headers[k] = strconv.FormatInt(n, 10)
			}
		}
	}
	return &consumer.Message{
		ID:      id,
		Key:     []byte(key),
		Payload: d.Body,
		Headers: headers,
		Topic:   opts.Queue,
		Metadata: map[string]string{
			"exchange":     exchange,
			"routing_key":  key,
			"delivery_tag": strconv.FormatUint(d.DeliveryTag, 10),
			"consumer_tag": d.ConsumerTag,
			"redelivered":  strconv.FormatBool(d.Redelivered),
		},
		Attempt:     attempt,
		Redelivered: d.Redelivered,
		Time:        d.Timestamp,
	}, err
}
