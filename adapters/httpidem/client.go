package httpidem

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/backoff"
	"github.com/idemkit/idem/internal/defaults"
)

// Transport defaults.
const (
	defaultMaxAttempts = 5
	defaultMaxElapsed  = 30 * time.Second
)

// defaultBackoff is TransportOptions.Backoff's default.
var defaultBackoff = consumer.Backoff{Initial: 100 * time.Millisecond, Max: 5 * time.Second, Factor: 2}

// TransportOptions configure a Transport. The zero value is usable.
type TransportOptions struct {
	// Base sends each attempt. Defaults to http.DefaultTransport.
	Base http.RoundTripper
	// Methods are the methods whose requests get an Idempotency-Key when
	// they have none. Defaults to POST and PATCH.
	Methods []string
	// NewKey makes a key for an operation that has none. Defaults to a
	// random (version 4) UUID.
	NewKey func() string
	// BareKey sends a generated or context key as it is, instead of as a
	// Structured Field String ("quoted"), the IETF draft's form. Servers
	// that treat the header as opaque (most) accept either, as httpidem's
	// middleware does. Defaults to false.
	BareKey bool
	// MaxAttempts bounds the attempts of one request, the first included.
	// Defaults to 5.
	MaxAttempts int
	// MaxElapsed bounds the time from the first attempt to the start of
	// the last one; no retry starts (and no Retry-After is waited for)
	// past it. Defaults to 30s. The request's context
	// bounds everything too.
	MaxElapsed time.Duration
	// Backoff shapes the waits: before retry n (1, 2, ...) the Transport
	// sleeps a uniformly random time in [0, Backoff.Delay(n)] ("full
	// jitter"), or the server's Retry-After when that is longer. Defaults
	// to Initial 100ms, Max 5s, Factor 2.
	Backoff consumer.Backoff
}

// Transport is an http.RoundTripper that makes a non-idempotent request safe
// to retry: it gives each logical operation one Idempotency-Key and sends it
// on every attempt, and retries network errors, 409 (in progress), 429 and
// 5xx (but 501 and 505) with exponential backoff and full jitter, honouring
// Retry-After, within a bound on attempts and on total time.
//
// The key is, in this order: the request's own Idempotency-Key header; the
// key of its context (WithKey), which lets one operation span several
// RoundTrip calls (a retry loop above the client, a process that saved the
// key); or a new key, made once per RoundTrip call, for requests of
// Options.Methods. Requests of other methods that carry no key are retried
// only when their method is idempotent (GET, HEAD, OPTIONS, TRACE, PUT,
// DELETE).
//
// A response with Idempotent-Replayed: true is final and never retried: the
// server replays what it stored and will answer the same again. A request
// with a body must be replayable: its GetBody must be set, as
// http.NewRequest does for a *bytes.Buffer, *bytes.Reader or
// *strings.Reader body.
type Transport struct {
	opts TransportOptions
}

// NewTransport returns a Transport. It validates opts.
func NewTransport(opts TransportOptions) (*Transport, error) {
	c := defaults.New("httpidem: NewTransport: TransportOptions")
	c.Int("MaxAttempts", &opts.MaxAttempts, defaultMaxAttempts)
	c.Duration("MaxElapsed", &opts.MaxElapsed, defaultMaxElapsed)
	var err error
	opts.Backoff, err = opts.Backoff.WithDefaults(defaultBackoff)
	c.Wrap("Backoff", err)
	if err := c.Err(); err != nil {
		return nil, err
	}
	if opts.Base == nil {
		opts.Base = http.DefaultTransport
	}
	if opts.Methods == nil {
		opts.Methods = defaultMethods
	}
	opts.Methods = slices.Clone(opts.Methods)
	for _, m := range opts.Methods {
		if !isToken(m) {
			return nil, fmt.Errorf("httpidem: NewTransport: TransportOptions.Methods has %q, which is not an HTTP method token", m)
		}
	}
	if opts.NewKey == nil {
		opts.NewKey = uuid.NewString
	}
	return &Transport{opts: opts}, nil
}

type keyCtx struct{}

// WithKey returns a context whose requests through a Transport carry key as
// their Idempotency-Key (unless they set the header themselves). Use one
// key per logical operation, and the same key when the operation is tried
// again later.
func WithKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, keyCtx{}, key)
}

// keyFrom returns the key WithKey put in ctx, if any.
func keyFrom(ctx context.Context) (string, bool) {
	k, ok := ctx.Value(keyCtx{}).(string)
	return k, ok && k != ""
}

// quoteKey writes key as a Structured Field String when it can be one.
func quoteKey(key string) string {
	for i := 0; i < len(key); i++ {
		if c := key[i]; c < 0x20 || c > 0x7e {
			return key // not representable; send it as it is
		}
	}
	r := strings.NewReplacer(`\`, `\\`, `"`, `\"`)
	return `"` + r.Replace(key) + `"`
}

var idempotentMethods = []string{
	http.MethodGet, http.MethodHead, http.MethodOptions, http.MethodTrace, http.MethodPut, http.MethodDelete,
}

// RoundTrip implements http.RoundTripper.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	header := req.Header.Get(headerKey)
	if header == "" {
		key, ok := keyFrom(ctx)
		if !ok && slices.Contains(t.opts.Methods, req.Method) {
			key, ok = t.opts.NewKey(), true
		}
		if ok {
			header = key
			if !t.opts.BareKey {
				header = quoteKey(key)
			}
		}
	}
	retryable := header != "" || slices.Contains(idempotentMethods, req.Method)
	hasBody := req.Body != nil && req.Body != http.NoBody
	if retryable && hasBody && req.GetBody == nil {
		_ = req.Body.Close()
		return nil, fmt.Errorf("httpidem: Transport: the %s request to %s has a body but no GetBody, so it cannot be sent again; "+
			"build it with http.NewRequest from a *bytes.Reader, *bytes.Buffer or *strings.Reader, or set GetBody", req.Method, req.URL.Redacted())
	}

	start := time.Now()
	for attempt := 1; ; attempt++ {
		r := req.Clone(ctx)
		if header != "" {
			r.Header.Set(headerKey, header)
		}
		if attempt > 1 && hasBody {
			body, err := req.GetBody()
			if err != nil {
				return nil, fmt.Errorf("httpidem: Transport: GetBody: %w", err)
			}
			r.Body = body
		}
		resp, err := t.opts.Base.RoundTrip(r)
		if !retryable || attempt >= t.opts.MaxAttempts || !shouldRetry(ctx, resp, err) {
			return resp, err
		}
		delay := t.backoff(attempt)
		if resp != nil {
			if ra, ok := parseRetryAfter(resp.Header.Get("Retry-After"), time.Now()); ok && ra > delay {
				delay = ra
			}
		}
		if time.Since(start)+delay > t.opts.MaxElapsed {
			return resp, err // no time left for another attempt
		}
		if resp != nil {
			drain(resp.Body)
		}
		if !backoff.Sleep(ctx, delay) {
			return nil, fmt.Errorf("httpidem: Transport: %s %s: gave up after %d attempts: %w", req.Method, req.URL.Redacted(), attempt, context.Cause(ctx))
		}
	}
}

// backoff returns the full-jitter delay before retry n.
func (t *Transport) backoff(n int) time.Duration {
	return backoff.Full(t.opts.Backoff.Delay(n))
}

// shouldRetry says whether an attempt's outcome is worth another attempt.
func shouldRetry(ctx context.Context, resp *http.Response, err error) bool {
	if ctx.Err() != nil {
		return false
	}
	if err != nil {
		var (
			unknownAuthority x509.UnknownAuthorityError
			hostname         x509.HostnameError
			invalid          x509.CertificateInvalidError
			verification     *tls.CertificateVerificationError
		)
		if errors.As(err, &unknownAuthority) || errors.As(err, &hostname) || errors.As(err, &invalid) || errors.As(err, &verification) {
			return false
		}
		return true
	}
	if resp.Header.Get(headerReplayed) == "true" {
		return false
	}
	switch s := resp.StatusCode; s {
	case http.StatusConflict, http.StatusTooManyRequests:
		return true
	case http.StatusNotImplemented, http.StatusHTTPVersionNotSupported:
		return false
	default:
		return s >= 500 && s <= 599
	}
}

// parseRetryAfter reads a Retry-After value: delay-seconds or an HTTP-date.
func parseRetryAfter(v string, now time.Time) (time.Duration, bool) {
	v = strings.TrimSpace(v)
	if v == "" {
		return 0, false
	}
	if s, err := strconv.ParseInt(v, 10, 64); err == nil {
		if s < 0 {
			return 0, false
		}
		if s > 86400 {
			s = 86400
		}
		return time.Duration(s) * time.Second, true
	}
	if t, err := http.ParseTime(v); err == nil {
		return max(t.Sub(now), 0), true
	}
	return 0, false
}

// drain reads a little of a discarded body, so the connection can be
// reused, and closes it.
func drain(body io.ReadCloser) {
	_, _ = io.CopyN(io.Discard, body, 64<<10)
	_ = body.Close()
}
