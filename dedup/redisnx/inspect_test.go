package redisnx_test

import (
	"testing"
	"time"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestInspect: Inspect reports a key's record on the real Redis (absent,
// in flight with its lease's end, done with its result, the bare done
// mark, a record of the previous layout), and InspectDigest finds the
// current layout's record by the digest alone.
func TestInspect(t *testing.T) {
	prefix := testenv.Name("redisnx")
	s, c := newStore(t, redisnx.Options{Prefix: prefix, Lease: time.Minute, TTL: time.Hour})
	ctx := testenv.Ctx(t)
	scope := testenv.UniqueID("billing/charge")
	inspect := func(key dedup.Key, byDigest bool) dedup.KeyState {
		t.Helper()
		st, err := s.Inspect(ctx, key)
		if byDigest {
			st, err = s.InspectDigest(ctx, key.Digest())
		}
		if err != nil {
			t.Fatal(err)
		}
		if st.Digest != key.Digest() || st.Expired || st.KeysKept {
			t.Fatalf("%+v: want digest %s, never expired, no keys kept", st, key.Digest())
		}
		return st
	}
	within := func(st dedup.KeyState, ttl time.Duration) bool {
		now := time.Now()
		return !st.ExpiresAt.IsZero() && st.ExpiresAt.After(now.Add(-time.Second)) && !st.ExpiresAt.After(now.Add(ttl+time.Second))
	}

	for _, byDigest := range []bool{false, true} {
		absent := dedup.NewKey(scope, testenv.UniqueID("a"), nil)
		if st := inspect(absent, byDigest); st.Status != dedup.KeyAbsent || st.Held() || !st.ExpiresAt.IsZero() {
			t.Fatalf("absent key: %+v", st)
		}

		key := dedup.NewKey(scope, testenv.UniqueID("p"), []byte("100"))
		l, err := s.Claim(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		st := inspect(key, byDigest)
		if st.Status != dedup.KeyInFlight || st.Fingerprint != key.Fingerprint || st.Result != nil || !within(st, time.Minute) {
			t.Fatalf("in flight: %+v (the token must not show as a result)", st)
		}
		if err := s.Complete(ctx, l, []byte("receipt-1")); err != nil {
			t.Fatal(err)
		}
		st = inspect(key, byDigest)
		if st.Status != dedup.KeyDone || !st.Held() || string(st.Result) != "receipt-1" || st.Fingerprint != key.Fingerprint || !within(st, time.Hour) {
			t.Fatalf("done: %+v", st)
		}

		bare := dedup.Key{Scope: scope, ID: testenv.UniqueID("b")}
		l, err = s.Claim(ctx, bare)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Complete(ctx, l, nil); err != nil {
			t.Fatal(err)
		}
		if st := inspect(bare, byDigest); st.Status != dedup.KeyDone || !st.Fingerprint.IsZero() || st.Result != nil {
			t.Fatalf("bare done mark: %+v", st)
		}
		if v := c.Get(ctx, s.RedisKey(bare)).Val(); v != "1" {
			t.Fatalf("bare done mark holds %q, want 1", v)
		}
	}

	// A record of the previous layout answers Inspect (not InspectDigest,
	// which cannot compute its key).
	old := dedup.NewKey(scope, testenv.UniqueID("o"), []byte("a"))
	if err := c.Set(ctx, previousKey(prefix, old), previousRecord('D', old.Fingerprint, "r-old"), time.Hour).Err(); err != nil {
		t.Fatal(err)
	}
	if st := inspect(old, false); st.Status != dedup.KeyDone || string(st.Result) != "r-old" || st.Fingerprint != old.Fingerprint {
		t.Fatalf("previous layout: %+v", st)
	}
	if st := inspect(old, true); st.Status != dedup.KeyAbsent {
		t.Fatalf("previous layout by digest: %+v, want absent", st)
	}

	// A value that is not a record is an error, never a state.
	junk := dedup.Key{Scope: scope, ID: testenv.UniqueID("j")}
	if err := c.Set(ctx, s.RedisKey(junk), "", time.Hour).Err(); err != nil {
		t.Fatal(err)
	}
	if st, err := s.Inspect(ctx, junk); err == nil {
		t.Fatalf("a key holding no record: %+v, nil error", st)
	}
}
