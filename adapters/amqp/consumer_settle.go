package idemamqp

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/backoff"
)

// settlement is what the Consumer did with a delivery.
type settlement int8

const (
	// settledAcked: acknowledged (success, a completed duplicate, or a
	// dead letter a consumer.DeadLetter middleware parked); the ack,
	// possibly coalesced with others, was written.
	settledAcked settlement = iota + 1
	// settledRetried: a copy went to a retry queue, then the delivery was
	// acknowledged.
	settledRetried
	// settledDeadLettered: a copy went to the dead-letter exchange, then
	// the delivery was acknowledged.
	settledDeadLettered
	// settledRequeued: nacked with requeue, because a copy could not be
	// published or the consumer is stopping.
	settledRequeued
	// settledAbandoned: the delivery's channel closed before it could be
	// settled (or while its ack was being coalesced); the broker
	// redelivers it.
	settledAbandoned
	// settledUnpublished: nacked with requeue because its retry or
	// dead-letter copy was not confirmed.
	settledUnpublished
)

// errUnpublished is the Report.Err of a delivery requeued because its
// retry or dead-letter copy was not confirmed.
var errUnpublished = errors.New("amqp: the delivery's retry or dead-letter copy was not confirmed; the delivery was requeued")

// errAbandoned is the Report.Err of a delivery whose channel closed before
// it was settled.
var errAbandoned = fmt.Errorf("amqp: the delivery's channel closed before it was settled; the broker redelivers it: %w", amqp091.ErrClosed)

// reportDone counts and reports a delivery the acker acknowledged
// (settledAcked) or abandoned.
func (c *Consumer) reportDone(p *consDone, out settlement) {
	if out == settledAcked {
		c.stats.acked.Add(1)
		if p.r.Duplicate {
			c.stats.duplicates.Add(1)
		}
	} else {
		c.abandon()
	}
	c.report(p.ctx, p.msg, p.r, out, p.start, p.end)
}

// report records a settled delivery's verdict (metrics, its span) and
// calls OnOutcome.
func (c *Consumer) report(mctx context.Context, msg *consumer.Message, r consumer.Result, out settlement, start time.Time, end func(string, error)) {
	v := applied(r, out)
	result, reason := verdictOf(v)
	c.tel.Result(mctx, c.queue, result, reason, time.Since(start))
	end(result, v.Err)
	if c.opts.OnOutcome != nil {
		err := v.Err
		if out == settledAbandoned {
			err = errAbandoned
		}
		c.opts.OnOutcome(mctx, consumer.Report{Outcome: v.Outcome(), Message: msg, Result: v, Err: err})
	}
}

// system is the messaging.system attribute of the Consumer's metrics and
// spans.
const system = "rabbitmq"

// applied is the verdict the Consumer carried out on a delivery whose chain
// returned r and that it settled with out: r itself when it was
// acknowledged or dead-lettered as r said; a dead letter with reason
// wait_limit or retries_exhausted for a retry the Consumer dead-lettered
// instead; a retry for every delivery that comes back (a retry copy, a
// requeue, an abandoned delivery), with r's reason and error.
func applied(r consumer.Result, out settlement) consumer.Result {
	switch out {
	case settledAcked:
		return r
	case settledUnpublished:
		// Not the verdict r asked for (a dead letter, maybe): the copy
		// that carries it out was not confirmed, and the message comes
		// back.
		return consumer.Result{Action: consumer.ActionRetry, Reason: consumer.OutcomeTransient, Err: errUnpublished}
	case settledDeadLettered:
		if r.Action == consumer.ActionRetry {
			reason := consumer.OutcomeRetriesExhausted
			if consOwned(r) {
				reason = ReasonWaitLimit
			}
			return consumer.Result{Action: consumer.ActionDeadLetter, Reason: reason, Err: r.Err}
		}
		return r
	}
	return consumer.Result{Action: consumer.ActionRetry, Reason: r.Reason, Err: r.Err, RetryAfter: r.RetryAfter}
}

// verdictOf is the idem.result and idem.reason of a verdict the Consumer
// carried out (see applied): ack, retry, or dead_letter with the reason
// the copy carries (or the consumer.DeadLetter middleware gave).
func verdictOf(v consumer.Result) (result, reason string) {
	switch {
	case v.DeadLettered, v.Action == consumer.ActionDeadLetter:
		return "dead_letter", string(v.Reason)
	case v.Action == consumer.ActionAck:
		return "ack", ""
	}
	return "retry", ""
}

// overDelivered reports whether d is past MaxDeliveries, with its
// x-delivery-count.
func (c *Consumer) overDelivered(d *amqp091.Delivery) (int64, bool) {
	if c.opts.MaxDeliveries < 0 {
		return 0, false
	}
	n := consReturns(d)
	return n, n > 0 && n >= int64(c.opts.MaxDeliveries)
}

// consReturns is how many deliveries of d's message were returned
// unsettled: its x-delivery-count, plus those of the earlier copies that
// waited for a held key (HeaderReturns).
func consReturns(d *amqp091.Delivery) int64 {
	n, _ := consHeaderInt(d.Headers[HeaderDeliveryCount])
	carried, _ := consHeaderInt(d.Headers[HeaderReturns])
	return max(n, 0) + max(carried, 0)
}

// settle settles a delivery whose chain did not return ActionAck (those go
// to the acker) on its own tag: a dead-letter or retry copy then an ack, or
// a nack with requeue.
func (c *Consumer) settle(hctx context.Context, s *consSession, d *amqp091.Delivery, msg *consumer.Message, r consumer.Result) settlement {
	if r.Action == consumer.ActionDeadLetter {
		return c.deadLetter(hctx, s, d, msg, r.Reason, r.Err)
	}
	// ActionRetry, and anything unknown.
	if hctx.Err() != nil || errors.Is(r.Err, errStopped) {
		// The shutdown timeout cut the handler short, or the stop came
		// before the handler started: not the message's fault, so no
		// attempt is spent; the broker redelivers it.
		return c.requeue(s, d)
	}
	var p amqp091.Publishing
	var delay time.Duration
	if consOwned(r) {
		// Another owner holds the key: the handler did not fail, so no
		// attempt is spent; the waits are bounded on their own.
		now := time.Now()
		waits, _ := consHeaderInt(d.Headers[HeaderWaits])
		since, ok := consHeaderInt(d.Headers[HeaderWaitingSince])
		if !ok || waits <= 0 {
			since = now.UnixMilli()
		}
		if waited := now.Sub(time.UnixMilli(since)); c.opts.MaxWait > 0 && waited > c.opts.MaxWait {
			return c.deadLetter(hctx, s, d, msg, ReasonWaitLimit,
				fmt.Errorf("the key was held by another owner for %v, on %d deliveries (MaxWait %v): %w",
					waited.Round(time.Millisecond), waits+1, c.opts.MaxWait, r.Err))
		}
		waits = min(max(waits, 0)+1, 1<<30)
		delay = c.retryDelay(int(waits), r.RetryAfter)
		p = c.copyOf(d, msg.Attempt)
		p.Headers[HeaderWaits] = int32(waits)
		p.Headers[HeaderWaitingSince] = since
		// A worker that died holding the key (its lease runs until it
		// expires) is what this copy may be waiting for: it keeps the
		// count of such deaths, or a message that kills every worker
		// would start from zero after each wait and never reach
		// MaxDeliveries.
		if n := consReturns(d); n > 0 {
			p.Headers[HeaderReturns] = n
		}
	} else {
		if msg.Attempt >= c.opts.MaxAttempts {
			err := r.Err
			if err == nil {
				err = errors.New("retry requested")
			}
			return c.deadLetter(hctx, s, d, msg, consumer.OutcomeRetriesExhausted,
				&consumer.RetriesExhaustedError{Attempts: msg.Attempt, Err: err})
		}
		delay = c.retryDelay(msg.Attempt, r.RetryAfter)
		p = c.copyOf(d, msg.Attempt+1)
	}
	p.Expiration = strconv.FormatInt(delay.Milliseconds(), 10)
	if r.Err != nil {
		p.Headers[consumer.HeaderError] = consTruncate(r.Err.Error())
	}
	if s.isDead() {
		return c.abandon()
	}
	if err := c.publishCopy(s, "", consRetryQueue(c.queue, delay), p); err != nil {
		return c.publishFailed(hctx, s, d, "retry queue", err)
	}
	out := c.ack(s, d)
	if out == settledAcked {
		c.stats.retried.Add(1)
		return settledRetried
	}
	return out
}

// consOwned reports whether r retries a message because another owner
// holds its key (in_flight, lease_lost): a wait, not a failure.
func consOwned(r consumer.Result) bool {
	return r.Reason == consumer.OutcomeInFlight || r.Reason == consumer.OutcomeLeaseLost
}

// retryDelay is the delay before the attempt after attempt: the Backoff's
// one, or the shortest of its delays that covers the hint (the longest
// when none does).
func (c *Consumer) retryDelay(attempt int, hint time.Duration) time.Duration {
	ds := c.delays
	d := ds[min(max(attempt, 1), len(ds))-1]
	if hint > d {
		d = c.delays[len(c.delays)-1]
		for _, x := range c.delays {
			if x >= hint {
				d = x
				break
			}
		}
	}
	return d
}

func (c *Consumer) deadLetter(hctx context.Context, s *consSession, d *amqp091.Delivery, msg *consumer.Message, reason consumer.Outcome, cause error) settlement {
	p := c.copyOf(d, msg.Attempt)
	p.MessageId = c.deadLetterID(d, msg)
	p.Headers[consumer.HeaderID] = p.MessageId
	p.Headers[consumer.HeaderReason] = string(reason)
	attempts := msg.Attempt
	if exhausted := (*consumer.RetriesExhaustedError)(nil); errors.As(cause, &exhausted) {
		attempts = max(attempts, exhausted.Attempts)
	}
	p.Headers[consumer.HeaderAttempts] = int32(min(attempts, 1<<30))
	if cause != nil {
		p.Headers[consumer.HeaderError] = consTruncate(cause.Error())
	}
	if s.isDead() {
		return c.abandon()
	}
	if err := c.publishCopy(s, c.opts.DeadLetterExchange, c.queue, p); err != nil {
		return c.publishFailed(hctx, s, d, "dead-letter exchange", err)
	}
	c.opts.Logger.LogAttrs(hctx, slog.LevelWarn, "amqp: message dead-lettered", slog.String("queue", c.queue),
		slog.String("message_id_hash", dedup.HashKey("", msg.ID)), slog.String("reason", string(reason)),
		slog.Int("attempt", msg.Attempt), slog.Any("err", cause))
	out := c.ack(s, d)
	if out == settledAcked {
		c.stats.deadLettered.Add(1)
		return settledDeadLettered
	}
	return out
}

// deadLetterID is the message id of d's dead letter, the same for every
// delivery of the same message: d's message-id; else the id it was
// handled under (from IDHeader); else "idem-dl-" and a digest of the work
// queue and of what the producer sent (exchange, routing key, properties,
// headers but the broker's delivery count, body).
func (c *Consumer) deadLetterID(d *amqp091.Delivery, msg *consumer.Message) string {
	if d.MessageId != "" {
		return d.MessageId
	}
	if msg.ID != "" && len(msg.ID) <= 255 {
		return msg.ID
	}
	h := sha256.New()
	headers := make(amqp091.Table, len(d.Headers))
	for k, v := range d.Headers {
		if k != HeaderDeliveryCount {
			headers[k] = v
		}
	}
	// fmt prints maps sorted by key: the same table, the same text.
	_, _ = fmt.Fprintf(h, "%q\x00%q\x00%q\x00%q %q %q %q %q %q %q %d %d\x00%v\x00", c.queue,
		msg.Metadata["exchange"], msg.Metadata["routing_key"],
		d.ContentType, d.ContentEncoding, d.CorrelationId, d.ReplyTo, d.Type, d.AppId, d.UserId,
		d.Priority, d.Timestamp.UnixNano(), headers)
	h.Write(d.Body)
	return "idem-dl-" + hex.EncodeToString(h.Sum(nil)[:16])
}

// publishFailed handles a copy that was not confirmed: the delivery goes
// back to the queue, after a pause so a broken publish path is not spun.
func (c *Consumer) publishFailed(hctx context.Context, s *consSession, d *amqp091.Delivery, where string, err error) settlement {
	if s.isDead() {
		return c.abandon()
	}
	c.opts.Logger.WarnContext(hctx, "amqp: publishing a copy failed; requeueing the delivery", "queue", c.queue, "to", where, "err", err)
	t := time.NewTimer(backoff.Spread(time.Second))
	defer t.Stop()
	select {
	case <-t.C:
	case <-s.dead:
	case <-hctx.Done():
	}
	if out := c.requeue(s, d); out != settledRequeued {
		return out
	}
	return settledUnpublished
}

// publishCopy publishes p, mandatory, on s's confirm channel and waits for
// the broker's confirm; a copy the broker returned is an error (see
// returnWatch).
func (c *Consumer) publishCopy(s *consSession, exchange, key string, p amqp091.Publishing) error {
	ctx, cancel := context.WithTimeout(context.Background(), c.opts.PublishTimeout)
	defer cancel()
	returned := s.returns.count(exchange, key)
	dc, err := s.pub.PublishWithDeferredConfirmWithContext(ctx, exchange, key, true, false, p)
	if err != nil {
		return err
	}
	if dc == nil {
		return errors.New("the channel is not in confirm mode")
	}
	acked, err := dc.WaitContext(ctx)
	if err != nil {
		return err
	}
	if !acked {
		return ErrUnconfirmed
	}
	if s.returns.count(exchange, key) != returned {
		return c.unroutable(s, exchange, key)
	}
	return nil
}

// copyOf is the publishing that carries d to a retry queue or the
// dead-letter exchange: same body, id and properties, headers kept, the
// attempt and origin set.
func (c *Consumer) copyOf(d *amqp091.Delivery, attempt int) amqp091.Publishing {
	h := make(amqp091.Table, len(d.Headers)+6)
	for k, v := range d.Headers {
		h[k] = v
	}
	// The count is the work queue's, of this delivery; a copy is a new
	// message there (and a replayed dead letter must not come back
	// poisoned).
	delete(h, HeaderDeliveryCount)
	delete(h, HeaderReturns)
	// A wait for a held key starts its clock afresh after a handler ran:
	// only wait copies carry its start (set by settle). HeaderWaits goes
	// on counting every wait of the message.
	delete(h, HeaderWaitingSince)
	h[HeaderAttempt] = int32(min(attempt, 1<<30))
	h[consumer.HeaderSource] = c.queue
	if _, ok := h[HeaderExchange]; !ok {
		h[HeaderExchange] = d.Exchange
		h[HeaderRoutingKey] = d.RoutingKey
	}
	mode := amqp091.Persistent
	if c.opts.NotDurable {
		mode = amqp091.Transient
	}
	return amqp091.Publishing{
		Headers:         h,
		ContentType:     d.ContentType,
		ContentEncoding: d.ContentEncoding,
		DeliveryMode:    mode,
		Priority:        d.Priority,
		CorrelationId:   d.CorrelationId,
		ReplyTo:         d.ReplyTo,
		MessageId:       d.MessageId,
		Timestamp:       d.Timestamp,
		Type:            d.Type,
		AppId:           d.AppId,
		Body:            d.Body,
	}
}

func (c *Consumer) ack(s *consSession, d *amqp091.Delivery) settlement {
	// The tag belongs to s's channel: on a dead
	// generation it must not, and cannot, be used.
	if s.isDead() {
		return c.abandon()
	}
	if err := s.ch.Ack(d.DeliveryTag, false); err != nil {
		return c.abandon()
	}
	return settledAcked
}

func (c *Consumer) requeue(s *consSession, d *amqp091.Delivery) settlement {
	if s.isDead() {
		return c.abandon()
	}
	if err := s.ch.Nack(d.DeliveryTag, false, true); err != nil {
		return c.abandon()
	}
	c.stats.requeued.Add(1)
	return settledRequeued
}

func (c *Consumer) abandon() settlement {
	c.stats.abandoned.Add(1)
	return settledAbandoned
}

// message maps a delivery to a consumer.Message (see NewMessage), with the
// connection generation in its Metadata; err is NewMessage's.
func (c *Consumer) message(d *amqp091.Delivery, gen uint64) (*consumer.Message, error) {
	msg, err := NewMessage(d, MessageOptions{IDHeader: c.opts.IDHeader, Queue: c.queue})
	msg.Metadata["channel_generation"] = strconv.FormatUint(gen, 10)
	return msg, err
}

func consHeaderString(v any) (string, bool) {
	switch x := v.(type) {
	case string:
		return x, true
	case []byte:
		return string(x), true
	}
	return "", false
}

func consHeaderInt(v any) (int64, bool) {
	switch x := v.(type) {
	case int8:
		return int64(x), true
	case int16:
		return int64(x), true
	case int32:
		return int64(x), true
	case int64:
		return x, true
	case int:
		return int64(x), true
	case uint8:
		return int64(x), true
	case uint16:
		return int64(x), true
	case uint32:
		return int64(x), true
	}
	return 0, false
}

func consTruncate(s string) string {
	const limit = 1024
	if len(s) <= limit {
		return s
	}
	return s[:limit] + "..."
}
