package main

import (
	"context"
	"database/sql"
	"encoding/base64"
	"errors"
	"flag"
	"fmt"
	"io"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/dedup/sqltable"
)

const dedupShowSynopsis = `dedup show (--scope S --id ID | --digest HEX) (--postgres URL | --driver D --dsn DSN | --redis URL) [flags]

Finds one key in a dedup store and prints what the store holds for it: its
state (in flight, done, expired or absent), when it expires, its
fingerprint, its stored result, and its scope and id when the store keeps
them (KeepKeys). It is one read of the key's primary key or Redis key.

  --postgres            the pgtable store (--schema, --dedup-table)
  --driver, --dsn       the sqltable store on database/sql: mysql
                        (MySQL/MariaDB), sqlite (a file) or postgres
                        (--schema, --dedup-table)
  --redis               the redisnx store (--prefix)

--digest takes the key's stored digest, 32 hex digits (pgtable's key
column prints it as a uuid), for a key whose scope and id are not known;
logs show only its first half (the key's hash). On Redis it reads the
current key layout only. A pgtable store with TimeOrderedKeys keys the
rows of UUIDv6/v7 ids by their time: give --time-ordered-keys with
--scope and --id, or the key column as it reads to --digest.

Exits 0 when the store holds the key (in flight or done), 4 when it does
not (absent, or a row whose time has passed: a claim would take it).`

// exitAbsent is the exit status of "idem dedup show" when the store does
// not hold the key, and of "idem deadletter show" when no letter matches.
const exitAbsent = 4

// errAbsent reports that what "show" looked for is not there; what was
// found has been printed already.
var errAbsent = errors.New("not found")

// inspector is what "dedup show" needs of a store.
type inspector interface {
	Inspect(ctx context.Context, key dedup.Key) (dedup.KeyState, error)
	InspectDigest(ctx context.Context, d dedup.Digest) (dedup.KeyState, error)
}

func runDedupShow(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("dedup show", dedupShowSynopsis, stderr)
	var pg pgFlags
	pg.register(fs, withDedup)
	var (
		scope    = fs.String("scope", "", "the key's scope")
		id       = fs.String("id", "", "the key's id")
		digest   = fs.String("digest", "", "the key's stored digest, 32 hex digits, instead of --scope and --id")
		driver   = fs.String("driver", envDefault("IDEM_DRIVER", ""), "the sqltable store on database/sql: mysql, sqlite or postgres (or IDEM_DRIVER); needs --dsn")
		dsn      = fs.String("dsn", envDefault("IDEM_DSN", ""), "the database/sql data source name of --driver (or IDEM_DSN), e.g. user@tcp(host:3306)/db or file:app.db")
		redisURL = fs.String("redis", envDefault("IDEM_REDIS_URL", ""), "the redisnx store: a Redis URL or host:port (or IDEM_REDIS_URL)")
		prefix   = fs.String("prefix", "idem", "with --redis: the store's key prefix (redisnx.Options.Prefix)")
		ordered  = fs.Bool("time-ordered-keys", false, "with --postgres: the store keys the rows of UUIDv6/v7 ids by their time (pgtable.Options.TimeOrderedKeys; give the application's setting)")
	)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usageError(fs, "unexpected argument %q", fs.Arg(0))
	}
	var (
		key dedup.Key
		d   dedup.Digest
	)
	switch {
	case *digest != "" && (*scope != "" || *id != ""):
		return usageError(fs, "give --scope and --id, or --digest, not both")
	case *digest != "":
		var err error
		if d, err = dedup.ParseDigest(*digest); err != nil {
			return usageError(fs, "--digest: %v", err)
		}
	case *scope == "" || *id == "":
		return usageError(fs, "--scope and --id (or --digest) are required")
	default:
		key = dedup.Key{Scope: *scope, ID: *id}
		d = key.Digest()
	}
	// The store is the one named on the command line; the environment's
	// defaults count only when none is.
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	named := 0
	for _, n := range []string{"postgres", "driver", "redis"} {
		if set[n] {
			named++
		}
	}
	kind := ""
	switch {
	case named > 1:
		return usageError(fs, "--postgres, --driver and --redis are exclusive: name one store")
	case set["postgres"]:
		kind = "postgres"
	case set["driver"]:
		kind = "driver"
	case set["redis"]:
		kind = "redis"
	case pg.url != "":
		kind = "postgres"
	case *driver != "":
		kind = "driver"
	case *redisURL != "":
		kind = "redis"
	default:
		return usageError(fs, "name the store: --postgres, --driver with --dsn, or --redis")
	}

	if *ordered && kind != "postgres" {
		return usageError(fs, "--time-ordered-keys is a setting of the pgtable store (--postgres)")
	}
	var (
		store inspector
		where string
	)
	switch kind {
	case "postgres":
		pool, err := pg.connect(ctx)
		if err != nil {
			return err
		}
		defer pool.Close()
		s, err := pgtable.New(pool, pgtable.Options{Schema: pg.schema, Table: pg.dedupTable, TimeOrderedKeys: *ordered})
		if err != nil {
			return err
		}
		store, where = s, "pgtable "+s.Table()
	case "driver":
		dr, ok := sqlDrivers[*driver]
		if !ok {
			return usageError(fs, "--driver %q: want mysql, sqlite or postgres", *driver)
		}
		if *dsn == "" {
			return usageError(fs, "--dsn (or IDEM_DSN) is required with --driver %s", *driver)
		}
		db, err := sql.Open(dr.name, *dsn)
		if err != nil {
			return fmt.Errorf("--dsn: %w", err)
		}
		defer func() { _ = db.Close() }()
		pctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err = db.PingContext(pctx)
		cancel()
		if err != nil {
			return fmt.Errorf("%s database is unreachable: %w", *driver, err)
		}
		schema := ""
		if set["schema"] {
			schema = pg.schema
		}
		s, err := sqltable.New(db, dr.dialect, sqltable.Options{Schema: schema, Table: pg.dedupTable})
		if err != nil {
			return err
		}
		store, where = s, "sqltable ("+*driver+") "+s.Table()
	case "redis":
		opt, err := redisOptions(*redisURL)
		if err != nil {
			return fmt.Errorf("--redis: %w", err)
		}
		client := redis.NewClient(opt)
		defer func() { _ = client.Close() }()
		pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err = client.Ping(pctx).Err()
		cancel()
		if err != nil {
			return fmt.Errorf("redis at %s is unreachable: %w", opt.Addr, err)
		}
		s, err := redisnx.New(client, redisnx.Options{Prefix: *prefix})
		if err != nil {
			return err
		}
		store, where = s, "redisnx at "+opt.Addr
		if key.Scope != "" {
			where += ", key " + s.RedisKey(key)
		}
	}

	var (
		st  dedup.KeyState
		err error
	)
	if key.Scope != "" {
		st, err = store.Inspect(ctx, key)
	} else {
		st, err = store.InspectDigest(ctx, d)
	}
	if err != nil {
		return err
	}
	printKeyState(stdout, where, key, st, time.Now())
	if !st.Held() {
		return errAbsent
	}
	return nil
}

// printKeyState prints st, one field a line.
func printKeyState(w io.Writer, where string, key dedup.Key, st dedup.KeyState, now time.Time) {
	row := func(name, format string, args ...any) {
		fprintf(w, "%-12s "+format+"\n", append([]any{name}, args...)...)
	}
	row("store", "%s", where)
	if key.Scope != "" {
		row("key", "scope %q, id %q", key.Scope, key.ID)
	}
	row("digest", "%s (hash #%s)", st.Digest, st.Digest.Hash())
	state := st.Status.String()
	switch {
	case st.Status == dedup.KeyAbsent:
		state += ": the store holds nothing for this key"
	case st.Expired && st.Status == dedup.KeyInFlight:
		state = "expired: a lease that ran out; a claim takes it over, cleanup deletes it"
	case st.Expired:
		state = "expired: done, past its retention; a claim takes it over, cleanup deletes it"
	case st.Status == dedup.KeyInFlight:
		state += ": a lease holds it"
	}
	row("state", "%s", state)
	if st.Status == dedup.KeyAbsent {
		return
	}
	if !st.ExpiresAt.IsZero() {
		when := "in " + st.ExpiresAt.Sub(now).Round(time.Second).String()
		if !st.ExpiresAt.After(now) {
			when = now.Sub(st.ExpiresAt).Round(time.Second).String() + " ago"
		}
		what := "expires"
		if st.Status == dedup.KeyInFlight {
			what = "lease ends"
		}
		row(what, "%s (%s)", st.ExpiresAt.UTC().Format(time.RFC3339Nano), when)
	}
	if st.Fingerprint.IsZero() {
		row("fingerprint", "none")
	} else {
		row("fingerprint", "%s", st.Fingerprint)
	}
	switch {
	case st.Status == dedup.KeyInFlight:
	case st.Result == nil:
		row("result", "none")
	default:
		row("result", "%d bytes: %s", len(st.Result), printable(st.Result))
	}
	if st.KeysKept {
		row("kept", "scope %q, id %q", st.Scope, st.ID)
	} else {
		row("kept", "no scope or id (the store keeps only the digest)")
	}
}

// printable is b as a quoted string when it is printable UTF-8, else as
// base64.
func printable(b []byte) string {
	if utf8.Valid(b) && strings.IndexFunc(string(b), func(r rune) bool { return !unicode.IsPrint(r) && !unicode.IsSpace(r) }) < 0 {
		return fmt.Sprintf("%q", b)
	}
	return "base64 " + base64.StdEncoding.EncodeToString(b)
}
