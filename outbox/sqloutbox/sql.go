package sqloutbox

import (
	"strings"

	"github.com/idemkit/idem/internal/sqldialect"
)

// statements are built once per outbox from the quoted table names. Every
// value is bound; only the validated, quoted table names are spliced in.
// They are written with ? placeholders and rebound for PostgreSQL. "{{IN}}"
// stands for a list of placeholders filled in per call (see in).
type statements struct {
	keyTable              string
	insertHead, insertRow string
	notify                string
	claim                 string
	markPublished         string
	markDelete            string
	markFailed            string
	cleanup, cleanupDead  string
	backlog               string
	requeueDead           string
}

// in replaces {{IN}} in stmt by n placeholders.
func in(stmt string, n int) string {
	return strings.Replace(stmt, "{{IN}}", strings.TrimSuffix(strings.Repeat("?, ", n), ", "), 1)
}

func buildStatements(d sqldialect.Dialect, table, keyTable string) statements {
	switch d {
	case sqldialect.Postgres:
		return postgresStatements(table)
	case sqldialect.MySQL:
		return mysqlStatements(table, keyTable)
	default:
		return sqliteStatements(table)
	}
}

// postgresStatements write pgoutbox's table layout; the relay is
// pgoutbox's.
func postgresStatements(table string) statements {
	r := strings.NewReplacer("{{T}}", table)
	return statements{
		insertHead: r.Replace(`INSERT INTO {{T}} (id, topic, key, key_hash, payload, headers) VALUES `),
		insertRow:  `(?::uuid, ?, ?, ?::integer, ?, ?::jsonb)`,
		notify:     `SELECT pg_notify($1, '')`,
		cleanup: r.Replace(`
DELETE FROM {{T}} WHERE seq = ANY (ARRAY(
    SELECT e.seq FROM {{T}} e
    WHERE e.state = 1 AND e.published_at <= clock_timestamp() - ? * interval '1 microsecond'
    ORDER BY e.published_at LIMIT ? FOR UPDATE SKIP LOCKED))`),
		cleanupDead: r.Replace(`
DELETE FROM {{T}} WHERE seq = ANY (ARRAY(
    SELECT e.seq FROM {{T}} e
    WHERE e.state = 2 AND e.dead_at <= clock_timestamp() - ? * interval '1 microsecond'
    ORDER BY e.dead_at LIMIT ? FOR UPDATE SKIP LOCKED))`),
		backlog: r.Replace(`
SELECT count(*), coalesce((extract(epoch FROM (clock_timestamp() - min(created_at))) * 1000000)::bigint, 0)
FROM {{T}} WHERE state = 0`),
		requeueDead: r.Replace(`
UPDATE {{T}} SET state = 0, attempts = 0, last_error = NULL, dead_at = NULL, available_at = clock_timestamp()
WHERE id::text IN ({{IN}}) AND state = 2`),
	}
}

// mysqlStatements: times are DATETIME(6) in UTC (UTC_TIMESTAMP), read back
// as microseconds since the epoch so that the driver's parseTime and loc
// settings do not matter.
func mysqlStatements(table, keyTable string) statements {
	pending := strings.Trim(table, "`")
	r := strings.NewReplacer("{{T}}", table, "{{NOW}}", "UTC_TIMESTAMP(6)",
		"{{PENDING}}", "`"+strings.ReplaceAll(pending+"_pending_idx", "`", "``")+"`")
	return statements{
		keyTable:   keyTable,
		insertHead: r.Replace(`INSERT INTO {{T}} (id, topic, msg_key, key_hash, payload, headers, created_at, available_at) VALUES `),
		insertRow:  r.Replace(`(?, ?, ?, ?, ?, ?, {{NOW}}, {{NOW}})`),

		// The oldest claimable rows: pending, due, and the head of their
		// key (no earlier pending row of the same key, whether it waits
		// for a retry or is held by another relay's batch). Rows another
		// transaction holds are skipped. The NOT EXISTS reads without
		// locking, the latest committed versions under READ COMMITTED.
		claim: r.Replace(`
SELECT o.seq, o.id, o.topic, o.msg_key, o.payload, o.headers,
       TIMESTAMPDIFF(MICROSECOND, '1970-01-01 00:00:00', o.created_at), o.attempts
FROM {{T}} o FORCE INDEX ({{PENDING}})
WHERE o.state = 0 AND o.available_at <= {{NOW}}
  AND (o.key_hash = 0 OR NOT EXISTS (
      SELECT 1 FROM {{T}} p
      WHERE p.key_hash = o.key_hash AND p.state = 0 AND p.seq < o.seq AND p.msg_key = o.msg_key))
ORDER BY o.seq LIMIT ?
FOR UPDATE SKIP LOCKED`),

		markPublished: r.Replace(`
UPDATE {{T}} SET state = 1, published_at = {{NOW}}, attempts = attempts + 1, last_error = NULL
WHERE seq IN ({{IN}}) AND state = 0`),
		markDelete: r.Replace(`DELETE FROM {{T}} WHERE seq IN ({{IN}}) AND state = 0`),

		// ? error, ? delay in µs, ? new state (0 or 2), ? new state again, ? seq.
		markFailed: r.Replace(`
UPDATE {{T}} SET attempts = attempts + 1, last_error = ?,
    available_at = {{NOW}} + INTERVAL ? MICROSECOND,
    state = ?, dead_at = CASE WHEN ? = 2 THEN {{NOW}} END
WHERE seq = ? AND state = 0`),

		// ? age in µs, ? batch size.
		cleanup: r.Replace(`
DELETE FROM {{T}} WHERE state = 1 AND published_at <= {{NOW}} - INTERVAL ? MICROSECOND
ORDER BY published_at LIMIT ?`),
		cleanupDead: r.Replace(`
DELETE FROM {{T}} WHERE state = 2 AND dead_at <= {{NOW}} - INTERVAL ? MICROSECOND
ORDER BY dead_at LIMIT ?`),

		backlog: r.Replace(`
SELECT COUNT(*), COALESCE(TIMESTAMPDIFF(MICROSECOND, MIN(created_at), {{NOW}}), 0)
FROM {{T}} WHERE state = 0`),
		requeueDead: r.Replace(`
UPDATE {{T}} SET state = 0, attempts = 0, last_error = NULL, dead_at = NULL, available_at = {{NOW}}
WHERE id IN ({{IN}}) AND state = 2`),
	}
}

// sqliteStatements: times are Unix microseconds.
func sqliteStatements(table string) statements {
	r := strings.NewReplacer("{{T}}", table, "{{NOW}}", "CAST(unixepoch('subsec') * 1000000 AS INTEGER)")
	return statements{
		insertHead: r.Replace(`INSERT INTO {{T}} (id, topic, msg_key, key_hash, payload, headers, created_at, available_at) VALUES `),
		insertRow:  r.Replace(`(?, ?, ?, ?, ?, ?, {{NOW}}, {{NOW}})`),

		// As on MySQL, without locks: SQLite has one relay.
		claim: r.Replace(`
SELECT o.seq, o.id, o.topic, o.msg_key, o.payload, o.headers, o.created_at, o.attempts
FROM {{T}} o
WHERE o.state = 0 AND o.available_at <= {{NOW}}
  AND (o.key_hash = 0 OR NOT EXISTS (
      SELECT 1 FROM {{T}} p
      WHERE p.key_hash = o.key_hash AND p.state = 0 AND p.seq < o.seq AND p.msg_key = o.msg_key))
ORDER BY o.seq LIMIT ?`),

		markPublished: r.Replace(`
UPDATE {{T}} SET state = 1, published_at = {{NOW}}, attempts = attempts + 1, last_error = NULL
WHERE seq IN ({{IN}}) AND state = 0`),
		markDelete: r.Replace(`DELETE FROM {{T}} WHERE seq IN ({{IN}}) AND state = 0`),
		markFailed: r.Replace(`
UPDATE {{T}} SET attempts = attempts + 1, last_error = ?,
    available_at = {{NOW}} + ?,
    state = ?, dead_at = CASE WHEN ? = 2 THEN {{NOW}} END
WHERE seq = ? AND state = 0`),

		cleanup: r.Replace(`
DELETE FROM {{T}} WHERE seq IN (
    SELECT seq FROM {{T}} WHERE state = 1 AND published_at <= {{NOW}} - ?
    ORDER BY published_at LIMIT ?)`),
		cleanupDead: r.Replace(`
DELETE FROM {{T}} WHERE seq IN (
    SELECT seq FROM {{T}} WHERE state = 2 AND dead_at <= {{NOW}} - ?
    ORDER BY dead_at LIMIT ?)`),

		backlog: r.Replace(`
SELECT COUNT(*), COALESCE({{NOW}} - MIN(created_at), 0) FROM {{T}} WHERE state = 0`),
		requeueDead: r.Replace(`
UPDATE {{T}} SET state = 0, attempts = 0, last_error = NULL, dead_at = NULL, available_at = {{NOW}}
WHERE id IN ({{IN}}) AND state = 2`),
	}
}
