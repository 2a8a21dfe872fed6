package httpidem

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/defaults"
	"github.com/idemkit/idem/internal/leasekeep"
)

// Webhook signature errors. A WebhookOptions.Verify function returns one of
// the two exported ones (wrapped) to have the request answered 400 rather
// than 401.
var (
	ErrSignatureMissing   = errors.New("httpidem: webhook signature header missing")
	ErrSignatureMalformed = errors.New("httpidem: webhook signature header malformed")
	errSignatureMismatch  = errors.New("httpidem: webhook signature does not match")
	errSignatureStale     = errors.New("httpidem: webhook timestamp outside the tolerance")
)

// Webhook defaults.
const (
	defaultSignatureHeader  = "Webhook-Signature"
	defaultSignatureVersion = "v1"
	defaultEventIDHeader    = "Webhook-Id"
	defaultTolerance        = 5 * time.Minute
	maxSignatures           = 32
)

// WebhookOptions configure a Webhook. Secrets is required.
type WebhookOptions struct {
	// Secrets are the signing secrets a signature may be made with; a
	// request is accepted when its signature matches any of them, so a
	// secret can be rotated by adding the new one before the provider
	// switches and removing the old one after. Required (unless Verify is
	// set).
	Secrets [][]byte
	// SignatureHeader is the header that carries the signature, in the
	// form "t=<unix seconds>,<version>=<hex>[,<version>=<hex>...]": the
	// HMAC-SHA256, with a secret, of the timestamp, a '.', and the raw
	// body (Stripe's scheme). Defaults to "Webhook-Signature".
	SignatureHeader string
	// SignatureVersion is the name of the signature items to check in the
	// header; items of other names are ignored. Defaults to "v1".
	SignatureVersion string
	// Tolerance is how far the signed timestamp may be from now, either
	// way, so a captured request cannot be replayed later. Defaults to
	// 5 minutes.
	Tolerance time.Duration
	// Verify, if set, replaces the built-in signature check, for providers
	// with another scheme. It gets the raw body and returns nil for an
	// authentic request, or an error (wrapping ErrSignatureMissing or
	// ErrSignatureMalformed for a 400, anything else for a 401).
	Verify func(r *http.Request, body []byte) error
	// EventID returns the provider's event id, the dedup key, from a
	// verified request. Defaults to the Webhook-Id header;
	// EventIDJSON reads a member of a JSON body.
	EventID func(r *http.Request, body []byte) (string, error)
	// Scope names the sender, so two providers' ids never collide.
	// Defaults to "webhook:" and the route (the ServeMux pattern, or the
	// URL path).
	Scope string
	// Clock tells the time for the tolerance check. Defaults to the wall
	// clock (time.Now).
	Clock dedup.Clock
	// Options are the deduplication settings. Methods defaults to POST
	// only and StoreResponse to 2xx only: a failed delivery releases the
	// event id, so the provider's own retry runs the handler again, and a
	// duplicate is always answered with the stored 2xx, so the provider
	// stops retrying. Optional, Principal, Route and Fingerprint do not
	// apply: the key is the event id, the fingerprint the body.
	Options Options
}

// Webhook receives signed webhooks and runs each event once. The signature
// is verified before the event id is claimed: a forged request with a real
// event id is refused without a claim, so it cannot block the real event.
type Webhook struct {
	m    *Middleware
	opts WebhookOptions
}

// NewWebhook returns a Webhook that deduplicates events on a lease store.
func NewWebhook(store dedup.LeaseStore, opts WebhookOptions) (*Webhook, error) {
	if store == nil {
		return nil, errors.New("httpidem: NewWebhook: store is nil; pass a dedup.LeaseStore")
	}
	wh, err := newWebhook("NewWebhook", opts)
	if err != nil {
		return nil, err
	}
	wh.m.lease = store
	wh.m.keeper = leasekeep.New(store, wh.m.opts.Logger, "httpidem")
	wh.m.setTelemetry(store)
	return wh, nil
}

// NewWebhookTx returns a Webhook that deduplicates events on a
// transactional store (see NewTx): the handler's writes through
// Tx[T](r.Context()) commit with the event's claim.
func NewWebhookTx[Tx any](store dedup.TxStore[Tx], opts WebhookOptions) (*Webhook, error) {
	if store == nil {
		return nil, errors.New("httpidem: NewWebhookTx: store is nil; pass a *pgtable.Store or a *sqltable.Store")
	}
	wh, err := newWebhook("NewWebhookTx", opts)
	if err != nil {
		return nil, err
	}
	wh.m.tx = eraseTx(store)
	wh.m.setTelemetry(store)
	return wh, nil
}

func newWebhook(who string, opts WebhookOptions) (*Webhook, error) {
	if opts.Verify == nil && len(opts.Secrets) == 0 {
		return nil, fmt.Errorf("httpidem: %s: WebhookOptions.Secrets is empty; pass the provider's signing secret(s) or set Verify", who)
	}
	for i, s := range opts.Secrets {
		if len(s) == 0 {
			return nil, fmt.Errorf("httpidem: %s: WebhookOptions.Secrets[%d] is empty", who, i)
		}
	}
	c := defaults.New("httpidem: " + who + ": WebhookOptions")
	c.Duration("Tolerance", &opts.Tolerance, defaultTolerance)
	if err := c.Err(); err != nil {
		return nil, err
	}
	if opts.SignatureHeader == "" {
		opts.SignatureHeader = defaultSignatureHeader
	}
	if !isToken(opts.SignatureHeader) {
		return nil, fmt.Errorf("httpidem: %s: WebhookOptions.SignatureHeader %q is not a header name", who, opts.SignatureHeader)
	}
	if opts.SignatureVersion == "" {
		opts.SignatureVersion = defaultSignatureVersion
	}
	if !isToken(opts.SignatureVersion) || strings.ContainsAny(opts.SignatureVersion, "=,") || opts.SignatureVersion == "t" {
		return nil, fmt.Errorf("httpidem: %s: WebhookOptions.SignatureVersion %q is not a valid item name", who, opts.SignatureVersion)
	}
	if opts.Scope != "" {
		if err := dedup.ValidateKey(dedup.Key{Scope: opts.Scope, ID: "x"}, 0); err != nil {
			return nil, fmt.Errorf("httpidem: %s: WebhookOptions.Scope: %w", who, err)
		}
	}
	if opts.EventID == nil {
		opts.EventID = func(r *http.Request, _ []byte) (string, error) {
			return r.Header.Get(defaultEventIDHeader), nil
		}
	}
	if opts.Clock == nil {
		opts.Clock = wallClock{}
	}
	mo := opts.Options
	if mo.Methods == nil {
		mo.Methods = []string{http.MethodPost}
	}
	if mo.StoreResponse == nil {
		mo.StoreResponse = func(status int) bool { return status >= 200 && status <= 299 }
	}
	if mo.MetricScope == nil {
		mo.MetricScope = func(r *http.Request) string {
			switch {
			case opts.Scope != "":
				return opts.Scope
			case r.Pattern != "":
				return r.Pattern
			}
			return "webhook"
		}
	}
	if err := mo.fill(who); err != nil {
		return nil, err
	}
	opts.Options = mo
	wh := &Webhook{opts: opts, m: &Middleware{opts: mo}}
	wh.m.check = wh.Check
	return wh, nil
}

// Handler returns next wrapped in the webhook check and deduplication.
func (wh *Webhook) Handler(next http.Handler) http.Handler { return wh.m.Handler(next) }

// Check is the webhook's check on its own: it reads the body (bounded,
// and puts it back), verifies the signature, and returns the event's dedup
// key. It returns ErrNoKey for a method that is not deduplicated, and a
// *Problem otherwise: 413 for a large body, 400 for a missing or malformed
// signature or event id, 401 for a signature that does not match or a
// stale timestamp. Nothing is claimed.
func (wh *Webhook) Check(r *http.Request) (dedup.Key, error) {
	o := &wh.opts
	if !wh.m.handles(r.Method) {
		return dedup.Key{}, ErrNoKey
	}
	body, p := readBody(r, o.Options.MaxBodyBytes)
	if p != nil {
		return dedup.Key{}, p
	}
	var err error
	if o.Verify != nil {
		err = o.Verify(r, body)
	} else {
		err = verifySignature(r.Header.Get(o.SignatureHeader), o.SignatureVersion, body, o.Secrets, o.Clock.Now(), o.Tolerance)
	}
	if err != nil {
		status := http.StatusUnauthorized
		if errors.Is(err, ErrSignatureMissing) || errors.Is(err, ErrSignatureMalformed) {
			status = http.StatusBadRequest
		}
		return dedup.Key{}, newProblem(status, problemSignatureInvalid, "Webhook signature invalid", err.Error())
	}
	id, err := o.EventID(r, body)
	if err == nil && id == "" {
		err = errors.New("the event id is empty")
	}
	if err == nil {
		err = dedup.ValidateKey(dedup.Key{Scope: "x", ID: id}, o.Options.MaxKeyLen)
	}
	if err != nil {
		return dedup.Key{}, newProblem(http.StatusBadRequest, problemEventIDMissing, "Webhook event id missing or invalid", err.Error())
	}
	scope := o.Scope
	if scope == "" {
		scope = "webhook:" + defaultRoute(r)
		if dedup.ValidateKey(dedup.Key{Scope: scope, ID: "x"}, 0) != nil {
			scope = keyScope("", "webhook", defaultRoute(r), dedup.DefaultMaxKeyLen)
		}
	}
	return dedup.Key{Scope: scope, ID: id, Fingerprint: dedup.FingerprintOf(body)}, nil
}

// EventIDJSON returns a WebhookOptions.EventID that reads the top-level
// string member name of a JSON body, such as "id" for Stripe events.
func EventIDJSON(name string) func(r *http.Request, body []byte) (string, error) {
	return func(_ *http.Request, body []byte) (string, error) {
		var obj map[string]json.RawMessage
		if err := json.Unmarshal(body, &obj); err != nil {
			return "", fmt.Errorf("the body is not a JSON object: %w", err)
		}
		raw, ok := obj[name]
		if !ok {
			return "", fmt.Errorf("the body has no %q member", name)
		}
		var id string
		if err := json.Unmarshal(raw, &id); err != nil {
			return "", fmt.Errorf("member %q is not a string", name)
		}
		return id, nil
	}
}

// SignWebhook returns a signature header value for body sent at t, as a
// provider would: "t=<unix>,v1=<hex of HMAC-SHA256(secret, "<unix>." + body)>".
// Tests and senders use it; receivers use NewWebhook or NewWebhookTx.
func SignWebhook(secret []byte, t time.Time, body []byte) string {
	ts := strconv.FormatInt(t.Unix(), 10)
	return "t=" + ts + "," + defaultSignatureVersion + "=" + hex.EncodeToString(signature(secret, ts, body))
}

func signature(secret []byte, ts string, body []byte) []byte {
	mac := hmac.New(sha256.New, secret)
	mac.Write([]byte(ts))
	mac.Write([]byte{'.'})
	mac.Write(body)
	return mac.Sum(nil)
}

// parseSignature parses a signature header value of the form
// "t=<unix seconds>,<version>=<hex>[,<version>=<hex>...]". Items are
// separated by commas, with optional spaces around them; items of other
// names are ignored; "t" must appear once, as decimal digits. It returns
// the timestamp as written (for the signed payload), its value, and the
// SHA-256-sized signatures of the given version, at least one.
func parseSignature(header, version string) (ts string, unix int64, sigs [][]byte, err error) {
	if strings.TrimSpace(header) == "" {
		return "", 0, nil, ErrSignatureMissing
	}
	items := strings.Split(header, ",")
	if len(items) > 2*maxSignatures {
		return "", 0, nil, fmt.Errorf("%w: %d items", ErrSignatureMalformed, len(items))
	}
	for _, item := range items {
		item = strings.Trim(item, " \t")
		name, value, ok := strings.Cut(item, "=")
		if !ok {
			return "", 0, nil, fmt.Errorf("%w: item %q has no '='", ErrSignatureMalformed, item)
		}
		switch name {
		case "t":
			if ts != "" {
				return "", 0, nil, fmt.Errorf("%w: more than one timestamp", ErrSignatureMalformed)
			}
			if value == "" || len(value) > 18 || strings.Trim(value, "0123456789") != "" {
				return "", 0, nil, fmt.Errorf("%w: timestamp %q is not a number of seconds", ErrSignatureMalformed, value)
			}
			unix, _ = strconv.ParseInt(value, 10, 64) // at most 18 digits: cannot overflow
			ts = value
		case version:
			sig, herr := hex.DecodeString(value)
			if herr != nil || len(sig) != sha256.Size {
				return "", 0, nil, fmt.Errorf("%w: %s signature is not %d hex-encoded bytes", ErrSignatureMalformed, version, sha256.Size)
			}
			if len(sigs) == maxSignatures {
				return "", 0, nil, fmt.Errorf("%w: more than %d signatures", ErrSignatureMalformed, maxSignatures)
			}
			sigs = append(sigs, sig)
		}
	}
	if ts == "" {
		return "", 0, nil, fmt.Errorf("%w: no timestamp (t=)", ErrSignatureMalformed)
	}
	if len(sigs) == 0 {
		return "", 0, nil, fmt.Errorf("%w: no %s signature", ErrSignatureMalformed, version)
	}
	return ts, unix, sigs, nil
}

// verifySignature checks a signature header value,
// "t=<unix seconds>,<version>=<hex>[,<version>=<hex>...]" (items of other
// names are ignored; "t" must appear once, as decimal digits), against body: the timestamp must be within tolerance of now, either way,
// and one of the signatures must equal HMAC-SHA256(secret, ts + "." + body)
// for one of the secrets, compared in constant time. The timestamp is
// checked first, so a stale request costs no HMAC.
func verifySignature(header, version string, body []byte, secrets [][]byte, now time.Time, tolerance time.Duration) error {
	ts, unix, sigs, err := parseSignature(header, version)
	if err != nil {
		return err
	}
	age := now.Sub(time.Unix(unix, 0))
	if age > tolerance || age < -tolerance {
		return fmt.Errorf("%w: signed at %s, %v from now (tolerance %v)", errSignatureStale,
			time.Unix(unix, 0).UTC().Format(time.RFC3339), age.Round(time.Second), tolerance)
	}
	for _, secret := range secrets {
		want := signature(secret, ts, body)
		for _, sig := range sigs {
			if hmac.Equal(want, sig) {
				return nil
			}
		}
	}
	return errSignatureMismatch
}

// wallClock is the default Clock: time.Now.
type wallClock struct{}

func (wallClock) Now() time.Time { return time.Now() }
