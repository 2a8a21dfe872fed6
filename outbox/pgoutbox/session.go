package pgoutbox

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/backoff"
	"github.com/idemkit/idem/internal/pgdirect"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/internal/relaycore"
)

// session is one claim loop on a dedicated connection, plus a second one
// for the batch it claims while the previous batch is being published. Only
// its goroutine touches it (pgx calls OnNotification from the goroutine
// reading the connection).
type session struct {
	r    *Relay
	idx  int
	conn *pgx.Conn // LISTENs, holds the shard locks, runs claims
	aux  *pgx.Conn // runs the claim taken while conn's batch is published; opened on first use

	flight *flight // the batch being published, nil when none

	notified      bool    // a notification arrived since the last claim
	rebalanceSoon bool    // another session joined or gave shards back
	retries       bool    // a row of the owned shards may wait for a retry
	owned         []int32 // shards held, sorted
	nextRebalance time.Time
	mismatch      bool // another shard count is in use
	worked        bool // connected and set up: the reconnect backoff restarts
	announce      bool // tell the other sessions to rebalance now
	pubBackoff    backoff.Growing
}

const memberShard = 0xFFFF

// rebalancePayload is the notification a session sends when it joins or
// gives shards back, so that the others rebalance at once rather than at
// their next RebalanceInterval: a hand-over then leaves a shard without an
// owner for milliseconds. (A session that dies cannot announce it; its
// shards wait for the others' next periodic rebalance.)
const rebalancePayload = "idem:rebalance"

// lockKey2 is the second key of the session-level advisory locks: the shard
// count in the high bits, so relays configured differently see each other.
func (s *session) lockKey2(shard int) int32 { return int32(s.r.opts.Shards<<16 | shard) }

func (s *session) run(ctx context.Context) error {
	if err := s.connect(ctx); err != nil {
		return err
	}
	defer s.close()
	s.worked = true
	for {
		if ctx.Err() != nil {
			return nil
		}
		// Rebalancing runs on conn, so not while conn's transaction holds
		// the batch being published: the next cycle frees it.
		if (s.rebalanceSoon || !time.Now().Before(s.nextRebalance)) && (s.flight == nil || s.flight.conn != s.conn) {
			s.rebalanceSoon = false
			if err := s.rebalance(ctx); err != nil {
				return err
			}
		}
		n, err := s.cycle(ctx)
		var pf *relaycore.PublishFailure
		switch {
		case errors.As(err, &pf):
			if ctx.Err() != nil {
				return nil
			}
			d := s.pubBackoff.Next()
			s.r.opts.Logger.Warn("pgoutbox: publish failed; retrying the batch", "table", s.r.ob.table, "session", s.idx, "in", d, "err", pf.Err)
			if !backoff.Sleep(ctx, d) {
				return nil
			}
			continue
		case err != nil:
			return err
		}
		if n > 0 {
			s.pubBackoff.Reset()
			continue // more may be claimable: the next message of each key just sent
		}
		if err := s.wait(ctx); err != nil {
			return err
		}
	}
}

// dial opens a dedicated connection with the session settings; listen
// makes it the session's main connection, which receives notifications.
func (s *session) dial(ctx context.Context, listen bool) (*pgx.Conn, error) {
	cfg := s.r.connCfg.Copy()
	cfg.OnNotification = nil
	if listen {
		cfg.OnNotification = func(pc *pgconn.PgConn, n *pgconn.Notification) {
			s.notified = true
			if n.Payload == rebalancePayload && n.PID != pc.PID() {
				s.rebalanceSoon = true
			}
		}
	}
	// A deadline, not a cancel request, ends WaitForNotification's wait:
	// the connection stays usable and no cancel request can hit the next
	// statement.
	cfg.BuildContextWatcherHandler = func(pc *pgconn.PgConn) ctxwatch.Handler {
		return &pgconn.DeadlineContextWatcherHandler{Conn: pc.Conn()}
	}
	if cfg.RuntimeParams == nil {
		cfg.RuntimeParams = map[string]string{}
	}
	if cfg.RuntimeParams["application_name"] == "" {
		cfg.RuntimeParams["application_name"] = "idem-outbox-relay"
	}
	cctx, cancel := context.WithTimeout(ctx, s.r.opts.QueryTimeout)
	defer cancel()
	conn, err := pgx.ConnectConfig(cctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("connect: %w", err)
	}
	// Before any session state: through a pooler it would stay on a
	// server connection that other clients get next.
	probe, err := pgdirect.Detect(cctx, conn)
	if err != nil {
		_ = conn.Close(cctx)
		return nil, fmt.Errorf("check connection: %w", err)
	}
	if probe.Pooled() && !s.r.opts.SessionPooler {
		_ = conn.Close(cctx)
		return nil, fmt.Errorf("%w: the relay's sessions hold session-level advisory locks (their shards) and LISTEN, "+
			"which a pooler in transaction mode (PgBouncer's pool_mode=transaction) does not keep, and the connection to %s is %s: "+
			"set RelayOptions.ConnConfig to a direct connection to PostgreSQL (the Outbox's pool may stay on the pooler), "+
			"or RelayOptions.SessionPooler if the pooler runs in session mode", errFatal, cfg.Host, probe)
	}
	// These connections run only the relay's statements. The claim scans
	// the pending rows in seq order and stops after ScanWindow of them;
	// the planner, misjudging the shard filter's selectivity, would rather
	// read and sort every pending row.
	if _, err := conn.Exec(cctx, "SET enable_seqscan = off"); err != nil {
		_ = conn.Close(cctx)
		return nil, fmt.Errorf("session settings: %w", err)
	}
	if h := s.r.hooks.connected; h != nil {
		h(probe.Backend)
	}
	return conn, nil
}

func (s *session) connect(ctx context.Context) error {
	conn, err := s.dial(ctx, true)
	if err != nil {
		return err
	}
	s.conn = conn
	cctx, cancel := context.WithTimeout(ctx, s.r.opts.QueryTimeout)
	defer cancel()
	var exists bool
	if err := conn.QueryRow(cctx, "SELECT to_regclass($1) IS NOT NULL", s.r.ob.table).Scan(&exists); err != nil {
		s.close()
		return fmt.Errorf("check table: %w", err)
	}
	if !exists {
		s.close()
		return fmt.Errorf("%w: table %s does not exist; run Outbox.Migrate or apply Outbox.SQL", errFatal, s.r.ob.table)
	}
	if _, err := conn.Exec(cctx, "LISTEN "+pgx.Identifier{s.r.ob.channel}.Sanitize()); err != nil {
		s.close()
		return fmt.Errorf("listen: %w", err)
	}
	if _, err := conn.Exec(cctx, "SELECT pg_advisory_lock_shared($1::integer, $2::integer)", s.r.ob.relayNS, s.lockKey2(memberShard)); err != nil {
		s.close()
		return fmt.Errorf("member lock: %w", err)
	}
	s.notified = true // catch up on what was committed while away
	s.retries = true
	s.announce = true // the others give back shards for this one
	return nil
}

func (s *session) close() {
	if f := s.flight; f != nil {
		// Finish the batch being published (within ShutdownTimeout when
		// Run's context ended): mark what the broker confirmed, or roll
		// back so that it is sent again.
		s.flight = nil
		if _, err := s.land(f); err != nil && !errors.Is(err, context.Canceled) {
			s.r.opts.Logger.Warn("pgoutbox: batch left for a later attempt", "table", s.r.ob.table, "session", s.idx, "err", err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if s.aux != nil {
		_ = s.aux.Close(ctx)
		s.aux = nil
	}
	if s.conn == nil {
		return
	}
	if len(s.owned) > 0 && !s.conn.IsClosed() {
		// Leaving cleanly: give the shards back and say so, so the others
		// take them now. Best effort: closing releases the locks anyway.
		if _, err := s.conn.Exec(ctx, "SELECT pg_advisory_unlock_all()"); err == nil {
			_ = s.notifyRebalance(ctx)
		}
	}
	_ = s.conn.Close(ctx) // ends the session: its advisory locks are released
	s.conn = nil
}

// rebalance counts the relay sessions of this outbox (holders of the shared
// member lock) and takes or gives back shards so that each holds about
// Shards/members of them. A session that died released its locks with its
// connection; the others take its shards over here.
func (s *session) rebalance(ctx context.Context) error {
	s.nextRebalance = time.Now().Add(backoff.Spread(s.r.opts.RebalanceInterval))
	qctx, cancel := context.WithTimeout(ctx, s.r.opts.QueryTimeout)
	defer cancel()
	ns := s.r.ob.relayNS
	var (
		members int64
		others  []int64
	)
	err := s.conn.QueryRow(qctx, `
SELECT count(*) FILTER (WHERE objid::bigint = $2),
       coalesce(array_agg(DISTINCT objid::bigint >> 16) FILTER (WHERE objid::bigint <> $2), '{}')
FROM pg_locks
WHERE locktype = 'advisory' AND granted AND objsubid = 2
  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND classid::bigint = $1 AND (objid::bigint & 65535) = 65535`, int64(ns), int64(s.lockKey2(memberShard))).Scan(&members, &others)
	if err != nil {
		return fmt.Errorf("rebalance: %w", err)
	}
	if len(others) > 0 {
		if !s.mismatch {
			s.r.opts.Logger.Error("pgoutbox: relays with another Shards count run on this outbox; owning no shard until they are gone",
				"table", s.r.ob.table, "shards", s.r.opts.Shards, "others", others)
		}
		s.mismatch = true
		return s.release(qctx, s.owned)
	}
	s.mismatch = false
	if s.announce {
		s.announce = false
		if err := s.notifyRebalance(qctx); err != nil {
			return err
		}
	}
	members = max(members, 1)
	shards := s.r.opts.Shards
	target := (shards + int(members) - 1) / int(members)
	switch {
	case len(s.owned) > target:
		return s.release(qctx, s.owned[target:])
	case len(s.owned) < target:
		free := make([]int32, 0, shards-len(s.owned))
		start := rand.IntN(shards)
		for i := range shards {
			sh := int32((start + i) % shards)
			if !slices.Contains(s.owned, sh) {
				free = append(free, sh)
			}
		}
		rows, err := s.conn.Query(qctx, `
SELECT u.s FROM unnest($2::integer[]) AS u(s)
WHERE pg_try_advisory_lock($1::integer, ($3::integer << 16) | u.s)
LIMIT $4`, ns, free, shards, target-len(s.owned))
		if err != nil {
			return fmt.Errorf("rebalance: take shards: %w", err)
		}
		got, err := pgx.CollectRows(rows, pgx.RowTo[int32])
		if err != nil {
			return fmt.Errorf("rebalance: take shards: %w", err)
		}
		if len(got) > 0 {
			s.owned = append(s.owned, got...)
			slices.Sort(s.owned)
			s.r.opts.Logger.Debug("pgoutbox: shards taken", "table", s.r.ob.table, "session", s.idx, "shards", got, "owned", len(s.owned))
			s.notified = true // look at the new shards now
			s.retries = true
		}
	}
	return nil
}

func (s *session) release(ctx context.Context, shards []int32) error {
	if len(shards) == 0 {
		return nil
	}
	drop := slices.Clone(shards)
	if _, err := s.conn.Exec(ctx, `SELECT pg_advisory_unlock($1::integer, ($2::integer << 16) | u.s) FROM unnest($3::integer[]) AS u(s)`,
		s.r.ob.relayNS, s.r.opts.Shards, drop); err != nil {
		return fmt.Errorf("rebalance: give back shards: %w", err)
	}
	s.owned = slices.DeleteFunc(s.owned, func(x int32) bool { return slices.Contains(drop, x) })
	s.r.opts.Logger.Debug("pgoutbox: shards given back", "table", s.r.ob.table, "session", s.idx, "shards", drop, "owned", len(s.owned))
	return s.notifyRebalance(ctx)
}

// notifyRebalance asks the other sessions to rebalance now.
func (s *session) notifyRebalance(ctx context.Context) error {
	if _, err := s.conn.Exec(ctx, "SELECT pg_notify($1, $2)", s.r.ob.channel, rebalancePayload); err != nil {
		return fmt.Errorf("rebalance: notify: %w", err)
	}
	return nil
}

// wait blocks until a notification, the poll interval, the next due retry or
// the next rebalance, whichever comes first.
func (s *session) wait(ctx context.Context) error {
	if s.notified {
		s.notified = false
		return nil
	}
	d := s.r.opts.PollInterval
	if len(s.owned) > 0 && s.retries {
		qctx, cancel := context.WithTimeout(ctx, s.r.opts.QueryTimeout)
		var due *int64
		err := s.conn.QueryRow(qctx, s.r.ob.sql.nextDue, s.r.opts.Shards, s.owned).Scan(&due)
		cancel()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("next due: %w", err)
		}
		if due != nil {
			d = min(d, time.Duration(max(*due, 1))*time.Millisecond)
		} else {
			s.retries = false
		}
	}
	d = min(d, time.Until(s.nextRebalance))
	if s.notified || s.rebalanceSoon || d <= 0 {
		s.notified = false
		return nil
	}
	if h := s.r.hooks.idle; h != nil {
		h()
	}
	wctx, cancel := context.WithTimeout(ctx, d)
	err := s.conn.PgConn().WaitForNotification(wctx)
	cancel()
	s.notified = false
	switch {
	case err == nil, ctx.Err() != nil:
		return nil
	case pgconn.Timeout(err), errors.Is(err, context.DeadlineExceeded):
		return nil // poll
	}
	return fmt.Errorf("wait for notification: %w", err)
}

// claimed is one row of a claim.
type claimed struct {
	seq      int64
	attempts int
	age      time.Duration // since available, database clock, at the claim
	msg      *outbox.Message
}

// flight is a claimed batch: its transaction, open on conn, holds its rows
// locked from the claim until its marks commit. Once started, its Publish
// runs on a goroutine of its own while the session claims the next batch
// on its other connection; done is closed when Publish returned.
type flight struct {
	conn      *pgx.Conn
	batch     []claimed
	claimedAt time.Time
	ctx       context.Context // lives ShutdownTimeout past Run's context
	release   func()          // ends ctx
	started   bool
	done      chan struct{}
	pe        *outbox.PublishError // after done: the per-message failures
	err       error                // after done: a *relaycore.PublishFailure
}

// cycle moves the session's pipeline one step and returns the number of
// messages claimed or marked. While a full batch is being published it
// claims the next one on the other connection (the rows of the batch in
// flight are locked, so the claim passes over their keys), waits for the
// publish, starts publishing the new batch and then marks and commits the
// previous one: the database work of one batch overlaps the broker's work
// on the other, and at most one batch is unconfirmed at a time. After a
// batch that was not full, it only waits for that batch and marks it, as
// the rows left are likely of its keys.
func (s *session) cycle(ctx context.Context) (int, error) {
	prev := s.flight
	s.flight = nil
	if len(s.owned) == 0 || s.mismatch || ctx.Err() != nil || (prev != nil && len(prev.batch) < s.r.opts.BatchSize) {
		if prev == nil {
			return 0, nil
		}
		return s.land(prev)
	}
	conn := s.conn
	if prev != nil && prev.conn == s.conn {
		if s.aux == nil {
			aux, err := s.dial(ctx, false)
			if err != nil {
				_, _ = s.land(prev)
				return 0, err
			}
			s.aux = aux
		}
		conn = s.aux
	}
	next, err := s.claimOn(ctx, conn)
	if err != nil {
		_, _ = s.land(prev)
		return 0, err
	}
	if prev != nil {
		<-prev.done
		if prev.err != nil { // outcome unknown: the next batch waits too
			s.abandon(next)
			return s.land(prev)
		}
	}
	n := 0
	if next != nil {
		s.start(next)
		s.flight = next
		n = len(next.batch)
	}
	if prev != nil {
		m, err := s.land(prev)
		if err != nil {
			return 0, err
		}
		n += m
	}
	return n, nil
}

// claimOn opens a transaction on conn and claims a batch, in one round
// trip. It returns nil, with the transaction ended, when there is nothing
// to claim.
func (s *session) claimOn(ctx context.Context, conn *pgx.Conn) (*flight, error) {
	o := &s.r.opts
	fctx, release := relaycore.Graceful(ctx, o.ShutdownTimeout)
	f := &flight{conn: conn, ctx: fctx, release: release, done: make(chan struct{})}
	qctx, cancel := context.WithTimeout(fctx, o.QueryTimeout)
	defer cancel()
	claimBatch := &pgx.Batch{}
	claimBatch.Queue("BEGIN")
	claimBatch.Queue(s.r.ob.sql.claim, o.Shards, s.owned, o.ScanWindow, o.PerKeyBatch, o.BatchSize)
	br := conn.SendBatch(qctx, claimBatch)
	f.claimedAt = time.Now()
	batch, err := s.claim(br)
	if cerr := br.Close(); err == nil && cerr != nil {
		err = fmt.Errorf("claim: %w", cerr)
	}
	if err != nil || len(batch) == 0 {
		s.abandon(f)
		return nil, err
	}
	f.batch = batch
	return f, nil
}

// start publishes f's batch on a goroutine of its own; land or abandon
// waits for it.
func (s *session) start(f *flight) {
	f.started = true
	go func() {
		defer close(f.done)
		f.pe, f.err = s.publish(f.ctx, f.batch, f.claimedAt)
	}()
}

// abandon rolls f back without publishing it (or after its publish
// failed as a whole): its rows are claimed again later.
func (s *session) abandon(f *flight) {
	if f == nil {
		return
	}
	if f.started {
		<-f.done
	}
	rollback(f.conn)
	f.release()
}

// land waits for f's publish and marks its rows in its transaction, or
// rolls it back when the publish failed as a whole (a *relaycore.PublishFailure). It
// returns the number of messages marked.
func (s *session) land(f *flight) (int, error) {
	if f == nil {
		return 0, nil
	}
	if !f.started {
		s.abandon(f)
		return 0, nil
	}
	<-f.done
	if f.err != nil {
		s.abandon(f)
		return 0, f.err
	}
	defer f.release()
	m := s.sortOut(f.batch, f.pe)
	if err := s.markAndCommit(f.ctx, f.conn, m); err != nil {
		rollback(f.conn)
		return 0, err
	}
	tel := s.r.tel
	tel.Count(f.ctx, tel.Published, m.published)
	tel.Count(f.ctx, tel.Retried, m.retried)
	tel.Count(f.ctx, tel.Dead, m.dead)
	return len(f.batch), nil
}

// publish hands the batch to the publisher and records it. It returns the
// publisher's per-message failures (nil when all went out), or a
// *relaycore.PublishFailure when the whole batch failed.
func (s *session) publish(ctx context.Context, batch []claimed, claimedAt time.Time) (*outbox.PublishError, error) {
	msgs := make([]*outbox.Message, len(batch))
	for i, c := range batch {
		msgs[i] = c.msg
	}
	pe, pend, err := relaycore.Publish(ctx, s.r.tel.Telemetry, s.r.pub, msgs, "pgoutbox: ", s.r.hooks.afterPublish)
	if err != nil {
		return nil, err
	}
	// A message's delay: its age at the claim, by the database clock,
	// plus the time since the claim.
	for i, c := range batch {
		if failed, _ := relaycore.Failed(pe, i); !failed {
			s.r.tel.RecordDelay(ctx, c.age+pend.Sub(claimedAt))
		}
	}
	return pe, nil
}

// marks is what a cycle writes back: the rows published, the rows that
// failed (each with its error, its next delay and whether it is now dead),
// and the counts per topic.
type marks struct {
	okSeqs                   []int64
	failSeqs, delays         []int64
	failErrs                 []string
	failDead                 []bool
	published, retried, dead map[string]int
}

// sortOut sorts the batch into published and failed rows after a publish
// whose per-message failures are pe (nil: all published).
func (s *session) sortOut(batch []claimed, pe *outbox.PublishError) *marks {
	o := &s.r.opts
	m := &marks{published: map[string]int{}, retried: map[string]int{}, dead: map[string]int{}}
	for i, c := range batch {
		failed, ferr := relaycore.Failed(pe, i)
		if !failed {
			m.okSeqs = append(m.okSeqs, c.seq)
			m.published[c.msg.Topic]++
			continue
		}
		n := c.attempts + 1
		dead := n >= o.MaxAttempts
		m.failSeqs = append(m.failSeqs, c.seq)
		m.failErrs = append(m.failErrs, relaycore.Truncate(ferr.Error(), 2000))
		m.delays = append(m.delays, relaycore.RetryDelay(o.Backoff, n).Milliseconds())
		m.failDead = append(m.failDead, dead)
		if dead {
			m.dead[c.msg.Topic]++
			o.Logger.Warn("pgoutbox: message parked as dead", "table", s.r.ob.table, "id_hash", dedup.HashKey("", c.msg.ID), "topic", c.msg.Topic,
				"attempts", n, "err", ferr)
		} else {
			m.retried[c.msg.Topic]++
		}
	}
	return m
}

// markAndCommit writes the marks and commits, in one round trip.
func (s *session) markAndCommit(ctx context.Context, conn *pgx.Conn, m *marks) error {
	o := &s.r.opts
	mctx, mcancel := context.WithTimeout(ctx, o.QueryTimeout)
	defer mcancel()
	b := &pgx.Batch{}
	if len(m.okSeqs) > 0 {
		if o.DeletePublished {
			b.Queue(s.r.ob.sql.markDelete, m.okSeqs)
		} else {
			b.Queue(s.r.ob.sql.markPublished, m.okSeqs)
		}
	}
	if len(m.failSeqs) > 0 {
		b.Queue(s.r.ob.sql.markFailed, m.failSeqs, m.failErrs, m.delays, m.failDead)
		s.retries = true
	}
	b.Queue("COMMIT")
	mr := conn.SendBatch(mctx, b)
	var (
		tag pgconn.CommandTag
		err error
	)
	for range b.Len() {
		if tag, err = mr.Exec(); err != nil {
			break
		}
	}
	if cerr := mr.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("mark: %w", err)
	}
	if tag.String() != "COMMIT" { // COMMIT of a failed transaction answers ROLLBACK
		return fmt.Errorf("mark: the transaction did not commit (%s)", tag)
	}
	return nil
}

// claim reads the results of BEGIN and the claim statement, and keeps, per
// key, the rows up to the first one it could not lock: a key's message is
// never sent while an earlier one of the same key is held elsewhere.
func (s *session) claim(br pgx.BatchResults) ([]claimed, error) {
	if _, err := br.Exec(); err != nil {
		return nil, fmt.Errorf("begin: %w", err)
	}
	rows, err := br.Query()
	if err != nil {
		return nil, fmt.Errorf("claim: %w", err)
	}
	defer rows.Close()
	var (
		out     []claimed
		skipped map[string]bool
	)
	for rows.Next() {
		var (
			seq      int64
			key      []byte
			locked   bool
			id       *string
			topic    *string
			payload  []byte
			headers  *string
			created  *time.Time
			attempts *int32
			ageUS    *int64
		)
		if err := rows.Scan(&seq, &key, &locked, &id, &topic, &payload, &headers, &created, &attempts, &ageUS); err != nil {
			return nil, fmt.Errorf("claim: %w", err)
		}
		k := string(key)
		if k != "" && skipped[k] {
			continue
		}
		if !locked {
			if k != "" {
				if skipped == nil {
					skipped = map[string]bool{}
				}
				skipped[k] = true
			}
			continue
		}
		m := &outbox.Message{
			ID:        *id,
			Topic:     *topic,
			Key:       key,
			Payload:   payload,
			CreatedAt: *created,
			Attempt:   int(*attempts) + 1,
		}
		if len(key) == 0 {
			m.Key = nil
		}
		if headers != nil && *headers != "{}" {
			m.Headers = relaycore.DecodeHeaders(*headers)
		}
		c := claimed{seq: seq, attempts: int(*attempts), msg: m}
		if ageUS != nil {
			c.age = time.Duration(*ageUS) * time.Microsecond
		}
		out = append(out, c)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("claim: %w", err)
	}
	return out, nil
}

// rollback ends conn's transaction. If that fails the connection is
// broken; the next statement fails and the session reconnects.
func rollback(conn *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, _ = conn.Exec(ctx, "ROLLBACK")
}
