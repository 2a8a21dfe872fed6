package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	"github.com/google/uuid"

	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

const outboxSynopsis = `outbox [flags] stats|dead|requeue ID...

  stats          pending messages, the oldest one's age, published and dead counts
  dead           the dead messages with their last error (--limit)
  requeue ID...  make dead messages pending again (RequeueDead)

"idem deadletter --outbox" lists them grouped, replays (requeues) and
discards them by selection, as it does the brokers' dead letters.`

// splitAction takes the action (and its arguments) before or after the flags.
func splitAction(args []string) (action string, rest []string) {
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		return args[0], args[1:]
	}
	return "", args
}

func runOutbox(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("outbox", outboxSynopsis, stderr)
	var pg pgFlags
	pg.register(fs, withOutbox)
	limit := fs.Int("limit", 50, "most dead messages to list")
	action, args := splitAction(args)
	var pre []string
	if action != "" {
		// Arguments of the action (ids) may precede the flags.
		for len(args) > 0 && !strings.HasPrefix(args[0], "-") {
			pre, args = append(pre, args[0]), args[1:]
		}
	}
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	operands := slices.Concat(pre, fs.Args())
	if action == "" && len(operands) > 0 {
		action, operands = operands[0], operands[1:]
	}
	switch action {
	case "stats", "dead":
		if len(operands) > 0 {
			return usageError(fs, "unexpected argument %q", operands[0])
		}
	case "requeue":
		if len(operands) == 0 {
			return usageError(fs, "requeue needs the ids of dead messages")
		}
		for _, id := range operands {
			if _, err := uuid.Parse(id); err != nil {
				return usageError(fs, "%q is not a message id: ids are UUIDs, as \"idem outbox dead\" lists them", id)
			}
		}
	case "":
		return usageError(fs, "missing action: stats, dead or requeue")
	default:
		return usageError(fs, "unknown action %q: want stats, dead or requeue", action)
	}
	pool, err := pg.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	ob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: pg.schema, Table: pg.outboxTable})
	if err != nil {
		return err
	}
	switch action {
	case "stats":
		pending, oldest, err := ob.Backlog(ctx)
		if err != nil {
			return fmt.Errorf("%s: %w", ob.Table(), err)
		}
		var published, dead int64
		err = pool.QueryRow(ctx, "SELECT count(*) FILTER (WHERE state = 1), count(*) FILTER (WHERE state = 2) FROM "+ob.Table()).
			Scan(&published, &dead)
		if err != nil {
			return fmt.Errorf("%s: %w", ob.Table(), err)
		}
		fprintf(stdout, "%s: %d pending (oldest %v), %d published (kept for retention), %d dead\n",
			ob.Table(), pending, oldest.Round(time.Millisecond), published, dead)
	case "dead":
		dead, err := ob.Dead(ctx, nil, *limit)
		if err != nil {
			return err
		}
		for _, m := range dead {
			fprintf(stdout, "%s  topic=%s attempts=%d dead_at=%s error=%q\n", m.ID, m.Topic, m.Attempts, m.DeadAt.UTC().Format(time.RFC3339), m.LastError)
		}
		if len(dead) == 0 {
			fprintf(stdout, "%s: no dead messages\n", ob.Table())
		}
	case "requeue":
		n, err := ob.RequeueDead(ctx, operands...)
		if err != nil {
			return fmt.Errorf("%s: %w", ob.Table(), err)
		}
		fprintf(stdout, "requeued %d of %d messages\n", n, len(operands))
		if n != int64(len(operands)) {
			return errors.New("some ids are not dead messages of this outbox")
		}
	}
	return nil
}

const dedupSynopsis = `dedup [flags] stats|cleanup
       dedup show --scope S --id ID [flags]   (see "idem dedup show -h")

  stats    rows per scope (of stores that keep scopes: pgtable Options.KeepKeys):
           done and in flight, expired (cleanup deletes them), the next expiry
  cleanup  delete the expired rows now, in bounded batches
  show     one key in pgtable, sqltable or redisnx: state, expiry,
           fingerprint, result`

func runDedup(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	if len(args) > 0 && args[0] == "show" {
		return runDedupShow(ctx, args[1:], stdout, stderr)
	}
	fs := newFlagSet("dedup", dedupSynopsis, stderr)
	var pg pgFlags
	pg.register(fs, withDedup)
	action, args := splitAction(args)
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	operands := fs.Args()
	if action == "" && len(operands) > 0 {
		action, operands = operands[0], operands[1:]
	}
	if len(operands) > 0 {
		return usageError(fs, "unexpected argument %q", operands[0])
	}
	switch action {
	case "stats", "cleanup":
	case "show":
		return usageError(fs, "write show first, then its flags: idem dedup show --scope S --id ID ...")
	case "":
		return usageError(fs, "missing action: stats, cleanup or show")
	default:
		return usageError(fs, "unknown action %q: want stats, cleanup or show", action)
	}
	pool, err := pg.connect(ctx)
	if err != nil {
		return err
	}
	defer pool.Close()
	store, err := pgtable.New(pool, pgtable.Options{Schema: pg.schema, Table: pg.dedupTable})
	if err != nil {
		return err
	}
	if action == "cleanup" {
		n, err := store.Cleanup(ctx)
		if err != nil {
			return fmt.Errorf("%s: %w", store.Table(), err)
		}
		fprintf(stdout, "%s: deleted %d expired rows\n", store.Table(), n)
		return nil
	}
	// A row with a token is in flight, one without is done; a row whose
	// expires_at has passed (a lease that ran out, a done key past its
	// retention) counts as expired: it no longer holds its key, and
	// cleanup deletes it. scope is NULL in the rows of a store that does
	// not keep keys.
	rows, err := pool.Query(ctx, `SELECT scope,
    count(*) FILTER (WHERE token IS NULL AND expires_at > now()),
    count(*) FILTER (WHERE token IS NOT NULL AND expires_at > now()),
    count(*) FILTER (WHERE expires_at <= now()),
    min(expires_at) FILTER (WHERE expires_at > now())
FROM `+store.Table()+` GROUP BY scope ORDER BY scope NULLS LAST`)
	if err != nil {
		return fmt.Errorf("%s: %w", store.Table(), err)
	}
	defer rows.Close()
	n := 0
	for rows.Next() {
		var (
			scope                 *string
			done, flight, expired int64
			next                  *time.Time
		)
		if err := rows.Scan(&scope, &done, &flight, &expired, &next); err != nil {
			return err
		}
		n++
		name := "(scope not kept)"
		if scope != nil {
			name = *scope
		}
		nextAt := "none"
		if next != nil {
			nextAt = next.UTC().Format(time.RFC3339)
		}
		fprintf(stdout, "%-40s %10d done %6d in flight %6d expired  next expiry %s\n", name, done, flight, expired, nextAt)
	}
	if err := rows.Err(); err != nil {
		return err
	}
	if n == 0 {
		fprintf(stdout, "%s: empty\n", store.Table())
	}
	return nil
}
