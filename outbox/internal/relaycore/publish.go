package relaycore

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"time"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/backoff"
	"github.com/idemkit/idem/outbox"
)

// PublishFailure is a Publish error for the whole batch: no attempt is
// counted, the relay waits and sends the batch again.
type PublishFailure struct {
	// Prefix starts the error text ("pgoutbox: ", or empty).
	Prefix string
	Err    error
}

func (e *PublishFailure) Error() string { return e.Prefix + "publish: " + e.Err.Error() }
func (e *PublishFailure) Unwrap() error { return e.Err }

// Publish hands msgs to pub. With tel it runs the call in the batch's
// producer span and records its duration; after, when not nil, runs once
// Publish returned (a test seam). It returns the per-message failures (nil
// when all went out) and the time Publish returned, or a *PublishFailure
// with prefix when the whole batch failed.
func Publish(ctx context.Context, tel *Telemetry, pub outbox.Publisher, msgs []*outbox.Message, prefix string,
	after func([]*outbox.Message, error)) (*outbox.PublishError, time.Time, error) {
	pctx, endSpan := ctx, func(error) {}
	if tel != nil {
		pctx, endSpan = tel.StartPublish(ctx, msgs)
	}
	start := time.Now()
	err := pub.Publish(pctx, msgs)
	end := time.Now()
	endSpan(err)
	if after != nil {
		after(msgs, err)
	}
	if tel != nil {
		tel.RecordPublish(ctx, end.Sub(start), err)
	}
	var pe *outbox.PublishError
	if err != nil && !errors.As(err, &pe) {
		return nil, end, &PublishFailure{Prefix: prefix, Err: err}
	}
	return pe, end, nil
}

// Failed reports whether message i of a batch failed by pe (nil: none
// did), and with what error: "not confirmed" when the publisher named none.
func Failed(pe *outbox.PublishError, i int) (bool, error) {
	if pe == nil {
		return false, nil
	}
	err, failed := pe.Failed[i]
	if failed && err == nil {
		err = errors.New("not confirmed")
	}
	return failed, err
}

// RetryDelay is the delay before the attempt after failed attempt n
// (1-based): base·2^(n-1), at most limit, ±20%.
func RetryDelay(b consumer.Backoff, n int) time.Duration {
	return backoff.Spread(b.Delay(n))
}

// Truncate cuts an error text for a last_error column: at most n bytes,
// valid UTF-8, no NUL (PostgreSQL text accepts neither).
func Truncate(s string, n int) string {
	if len(s) > n {
		s = s[:n]
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, ""), "\x00", "")
}

// DecodeHeaders reads a headers column. Enqueue writes string values only;
// other JSON values (written by hand) are kept as their JSON text.
func DecodeHeaders(js string) map[string]string {
	var h map[string]string
	if json.Unmarshal([]byte(js), &h) == nil {
		return h
	}
	var raw map[string]json.RawMessage
	if json.Unmarshal([]byte(js), &raw) != nil {
		return nil
	}
	h = make(map[string]string, len(raw))
	for k, v := range raw {
		var str string
		if json.Unmarshal(v, &str) == nil {
			h[k] = str
		} else {
			h[k] = string(v)
		}
	}
	return h
}
