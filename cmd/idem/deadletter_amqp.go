package main

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	idemamqp "github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/consumer"
)

// The RabbitMQ dead-letter queue. Letters are taken with basic.get and
// manual acknowledgement, at most as many as the queue held when the
// command started: a removed letter is acknowledged (after its replay's
// publish was confirmed), and the others are returned to the queue (nack
// with requeue) when the command ends, or by the broker if the command
// dies.

type amqpDLQ struct {
	queue   string
	conn    *amqp091.Connection
	get     *amqp091.Channel // basic.get and the acknowledgements
	pub     *amqp091.Channel // the replays, in confirm mode
	returns chan amqp091.Return
	depth   int // the queue's ready messages when the command started
	taken   int
	held    map[uint64]bool // delivery tags taken and not removed
}

func openAMQPDLQ(ctx context.Context, f *dlqFlags) (dlqBackend, error) {
	cfg := amqp091.Config{Dial: amqp091.DefaultDial(10 * time.Second), Heartbeat: 10 * time.Second}
	conn, err := amqp091.DialConfig(f.amqp, cfg)
	if err != nil {
		return nil, fmt.Errorf("RabbitMQ at %s is unreachable: %w", redactAMQP(f.amqp), err)
	}
	a := &amqpDLQ{queue: f.queue, conn: conn, held: map[uint64]bool{}, returns: make(chan amqp091.Return, 64)}
	if err := a.start(); err != nil {
		_ = conn.Close()
		return nil, fmt.Errorf("%s: %w", a.describe(), err)
	}
	return a, nil
}

func (a *amqpDLQ) describe() string { return fmt.Sprintf("rabbitmq queue %q", a.queue) }

func (a *amqpDLQ) start() error {
	var err error
	if a.get, err = a.conn.Channel(); err != nil {
		return err
	}
	q, err := a.get.QueueDeclarePassive(a.queue, false, false, false, false, nil)
	if err != nil {
		return fmt.Errorf("the queue cannot be read (does it exist?): %w", err)
	}
	a.depth = q.Messages
	if a.pub, err = a.conn.Channel(); err != nil {
		return err
	}
	if err := a.pub.Confirm(false); err != nil {
		return fmt.Errorf("confirm mode: %w", err)
	}
	a.pub.NotifyReturn(a.returns)
	return nil
}

func (a *amqpDLQ) next(context.Context) (*deadLetter, error) {
	if a.taken >= a.depth {
		return nil, nil
	}
	m, ok, err := a.get.Get(a.queue, false)
	if err != nil {
		return nil, fmt.Errorf("basic.get: %w", err)
	}
	if !ok {
		return nil, nil
	}
	a.taken++
	a.held[m.DeliveryTag] = true
	return amqpLetter(&m, a.taken), nil
}

// amqpLetter maps a delivery of the dead-letter queue to a letter; n is its
// place in the order of reading.
func amqpLetter(m *amqp091.Delivery, n int) *deadLetter {
	d := &deadLetter{pos: fmt.Sprintf("#%d", n), msgID: m.MessageId, key: nil, payload: m.Body, ref: m}
	names := make([]string, 0, len(m.Headers))
	for k := range m.Headers {
		names = append(names, k)
	}
	sort.Strings(names)
	for _, k := range names {
		v := amqpHeaderText(m.Headers[k])
		d.headers = append(d.headers, header{k, v})
		switch k {
		case consumer.HeaderID:
			d.id = v
		case consumer.HeaderReason:
			d.reason = v
		case consumer.HeaderError:
			d.errText = v
		case consumer.HeaderAttempts:
			d.attempts = v
		case consumer.HeaderSource:
			d.source = v
		}
	}
	for _, p := range []header{
		{"(message-id)", m.MessageId}, {"(content-type)", m.ContentType}, {"(correlation-id)", m.CorrelationId},
		{"(type)", m.Type}, {"(app-id)", m.AppId},
	} {
		if p.value != "" {
			d.headers = append(d.headers, p)
		}
	}
	if !m.Timestamp.IsZero() {
		d.headers = append(d.headers, header{"(timestamp)", m.Timestamp.UTC().Format(time.RFC3339)})
	}
	if d.id == "" {
		d.id = d.msgID
	}
	return d
}

// amqpHeaderText is a header value as text.
func amqpHeaderText(v any) string {
	switch x := v.(type) {
	case string:
		return x
	case []byte:
		return printableHeader(x)
	case time.Time:
		return x.UTC().Format(time.RFC3339)
	}
	return fmt.Sprint(v)
}

// amqpReplayHeaders are the headers a replay drops besides the dead-letter
// ones: the Consumer's retry bookkeeping and the broker's, so the replay
// starts at its first attempt. The original exchange and routing key
// (idemamqp.HeaderExchange, HeaderRoutingKey) are kept: the Consumer
// reports them as the message's.
func amqpReplayHeader(name string) bool {
	switch name {
	case idemamqp.HeaderExchange, idemamqp.HeaderRoutingKey:
		return true
	case idemamqp.HeaderAttempt, idemamqp.HeaderWaits, idemamqp.HeaderWaitingSince, idemamqp.HeaderReturns,
		idemamqp.HeaderDeliveryCount, "x-death":
		return false
	}
	return !strings.HasPrefix(name, consumer.HeaderPrefix) && !strings.HasPrefix(name, "x-first-death-") &&
		!strings.HasPrefix(name, "x-last-death-")
}

func (a *amqpDLQ) replay(ctx context.Context, d *deadLetter) (string, error) {
	m := d.ref.(*amqp091.Delivery)
	if d.source == "" {
		return "it has no " + consumer.HeaderSource + " header: where it came from is not known", nil
	}
	h := amqp091.Table{}
	for k, v := range m.Headers {
		if amqpReplayHeader(k) {
			h[k] = v
		}
	}
	mode := m.DeliveryMode
	if mode == 0 {
		mode = amqp091.Persistent
	}
	p := amqp091.Publishing{
		Headers: h, ContentType: m.ContentType, ContentEncoding: m.ContentEncoding, DeliveryMode: mode,
		Priority: m.Priority, CorrelationId: m.CorrelationId, ReplyTo: m.ReplyTo, MessageId: d.msgID,
		Timestamp: m.Timestamp, Type: m.Type, AppId: m.AppId, Body: m.Body,
	}
	if p.MessageId == "" {
		p.MessageId = d.id
	}
	pctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	// Through the default exchange to the work queue the letter came
	// from, mandatory: a queue that does not exist returns it.
	dc, err := a.pub.PublishWithDeferredConfirmWithContext(pctx, "", d.source, true, false, p)
	if err != nil {
		return "", fmt.Errorf("publish to queue %q: %w", d.source, err)
	}
	acked, err := dc.WaitContext(pctx)
	if err != nil {
		return "", fmt.Errorf("publish to queue %q: %w", d.source, err)
	}
	if !acked {
		return "", fmt.Errorf("publish to queue %q: the broker did not confirm it (nack)", d.source)
	}
	// The broker sends a return before the confirm, on the same channel:
	// it is in the channel by now.
	select {
	case r := <-a.returns:
		return fmt.Sprintf("the broker could not route it to queue %q (%s): does the queue exist?", d.source, r.ReplyText), nil
	default:
	}
	return "", a.remove(m)
}

func (a *amqpDLQ) discard(_ context.Context, d *deadLetter) error {
	return a.remove(d.ref.(*amqp091.Delivery))
}

func (a *amqpDLQ) remove(m *amqp091.Delivery) error {
	if err := a.get.Ack(m.DeliveryTag, false); err != nil {
		return fmt.Errorf("acknowledge: %w", err)
	}
	delete(a.held, m.DeliveryTag)
	return nil
}

// close returns the letters taken and not removed to the queue.
func (a *amqpDLQ) close(context.Context) error {
	var err error
	for tag := range a.held {
		err = errors.Join(err, a.get.Nack(tag, false, true))
	}
	err = errors.Join(err, a.get.Close(), a.pub.Close())
	if cerr := a.conn.Close(); cerr != nil && !errors.Is(cerr, amqp091.ErrClosed) {
		err = errors.Join(err, cerr)
	}
	return err
}
