package sqltable_test

import (
	"bytes"
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/sqltable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// dbNowMs is the SQL of the database clock as Unix milliseconds.
var dbNowMs = map[sqltable.Dialect]string{
	sqltable.Postgres: "SELECT CAST(floor(extract(epoch FROM clock_timestamp()) * 1000) AS bigint)",
	sqltable.MySQL:    "SELECT TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', UTC_TIMESTAMP(6)) DIV 1000",
	sqltable.SQLite:   "SELECT CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)",
}

// TestInspect: Inspect reports each state a key's row can be in (absent,
// in flight with its lease's end, done with its result, expired), the
// fingerprint, and the scope and id only when the store keeps them, on
// every driver; InspectDigest finds the same row by the digest, and the
// expiry is the database clock's.
func TestInspect(t *testing.T) {
	for _, b := range backends {
		for _, keep := range []bool{false, true} {
			name := b.name
			if keep {
				name += "/keep-keys"
			}
			t.Run(name, func(t *testing.T) {
				db := b.open(t)
				s := newStore(t, b, db, sqltable.Options{KeepKeys: keep, Lease: time.Minute})
				ctx := testenv.Ctx(t)
				var nowMs int64
				if err := db.QueryRowContext(ctx, dbNowMs[b.dialect]).Scan(&nowMs); err != nil {
					t.Fatal(err)
				}
				dbNow := time.UnixMilli(nowMs)
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
					if st.Digest != key.Digest() || byDigest.Status != st.Status || !byDigest.ExpiresAt.Equal(st.ExpiresAt) ||
						!bytes.Equal(byDigest.Result, st.Result) {
						t.Fatalf("Inspect %+v, InspectDigest %+v", st, byDigest)
					}
					if st.Status != dedup.KeyAbsent && (st.KeysKept != keep || (keep && (st.Scope != key.Scope || st.ID != key.ID))) {
						t.Errorf("scope %q id %q kept %v; want %q %q kept %v", st.Scope, st.ID, st.KeysKept, key.Scope, key.ID, keep)
					}
					return st
				}

				if st := inspect(dedup.NewKey("pay", testenv.UniqueID("i"), nil)); st.Status != dedup.KeyAbsent || st.Held() {
					t.Fatalf("absent key: %+v", st)
				}

				done := dedup.NewKey("pay", testenv.UniqueID("i"), []byte("100"))
				if _, err := s.Process(ctx, done, func(context.Context, *sql.Tx) ([]byte, error) { return []byte("receipt-1"), nil }); err != nil {
					t.Fatal(err)
				}
				st := inspect(done)
				if st.Status != dedup.KeyDone || st.Expired || string(st.Result) != "receipt-1" || st.Fingerprint != done.Fingerprint {
					t.Fatalf("done key: %+v", st)
				}
				if lo := dbNow.Add(s.Options().Retention - time.Minute); st.ExpiresAt.Before(lo) {
					t.Errorf("done key expires at %v, before %v (the retention from the database's now %v)", st.ExpiresAt, lo, dbNow)
				}

				leased := dedup.Key{Scope: "pay", ID: testenv.UniqueID("i")}
				if _, err := s.Lease().Claim(ctx, leased); err != nil {
					t.Fatal(err)
				}
				st = inspect(leased)
				if st.Status != dedup.KeyInFlight || st.Expired || !st.Fingerprint.IsZero() || st.Result != nil {
					t.Fatalf("leased key: %+v", st)
				}
				if hi := dbNow.Add(s.Options().Lease + time.Minute); st.ExpiresAt.Before(dbNow) || st.ExpiresAt.After(hi) {
					t.Errorf("lease ends at %v, want within the lease of the database's now %v", st.ExpiresAt, dbNow)
				}

				if _, err := db.ExecContext(ctx, "UPDATE "+s.Table()+" SET expires_at = "+b.past); err != nil {
					t.Fatal(err)
				}
				for _, k := range []dedup.Key{done, leased} {
					if st := inspect(k); !st.Expired || st.Held() || st.Status == dedup.KeyAbsent {
						t.Errorf("expired row of %s: %+v", k, st)
					}
				}
			})
		}
	}
	t.Run("down", func(t *testing.T) {
		for _, b := range backends {
			s := downStore(t, b)
			if _, err := s.Inspect(testenv.Ctx(t), dedup.NewKey("pay", "x", nil)); err == nil {
				t.Fatalf("%s: inspect on a store that is down = nil error", b.name)
			}
		}
	})
}
