package httpidem

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strconv"
	"time"
)

// Problem types (RFC 9457 "type" members) of the answers the middleware and
// the webhook handler write themselves. They are tag URIs (RFC 4151): stable
// identifiers to compare against, not links to dereference.
const (
	problemKeyMissing       = "tag:idemkit,2026:http/idempotency-key-missing"
	problemKeyInvalid       = "tag:idemkit,2026:http/idempotency-key-invalid"
	problemBodyTooLarge     = "tag:idemkit,2026:http/body-too-large"
	problemBodyUnreadable   = "tag:idemkit,2026:http/body-unreadable"
	problemKeyReused        = "tag:idemkit,2026:http/idempotency-key-reused"
	problemInProgress       = "tag:idemkit,2026:http/request-in-progress"
	problemStoreUnavailable = "tag:idemkit,2026:http/store-unavailable"
	problemResponseTooLarge = "tag:idemkit,2026:http/response-too-large"
	problemStoredUnreadable = "tag:idemkit,2026:http/stored-response-unreadable"
	problemSignatureInvalid = "tag:idemkit,2026:http/webhook-signature-invalid"
	problemEventIDMissing   = "tag:idemkit,2026:http/webhook-event-id-missing"
)

// contentTypeProblem is the media type of problem details (RFC 9457).
const contentTypeProblem = "application/problem+json"

// Problem is an RFC 9457 problem details object. The middleware answers with
// one, as application/problem+json, whenever it answers instead of the
// handler. It is also the error type of Middleware.Check: errors.As finds it.
type Problem struct {
	// Type identifies the kind of problem. The middleware and the webhook
	// handler write these tag URIs (RFC 4151), stable identifiers to
	// compare against: tag:idemkit,2026:http/ followed by
	// idempotency-key-missing, idempotency-key-invalid, body-too-large,
	// body-unreadable, idempotency-key-reused, request-in-progress,
	// store-unavailable, response-too-large, stored-response-unreadable,
	// webhook-signature-invalid or webhook-event-id-missing.
	Type string `json:"type"`
	// Title is a short summary of the kind of problem.
	Title string `json:"title"`
	// Status is the HTTP status code of the answer.
	Status int `json:"status"`
	// Detail explains this occurrence.
	Detail string `json:"detail,omitempty"`
	// RetryAfter, when positive, is sent as the Retry-After header,
	// rounded up to whole seconds.
	RetryAfter time.Duration `json:"-"`
}

func (p *Problem) Error() string {
	if p.Detail != "" {
		return fmt.Sprintf("httpidem: %d %s: %s", p.Status, p.Title, p.Detail)
	}
	return fmt.Sprintf("httpidem: %d %s", p.Status, p.Title)
}

func newProblem(status int, typ, title, detail string) *Problem {
	return &Problem{Type: typ, Title: title, Status: status, Detail: detail}
}

// body returns the JSON encoding of p.
func (p *Problem) body() []byte {
	b, err := json.Marshal(p)
	if err != nil { // cannot happen: strings and an int
		return []byte(`{"title":"problem"}`)
	}
	return append(b, '\n')
}

// WriteProblem writes p as application/problem+json with p.Status, and a
// Retry-After header when p.RetryAfter is positive.
func WriteProblem(w http.ResponseWriter, p *Problem) {
	h := w.Header()
	h.Set("Content-Type", contentTypeProblem)
	h.Set("Cache-Control", "no-store")
	if p.RetryAfter > 0 {
		h.Set("Retry-After", retryAfterSeconds(p.RetryAfter))
	}
	body := p.body()
	h.Set("Content-Length", strconv.Itoa(len(body)))
	w.WriteHeader(p.Status)
	_, _ = w.Write(body)
}

// retryAfterSeconds rounds d up to whole seconds, at least 1.
func retryAfterSeconds(d time.Duration) string {
	s := int64((d + time.Second - 1) / time.Second)
	if s < 1 {
		s = 1
	}
	return strconv.FormatInt(s, 10)
}
