package walrelay

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pglogrepl"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/idemkit/idem/outbox"
)

// session is one replication connection: a reader (the session's own
// goroutine) that decodes the stream and reports the confirmed position,
// and an engine goroutine that publishes. When either ends, both do, and
// what was not confirmed is sent again by the server on the next session.
type session struct {
	r        *Relay
	conn     *pgconn.PgConn
	streamed bool // streaming started: the reconnect backoff restarts

	// confirmed is the position up to which every message is published
	// or parked: written by the engine, reported by the reader.
	confirmed atomic.Uint64
	reported  pglogrepl.LSN

	relations map[uint32]*relation
	types     *pgtype.Map
}

// slotBusyError says that another relay streams the slot.
type slotBusyError struct{ msg string }

func (e *slotBusyError) Error() string { return "walrelay: slot in use: " + e.msg }

func newSession(r *Relay) *session {
	return &session{r: r, relations: map[uint32]*relation{}, types: pgtype.NewMap()}
}

// item is what the reader hands the engine: messages of a transaction, in
// commit order, and then the transaction's commit (end set).
type item struct {
	tx      *txn
	entries []*entry
	end     pglogrepl.LSN // the commit's end; 0 for a chunk of messages
}

// chunk is how many messages the reader hands over at once.
const chunk = 128

func (s *session) run(ctx context.Context) error {
	if err := s.connect(ctx); err != nil {
		return err
	}
	defer s.close(ctx)
	if h := s.r.hooks.streaming; h != nil {
		h()
	}
	sctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	items := make(chan item, 64)
	e := newEngine(s.r, &s.confirmed)
	var (
		wg        sync.WaitGroup
		engineErr error
	)
	wg.Go(func() {
		engineErr = e.run(sctx, items)
		cancel(errors.New("engine stopped"))
	})
	readErr := s.read(sctx, items)
	cancel(errors.New("reader stopped"))
	wg.Wait()
	e.finish()
	if ctx.Err() != nil {
		return nil
	}
	return errors.Join(readErr, engineErr)
}

// connect opens the replication connection, makes sure the slot and the
// publication exist, and starts streaming from the slot's confirmed
// position.
func (s *session) connect(ctx context.Context) error {
	r := s.r
	o := r.ob
	qctx, cancel := context.WithTimeout(ctx, r.opts.QueryTimeout)
	defer cancel()
	var pubExists bool
	if err := o.pool.QueryRow(qctx, `SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)`, o.opts.Publication).Scan(&pubExists); err != nil {
		return fmt.Errorf("look up publication: %w", err)
	}
	if !pubExists {
		return fmt.Errorf("%w: publication %s does not exist; run Outbox.Migrate", errFatal, o.opts.Publication)
	}
	if created, err := o.ensureSlot(qctx); err != nil {
		if errors.Is(err, ErrSetup) {
			return fmt.Errorf("%w: %w", errFatal, err)
		}
		return err
	} else if created {
		r.opts.Logger.Warn("walrelay: replication slot did not exist and was created now: messages committed before this moment are not published (run Migrate before enqueueing to create it early)",
			"slot", o.opts.Slot)
	}
	var start string
	if err := o.pool.QueryRow(qctx, `SELECT coalesce(confirmed_flush_lsn::text, '0/0') FROM pg_replication_slots WHERE slot_name = $1`, o.opts.Slot).Scan(&start); err != nil {
		return fmt.Errorf("read slot position: %w", err)
	}
	lsn, err := pglogrepl.ParseLSN(start)
	if err != nil {
		return fmt.Errorf("read slot position: %w", err)
	}
	s.confirmed.Store(uint64(lsn))
	s.reported = lsn

	cfg := r.connCfg.Copy()
	if cfg.RuntimeParams == nil {
		cfg.RuntimeParams = map[string]string{}
	}
	cfg.RuntimeParams["replication"] = "database"
	if cfg.RuntimeParams["application_name"] == "" {
		cfg.RuntimeParams["application_name"] = "idem-wal-relay"
	}
	// A deadline, not a cancel request, ends a receive that waits: the
	// stream stays usable.
	cfg.BuildContextWatcherHandler = func(pc *pgconn.PgConn) ctxwatch.Handler {
		return &pgconn.DeadlineContextWatcherHandler{Conn: pc.Conn()}
	}
	conn, err := pgconn.ConnectConfig(qctx, cfg)
	if err != nil {
		if poolerRefusesReplication(err) {
			return fmt.Errorf("%w: the replication connection to %s was refused by a connection pooler (%w), and a pooler in transaction mode "+
				"could not keep a replication stream anyway: set RelayOptions.ConnConfig to a direct connection to PostgreSQL "+
				"(the Outbox's pool may stay on the pooler)", errFatal, cfg.Host, err)
		}
		return fmt.Errorf("connect: %w", err)
	}
	s.conn = conn
	args := []string{
		"proto_version '1'",
		"publication_names '" + o.opts.Publication + "'", // checked: lowercase identifier
		"binary 'true'",
	}
	if o.opts.Source == SourceMessages {
		args = append(args, "messages 'true'")
	}
	err = pglogrepl.StartReplication(qctx, conn, o.opts.Slot, 0, pglogrepl.StartReplicationOptions{PluginArgs: args})
	if err != nil {
		_ = conn.Close(context.Background())
		s.conn = nil
		var pe *pgconn.PgError
		if errors.As(err, &pe) {
			switch pe.Code {
			case "55006": // object_in_use: another relay streams the slot
				return &slotBusyError{msg: pe.Message}
			case "55000": // object_not_in_prerequisite_state: invalidated slot
				return fmt.Errorf("%w: slot %s cannot stream: %s (the slot lost WAL it needed: see the walrelay package documentation on max_slot_wal_keep_size)",
					errFatal, o.opts.Slot, pe.Message)
			case "42704", "22023": // the publication, or an option, is unknown
				return fmt.Errorf("%w: start replication: %s", errFatal, pe.Message)
			}
		}
		return fmt.Errorf("start replication: %w", err)
	}
	s.streamed = true
	r.opts.Logger.Info("walrelay: streaming", "slot", o.opts.Slot, "from", lsn.String())
	return nil
}

// close reports the confirmed position one last time (a clean stop loses
// nothing and re-publishes nothing) and closes the connection.
func (s *session) close(ctx context.Context) {
	if s.conn == nil {
		return
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if !s.conn.IsClosed() {
		_ = s.report(cctx)
	}
	_ = s.conn.Close(cctx)
	s.conn = nil
}

// report sends the confirmed position as a standby status update. Write,
// flush and apply positions are all the confirmed one: the server takes
// the flush position as the slot's confirmed_flush_lsn.
func (s *session) report(ctx context.Context) error {
	lsn := pglogrepl.LSN(s.confirmed.Load())
	if lsn == 0 {
		return nil
	}
	if err := pglogrepl.SendStandbyStatusUpdate(ctx, s.conn, pglogrepl.StandbyStatusUpdate{
		WALWritePosition: lsn, WALFlushPosition: lsn, WALApplyPosition: lsn,
	}); err != nil {
		return fmt.Errorf("standby status update: %w", err)
	}
	s.reported = lsn
	return nil
}

// read decodes the stream into items until ctx ends or the stream fails.
// It reports the confirmed position every StatusInterval, and at once when
// the server asks, also while it waits for the engine to take an item.
func (s *session) read(ctx context.Context, items chan<- item) error {
	defer close(items)
	rd := reader{s: s, items: items, nextStatus: time.Now()}
	for {
		if ctx.Err() != nil {
			return nil
		}
		if err := rd.statusIfDue(ctx); err != nil {
			return err
		}
		rctx, cancel := context.WithDeadline(ctx, rd.nextStatus)
		msg, err := s.conn.ReceiveMessage(rctx)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if pgconn.Timeout(err) {
				continue
			}
			return fmt.Errorf("receive: %w", err)
		}
		switch m := msg.(type) {
		case *pgproto3.CopyData:
			if err := rd.copyData(ctx, m.Data); err != nil {
				return err
			}
		case *pgproto3.ErrorResponse:
			return fmt.Errorf("stream: %w", pgconn.ErrorResponseToPgError(m))
		case *pgproto3.CopyDone:
			return errors.New("stream: the server ended the replication stream")
		}
	}
}

// reader is the state of read: the transaction being received.
type reader struct {
	s          *session
	items      chan<- item
	nextStatus time.Time
	tx         *txn     // between BEGIN and COMMIT
	pending    []*entry // messages of tx not handed over yet
	handed     bool     // some of tx's messages were handed over
	marked     pglogrepl.LSN
}

func (rd *reader) statusIfDue(ctx context.Context) error {
	if time.Now().Before(rd.nextStatus) {
		return nil
	}
	rd.nextStatus = time.Now().Add(rd.s.r.opts.StatusInterval)
	return rd.s.report(ctx)
}

// hand gives it to the engine, reporting the position meanwhile. It does
// not give up when ctx ends: the engine takes every item until the reader
// closes items, so a commit received before a shutdown still counts for
// the final position.
func (rd *reader) hand(ctx context.Context, it item) error {
	select {
	case rd.items <- it:
		return nil
	default:
	}
	for {
		t := time.NewTimer(time.Until(rd.nextStatus))
		select {
		case rd.items <- it:
			t.Stop()
			return nil
		case <-t.C:
			if ctx.Err() != nil {
				// The engine finishes its batch, then drains.
				rd.items <- it
				return nil
			}
			if err := rd.statusIfDue(ctx); err != nil {
				return err
			}
		}
	}
}

func (rd *reader) flush(ctx context.Context) error {
	if len(rd.pending) == 0 {
		return nil
	}
	it := item{tx: rd.tx, entries: rd.pending}
	rd.pending = nil
	rd.handed = true
	return rd.hand(ctx, it)
}

func (rd *reader) copyData(ctx context.Context, data []byte) error {
	if len(data) == 0 {
		return nil
	}
	switch data[0] {
	case pglogrepl.PrimaryKeepaliveMessageByteID:
		pkm, err := pglogrepl.ParsePrimaryKeepaliveMessage(data[1:])
		if err != nil {
			return fmt.Errorf("keepalive: %w", err)
		}
		if pkm.ReplyRequested {
			rd.nextStatus = time.Time{}
		}
		// Between transactions, everything up to the server's position
		// was received: once what came before is done, the slot may
		// move there (so it does not hold WAL while idle).
		if rd.tx == nil && pkm.ServerWALEnd > rd.marked {
			rd.marked = pkm.ServerWALEnd
			return rd.hand(ctx, item{tx: &txn{}, end: pkm.ServerWALEnd})
		}
		return nil
	case pglogrepl.XLogDataByteID:
		xld, err := pglogrepl.ParseXLogData(data[1:])
		if err != nil {
			return fmt.Errorf("xlog data: %w", err)
		}
		return rd.logical(ctx, xld)
	}
	return nil
}

func (rd *reader) logical(ctx context.Context, xld pglogrepl.XLogData) error {
	lm, err := pglogrepl.Parse(xld.WALData)
	if err != nil {
		return fmt.Errorf("decode pgoutput message: %w", err)
	}
	s := rd.s
	switch m := lm.(type) {
	case *pglogrepl.RelationMessage:
		s.relations[m.RelationID] = newRelation(m)
	case *pglogrepl.BeginMessage:
		now := time.Now()
		// The commit time by the local clock: now, less how long ago
		// the server committed by its own clock.
		rd.tx = &txn{commit: m.CommitTime, final: m.FinalLSN, localCommit: now.Add(-max(xld.ServerTime.Sub(m.CommitTime), 0))}
		rd.handed = false
	case *pglogrepl.InsertMessage:
		if rd.tx == nil || s.r.ob.opts.Source != SourceTable {
			return nil
		}
		rel := s.relations[m.RelationID]
		if rel == nil || !rel.is(s.r.ob.opts.Schema, s.r.ob.opts.Table) {
			return nil
		}
		msg, err := rel.decode(s.types, m.Tuple)
		if err != nil {
			return fmt.Errorf("decode a row of %s: %w", s.r.ob.tableQ, err)
		}
		rd.pending = append(rd.pending, &entry{msg: msg, key: string(msg.Key), tx: rd.tx})
	case *pglogrepl.LogicalDecodingMessage:
		if rd.tx == nil || !m.Transactional || s.r.ob.opts.Source != SourceMessages || m.Prefix != s.r.ob.opts.Prefix {
			return nil
		}
		msgs, err := decodeMessages(m.Content)
		if err != nil {
			// Not ours after all, or damaged: park it as it is, with an
			// id derived from its position, so nothing is lost silently.
			id := uuid.NewSHA1(uuid.NameSpaceOID, fmt.Appendf(nil, "%s/%s", s.r.ob.opts.Slot, m.LSN))
			msg := &outbox.Message{ID: id.String(), Payload: append([]byte(nil), m.Content...)}
			rd.pending = append(rd.pending, &entry{msg: msg, tx: rd.tx, corrupt: err})
			break
		}
		for _, msg := range msgs {
			msg.CreatedAt = rd.tx.commit
			rd.pending = append(rd.pending, &entry{msg: msg, key: string(msg.Key), tx: rd.tx})
		}
	case *pglogrepl.CommitMessage:
		if rd.tx == nil {
			return nil
		}
		if err := rd.flush(ctx); err != nil {
			return err
		}
		if h := s.r.hooks.beforeCommit; h != nil && rd.handed {
			h()
		}
		tx := rd.tx
		rd.tx = nil
		if m.TransactionEndLSN > rd.marked {
			rd.marked = m.TransactionEndLSN
		}
		return rd.hand(ctx, item{tx: tx, end: m.TransactionEndLSN})
	}
	if len(rd.pending) >= chunk {
		return rd.flush(ctx)
	}
	return nil
}

// poolerRefusesReplication reports the error PgBouncer (before 1.23)
// answers a replication connection with: a startup parameter it does not
// know. PostgreSQL itself never says so.
func poolerRefusesReplication(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && strings.Contains(pe.Message, "unsupported startup parameter") && strings.Contains(pe.Message, "replication")
}
