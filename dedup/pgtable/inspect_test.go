package pgtable_test

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestInspect: Inspect reports each state a key's row can be in (absent,
// in flight with its lease's end, done with its result, expired), the
// fingerprint, and the scope and id only when the store keeps them, in
// both table layouts; InspectDigest finds the same row by the digest.
func TestInspect(t *testing.T) {
	pool := testenv.Pool(t, 4)
	for _, tc := range []struct {
		name string
		opts pgtable.Options
	}{
		{"plain", pgtable.Options{}},
		{"plain keep keys", pgtable.Options{KeepKeys: true}},
		{"partitioned keep keys", pgtable.Options{Partitioned: true, Retention: 24 * time.Hour, KeepKeys: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.opts.Lease = time.Minute
			s := newStore(t, pool, tc.opts)
			ctx := testenv.Ctx(t)
			var dbNow time.Time
			if err := pool.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&dbNow); err != nil {
				t.Fatal(err)
			}
			inspect := func(key dedup.Key) dedup.KeyState {
				t.Helper()
				st, err := s.Inspect(ctx, key)
				if err != nil {
					t.Fatal(err)
				}
				byDigest, err := s.InspectDigest(ctx, key.Digest())
				if err != nil {
					t.Fatal(err)
				}
				if st.Digest != key.Digest() || byDigest.Digest != st.Digest || byDigest.Status != st.Status ||
					!byDigest.ExpiresAt.Equal(st.ExpiresAt) || !bytes.Equal(byDigest.Result, st.Result) {
					t.Fatalf("Inspect %+v, InspectDigest %+v", st, byDigest)
				}
				if st.Status != dedup.KeyAbsent {
					if st.KeysKept != tc.opts.KeepKeys || (st.KeysKept && (st.Scope != key.Scope || st.ID != key.ID)) {
						t.Errorf("scope %q id %q kept %v; want %q %q kept %v", st.Scope, st.ID, st.KeysKept, key.Scope, key.ID, tc.opts.KeepKeys)
					}
				}
				return st
			}

			absent := dedup.NewKey("pay", testenv.UniqueID("i"), []byte("100"))
			if st := inspect(absent); st.Status != dedup.KeyAbsent || st.Held() {
				t.Fatalf("absent key: %+v", st)
			}

			done := dedup.NewKey("pay", testenv.UniqueID("i"), []byte("100"))
			if _, err := s.Process(ctx, done, func(context.Context, pgx.Tx) ([]byte, error) { return []byte("receipt-1"), nil }); err != nil {
				t.Fatal(err)
			}
			st := inspect(done)
			if st.Status != dedup.KeyDone || st.Expired || !st.Held() || string(st.Result) != "receipt-1" || st.Fingerprint != done.Fingerprint {
				t.Fatalf("done key: %+v", st)
			}
			if lo := dbNow.Add(s.Options().Retention - time.Minute); st.ExpiresAt.Before(lo) {
				t.Errorf("done key expires at %v, before %v (retention %v from the database's now %v)", st.ExpiresAt, lo, s.Options().Retention, dbNow)
			}

			leased := dedup.Key{Scope: "pay", ID: testenv.UniqueID("i")} // no fingerprint
			if _, err := s.Lease().Claim(ctx, leased); err != nil {
				t.Fatal(err)
			}
			st = inspect(leased)
			if st.Status != dedup.KeyInFlight || st.Expired || !st.Fingerprint.IsZero() || st.Result != nil {
				t.Fatalf("leased key: %+v", st)
			}
			if lo, hi := dbNow, dbNow.Add(s.Options().Lease+time.Minute); st.ExpiresAt.Before(lo) || st.ExpiresAt.After(hi) {
				t.Errorf("lease ends at %v, want within the lease of the database's now %v", st.ExpiresAt, dbNow)
			}

			if _, err := pool.Exec(ctx, "UPDATE "+s.Table()+" SET expires_at = clock_timestamp() - interval '1 second'"); err != nil {
				t.Fatal(err)
			}
			for _, k := range []dedup.Key{done, leased} {
				before := inspect(k)
				if !before.Expired || before.Held() || before.Status == dedup.KeyAbsent {
					t.Errorf("expired row of %s: %+v", k, before)
				}
			}
		})
	}
}
