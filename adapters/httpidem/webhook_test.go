package httpidem_test

import (
	"context"
	"errors"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/idemkit/idem/adapters/httpidem"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/internal/testkit/clocktest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

var (
	oldSecret = []byte("whsec_old_0123456789")
	newSecret = []byte("whsec_new_9876543210")
)

// event is a delivery as the provider sends it.
type event struct {
	id, body  string
	signature string
}

func signed(id, body string, secret []byte, at time.Time) event {
	return event{id: id, body: body, signature: httpidem.SignWebhook(secret, at, []byte(body))}
}

func deliver(t *testing.T, url string, e event) response {
	t.Helper()
	h := map[string]string{defaultEventIDHeader: e.id}
	if e.signature != "" {
		h[defaultSignatureHeader] = e.signature
	}
	return do(t, nil, url, req{path: "/webhooks/provider", body: e.body, header: h})
}

// webhookEnv is a webhook endpoint whose handler counts events.
type webhookEnv struct {
	url   string
	calls atomic.Int64
	fail  atomic.Bool // the handler answers 500
}

func newWebhookEnv(t *testing.T, store dedup.LeaseStore, clock dedup.Clock) *webhookEnv {
	t.Helper()
	env := &webhookEnv{}
	wh, err := httpidem.NewWebhook(store, httpidem.WebhookOptions{
		Secrets: [][]byte{oldSecret, newSecret}, // rotation: both are valid
		Clock:   clock,
	})
	if err != nil {
		t.Fatal(err)
	}
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		env.calls.Add(1)
		if env.fail.Load() {
			http.Error(w, "downstream unavailable", http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write([]byte(`{"received":true}`))
	})
	env.url = quietServer(t, wh.Handler(h)).URL
	return env
}

func TestWebhook(t *testing.T) {
	t.Parallel()
	now := time.Unix(1_760_000_000, 0)
	clock := clocktest.NewManual(now)
	store := newMem(t, memstore.Options{})
	env := newWebhookEnv(t, store, clock)
	body := `{"id":"evt_1","type":"payment.succeeded"}`

	t.Run("valid then replayed", func(t *testing.T) {
		r := deliver(t, env.url, signed("evt_1", body, oldSecret, now))
		if r.status != http.StatusOK || r.replayed() {
			t.Fatalf("first delivery: %d %s", r.status, r.body)
		}
		// The provider redelivers (a new signature, a later timestamp,
		// signed with the rotated secret): answered 2xx, not run again.
		clock.Advance(time.Minute)
		r = deliver(t, env.url, signed("evt_1", body, newSecret, clock.Now()))
		if r.status != http.StatusOK || !r.replayed() {
			t.Fatalf("redelivery: %d replayed=%v", r.status, r.replayed())
		}
		if env.calls.Load() != 1 {
			t.Fatalf("handler ran %d times", env.calls.Load())
		}
	})
	t.Run("refused before the claim", func(t *testing.T) {
		before := store.Len()
		good := signed("evt_2", body, oldSecret, clock.Now())
		for _, tc := range []struct {
			name   string
			e      event
			status int
		}{
			{"bad signature", signed("evt_2", body, []byte("not the secret"), clock.Now()), http.StatusUnauthorized},
			{"body tampered", event{"evt_2", body + " ", good.signature}, http.StatusUnauthorized},
			{"stale timestamp", signed("evt_2", body, oldSecret, clock.Now().Add(-6*time.Minute)), http.StatusUnauthorized},
			{"from the future", signed("evt_2", body, oldSecret, clock.Now().Add(6*time.Minute)), http.StatusUnauthorized},
			{"no signature", event{"evt_2", body, ""}, http.StatusBadRequest},
			{"malformed signature", event{"evt_2", body, "v1=abc"}, http.StatusBadRequest},
			{"no event id", signed("", body, oldSecret, clock.Now()), http.StatusBadRequest},
		} {
			r := deliver(t, env.url, tc.e)
			if r.status != tc.status {
				t.Fatalf("%s: %d, want %d (%s)", tc.name, r.status, tc.status, r.body)
			}
			r.problem(t)
		}
		if store.Len() != before || env.calls.Load() != 1 {
			t.Fatalf("a refused delivery claimed (%d → %d entries) or ran (%d calls)", before, store.Len(), env.calls.Load())
		}
	})
	t.Run("failed delivery is retried by the provider", func(t *testing.T) {
		env.fail.Store(true)
		if r := deliver(t, env.url, signed("evt_3", body, oldSecret, clock.Now())); r.status != http.StatusInternalServerError {
			t.Fatalf("failing handler: %d", r.status)
		}
		env.fail.Store(false)
		if r := deliver(t, env.url, signed("evt_3", body, oldSecret, clock.Now())); r.status != http.StatusOK || r.replayed() {
			t.Fatalf("provider's retry: %d replayed=%v", r.status, r.replayed())
		}
	})
}

// A forged request that reuses a real event id is refused without a claim,
// so the real event, arriving after it, is processed. On Redis.
func TestWebhookForgedIDDoesNotBlockRealEvent(t *testing.T) {
	t.Parallel()
	prefix := testenv.Name("httpidemwh")
	env := newWebhookEnv(t, redisStore(t, prefix), nil)
	body := `{"id":"evt_real","amount":100}`
	forged := signed("evt_real", `{"id":"evt_real","amount":1}`, []byte("attacker's guess"), time.Now())
	for range 3 {
		if r := deliver(t, env.url, forged); r.status != http.StatusUnauthorized {
			t.Fatalf("forged: %d", r.status)
		}
	}
	// Even a forged request with the real body and a lifted old signature
	// fails: its timestamp is out of tolerance.
	lifted := signed("evt_real", body, oldSecret, time.Now().Add(-time.Hour))
	if r := deliver(t, env.url, lifted); r.status != http.StatusUnauthorized {
		t.Fatalf("replayed old signature: %d", r.status)
	}
	if keys, _ := testenv.Redis(t).Keys(context.Background(), prefix+"*").Result(); len(keys) != 0 {
		t.Fatalf("forged requests left claims: %v", keys)
	}
	r := deliver(t, env.url, signed("evt_real", body, newSecret, time.Now()))
	if r.status != http.StatusOK || r.replayed() || env.calls.Load() != 1 {
		t.Fatalf("the real event: %d replayed=%v calls=%d", r.status, r.replayed(), env.calls.Load())
	}
}

func TestWebhookEventIDJSONAndScope(t *testing.T) {
	t.Parallel()
	store := newMem(t, memstore.Options{})
	var calls atomic.Int64
	wh, err := httpidem.NewWebhook(store, httpidem.WebhookOptions{
		Secrets: [][]byte{oldSecret}, EventID: httpidem.EventIDJSON("id"), Scope: "stripe",
		SignatureHeader: "Stripe-Signature",
	})
	if err != nil {
		t.Fatal(err)
	}
	srv := quietServer(t, wh.Handler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		calls.Add(1)
		w.WriteHeader(http.StatusNoContent)
	})))
	body := `{"id":"evt_json","object":"event"}`
	for i := range 2 {
		r := do(t, nil, srv.URL, req{path: "/hooks", body: body, header: map[string]string{
			"Stripe-Signature": httpidem.SignWebhook(oldSecret, time.Now(), []byte(body)),
		}})
		if r.status != http.StatusNoContent || r.replayed() != (i == 1) {
			t.Fatalf("delivery %d: %d replayed=%v", i, r.status, r.replayed())
		}
	}
	r := do(t, nil, srv.URL, req{path: "/hooks", body: `{"object":"event"}`, header: map[string]string{
		"Stripe-Signature": httpidem.SignWebhook(oldSecret, time.Now(), []byte(`{"object":"event"}`)),
	}})
	if r.status != http.StatusBadRequest || r.problem(t).Type != problemEventIDMissing {
		t.Fatalf("no id member: %d", r.status)
	}
	if calls.Load() != 1 {
		t.Fatalf("calls %d", calls.Load())
	}
}

func TestWebhookOptionsValidation(t *testing.T) {
	t.Parallel()
	store := newMem(t, memstore.Options{})
	for _, tc := range []struct {
		opts httpidem.WebhookOptions
		want string
	}{
		{httpidem.WebhookOptions{}, "Secrets"},
		{httpidem.WebhookOptions{Secrets: [][]byte{nil}}, "Secrets[0]"},
		{httpidem.WebhookOptions{Secrets: [][]byte{oldSecret}, Tolerance: -1}, "Tolerance"},
		{httpidem.WebhookOptions{Secrets: [][]byte{oldSecret}, SignatureHeader: "a b"}, "SignatureHeader"},
		{httpidem.WebhookOptions{Secrets: [][]byte{oldSecret}, SignatureVersion: "t"}, "SignatureVersion"},
		{httpidem.WebhookOptions{Secrets: [][]byte{oldSecret}, Scope: "a\nb"}, "Scope"},
		{httpidem.WebhookOptions{Secrets: [][]byte{oldSecret}, Options: httpidem.Options{Wait: -1}}, "Options.Wait"},
	} {
		if _, err := httpidem.NewWebhook(store, tc.opts); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v", tc.want, err)
		}
	}
	if _, err := httpidem.NewWebhook(nil, httpidem.WebhookOptions{Secrets: [][]byte{oldSecret}}); err == nil {
		t.Error("nil store accepted")
	}
}

func TestVerifySignature(t *testing.T) {
	t.Parallel()
	now := time.Unix(1_760_000_000, 0)
	body := []byte(`{"a":1}`)
	good := httpidem.SignWebhook(oldSecret, now, body)
	ts := strconv.FormatInt(now.Unix(), 10)
	for _, tc := range []struct {
		header string
		want   error
	}{
		{good, nil},
		{" " + good + " ", nil},
		{good + ",v0=zz", nil}, // other schemes are ignored
		{"v1=" + strings.Repeat("00", 32) + "," + good[len("t="+ts+","):] + ",t=" + ts, nil},
		{"", httpidem.ErrSignatureMissing},
		{"t=" + ts, httpidem.ErrSignatureMalformed},
		{"t=" + ts + ",t=" + ts + "," + good[len("t="+ts+","):], httpidem.ErrSignatureMalformed},
		{"t=-5," + good[len("t="+ts+","):], httpidem.ErrSignatureMalformed},
		{"t=" + ts + ",v1=nothex", httpidem.ErrSignatureMalformed},
		{"t=" + ts + ",v1=" + strings.Repeat("00", 32), httpidem.ErrSignatureMismatch},
		{httpidem.SignWebhook(oldSecret, now.Add(-301*time.Second), body), httpidem.ErrSignatureStale},
	} {
		err := httpidem.VerifySignature(tc.header, "v1", body, [][]byte{newSecret, oldSecret}, now, 5*time.Minute)
		if (tc.want == nil) != (err == nil) || (tc.want != nil && !errors.Is(err, tc.want)) {
			t.Errorf("%q: %v, want %v", tc.header, err, tc.want)
		}
	}
}
