package sqltable

import (
	"strings"

	"github.com/idemkit/idem/internal/sqldialect"
)

// statements are built once per store from the quoted table name, in the
// store's dialect. Every value is a bound parameter; only the validated,
// quoted table name is spliced in.
//
// A key's row is found by its digest (keyDigest, 16 bytes). A row with a
// token is in flight (lease mode) until expires_at; a row without one is
// done and kept until expires_at. Every time comes from the database
// clock: PostgreSQL's clock_timestamp(), MySQL's UTC_TIMESTAMP(6) (the
// column holds UTC), SQLite's julianday('now') as Unix milliseconds (the
// column holds an integer).
type statements struct {
	insertDone, insertLease     string
	lookup                      string
	peek, inspect               string
	takeoverDone, takeoverLease string
	setResult                   string
	extend, complete, release   string
	now, cleanup, cleanupSelect string
	cleanupDelete               string // MySQL: one row of a batch
}

// clock is the SQL of a dialect's clock.
type clock struct {
	// now is the current time, in the type of expires_at.
	now string
	// plus is now plus a parameter in milliseconds.
	plus string
	// leftMs is the time left until expires_at in milliseconds, at least 0.
	leftMs string
	// nowText selects now as Cleanup passes it back as its cutoff.
	nowText string
	// expiresMs is expires_at as Unix milliseconds.
	expiresMs string
}

func clockOf(d sqldialect.Dialect) clock {
	switch d {
	case sqldialect.MySQL:
		return clock{
			now:     `UTC_TIMESTAMP(6)`,
			plus:    `(UTC_TIMESTAMP(6) + INTERVAL ? * 1000 MICROSECOND)`,
			leftMs:  `GREATEST(0, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) DIV 1000)`,
			nowText: `SELECT DATE_FORMAT(UTC_TIMESTAMP(6), '%Y-%m-%d %H:%i:%s.%f')`,
			// The column holds UTC without a zone: its distance from the
			// epoch, also without one.
			expiresMs: `(TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', expires_at) DIV 1000)`,
		}
	case sqldialect.SQLite:
		const now = `CAST((julianday('now') - 2440587.5) * 86400000.0 AS INTEGER)`
		return clock{
			now:       now,
			plus:      `(` + now + ` + ?)`,
			leftMs:    `MAX(0, expires_at - ` + now + `)`,
			nowText:   `SELECT ` + now,
			expiresMs: `expires_at`,
		}
	}
	return clock{
		now:       `clock_timestamp()`,
		plus:      `(clock_timestamp() + CAST(? AS bigint) * interval '1 millisecond')`,
		leftMs:    `GREATEST(0, CAST(extract(epoch FROM (expires_at - clock_timestamp())) * 1000 AS bigint))`,
		nowText:   `SELECT clock_timestamp()`,
		expiresMs: `CAST(floor(extract(epoch FROM expires_at) * 1000) AS bigint)`,
	}
}

func buildStatements(d sqldialect.Dialect, table string) statements {
	c := clockOf(d)
	onConflict, lockRead := " ON CONFLICT (digest) DO NOTHING", ""
	if d == sqldialect.MySQL {
		// A plain INSERT: a duplicate key is error 1062, after which the
		// transaction goes on. The read that follows it is a locking read,
		// so it sees the latest committed row whatever the transaction's
		// snapshot.
		onConflict, lockRead = "", " LOCK IN SHARE MODE"
	}
	r := strings.NewReplacer("{{T}}", table, "{{NOW}}", c.now, "{{PLUS}}", c.plus, "{{LEFT}}", c.leftMs, "{{EXPMS}}", c.expiresMs,
		"{{CONFLICT}}", onConflict, "{{LOCKREAD}}", lockRead)
	q := func(s string) string { return d.Rebind(r.Replace(s)) }
	st := statements{
		// digest, retention ms, fingerprint, scope, id. Inserts the
		// key's row, done; a concurrent insert of the key waits until
		// this transaction ends. Nothing (or error 1062 on MySQL) when
		// the key has a row.
		insertDone: q(`INSERT INTO {{T}} (digest, expires_at, fingerprint, scope, id)
VALUES (?, {{PLUS}}, ?, ?, ?){{CONFLICT}}`),
		// digest, lease ms, fingerprint, token, scope, id.
		insertLease: q(`INSERT INTO {{T}} (digest, expires_at, fingerprint, token, scope, id)
VALUES (?, {{PLUS}}, ?, ?, ?, ?){{CONFLICT}}`),
		// digest. State (1 in flight, 2 done), fingerprint, result, the
		// lease's time left (0 for a done row), expired (1 or 0).
		lookup: q(`SELECT CASE WHEN token IS NULL THEN 2 ELSE 1 END, fingerprint, result,
    CASE WHEN token IS NULL THEN 0 ELSE {{LEFT}} END, CASE WHEN expires_at <= {{NOW}} THEN 1 ELSE 0 END
FROM {{T}} WHERE digest = ?{{LOCKREAD}}`),
		// The same read without a lock: the row as last committed, never
		// waiting for a transaction that holds it (Lookup).
		peek: q(`SELECT CASE WHEN token IS NULL THEN 2 ELSE 1 END, fingerprint, result,
    CASE WHEN token IS NULL THEN 0 ELSE {{LEFT}} END, CASE WHEN expires_at <= {{NOW}} THEN 1 ELSE 0 END
FROM {{T}} WHERE digest = ?`),
		// digest. Inspect: in flight (1 or 0), expires_at as Unix
		// milliseconds, expired (1 or 0), fingerprint, result, scope, id;
		// without a lock, as peek.
		inspect: q(`SELECT CASE WHEN token IS NULL THEN 0 ELSE 1 END, {{EXPMS}},
    CASE WHEN expires_at <= {{NOW}} THEN 1 ELSE 0 END, fingerprint, result, scope, id
FROM {{T}} WHERE digest = ?`),
		// retention ms, fingerprint, scope, id, digest. Takes over an
		// expired row, done.
		takeoverDone: q(`UPDATE {{T}} SET expires_at = {{PLUS}}, fingerprint = ?, token = NULL, result = NULL, scope = ?, id = ?
WHERE digest = ? AND expires_at <= {{NOW}}`),
		// lease ms, fingerprint, token, scope, id, digest.
		takeoverLease: q(`UPDATE {{T}} SET expires_at = {{PLUS}}, fingerprint = ?, token = ?, result = NULL, scope = ?, id = ?
WHERE digest = ? AND expires_at <= {{NOW}}`),
		// result, digest.
		setResult: q(`UPDATE {{T}} SET result = ? WHERE digest = ? AND token IS NULL`),
		// lease ms, digest, token.
		extend: q(`UPDATE {{T}} SET expires_at = {{PLUS}} WHERE digest = ? AND token = ? AND expires_at > {{NOW}}`),
		// result, retention ms, digest, token.
		complete: q(`UPDATE {{T}} SET token = NULL, result = ?, expires_at = {{PLUS}}
WHERE digest = ? AND token = ? AND expires_at > {{NOW}}`),
		// digest, token.
		release: q(`DELETE FROM {{T}} WHERE digest = ? AND token = ? AND expires_at > {{NOW}}`),
		now:     c.nowText,
	}
	switch d {
	case sqldialect.Postgres:
		// cutoff, batch. Rows a claim holds locked are skipped.
		st.cleanup = q(`DELETE FROM {{T}} WHERE digest IN (
    SELECT digest FROM {{T}} WHERE expires_at <= ? ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED)`)
	case sqldialect.SQLite:
		// cutoff, batch. A single writer: no row is locked.
		st.cleanup = q(`DELETE FROM {{T}} WHERE digest IN (
    SELECT digest FROM {{T}} WHERE expires_at <= ? ORDER BY expires_at LIMIT ?)`)
	case sqldialect.MySQL:
		// cutoff, batch; then each digest it found is deleted. MySQL
		// takes no LIMIT in an IN subquery and no SKIP LOCKED in a
		// DELETE, so a batch is this select, under READ COMMITTED (no gap
		// locks), and a delete of each row it locked.
		st.cleanupSelect = q(`SELECT digest FROM {{T}} WHERE expires_at <= ? ORDER BY expires_at LIMIT ? FOR UPDATE SKIP LOCKED`)
		st.cleanupDelete = q(`DELETE FROM {{T}} WHERE digest = ?`)
	}
	return st
}
