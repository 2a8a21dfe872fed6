package walrelay

import (
	"context"
	"encoding/json"
	"errors"
	"sync/atomic"
	"time"

	"github.com/jackc/pglogrepl"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/backoff"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/internal/relaycore"
)

// txn is a transaction of the stream, in commit order.
type txn struct {
	commit      time.Time     // commit time, server clock
	localCommit time.Time     // the same moment by the local clock
	final       pglogrepl.LSN // the commit record's position
	end         pglogrepl.LSN // the transaction's end: what is confirmed
	committed   bool          // its commit was received (end is set)
	queued      bool          // in the engine's queue
	pending     int           // messages neither published nor parked
}

// Entry states.
const (
	stateReady  uint8 = iota // to publish, when due
	stateFlight              // in a Publish call not yet returned
	statePark                // to park in the dead table, when due
	stateDone                // published or parked
)

// entry is one message of the stream.
type entry struct {
	msg      *outbox.Message
	key      string
	tx       *txn
	state    uint8
	attempts int
	due      time.Time // next attempt; zero: now
	lastErr  error
	corrupt  error // a logical message that could not be decoded
}

// engine publishes the stream's messages: at most PublishesInFlight
// Publish calls at a time, each key's messages in commit order (a key with
// a message in flight waits for its outcome), and moves the confirmed
// position past a transaction once every message of it and of the
// transactions before it is published or parked. Only its goroutine
// touches it; a Publish call runs in a goroutine of its own and hands its
// outcome back through landed.
type engine struct {
	r          *Relay
	confirmed  *atomic.Uint64
	txns       []*txn
	win        []*entry // in commit order; done entries are dropped from the front
	undone     int
	parking    int
	blocked    map[string]bool
	perKey     map[string]int
	pubBackoff backoff.Growing
	flying     int         // Publish calls not yet landed
	landed     chan flight // their outcomes; room for every call in flight
	holdUntil  time.Time   // no new Publish call before this (a call failed as a whole)
	draining   bool        // the reader stopped: calls land, none starts
}

// flight is the outcome of one Publish call.
type flight struct {
	batch []*entry
	pe    *outbox.PublishError
	err   error // the outcome of the whole batch is unknown
}

func newEngine(r *Relay, confirmed *atomic.Uint64) *engine {
	return &engine{r: r, confirmed: confirmed, blocked: map[string]bool{}, perKey: map[string]int{},
		pubBackoff: relaycore.Growing(r.opts.ReconnectBackoff),
		landed:     make(chan flight, r.opts.PublishesInFlight)}
}

func (e *engine) run(ctx context.Context, items <-chan item) error {
	o := &e.r.opts
	for {
		if ctx.Err() != nil {
			e.drain(ctx, items)
			return nil
		}
	intake:
		for e.undone < o.MaxInFlight {
			select {
			case it, ok := <-items:
				if !ok {
					e.drain(ctx, items)
					return nil
				}
				e.add(it)
			case f := <-e.landed:
				e.land(ctx, f)
			default:
				break intake
			}
		}
		now := time.Now()
		if e.parking > 0 {
			e.park(ctx, now)
		}
		var due time.Time
		switch {
		case e.flying >= o.PublishesInFlight:
			// Wait for a call to land.
		case now.Before(e.holdUntil):
			due = e.holdUntil
		default:
			var batch []*entry
			if batch, due = e.pick(now); len(batch) > 0 {
				e.launch(ctx, batch)
				continue
			}
		}
		var in <-chan item
		if e.undone < o.MaxInFlight {
			in = items
		}
		var (
			timer *time.Timer
			fire  <-chan time.Time
		)
		if !due.IsZero() {
			timer = time.NewTimer(time.Until(due))
			fire = timer.C
		}
		select {
		case it, ok := <-in:
			if !ok {
				e.drain(ctx, items)
				return nil
			}
			e.add(it)
		case f := <-e.landed:
			e.land(ctx, f)
		case <-fire:
		case <-ctx.Done():
		}
		if timer != nil {
			timer.Stop()
		}
	}
}

// drain ends the engine's work once the reader stops: the Publish calls
// in flight land (each within ShutdownTimeout of ctx's end) and the
// commits the reader passed before it closed items are taken, so that the
// final position covers every batch confirmed. Nothing more is published.
func (e *engine) drain(ctx context.Context, items <-chan item) {
	e.draining = true
	for items != nil || e.flying > 0 {
		var landed <-chan flight
		if e.flying > 0 {
			landed = e.landed
		}
		select {
		case it, ok := <-items:
			if !ok {
				items = nil
				continue
			}
			e.add(it)
		case f := <-landed:
			e.land(ctx, f)
		}
	}
}

// add takes an item from the reader.
func (e *engine) add(it item) {
	t := it.tx
	if !t.queued {
		t.queued = true
		e.txns = append(e.txns, t)
	}
	for _, en := range it.entries {
		if en.corrupt != nil {
			en.state = statePark
			en.lastErr = en.corrupt
			e.parking++
		}
		e.win = append(e.win, en)
	}
	t.pending += len(it.entries)
	e.undone += len(it.entries)
	if it.end != 0 {
		t.end = it.end
		t.committed = true
	}
	e.advance()
}

// advance moves the confirmed position past the leading transactions that
// are done, and drops done entries from the front of the window.
func (e *engine) advance() {
	n := 0
	for n < len(e.txns) && e.txns[n].committed && e.txns[n].pending == 0 {
		if end := uint64(e.txns[n].end); end > e.confirmed.Load() {
			e.confirmed.Store(end)
		}
		n++
	}
	if n > 0 {
		clear(e.txns[:n])
		e.txns = e.txns[n:]
	}
	var oldest int64
	for _, t := range e.txns {
		if !t.localCommit.IsZero() {
			oldest = t.localCommit.UnixNano()
			break
		}
	}
	e.r.tel.oldestNanos.Store(oldest)
	d := 0
	for d < len(e.win) && e.win[d].state == stateDone {
		d++
	}
	if d > 0 {
		clear(e.win[:d])
		e.win = e.win[d:]
	}
	e.r.tel.pending.Store(int64(e.undone))
}

// finish clears the gauges of a session that ended.
func (e *engine) finish() {
	e.r.tel.oldestNanos.Store(0)
	e.r.tel.pending.Store(0)
}

func (e *engine) done(en *entry) {
	en.state = stateDone
	en.tx.pending--
	e.undone--
}

// pick returns the next batch in commit order: at most BatchSize messages,
// at most PerKeyBatch of a key, none of a key whose earlier message waits
// (for a retry or to be parked). It also returns when the earliest waiting
// message falls due (zero when none waits).
func (e *engine) pick(now time.Time) ([]*entry, time.Time) {
	o := &e.r.opts
	clear(e.blocked)
	clear(e.perKey)
	var (
		batch []*entry
		due   time.Time
	)
	for _, en := range e.win {
		if len(batch) >= o.BatchSize {
			break
		}
		if en.state == stateDone || (en.key != "" && e.blocked[en.key]) {
			continue
		}
		if en.state == stateFlight {
			if en.key != "" {
				e.blocked[en.key] = true
			}
			continue
		}
		if en.state == statePark || en.due.After(now) {
			if en.key != "" {
				e.blocked[en.key] = true
			}
			if en.state == stateReady && (due.IsZero() || en.due.Before(due)) {
				due = en.due
			}
			continue
		}
		batch = append(batch, en)
		if en.key != "" {
			e.perKey[en.key]++
			if e.perKey[en.key] >= o.PerKeyBatch {
				e.blocked[en.key] = true
			}
		}
	}
	if e.parking > 0 {
		for _, en := range e.win {
			if en.state == statePark && (due.IsZero() || en.due.Before(due)) {
				due = en.due
			}
		}
	}
	return batch, due
}

// launch starts a Publish call of batch in a goroutine of its own. The
// call may finish after ctx ends, within ShutdownTimeout: its outcome is
// then confirmed before the relay stops.
func (e *engine) launch(ctx context.Context, batch []*entry) {
	msgs := make([]*outbox.Message, len(batch))
	for i, en := range batch {
		en.msg.Attempt = en.attempts + 1
		en.state = stateFlight
		msgs[i] = en.msg
	}
	e.flying++
	r := e.r
	go func() {
		pctx, release := relaycore.Graceful(ctx, r.opts.ShutdownTimeout)
		defer release()
		pe, _, err := relaycore.Publish(pctx, r.tel.Telemetry, r.pub, msgs, "walrelay: ", r.hooks.afterPublish)
		e.landed <- flight{batch: batch, pe: pe, err: err}
	}()
}

// land records the outcome of a Publish call for each of its messages.
func (e *engine) land(ctx context.Context, f flight) {
	o := &e.r.opts
	tel := e.r.tel
	e.flying--
	if f.err != nil {
		// The outcome of the whole batch is unknown: it is sent again,
		// after a pause that grows while calls keep failing. Calls that
		// fail during a pause failed in the same outage: they neither
		// grow nor move it.
		for _, en := range f.batch {
			en.state = stateReady
		}
		if now := time.Now(); !e.draining && ctx.Err() == nil && !now.Before(e.holdUntil) {
			d := e.pubBackoff.Next()
			e.holdUntil = now.Add(d)
			var pf *relaycore.PublishFailure
			if errors.As(f.err, &pf) {
				f.err = pf.Err
			}
			o.Logger.Warn("walrelay: publish failed; retrying the batch", "slot", e.r.ob.opts.Slot, "in", d, "err", f.err)
		}
		return
	}
	e.pubBackoff.Reset()
	mctx := context.WithoutCancel(ctx)
	now := time.Now()
	published, retried := map[string]int{}, map[string]int{}
	for i, en := range f.batch {
		failed, ferr := relaycore.Failed(f.pe, i)
		if !failed {
			e.done(en)
			published[en.msg.Topic]++
			if !en.tx.localCommit.IsZero() {
				tel.RecordDelay(mctx, now.Sub(en.tx.localCommit))
			}
			continue
		}
		en.attempts++
		en.lastErr = ferr
		if en.attempts >= o.MaxAttempts {
			en.state = statePark
			en.due = now
			e.parking++
			continue
		}
		en.state = stateReady
		en.due = now.Add(relaycore.RetryDelay(o.Backoff, en.attempts))
		retried[en.msg.Topic]++
	}
	tel.Count(mctx, tel.Published, published)
	tel.Count(mctx, tel.Retried, retried)
	e.advance()
}

// park copies the messages due to be parked into the dead table and moves
// on. A message the database does not take now is tried again later: it
// is never dropped.
func (e *engine) park(ctx context.Context, now time.Time) {
	o := &e.r.opts
	ob := e.r.ob
	dead := map[string]int{}
	for _, en := range e.win {
		if en.state != statePark || en.due.After(now) || ctx.Err() != nil {
			continue
		}
		m := en.msg
		headers := "{}"
		if len(m.Headers) > 0 {
			if js, err := json.Marshal(m.Headers); err == nil {
				headers = string(js)
			}
		}
		var created *time.Time
		if !m.CreatedAt.IsZero() {
			created = &m.CreatedAt
		}
		key := m.Key
		if key == nil {
			key = []byte{}
		}
		qctx, cancel := context.WithTimeout(ctx, o.QueryTimeout)
		_, err := ob.pool.Exec(qctx, ob.sqlDead, m.ID, m.Topic, key, m.Payload, headers, created,
			en.tx.final.String(), en.attempts, relaycore.Truncate(en.lastErr.Error(), 2000))
		cancel()
		if err != nil {
			en.due = now.Add(backoff.Spread(o.ReconnectBackoff.Initial))
			if ctx.Err() == nil {
				o.Logger.Warn("walrelay: cannot park a message in the dead table; trying again", "table", ob.deadQ,
					"id_hash", dedup.HashKey("", m.ID), "err", err)
			}
			continue
		}
		o.Logger.Warn("walrelay: message parked as dead", "table", ob.deadQ, "id_hash", dedup.HashKey("", m.ID),
			"topic", m.Topic, "attempts", en.attempts, "err", en.lastErr)
		e.parking--
		e.done(en)
		dead[m.Topic]++
	}
	if len(dead) > 0 {
		e.r.tel.Count(ctx, e.r.tel.Dead, dead)
		e.advance()
	}
}
