package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"html/template"
	"io/fs"
	"net/http"
	"strconv"
	"time"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/outbox/pgoutbox"
	"github.com/idemkit/idem/outbox/walrelay"
)

// consoleCap bounds every count the console runs: a count stops there and
// the page says "more than", next to the planner's estimate of the table.
const consoleCap = 10000

// consoleTimeout bounds the work of one request on its sources.
const consoleTimeout = 30 * time.Second

var consoleFuncs = template.FuncMap{
	"when": timeText,
	"dash": orDash,
	"ago": func(d time.Duration) string {
		return d.Round(time.Millisecond).String()
	},
	"keyText": printable,
	"plural":  func(n int, one, many string) string { return map[bool]string{true: one, false: many}[n == 1] },
}

// page is what layout.html renders: the page's title, the CSRF token of
// its forms, and the page's own data.
type page struct {
	Title  string
	Active string
	CSRF   string
	Token  bool // the console requires a token
	Data   any
}

func (c *console) routes() {
	static, _ := fs.Sub(consoleFS, "console")
	c.mux.Handle("GET /console.css", http.FileServerFS(static))
	c.mux.HandleFunc("GET /{$}", c.home)
	c.mux.HandleFunc("GET /outbox", c.outboxPage)
	c.mux.HandleFunc("POST /outbox/requeue", c.outboxRequeue)
	c.mux.HandleFunc("GET /slot", c.slotPage)
	c.mux.HandleFunc("GET /dedup", c.dedupPage)
	c.mux.HandleFunc("GET /deadletters", c.dlqPage)
	c.mux.HandleFunc("GET /deadletters/show", c.dlqShowPage)
	c.mux.HandleFunc("POST /deadletters/act", c.dlqActPage)
	c.mux.HandleFunc("POST /logout", c.logout)
}

// logout clears the session cookie.
func (c *console) logout(w http.ResponseWriter, r *http.Request) {
	http.SetCookie(w, &http.Cookie{Name: consoleSessionCookie, Value: "", Path: "/", MaxAge: -1,
		HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil})
	http.Redirect(w, r, "/login", http.StatusSeeOther)
}

// render writes the page name with data; a template error becomes a 500.
func (c *console) render(w http.ResponseWriter, r *http.Request, name, title string, data any) {
	c.renderStatus(w, r, http.StatusOK, name, title, data)
}

// renderStatus renders a page with status. The headers (the CSRF nonce
// cookie among them) are set before the status is written.
func (c *console) renderStatus(w http.ResponseWriter, r *http.Request, status int, name, title string, data any) {
	t := c.pages[name]
	var buf bytes.Buffer
	p := page{Title: title, Active: name, CSRF: c.csrfToken(w, r), Token: c.cfg.token != "", Data: data}
	if err := t.ExecuteTemplate(&buf, "layout", p); err != nil {
		http.Error(w, "console template: "+err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	w.WriteHeader(status)
	_, _ = w.Write(buf.Bytes())
}

// fail renders an error page with status.
func (c *console) fail(w http.ResponseWriter, r *http.Request, status int, err error) {
	c.renderStatus(w, r, status, "error", "Error", err.Error())
}

type homeView struct {
	Postgres string
	Stores   []*consoleStore
	DLQs     []*consoleDLQ
	Slot     string
}

func (c *console) home(w http.ResponseWriter, r *http.Request) {
	v := homeView{Stores: c.src.stores, DLQs: c.src.dlqs}
	if c.src.pool != nil {
		v.Postgres = c.src.outbox.Table()
		v.Slot = c.slotName()
	}
	c.render(w, r, "home", "idem console", v)
}

// outboxView is the outbox page.
type outboxView struct {
	Configured bool
	Table      string
	Err        string
	Stats      *outboxStats
	Dead       []pgoutbox.DeadMessage
	DeadMore   bool
}

// outboxStats are the outbox's bounded counts.
type outboxStats struct {
	Pending, Published, Dead int64
	// More*: the count stopped at consoleCap.
	PendingMore, PublishedMore, DeadMore bool
	// Oldest is the age of the oldest pending message (the first by
	// sequence); HasOldest is false when none is pending.
	Oldest    time.Duration
	HasOldest bool
	// Estimate is the planner's row estimate of the whole table.
	Estimate int64
	Cap      int
}

// pgOutboxStats counts the outbox's rows by state, each count stopping at
// consoleCap, on the partial indexes of pending, published and dead rows:
// no statement reads more than consoleCap rows.
func pgOutboxStats(ctx context.Context, pool *pgxpool.Pool, table string) (*outboxStats, error) {
	s := &outboxStats{Cap: consoleCap}
	var oldest *int64
	err := pool.QueryRow(ctx, `SELECT
    (SELECT count(*) FROM (SELECT 1 FROM `+table+` WHERE state = 0 LIMIT $1) p),
    (SELECT count(*) FROM (SELECT 1 FROM `+table+` WHERE state = 1 LIMIT $1) s),
    (SELECT count(*) FROM (SELECT 1 FROM `+table+` WHERE state = 2 LIMIT $1) d),
    (SELECT (extract(epoch FROM clock_timestamp() - created_at) * 1000)::bigint FROM `+table+` WHERE state = 0 ORDER BY seq LIMIT 1),
    `+estimateSQL, consoleCap+1, table).Scan(&s.Pending, &s.Published, &s.Dead, &oldest, &s.Estimate)
	if err != nil {
		return nil, err
	}
	clip := func(n *int64, more *bool) {
		if *n > consoleCap {
			*n, *more = consoleCap, true
		}
	}
	clip(&s.Pending, &s.PendingMore)
	clip(&s.Published, &s.PublishedMore)
	clip(&s.Dead, &s.DeadMore)
	if oldest != nil {
		s.Oldest, s.HasOldest = time.Duration(*oldest)*time.Millisecond, true
	}
	return s, nil
}

// estimateSQL is the planner's row estimate of the table $2 and its
// partitions (reltuples; -1 before the first VACUUM or ANALYZE counts as 0).
const estimateSQL = `(SELECT coalesce(sum(greatest(c.reltuples, 0)), 0)::bigint FROM pg_class c
     WHERE c.oid = $2::regclass OR c.oid IN (SELECT inhrelid FROM pg_inherits WHERE inhparent = $2::regclass))`

func (c *console) outboxPage(w http.ResponseWriter, r *http.Request) {
	v := outboxView{Configured: c.src.outbox != nil}
	if !v.Configured {
		c.render(w, r, "outbox", "Outbox", v)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), consoleTimeout)
	defer cancel()
	v.Table = c.src.outbox.Table()
	stats, err := pgOutboxStats(ctx, c.src.pool, v.Table)
	if err != nil {
		v.Err = err.Error()
		c.render(w, r, "outbox", "Outbox", v)
		return
	}
	v.Stats = stats
	dead, err := c.src.outbox.Dead(ctx, nil, c.cfg.limit+1)
	if err != nil {
		v.Err = err.Error()
	}
	if len(dead) > c.cfg.limit {
		dead, v.DeadMore = dead[:c.cfg.limit], true
	}
	v.Dead = dead
	c.render(w, r, "outbox", "Outbox", v)
}

// actionView is a confirm page (Confirmed false: what the action will do,
// and the form that does it) or an action's result.
type actionView struct {
	Action string // the verb: requeue, replay, discard
	Target string // where: the outbox table, the destination
	Post   string // the form's path
	Fields []field
	Lines  []string // what will be or was done
	Count  int
	Err    string
	Back   string
}

type field struct{ Name, Value string }

func (c *console) outboxRequeue(w http.ResponseWriter, r *http.Request) {
	if c.src.outbox == nil {
		c.fail(w, r, http.StatusNotFound, errors.New("no outbox is configured: start the console with --postgres"))
		return
	}
	ids := r.PostForm["id"]
	switch {
	case len(ids) == 0:
		c.fail(w, r, http.StatusBadRequest, errors.New("select the dead messages to requeue"))
		return
	case len(ids) > c.cfg.limit:
		c.fail(w, r, http.StatusBadRequest, fmt.Errorf("at most %d messages at once (--limit)", c.cfg.limit))
		return
	}
	for _, id := range ids {
		if _, err := uuid.Parse(id); err != nil {
			c.fail(w, r, http.StatusBadRequest, fmt.Errorf("%q is not a message id", id))
			return
		}
	}
	v := actionView{Action: "requeue", Target: c.src.outbox.Table(), Post: "/outbox/requeue", Count: len(ids), Back: "/outbox"}
	for _, id := range ids {
		v.Fields = append(v.Fields, field{"id", id})
		v.Lines = append(v.Lines, id)
	}
	if r.PostFormValue("confirm") != "yes" {
		c.render(w, r, "confirm", "Confirm requeue", v)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), consoleTimeout)
	defer cancel()
	n, err := c.src.outbox.RequeueDead(ctx, ids...)
	v.Lines = []string{fmt.Sprintf("requeued %d of %d messages: a relay publishes them with their ids", n, len(ids))}
	switch {
	case err != nil:
		v.Err = err.Error()
	case n != int64(len(ids)):
		v.Err = "some ids are not dead messages of this outbox (requeued or deleted meanwhile)"
	}
	c.render(w, r, "result", "Requeue", v)
}

// slotView is the WAL relay's slot page.
type slotView struct {
	Configured bool
	Name       string
	Given      bool
	Missing    bool
	Err        string
	Info       walrelay.SlotInfo
	Safe       string
}

// slotName is the slot the console shows: --slot, or walrelay's default
// for the outbox table.
func (c *console) slotName() string {
	if c.src.slot != "" {
		return c.src.slot
	}
	ob, err := walrelay.New(c.src.pool, walrelay.Options{Schema: c.src.schema, Table: c.src.outboxTable})
	if err != nil {
		return ""
	}
	return ob.Options().Slot
}

func (c *console) slotPage(w http.ResponseWriter, r *http.Request) {
	v := slotView{Configured: c.src.pool != nil, Given: c.src.slotGiven}
	if !v.Configured {
		c.render(w, r, "slot", "WAL relay slot", v)
		return
	}
	ob, err := walrelay.New(c.src.pool, walrelay.Options{Schema: c.src.schema, Table: c.src.outboxTable, Slot: c.src.slot})
	if err != nil {
		v.Err = err.Error()
		c.render(w, r, "slot", "WAL relay slot", v)
		return
	}
	v.Name = ob.Options().Slot
	ctx, cancel := context.WithTimeout(r.Context(), consoleTimeout)
	defer cancel()
	v.Info, err = ob.Slot(ctx)
	switch {
	case errors.Is(err, walrelay.ErrNoSlot):
		v.Missing = true
	case err != nil:
		v.Err = err.Error()
	}
	v.Safe = "unlimited (max_slot_wal_keep_size = -1)"
	if v.Info.SafeWALSize >= 0 {
		v.Safe = strconv.FormatInt(v.Info.SafeWALSize, 10) + " bytes"
	}
	c.render(w, r, "slot", "WAL relay slot", v)
}

// dedupCounts are a dedup table's rows by state, read from at most
// consoleCap rows.
type dedupCounts struct {
	Done, InFlight, Expired, Read int64
	// More: the table holds more rows than were read; the counts are
	// those of the rows read.
	More     bool
	Estimate int64
	Cap      int
}

// pgDedupCounts counts the rows of a pgtable table by state among at most
// consoleCap of them, and reads the planner's estimate of the whole.
func pgDedupCounts(ctx context.Context, pool *pgxpool.Pool, table string) (*dedupCounts, error) {
	d := &dedupCounts{Cap: consoleCap}
	err := pool.QueryRow(ctx, `SELECT
    count(*) FILTER (WHERE token IS NULL AND expires_at > now()),
    count(*) FILTER (WHERE token IS NOT NULL AND expires_at > now()),
    count(*) FILTER (WHERE expires_at <= now()),
    count(*), `+estimateSQL+`
FROM (SELECT token, expires_at FROM `+table+` LIMIT $1) s`, consoleCap+1, table).
		Scan(&d.Done, &d.InFlight, &d.Expired, &d.Read, &d.Estimate)
	if err != nil {
		return nil, err
	}
	d.More = d.Read > consoleCap
	return d, nil
}

// dedupView is the dedup page.
type dedupView struct {
	Stores []storeCounts
	Note   string
	// The lookup form and its answer.
	Store, Scope, ID, Digest string
	Looked                   bool
	Where                    string
	State                    *keyStateView
	Err                      string
}

type storeCounts struct {
	Name, Where string
	Counts      *dedupCounts
	Err         string
}

// keyStateView is a dedup.KeyState as the page shows it.
type keyStateView struct {
	Digest, Hash      string
	Status            string
	Held              bool
	Explain           string
	ExpiresAt, Expiry string
	Fingerprint       string
	Result            string
	HasResult         bool
	KeysKept          bool
	Scope, ID         string
}

func newKeyStateView(st dedup.KeyState, now time.Time) *keyStateView {
	v := &keyStateView{Digest: st.Digest.String(), Hash: st.Digest.Hash(), Status: st.Status.String(), Held: st.Held(),
		KeysKept: st.KeysKept, Scope: st.Scope, ID: st.ID}
	switch {
	case st.Status == dedup.KeyAbsent:
		v.Explain = "the store holds nothing for this key: a claim would take it"
	case st.Expired && st.Status == dedup.KeyInFlight:
		v.Status, v.Explain = "expired", "a lease that ran out; a claim takes it over, cleanup deletes it"
	case st.Expired:
		v.Status, v.Explain = "expired", "done, past its retention; a claim takes it over, cleanup deletes it"
	case st.Status == dedup.KeyInFlight:
		v.Explain = "a lease holds it: a handler is running, or its owner died and the lease has not run out"
	default:
		v.Explain = "done: a delivery of this key is dropped as a duplicate"
	}
	if !st.ExpiresAt.IsZero() {
		v.ExpiresAt = st.ExpiresAt.UTC().Format(time.RFC3339Nano)
		if st.ExpiresAt.After(now) {
			v.Expiry = "in " + st.ExpiresAt.Sub(now).Round(time.Second).String()
		} else {
			v.Expiry = now.Sub(st.ExpiresAt).Round(time.Second).String() + " ago"
		}
	}
	if !st.Fingerprint.IsZero() {
		v.Fingerprint = st.Fingerprint.String()
	}
	if st.Status == dedup.KeyDone && st.Result != nil {
		v.HasResult, v.Result = true, fmt.Sprintf("%d bytes: %s", len(st.Result), printable(st.Result))
	}
	return v
}

func (c *console) dedupPage(w http.ResponseWriter, r *http.Request) {
	ctx, cancel := context.WithTimeout(r.Context(), consoleTimeout)
	defer cancel()
	q := r.URL.Query()
	v := dedupView{Store: q.Get("store"), Scope: q.Get("scope"), ID: q.Get("id"), Digest: q.Get("digest"), Note: c.src.storeNote}
	for _, s := range c.src.stores {
		sc := storeCounts{Name: s.Name, Where: s.Where}
		if s.counts != nil {
			var err error
			if sc.Counts, err = s.counts(ctx); err != nil {
				sc.Err = err.Error()
			}
		}
		v.Stores = append(v.Stores, sc)
	}
	if v.Store == "" && len(c.src.stores) > 0 {
		v.Store = c.src.stores[0].Name
	}
	if v.Scope == "" && v.ID == "" && v.Digest == "" {
		c.render(w, r, "dedup", "Dedup", v)
		return
	}
	v.Looked = true
	var store *consoleStore
	for _, s := range c.src.stores {
		if s.Name == v.Store {
			store = s
		}
	}
	var (
		st      dedup.KeyState
		err     error
		inspect bool
	)
	switch {
	case store == nil:
		err = fmt.Errorf("no store %q is configured", v.Store)
	case v.Digest != "" && (v.Scope != "" || v.ID != ""):
		err = errors.New("give a scope and an id, or a digest, not both")
	case v.Digest != "":
		var d dedup.Digest
		if d, err = dedup.ParseDigest(v.Digest); err == nil {
			inspect = true
			st, err = store.InspectDigest(ctx, d)
		}
	case v.Scope == "" || v.ID == "":
		err = errors.New("a lookup needs a scope and an id (or a digest)")
	default:
		inspect = true
		st, err = store.Inspect(ctx, dedup.Key{Scope: v.Scope, ID: v.ID})
	}
	status := http.StatusOK
	switch {
	case err != nil && inspect:
		v.Err, status = err.Error(), http.StatusBadGateway
	case err != nil:
		v.Err, status = err.Error(), http.StatusBadRequest
	default:
		v.Where, v.State = store.Where, newKeyStateView(st, time.Now())
	}
	c.renderStatus(w, r, status, "dedup", "Dedup", v)
}
