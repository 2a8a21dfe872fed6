package idemnats

import (
	"cmp"
	"errors"
	"strconv"
	"strings"

	"github.com/nats-io/nats.go"

	"github.com/idemkit/idem/consumer"
)

// Headers added to a dead-lettered copy; the package doc lists them. The
// copy keeps the message's payload and headers, except its Nats-Msg-Id,
// which is replaced by HeaderID's value (the original one is kept in
// HeaderMessageID), and headers with the "idem-dlq-" prefix from an
// earlier dead-lettering, which are replaced. Reason, error, attempts and
// id are consumer's names, the same on every adapter.
const (
	// headerDeadLetter is the prefix of every dead-letter header.
	headerDeadLetter = "idem-dlq-"
	// HeaderReason is the consumer.Outcome: permanent, panic,
	// fingerprint_mismatch, invalid_key, retries_exhausted or
	// redelivery_limit.
	HeaderReason = consumer.HeaderReason
	// HeaderError is the error's text, cut at 4 KiB.
	HeaderError = consumer.HeaderError
	// HeaderAttempts is the message's delivery count (NumDelivered) when
	// it was dead-lettered, or the attempts of a consumer.Retry
	// middleware that gave up when that is more.
	HeaderAttempts = consumer.HeaderAttempts
	// HeaderSubject, HeaderStream and HeaderSequence locate the original
	// message: its subject, its stream and its sequence there.
	HeaderSubject  = "idem-dlq-subject"
	HeaderStream   = "idem-dlq-stream"
	HeaderSequence = "idem-dlq-sequence"
	// HeaderConsumer is the durable consumer that dead-lettered it.
	HeaderConsumer = "idem-dlq-consumer"
	// HeaderMessageID is the original message's Nats-Msg-Id, when it had
	// one.
	HeaderMessageID = "idem-dlq-message-id"
	// HeaderID is the dead letter's own id, "<stream>/<durable>/<stream
	// sequence>" of the original message, also sent as the copy's
	// Nats-Msg-Id: the same each time that message is dead-lettered by
	// that durable consumer. A message can be dead-lettered twice (the
	// worker died after the copy was stored and before Term reached the
	// server); JetStream drops the second copy when it comes within the
	// dead-letter stream's duplicate window, and a reader of the
	// dead-letter stream deduplicates on it with idem otherwise (its
	// Nats-Msg-Id is the id a Consumer of that stream takes).
	HeaderID = consumer.HeaderID
)

const maxErrorHeader = 4 << 10

// deadLetterID is the id of d's dead letter.
func (c *Consumer) deadLetterID(d *delivery) string {
	return c.stream + "/" + c.durable + "/" + seqString(d.md)
}

// deadLetterMsg is the copy of d that goes to the dead-letter subject.
func (c *Consumer) deadLetterMsg(d *delivery, res consumer.Result) *nats.Msg {
	hdr := nats.Header{}
	for k, vs := range d.m.Headers() {
		if strings.HasPrefix(k, headerDeadLetter) || k == nats.MsgIdHdr {
			continue
		}
		hdr[k] = append([]string(nil), vs...)
	}
	if id := d.m.Headers().Get(nats.MsgIdHdr); id != "" {
		hdr.Set(HeaderMessageID, id)
	}
	errText := ""
	if res.Err != nil {
		errText = res.Err.Error()
		if len(errText) > maxErrorHeader {
			errText = errText[:maxErrorHeader]
		}
	}
	attempts := int(min(d.n, 1<<30))
	var exhausted *consumer.RetriesExhaustedError
	if errors.As(res.Err, &exhausted) {
		attempts = max(attempts, exhausted.Attempts)
	}
	id := c.deadLetterID(d)
	hdr.Set(HeaderReason, string(cmp.Or(res.Reason, consumer.OutcomePermanent)))
	hdr.Set(HeaderError, errText)
	hdr.Set(HeaderAttempts, strconv.Itoa(attempts))
	hdr.Set(HeaderSubject, d.m.Subject())
	hdr.Set(HeaderStream, c.stream)
	hdr.Set(HeaderSequence, seqString(d.md))
	hdr.Set(HeaderConsumer, c.durable)
	hdr.Set(HeaderID, id)
	hdr.Set(nats.MsgIdHdr, id)
	return &nats.Msg{Subject: c.opts.DeadLetterSubject, Data: d.m.Data(), Header: hdr}
}
