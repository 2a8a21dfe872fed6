package httpidem

import (
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"time"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/defaults"
)

// Defaults of Options.
const (
	defaultMaxBodyBytes     = 1 << 20 // 1 MiB
	defaultMaxResponseBytes = 1 << 20 // 1 MiB
	defaultPollInterval     = 50 * time.Millisecond
	defaultRetryAfter       = time.Second
	defaultFinishTimeout    = 10 * time.Second
)

// defaultMethods are the methods that need a key by default: the ones that
// are not idempotent by definition.
var defaultMethods = []string{http.MethodPost, http.MethodPatch}

// defaultReplayHeaders are the response headers stored and replayed by
// default (see Options.ReplayHeaders).
var defaultReplayHeaders = []string{
	"Cache-Control", "Content-Encoding", "Content-Language", "Content-Location",
	"Content-Type", "ETag", "Last-Modified", "Link", "Location", "Vary",
}

// defaultStoreResponse is the default Options.StoreResponse.
func defaultStoreResponse(status int) bool {
	switch status {
	case http.StatusUnauthorized, http.StatusForbidden, http.StatusTooManyRequests:
		return false
	}
	return status >= 200 && status <= 599
}

// Options configure a Middleware. The zero value is usable; each field says
// its default.
type Options struct {
	// Methods are the request methods that go through the middleware and
	// need a key. Requests of other methods pass through untouched, a key
	// or not. Defaults to POST and PATCH.
	Methods []string
	// Optional lets a request without a key through to the handler, with
	// no deduplication, instead of answering 400. Defaults to false.
	Optional bool
	// MaxKeyLen limits the key, in bytes, after unquoting. Longer keys are
	// answered 400. Defaults to dedup.DefaultMaxKeyLen (255). Keep it at
	// or below the store's own limit.
	MaxKeyLen int
	// MaxBodyBytes limits the request body, which is read once, in full,
	// before the claim (to fingerprint it) and given to the handler from
	// memory. A larger body is answered 413 and nothing is stored.
	// Defaults to 1 MiB.
	MaxBodyBytes int64
	// MaxResponseBytes limits the response the handler writes; the
	// response is buffered until it is stored. When the handler writes
	// more, its Write returns ErrResponseTooLarge and the client gets a
	// 500 problem (problemResponseTooLarge) instead of the response. With
	// a transactional store the transaction rolls back, so nothing
	// happened and a retry runs again. With a lease store the handler's
	// effects may have happened outside any transaction, so the key is
	// not released: the 500 is stored and replayed, and the effect never
	// runs twice. Defaults to 1 MiB.
	MaxResponseBytes int
	// Principal returns who sends the request (a user, an API key, an
	// account), the first part of the key's scope, so that one client's
	// key never replays another's response. Defaults to none: all clients
	// share one key space, which is unsafe in a multi-tenant API (a key
	// one client guessed or reused returns another client's response).
	Principal func(r *http.Request) string
	// Route returns the route of the request, the last part of the key's
	// scope. Defaults to the ServeMux
	// pattern that matched (r.Pattern), or else the URL path.
	Route func(r *http.Request) string
	// Fingerprint returns the digest of the request; the same key with
	// another fingerprint is answered 422. Defaults to SHA-256 over the
	// method, the route, the request target (path and query, as sent) and
	// the body byte for byte, each part length-prefixed. The request target
	// is included because the route is usually a pattern: a key reused on
	// POST /payments/1/refunds and POST /payments/2/refunds (same pattern,
	// same body) is a conflict (422), not a replay of the wrong refund.
	// FingerprintJSON is the same digest with JSON formatting differences
	// ignored.
	Fingerprint func(r *http.Request, route string, body []byte) dedup.Fingerprint
	// StoreResponse decides from the status code whether a response is
	// stored and replayed. A response that is not stored releases the key
	// (transactional stores: rolls the transaction back), so a retry runs
	// the handler again. Defaults to the rule Stripe follows: every
	// response of a handler that started is stored, 2xx to 5xx, except
	// 401, 403 and 429, which say the request was refused before it did
	// anything (and 1xx, never final). Requests the middleware rejects
	// itself (400, 413, 422, 409) are never stored, nor are responses of a
	// handler that panicked or called Release.
	StoreResponse func(status int) bool
	// ReplayHeaders are the response headers stored with the response and
	// replayed. Defaults to those that describe the representation or the
	// created resource: Cache-Control, Content-Encoding, Content-Language,
	// Content-Location, Content-Type, ETag, Last-Modified, Link, Location
	// and Vary. Anything else (Set-Cookie, Date, tracing ids) is sent with
	// the first response only. To add one, list it with those.
	ReplayHeaders []string
	// Wait is how long a request whose key is in flight waits for the
	// first request to finish, polling the store every PollInterval, and
	// then answers with its response (or runs the handler, if the first
	// released the key). When Wait runs out the answer is 409. Defaults to
	// 0: answer 409 with Retry-After at once. With pgtable's transactional
	// store a concurrent duplicate never sees "in flight": it waits in
	// PostgreSQL until the first transaction ends (bounded by the request's
	// context and the session's lock_timeout, answered 409 when it fires).
	Wait time.Duration
	// PollInterval is how often a waiting request asks the store again.
	// Defaults to 50ms.
	PollInterval time.Duration
	// RetryAfter is the Retry-After sent with 409 and 503, rounded up to
	// whole seconds. Defaults to 1s.
	RetryAfter time.Duration
	// ExtendEvery is how often a lease is extended while the handler runs.
	// Defaults to a third of the lease's TTL; negative disables it. The
	// first extension comes between ExtendEvery/2 and ExtendEvery after
	// the claim, the later ones every ExtendEvery (one timer per
	// middleware serves every request in flight). Transactional stores
	// have no lease.
	ExtendEvery time.Duration
	// CancelWithClient gives the handler the request's own context, which
	// net/http cancels when the client goes away. Defaults to false: the
	// handler's context keeps the request's values but is not cancelled,
	// so a first request whose client timed out still finishes and stores
	// its response, and the client's retry gets it instead of a stored
	// failure (or, with a lease store, an effect that happened but was
	// recorded as failed). Bound slow handlers with their own timeouts.
	CancelWithClient bool
	// FinishTimeout bounds the store calls after the handler returned
	// (Complete, Release, and on pgtable the check of a commit whose reply
	// was lost); they run even if the client went away.
	// Defaults to 10s.
	FinishTimeout time.Duration
	// Telemetry: the middleware's metrics, spans, logs and outcome reports
	// (consumer's block, shared by every adapter).
	//
	// Logger receives warnings: store failures, lost leases. Keys appear
	// in it as their hash (dedup.Key.Hash), never raw, and neither the
	// principal nor the route does. Defaults to discarding them
	// (slog.DiscardHandler).
	//
	// OnOutcome, if set, is called once per request that went through the
	// middleware, with the request's context, for metrics (hits, misses,
	// waits). It must be fast and safe for concurrent use. The Report has
	// Key (the request's dedup key, when it has one), Status (the status
	// code sent; 0 after a panic), Waited (the time spent waiting for an
	// in-flight first request, Options.Wait) and Err (the store's or the
	// claim's error, the lost lease's, or leasekeep's panic error), and
	// Outcome:
	//
	//   - consumer.OutcomeCompleted: the handler ran and its response was
	//     stored (transactional stores: committed).
	//   - consumer.OutcomeDuplicate: a stored response was replayed.
	//   - consumer.OutcomeInFlight: 409, the first request with the key is
	//     still running (after Wait, if set).
	//   - consumer.OutcomeFingerprintMismatch: 422, the key was used with
	//     another request.
	//   - consumer.OutcomeInvalidKey: 400 or 413 before any claim (key
	//     missing or invalid, body too large or unreadable); nothing is
	//     stored.
	//   - consumer.OutcomeStoreError: 503 (500 for a stored response that
	//     cannot be decoded): the store failed, or a transaction did not
	//     commit; this request changed nothing, unless its commit's
	//     outcome is unknown.
	//   - consumer.OutcomeLeaseLost: the lease ran out while the handler
	//     ran; its response was sent but not stored.
	//   - consumer.OutcomeReleased: the handler ran but nothing is stored,
	//     so a retry runs it again: its response is not to be stored
	//     (StoreResponse, Release), it panicked (Err is the panic's
	//     marker; the panic goes on), or, with a transactional store, its
	//     response passed MaxResponseBytes (rolled back, 500).
	//   - consumer.OutcomeCompleteFailed: lease stores, the handler ran but
	//     its response could not be stored: Complete failed (the key stays
	//     in flight until its lease runs out), or the response passed
	//     MaxResponseBytes (the 500 is stored in its place).
	//   - consumer.OutcomePassed: Optional is set and the request had no
	//     key: the handler ran without deduplication.
	//
	// MeterProvider receives the middleware's metrics (see the package
	// documentation, "Metrics and traces"): idem.claims by outcome,
	// idem.claim.duration, idem.handler.duration, idem.lease.lost,
	// idem.lease.wait.duration, and idem.messages and
	// messaging.process.duration with messaging.system "http". Their
	// idem.scope (and messaging.destination.name) is MetricScope's value,
	// never the key's scope, which holds the principal. Defaults to
	// otel.GetMeterProvider(), a no-op until the application installs a
	// provider.
	//
	// TracerProvider starts the idem.claim, idem.handle and idem.complete
	// (transactional stores: idem.commit) spans as children of the
	// request's span, when it records one (under otelhttp, say); the
	// handler runs under idem.handle. Spans carry the key's hash, never
	// the key. Defaults to otel.GetTracerProvider().
	consumer.Telemetry

	// MetricScope returns the idem.scope attribute of a request's
	// metrics. It must take few values, such as route templates, and never
	// hold a principal, a key or a raw path (/payments/123 would make one
	// time series per payment). Defaults to the
	// ServeMux pattern, or the method alone when the middleware runs
	// before the mux matched a route; set it to your router's route
	// template then.
	MetricScope func(r *http.Request) string
	// StoreName is the idem.store metric attribute. Defaults to the
	// store's package name: memstore, pgtable, redisnx, twolevel.
	StoreName string
}

// defaultMetricScope is the default Options.MetricScope: the pattern that
// matched the request in a Go 1.22+ http.ServeMux (r.Pattern, such as "POST
// /payments/{id}/refunds"), or the method when there is none. Unlike
// the default Route it never falls back to the path, which is unbounded.
func defaultMetricScope(r *http.Request) string {
	if r.Pattern != "" {
		return r.Pattern
	}
	return r.Method
}

// outcome says what the middleware did with a request: the idem.messages
// result and the wait outcome are derived from it, and it maps to the
// consumer.Outcome of Options.OnOutcome.
type outcome string

const (
	outcomePassed         outcome = "passed"          // optional key absent: the handler ran without deduplication
	outcomeRejected       outcome = "rejected"        // 400 or 413 before the claim; nothing stored
	outcomeProcessed      outcome = "processed"       // the handler ran and its response was stored
	outcomeCompleteFailed outcome = "complete_failed" // lease stores: the handler ran, storing its response failed
	outcomeNotStored      outcome = "not_stored"      // the handler ran; the response was not stored and the key released
	outcomeReplayed       outcome = "replayed"        // a stored response was replayed
	outcomeInFlight       outcome = "in_flight"       // 409: the first request is still running
	outcomeMismatch       outcome = "mismatch"        // 422: same key, other request
	outcomeStoreError     outcome = "store_error"     // 503 (or 500): the store failed; nothing stored
	outcomeLeaseLost      outcome = "lease_lost"      // the lease ran out while the handler ran; not stored
	outcomePanicked       outcome = "panicked"        // the handler panicked; key released, panic re-raised
	outcomeTooLarge       outcome = "too_large"       // the response passed MaxResponseBytes
)

// public is the consumer.Outcome reported for o (see Options.OnOutcome).
// tx says the middleware is transactional.
func (o outcome) public(tx bool) consumer.Outcome {
	switch o {
	case outcomePassed:
		return consumer.OutcomePassed
	case outcomeRejected:
		return consumer.OutcomeInvalidKey
	case outcomeProcessed:
		return consumer.OutcomeCompleted
	case outcomeReplayed:
		return consumer.OutcomeDuplicate
	case outcomeInFlight:
		return consumer.OutcomeInFlight
	case outcomeMismatch:
		return consumer.OutcomeFingerprintMismatch
	case outcomeLeaseLost:
		return consumer.OutcomeLeaseLost
	case outcomeCompleteFailed:
		return consumer.OutcomeCompleteFailed
	case outcomeTooLarge:
		if !tx {
			// The handler's effects stand; its response is replaced
			// by the stored 500.
			return consumer.OutcomeCompleteFailed
		}
		return consumer.OutcomeReleased
	case outcomeNotStored, outcomePanicked:
		return consumer.OutcomeReleased
	}
	return consumer.OutcomeStoreError
}

// fillLists checks Methods and ReplayHeaders and fills in their defaults.
func (o *Options) fillLists(who string) error {
	if o.Methods == nil {
		o.Methods = defaultMethods
	}
	o.Methods = slices.Clone(o.Methods)
	if len(o.Methods) == 0 {
		return fmt.Errorf("httpidem: %s: Options.Methods is empty; leave it nil for POST and PATCH", who)
	}
	for _, m := range o.Methods {
		if !isToken(m) {
			return fmt.Errorf("httpidem: %s: Options.Methods has %q, which is not an HTTP method token", who, m)
		}
	}
	if o.ReplayHeaders == nil {
		o.ReplayHeaders = defaultReplayHeaders
	}
	names := make([]string, 0, len(o.ReplayHeaders))
	for _, h := range o.ReplayHeaders {
		if !isToken(h) {
			return fmt.Errorf("httpidem: %s: Options.ReplayHeaders has %q, which is not a header name", who, h)
		}
		names = append(names, http.CanonicalHeaderKey(h))
	}
	o.ReplayHeaders = names
	return nil
}

func (o *Options) fill(who string) error {
	c := defaults.New("httpidem: " + who + ": Options")
	c.NotNegative("Wait", o.Wait)
	c.Duration("PollInterval", &o.PollInterval, defaultPollInterval)
	c.Duration("RetryAfter", &o.RetryAfter, defaultRetryAfter)
	c.Duration("FinishTimeout", &o.FinishTimeout, defaultFinishTimeout)
	c.Int("MaxKeyLen", &o.MaxKeyLen, dedup.DefaultMaxKeyLen)
	c.Int64("MaxBodyBytes", &o.MaxBodyBytes, defaultMaxBodyBytes)
	c.Int("MaxResponseBytes", &o.MaxResponseBytes, defaultMaxResponseBytes)
	if err := c.Err(); err != nil {
		return err
	}
	if err := o.fillLists(who); err != nil {
		return err
	}
	if o.Principal == nil {
		o.Principal = func(*http.Request) string { return "" }
	}
	if o.Route == nil {
		o.Route = defaultRoute
	}
	if o.Fingerprint == nil {
		o.Fingerprint = requestFingerprint
	}
	if o.StoreResponse == nil {
		o.StoreResponse = defaultStoreResponse
	}
	if o.Logger == nil {
		o.Logger = slog.New(slog.DiscardHandler)
	}
	if o.MetricScope == nil {
		o.MetricScope = defaultMetricScope
	}
	return nil
}
