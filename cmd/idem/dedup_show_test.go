package main

import (
	"context"
	"database/sql"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/dedup/sqltable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// showStore is one store "dedup show" reads, set up for a test.
type showStore struct {
	name  string
	flags []string
	// done processes key to completion with result; claim puts key in
	// flight.
	done  func(t *testing.T, key dedup.Key, result []byte)
	claim func(t *testing.T, key dedup.Key)
	// expire makes every row's time pass; nil for Redis, which deletes
	// a record when it expires.
	expire   func(t *testing.T)
	keepKeys bool
}

func pgShowStore(t *testing.T) showStore {
	pool := testenv.Pool(t, 4)
	schema := testenv.Schema(t, pool)
	ctx := context.Background()
	s, err := pgtable.New(pool, pgtable.Options{Schema: schema, KeepKeys: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	return showStore{
		name:  "pgtable",
		flags: []string{"--postgres", testenv.PostgresURL(), "--schema", schema},
		done: func(t *testing.T, key dedup.Key, result []byte) {
			if _, err := s.Process(ctx, key, func(context.Context, pgx.Tx) ([]byte, error) { return result, nil }); err != nil {
				t.Fatal(err)
			}
		},
		claim: func(t *testing.T, key dedup.Key) {
			if _, err := s.Lease().Claim(ctx, key); err != nil {
				t.Fatal(err)
			}
		},
		expire: func(t *testing.T) {
			if _, err := pool.Exec(ctx, "UPDATE "+s.Table()+" SET expires_at = clock_timestamp() - interval '1 minute'"); err != nil {
				t.Fatal(err)
			}
		},
		keepKeys: true,
	}
}

func sqlShowStore(t *testing.T, driver string) showStore {
	ctx := context.Background()
	var (
		db      *sql.DB
		dialect sqltable.Dialect
		opts    sqltable.Options
		flags   []string
		past    string
	)
	switch driver {
	case "mysql":
		db, dialect = testenv.MySQL(t, ""), sqltable.MySQL
		opts.Table = testenv.Name("pe")
		t.Cleanup(func() {
			_, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS `"+opts.Table+"`, `"+opts.Table+"_migrations`")
		})
		flags = []string{"--driver", "mysql", "--dsn", testenv.MySQLDSN(), "--dedup-table", opts.Table}
		past = "UTC_TIMESTAMP(6) - INTERVAL 1 MINUTE"
	case "sqlite":
		dsn := "file:" + filepath.Join(t.TempDir(), "idem.db") + "?_pragma=busy_timeout(10000)"
		var err error
		if db, err = sql.Open("sqlite", dsn); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		dialect = sqltable.SQLite
		flags = []string{"--driver", "sqlite", "--dsn", dsn}
		past = "0"
	case "postgres":
		pool := testenv.Pool(t, 2)
		opts.Schema = testenv.Schema(t, pool)
		var err error
		if db, err = sql.Open("pgx", testenv.PostgresURL()); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = db.Close() })
		dialect = sqltable.Postgres
		flags = []string{"--driver", "postgres", "--dsn", testenv.PostgresURL(), "--schema", opts.Schema}
		past = "clock_timestamp() - interval '1 minute'"
	}
	s, err := sqltable.New(db, dialect, opts)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	return showStore{
		name:  "sqltable " + driver,
		flags: flags,
		done: func(t *testing.T, key dedup.Key, result []byte) {
			if _, err := s.Process(ctx, key, func(context.Context, *sql.Tx) ([]byte, error) { return result, nil }); err != nil {
				t.Fatal(err)
			}
		},
		claim: func(t *testing.T, key dedup.Key) {
			if _, err := s.Lease().Claim(ctx, key); err != nil {
				t.Fatal(err)
			}
		},
		expire: func(t *testing.T) {
			if _, err := db.ExecContext(ctx, "UPDATE "+s.Table()+" SET expires_at = "+past); err != nil {
				t.Fatal(err)
			}
		},
	}
}

func redisShowStore(t *testing.T) showStore {
	c := testenv.Redis(t)
	prefix := testenv.Name("idemshow")
	t.Cleanup(func() { deleteRedisKeys(c, prefix+":") })
	s, err := redisnx.New(c, redisnx.Options{Prefix: prefix, TTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	return showStore{
		name:  "redisnx",
		flags: []string{"--redis", testenv.RedisAddr(), "--prefix", prefix},
		done: func(t *testing.T, key dedup.Key, result []byte) {
			l, err := s.Claim(ctx, key)
			if err != nil {
				t.Fatal(err)
			}
			if err := s.Complete(ctx, l, result); err != nil {
				t.Fatal(err)
			}
		},
		claim: func(t *testing.T, key dedup.Key) {
			if _, err := s.Claim(ctx, key); err != nil {
				t.Fatal(err)
			}
		},
	}
}

// TestDedupShow runs "idem dedup show" on every store and every state a
// key can be in there: absent (exit 4), in flight and done (exit 0, with
// the fingerprint and the result), expired (exit 4), by scope and id and
// by digest.
func TestDedupShow(t *testing.T) {
	for _, tc := range []struct {
		name string
		mk   func(t *testing.T) showStore
	}{
		{"pgtable", pgShowStore},
		{"sqltable-mysql", func(t *testing.T) showStore { return sqlShowStore(t, "mysql") }},
		{"sqltable-sqlite", func(t *testing.T) showStore { return sqlShowStore(t, "sqlite") }},
		{"sqltable-postgres", func(t *testing.T) showStore { return sqlShowStore(t, "postgres") }},
		{"redisnx", redisShowStore},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := tc.mk(t)
			ctx := context.Background()
			show := func(key dedup.Key, byDigest bool) (int, string) {
				t.Helper()
				args := append([]string{"dedup", "show"}, st.flags...)
				if byDigest {
					args = append(args, "--digest", key.Digest().String())
				} else {
					args = append(args, "--scope", key.Scope, "--id", key.ID)
				}
				code, out, errOut := runCmd(ctx, t, args...)
				if errOut != "" {
					t.Errorf("%s: stderr %q", st.name, errOut)
				}
				return code, out
			}
			expect := func(key dedup.Key, wantCode int, want ...string) {
				t.Helper()
				for _, byDigest := range []bool{false, true} {
					code, out := show(key, byDigest)
					if code != wantCode {
						t.Errorf("%s, by digest %v: exit %d, want %d; output:\n%s", st.name, byDigest, code, wantCode, out)
					}
					for _, w := range want {
						if !strings.Contains(out, w) {
							t.Errorf("%s, by digest %v: output lacks %q:\n%s", st.name, byDigest, w, out)
						}
					}
					if !strings.Contains(out, "digest       "+key.Digest().String()+" (hash #"+key.Hash()+")") {
						t.Errorf("%s: output lacks the digest line:\n%s", st.name, out)
					}
				}
			}
			scope := "billing/charge"
			absent := dedup.NewKey(scope, testenv.UniqueID("absent"), nil)
			expect(absent, exitAbsent, "state        absent")

			done := dedup.NewKey(scope, testenv.UniqueID("done"), []byte(`{"amount":100}`))
			st.done(t, done, []byte("receipt-42"))
			kept := "kept         no scope or id"
			if st.keepKeys {
				kept = "kept         scope \"billing/charge\", id \"" + done.ID + "\""
			}
			expect(done, 0, "state        done\n", "expires      ", "fingerprint  "+done.Fingerprint.String(),
				`result       10 bytes: "receipt-42"`, kept)

			binary := dedup.Key{Scope: scope, ID: testenv.UniqueID("bin")}
			st.done(t, binary, []byte{0xff, 0x00, 0x01})
			expect(binary, 0, "fingerprint  none", "result       3 bytes: base64 /wAB")

			leased := dedup.NewKey(scope, testenv.UniqueID("lease"), []byte("x"))
			st.claim(t, leased)
			expect(leased, 0, "state        in flight: a lease holds it", "lease ends   ", "fingerprint  "+leased.Fingerprint.String())

			if st.expire == nil {
				return
			}
			st.expire(t)
			expect(done, exitAbsent, "state        expired: done, past its retention", `result       10 bytes: "receipt-42"`, " ago)")
			expect(leased, exitAbsent, "state        expired: a lease that ran out")
		})
	}
}

// TestDedupShowTimeOrderedKeys: a pgtable store with TimeOrderedKeys keys
// the row of a UUIDv7 id by its time: "dedup show" finds it by scope and id
// with --time-ordered-keys (not without), and by the key column as it
// reads.
func TestDedupShowTimeOrderedKeys(t *testing.T) {
	pool := testenv.Pool(t, 4)
	schema := testenv.Schema(t, pool)
	ctx := context.Background()
	s, err := pgtable.New(pool, pgtable.Options{Schema: schema, TimeOrderedKeys: true})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	key := dedup.Key{Scope: "billing/charge", ID: "018bcfe5-6800-7000-8000-00000000002a"}
	if _, err := s.Process(ctx, key, func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil }); err != nil {
		t.Fatal(err)
	}
	var column string
	if err := pool.QueryRow(ctx, "SELECT key::text FROM "+s.Table()).Scan(&column); err != nil {
		t.Fatal(err)
	}
	base := []string{"dedup", "show", "--postgres", testenv.PostgresURL(), "--schema", schema}
	for _, c := range []struct {
		args []string
		code int
	}{
		{[]string{"--scope", key.Scope, "--id", key.ID, "--time-ordered-keys"}, 0},
		{[]string{"--scope", key.Scope, "--id", key.ID}, exitAbsent},
		{[]string{"--digest", column}, 0},
	} {
		code, out, errOut := runCmd(ctx, t, append(base, c.args...)...)
		if code != c.code || errOut != "" {
			t.Errorf("dedup show %v: exit %d (stderr %q), want %d; output:\n%s", c.args, code, errOut, c.code, out)
		}
	}
	if code, _, errOut := runCmd(ctx, t, "dedup", "show", "--redis", "127.0.0.1:1", "--scope", "s", "--id", "i", "--time-ordered-keys"); code == 0 ||
		!strings.Contains(errOut, "--time-ordered-keys is a setting of the pgtable store") {
		t.Errorf("--time-ordered-keys with --redis: exit %d, %q", code, errOut)
	}
}

func TestDedupShowUsage(t *testing.T) {
	ctx := context.Background()
	t.Setenv("IDEM_POSTGRES_URL", "")
	t.Setenv("IDEM_REDIS_URL", "")
	t.Setenv("IDEM_DRIVER", "")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--postgres", "postgres://x"}, "--scope and --id (or --digest) are required"},
		{[]string{"--postgres", "postgres://x", "--scope", "s"}, "--scope and --id (or --digest) are required"},
		{[]string{"--postgres", "postgres://x", "--scope", "s", "--id", "i", "--digest", strings.Repeat("0", 32)}, "not both"},
		{[]string{"--postgres", "postgres://x", "--digest", "0123456789abcdef"}, "that is a key's Hash"},
		{[]string{"--scope", "s", "--id", "i"}, "name the store"},
		{[]string{"--postgres", "postgres://x", "--redis", "r:6379", "--scope", "s", "--id", "i"}, "exclusive"},
		{[]string{"--driver", "oracle", "--dsn", "x", "--scope", "s", "--id", "i"}, `--driver "oracle"`},
		{[]string{"--driver", "mysql", "--scope", "s", "--id", "i"}, "--dsn (or IDEM_DSN) is required"},
		{[]string{"--postgres", "postgres://x", "--scope", "s", "--id", "i", "extra"}, `unexpected argument "extra"`},
	} {
		code, _, errOut := runCmd(ctx, t, append([]string{"dedup", "show"}, tc.args...)...)
		if code != 2 || !strings.Contains(errOut, tc.want) {
			t.Errorf("%v: exit %d, stderr %q; want exit 2 and %q", tc.args, code, errOut, tc.want)
		}
	}
	code, _, errOut := runCmd(ctx, t, "dedup", "--postgres", "postgres://x", "show")
	if code != 2 || !strings.Contains(errOut, "write show first") {
		t.Errorf("show after the flags: exit %d, stderr %q", code, errOut)
	}
	code, _, errOut = runCmd(ctx, t, "dedup", "show", "--redis", testenv.DeadAddr(t), "--scope", "s", "--id", "i")
	if code != 1 || !strings.Contains(errOut, "is unreachable") {
		t.Errorf("dead Redis: exit %d, stderr %q; want exit 1 and unreachable", code, errOut)
	}
}
