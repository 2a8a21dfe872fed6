package walrelay

import (
	"context"
	"embed"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"github.com/idemkit/idem/internal/pgmigrate"
	"github.com/idemkit/idem/internal/sqlname"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/internal/relaycore"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// Sentinel errors.
var (
	// ErrSetup reports a server setting or privilege the relay needs;
	// the error text says what to change.
	ErrSetup = errors.New("walrelay: the server is not set up for logical replication")
	// ErrNoSlot reports that the replication slot does not exist.
	ErrNoSlot = errors.New("walrelay: replication slot does not exist")
	// ErrSlotActive reports that a relay streams the slot, which therefore
	// cannot be dropped.
	ErrSlotActive = errors.New("walrelay: replication slot is in use")
)

// minServerVersion is PostgreSQL 14: pgoutput's binary and messages options.
const minServerVersion = 140000

//go:embed migrations/*.sql
var migrationFS embed.FS

type tmplData struct{ schema, table string }

func (d tmplData) Dead() string { return sqlname.Qualified(d.schema, d.table+"_dead") }

func (d tmplData) DeadIndex() string { return sqlname.Quote(d.table + "_dead_at_idx") }

// Migrations returns the relay's own migrations (the dead table), in order.
// With SourceTable, Migrate also applies the outbox table's migrations
// (pgoutbox.Outbox.Migrations).
func (o *Outbox) Migrations() ([]pgoutbox.Migration, error) {
	return pgmigrate.Render("walrelay", migrationFS, "migrations", tmplData{schema: o.opts.Schema, table: o.opts.Table})
}

// SQL returns the relay's migrations (preceded, with SourceTable, by the
// outbox table's) and the publication as one script, for users who apply
// schema changes with goose, golang-migrate or by hand. The replication
// slot is not in it: create it with
// SELECT pg_create_logical_replication_slot('<slot>', 'pgoutput'), or let
// the relay create it when it first starts.
func (o *Outbox) SQL() (string, error) {
	var script string
	if o.table != nil {
		s, err := o.table.SQL()
		if err != nil {
			return "", err
		}
		script = s + "\n"
	}
	ms, err := o.Migrations()
	if err != nil {
		return "", err
	}
	script += pgmigrate.Script("walrelay", o.opts.Schema, ms)
	return script + "\n-- idem walrelay publication\n" + o.createPublication() + ";\n", nil
}

func (o *Outbox) createPublication() string {
	p := sqlname.Quote(o.opts.Publication)
	if o.opts.Source == SourceTable {
		return "CREATE PUBLICATION " + p + " FOR TABLE " + o.tableQ + " WITH (publish = 'insert')"
	}
	// Publishes no table: the relay reads the logical messages only.
	return "CREATE PUBLICATION " + p
}

func errNoPool(what string) error {
	return fmt.Errorf("walrelay: %s needs a pool; create the Outbox with New(pool, ...)", what)
}

// Check verifies that the server can run the relay: PostgreSQL 14 or
// later, wal_level = logical, max_replication_slots and max_wal_senders
// above zero, and a role with the REPLICATION attribute (or a superuser).
// Each problem found is an error wrapping ErrSetup that says exactly what
// to change. It logs a warning when max_slot_wal_keep_size is unlimited
// (-1): a stopped relay then makes PostgreSQL keep WAL until the disk is
// full.
func (o *Outbox) Check(ctx context.Context) error {
	if o.pool == nil {
		return errNoPool("Check")
	}
	var (
		version                  int
		walLevel, slots, senders string
		keepSize, role           string
		replication              bool
	)
	err := o.pool.QueryRow(ctx, `
SELECT current_setting('server_version_num')::int, current_setting('wal_level'),
       current_setting('max_replication_slots'), current_setting('max_wal_senders'),
       coalesce(current_setting('max_slot_wal_keep_size', true), ''), current_user::text,
       (SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user)`).
		Scan(&version, &walLevel, &slots, &senders, &keepSize, &role, &replication)
	if err != nil {
		return fmt.Errorf("walrelay: check server settings: %w", err)
	}
	var errs []error
	if version < minServerVersion {
		errs = append(errs, fmt.Errorf("%w: PostgreSQL %d.%d is too old: the WAL relay needs 14 or later (pgoutput's binary and messages options); use the poll relay (outbox/pgoutbox) on older servers",
			ErrSetup, version/10000, version%10000))
	}
	if walLevel != "logical" {
		errs = append(errs, fmt.Errorf("%w: wal_level is %q; it must be logical: run ALTER SYSTEM SET wal_level = logical (or set it in postgresql.conf; on Amazon RDS and Aurora set rds.logical_replication = 1 in the parameter group, on Cloud SQL the flag cloudsql.logical_decoding = on) and restart PostgreSQL: wal_level takes effect only at server start",
			ErrSetup, walLevel))
	}
	if n, _ := strconv.Atoi(slots); n < 1 {
		errs = append(errs, fmt.Errorf("%w: max_replication_slots is %s; set it to at least 1 (one per WAL relay outbox, plus the slots of other consumers) and restart PostgreSQL",
			ErrSetup, slots))
	}
	if n, _ := strconv.Atoi(senders); n < 1 {
		errs = append(errs, fmt.Errorf("%w: max_wal_senders is %s; set it to at least 1 (one per streaming relay, plus standbys and other consumers) and restart PostgreSQL",
			ErrSetup, senders))
	}
	if !replication {
		errs = append(errs, fmt.Errorf("%w: role %s may not stream replication: run ALTER ROLE %s WITH REPLICATION (on Amazon RDS: GRANT rds_replication TO %s)",
			ErrSetup, role, sqlname.Quote(role), sqlname.Quote(role)))
	}
	if len(errs) == 0 && keepSize == "-1" {
		o.opts.Logger.Warn("walrelay: max_slot_wal_keep_size is -1 (unlimited): a stopped relay makes PostgreSQL keep WAL until the disk fills; consider a limit (the slot is then invalidated past it, see the walrelay package documentation)",
			"slot", o.opts.Slot)
	}
	return errors.Join(errs...)
}

// Migrate checks the server (Check), then applies what is missing: with
// SourceTable the outbox table (pgoutbox's migrations), the dead table, the
// publication, and the replication slot. Creating the slot here, not only
// when the relay first starts, means that messages enqueued between Migrate
// and the relay's first start are published too. Safe to run from several
// processes at once.
//
// An existing publication of the same name is kept; with SourceTable it
// must publish the inserts of the outbox table, or Migrate fails with the
// statement that fixes it.
func (o *Outbox) Migrate(ctx context.Context) error {
	if o.pool == nil {
		return errNoPool("Migrate")
	}
	if err := o.Check(ctx); err != nil {
		return err
	}
	if o.table != nil {
		if err := o.table.Migrate(ctx); err != nil {
			return err
		}
	}
	ms, err := o.Migrations()
	if err != nil {
		return err
	}
	err = pgmigrate.Migrate(ctx, o.pool, pgmigrate.Target{
		Who:          "walrelay",
		Schema:       o.opts.Schema,
		VersionTable: o.verQ,
		LockKey:      pgmigrate.LockKey("idem:walrelay:migrate:" + o.opts.Schema + "." + o.opts.Table),
	}, ms, o.ensurePublication)
	if err != nil {
		return err
	}
	_, err = o.ensureSlot(ctx)
	return err
}

// ensurePublication creates the publication, or checks the existing one.
func (o *Outbox) ensurePublication(ctx context.Context, tx pgx.Tx) error {
	var exists, inserts bool
	if err := tx.QueryRow(ctx, `SELECT count(*) > 0, coalesce(bool_and(pubinsert), false) FROM pg_publication WHERE pubname = $1`,
		o.opts.Publication).Scan(&exists, &inserts); err != nil {
		return fmt.Errorf("walrelay: migrate: publication: %w", err)
	}
	if !exists {
		if _, err := tx.Exec(ctx, o.createPublication()); err != nil {
			return fmt.Errorf("walrelay: migrate: %s: %w", o.createPublication(), err)
		}
		return nil
	}
	if o.opts.Source != SourceTable {
		return nil
	}
	var published bool
	if err := tx.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_publication_tables WHERE pubname = $1 AND schemaname = $2 AND tablename = $3)`,
		o.opts.Publication, o.opts.Schema, o.opts.Table).Scan(&published); err != nil {
		return fmt.Errorf("walrelay: migrate: publication: %w", err)
	}
	p := sqlname.Quote(o.opts.Publication)
	switch {
	case !published:
		return fmt.Errorf("%w: publication %s exists but does not publish %s: run ALTER PUBLICATION %s ADD TABLE %s, or name another publication in Options.Publication",
			ErrSetup, o.opts.Publication, o.tableQ, p, o.tableQ)
	case !inserts:
		return fmt.Errorf("%w: publication %s does not publish inserts: run ALTER PUBLICATION %s SET (publish = 'insert')",
			ErrSetup, o.opts.Publication, p)
	}
	return nil
}

// ensureSlot creates the replication slot when it does not exist, and
// reports whether it did. A slot created now starts at the current end of
// the WAL: what was committed before is not published.
func (o *Outbox) ensureSlot(ctx context.Context) (bool, error) {
	var plugin, db string
	var sameDB bool
	err := o.pool.QueryRow(ctx, `SELECT coalesce(plugin, ''), coalesce(database, ''), database = current_database() FROM pg_replication_slots WHERE slot_name = $1`,
		o.opts.Slot).Scan(&plugin, &db, &sameDB)
	switch {
	case err == nil:
		if plugin != "pgoutput" || !sameDB {
			return false, fmt.Errorf("%w: replication slot %s exists but is not a pgoutput slot of this database (plugin %q, database %q): drop it or name another one in Options.Slot",
				ErrSetup, o.opts.Slot, plugin, db)
		}
		return false, nil
	case !errors.Is(err, pgx.ErrNoRows):
		return false, fmt.Errorf("walrelay: look up replication slot %s: %w", o.opts.Slot, err)
	}
	// Outside a transaction: a slot cannot be created in a transaction
	// that wrote. It waits for the transactions running now to end.
	if _, err := o.pool.Exec(ctx, `SELECT pg_create_logical_replication_slot($1, 'pgoutput')`, o.opts.Slot); err != nil {
		var pe *pgconn.PgError
		if errors.As(err, &pe) && pe.Code == "42710" { // duplicate_object: created meanwhile
			return false, nil
		}
		return false, fmt.Errorf("walrelay: create replication slot %s: %w", o.opts.Slot, err)
	}
	o.opts.Logger.Info("walrelay: replication slot created", "slot", o.opts.Slot)
	return true, nil
}

// SlotInfo describes the replication slot (pg_replication_slots).
type SlotInfo struct {
	Name     string
	Plugin   string
	Database string
	// Active is true while a relay streams the slot; ActivePID is the
	// server process serving it (0 when not active).
	Active    bool
	ActivePID int32
	// ConfirmedLSN is the position up to which every message was
	// published and confirmed (confirmed_flush_lsn); RestartLSN is the
	// oldest WAL the slot makes the server keep.
	ConfirmedLSN, RestartLSN string
	// LagBytes is the WAL written since ConfirmedLSN: what a relay has
	// not confirmed yet. RetainedBytes is the WAL kept for the slot (from
	// RestartLSN): the disk it costs.
	LagBytes, RetainedBytes int64
	// WALStatus is reserved, extended, unreserved or lost (the slot was
	// invalidated past max_slot_wal_keep_size and cannot stream again).
	WALStatus string
	// SafeWALSize is how many more bytes of WAL can be written before the
	// slot is in danger of invalidation; -1 when max_slot_wal_keep_size
	// is unlimited.
	SafeWALSize int64
}

// Slot returns the replication slot's state, or an error wrapping ErrNoSlot.
func (o *Outbox) Slot(ctx context.Context) (SlotInfo, error) {
	if o.pool == nil {
		return SlotInfo{}, errNoPool("Slot")
	}
	var s SlotInfo
	err := o.pool.QueryRow(ctx, `
SELECT slot_name::text, coalesce(plugin, ''), coalesce(database, ''), active, coalesce(active_pid, 0),
       coalesce(confirmed_flush_lsn::text, ''), coalesce(restart_lsn::text, ''),
       coalesce(pg_wal_lsn_diff(pg_current_wal_insert_lsn(), confirmed_flush_lsn), 0)::bigint,
       coalesce(pg_wal_lsn_diff(pg_current_wal_insert_lsn(), restart_lsn), 0)::bigint,
       coalesce(wal_status, ''), coalesce(safe_wal_size, -1)
FROM pg_replication_slots WHERE slot_name = $1`, o.opts.Slot).Scan(
		&s.Name, &s.Plugin, &s.Database, &s.Active, &s.ActivePID, &s.ConfirmedLSN, &s.RestartLSN,
		&s.LagBytes, &s.RetainedBytes, &s.WALStatus, &s.SafeWALSize)
	if errors.Is(err, pgx.ErrNoRows) {
		return SlotInfo{}, fmt.Errorf("%w: %s", ErrNoSlot, o.opts.Slot)
	}
	if err != nil {
		return SlotInfo{}, fmt.Errorf("walrelay: slot %s: %w", o.opts.Slot, err)
	}
	return s, nil
}

// DropSlot drops the replication slot, so that PostgreSQL stops keeping
// WAL for it. Messages committed after the slot's confirmed position are
// then never published by the WAL relay (a relay started later creates a
// new slot at the current end of the WAL); with SourceTable their rows are
// still in the table until Cleanup, and the poll relay (outbox/pgoutbox)
// can publish them. It fails with ErrSlotActive while a relay streams the
// slot (stop it first), and with ErrNoSlot when there is none.
func (o *Outbox) DropSlot(ctx context.Context) error {
	if o.pool == nil {
		return errNoPool("DropSlot")
	}
	_, err := o.pool.Exec(ctx, `SELECT pg_drop_replication_slot($1)`, o.opts.Slot)
	var pe *pgconn.PgError
	switch {
	case err == nil:
		return nil
	case errors.As(err, &pe) && pe.Code == "55006": // object_in_use
		return fmt.Errorf("%w: %s is streamed by a relay (%s); stop the relay, then drop the slot", ErrSlotActive, o.opts.Slot, pe.Message)
	case errors.As(err, &pe) && pe.Code == "42704": // undefined_object
		return fmt.Errorf("%w: %s", ErrNoSlot, o.opts.Slot)
	}
	return fmt.Errorf("walrelay: drop slot %s: %w", o.opts.Slot, err)
}

// Cleanup deletes the outbox table's rows (SourceTable) older than
// Options.Retention, oldest first, in batches of Options.CleanupBatch, and
// returns how many it deleted. The WAL relay never marks rows: its
// position in the WAL is its cursor, and a row's insert stays in the WAL
// whether the row is deleted or not, so Cleanup never loses a message.
// With SourceMessages there is no table and Cleanup does nothing.
func (o *Outbox) Cleanup(ctx context.Context) (int64, error) {
	if o.table == nil {
		return 0, nil
	}
	if o.pool == nil {
		return 0, errNoPool("Cleanup")
	}
	// The inner query reads the oldest CleanupBatch rows by the primary
	// key and keeps those past the retention: a bounded index scan, even
	// when nothing is old enough.
	stmt := `DELETE FROM ` + o.tableQ + ` WHERE seq = ANY (ARRAY(
    SELECT s.seq FROM (SELECT seq, created_at FROM ` + o.tableQ + ` ORDER BY seq LIMIT $2) s
    WHERE s.created_at <= clock_timestamp() - $1 * interval '1 millisecond'))`
	return relaycore.DeleteBatches(ctx, o.opts.CleanupBatch, func(ctx context.Context) (int64, error) {
		tag, err := o.pool.Exec(ctx, stmt, o.opts.Retention.Milliseconds(), o.opts.CleanupBatch)
		if err != nil {
			return 0, fmt.Errorf("walrelay: cleanup %s: %w", o.tableQ, err)
		}
		return tag.RowsAffected(), nil
	})
}

// RequeueDead enqueues the parked messages with the given ids again, in
// one transaction, with their ids, topics, keys, payloads and headers, and
// removes them from the dead table; it returns how many it found. A
// requeued message is published after the messages committed before the
// requeue, so a key's later messages may already be out.
func (o *Outbox) RequeueDead(ctx context.Context, ids ...string) (int64, error) {
	if o.pool == nil {
		return 0, errNoPool("RequeueDead")
	}
	var n int64
	err := pgx.BeginFunc(ctx, o.pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, `DELETE FROM `+o.deadQ+` WHERE id = ANY ($1::uuid[])
RETURNING id::text, topic, key, payload, headers::text`, ids)
		if err != nil {
			return err
		}
		var msgs []outbox.Message
		for rows.Next() {
			var m outbox.Message
			var headers string
			if err := rows.Scan(&m.ID, &m.Topic, &m.Key, &m.Payload, &headers); err != nil {
				rows.Close()
				return err
			}
			if headers != "{}" {
				if err := json.Unmarshal([]byte(headers), &m.Headers); err != nil {
					rows.Close()
					return fmt.Errorf("headers of a dead message: %w", err)
				}
			}
			msgs = append(msgs, m)
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return err
		}
		if len(msgs) == 0 {
			return nil
		}
		if o.table != nil {
			// The row of the first attempt may still be there
			// (Retention); the id is unique in the table.
			if _, err := tx.Exec(ctx, `DELETE FROM `+o.tableQ+` WHERE id = ANY ($1::uuid[])`, ids); err != nil {
				return err
			}
		}
		if _, err := o.Enqueue(ctx, tx, msgs...); err != nil {
			return err
		}
		n = int64(len(msgs))
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("walrelay: requeue dead from %s: %w", o.deadQ, err)
	}
	return n, nil
}
