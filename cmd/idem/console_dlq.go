package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"strings"
	"time"
)

// The dead-letter pages: the letters of a destination grouped by reason
// (a bounded scan, --scan and --limit), one letter with its headers and
// payload, and the replay or discard of a selection. They run the
// backends and the code of "idem deadletter": a replay publishes a letter
// to where it came from with its message id and removes it once the
// broker confirmed it.

// dlqView is the dead-letter page.
type dlqView struct {
	DLQs    []*consoleDLQ
	Dest    string
	Label   string
	Err     string
	Groups  []*letterGroup
	Letters []letterView
	More    bool
	Scan    int
	Limit   int
}

// letterView is a dead letter as a page shows it.
type letterView struct {
	Pos, ID, MsgID, Reason, Source, Attempts, At, Error string
	// Sel is what selects it in a form: its id, else its position.
	Sel     string
	Key     string
	HasKey  bool
	Headers []header
	Payload string
	Size    int
	// Truncated says that Payload holds only the first maxPayloadShown
	// bytes.
	Truncated bool
}

// maxPayloadShown is how much of a payload the letter page shows.
const maxPayloadShown = 64 << 10

// newLetterView returns d as a list shows it, or with full as its own
// page shows it: with its headers and (the first maxPayloadShown bytes
// of) its payload.
func newLetterView(d *deadLetter, full bool) letterView {
	v := letterView{Pos: d.pos, ID: d.id, MsgID: d.msgID, Reason: d.reason, Source: d.source, Attempts: d.attempts,
		At: timeText(d.at), Error: d.errText, Sel: d.id, Size: len(d.payload)}
	if v.Sel == "" {
		v.Sel = d.pos
	}
	if !full {
		return v
	}
	p := d.payload
	if len(p) > maxPayloadShown {
		p, v.Truncated = p[:maxPayloadShown], true
	}
	v.Payload = printable(p)
	if d.key != nil {
		v.Key, v.HasKey = printable(d.key), true
	}
	for _, h := range d.headers {
		v.Headers = append(v.Headers, header{h.name, h.value})
	}
	return v
}

// Name and Value let a template read a header.
func (h header) Name() string  { return h.name }
func (h header) Value() string { return h.value }

// dest returns the destination the request names (dest), or the first.
func (c *console) dest(r *http.Request) *consoleDLQ {
	name := r.FormValue("dest")
	for _, d := range c.src.dlqs {
		if d.Name == name || name == "" {
			return d
		}
	}
	return nil
}

// withBackend opens d's backend, runs f on it and closes it, one request
// at a time per destination.
func withBackend(ctx context.Context, d *consoleDLQ, f func(b dlqBackend) error) error {
	select {
	case d.turn <- struct{}{}:
	case <-ctx.Done():
		return fmt.Errorf("%s is busy with another request: %w", d.Label, ctx.Err())
	}
	defer func() { <-d.turn }()
	b, err := d.open(ctx)
	if err != nil {
		return err
	}
	runErr := f(b)
	// close records progress and returns what was read: it runs even
	// when the request's context has ended.
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	if err := b.close(cctx); err != nil {
		runErr = errors.Join(runErr, fmt.Errorf("%s: %w", b.describe(), err))
	}
	return runErr
}

func (c *console) dlqPage(w http.ResponseWriter, r *http.Request) {
	v := dlqView{DLQs: c.src.dlqs, Scan: c.cfg.scan, Limit: c.cfg.limit}
	d := c.dest(r)
	if d == nil {
		if len(c.src.dlqs) > 0 {
			c.fail(w, r, http.StatusNotFound, fmt.Errorf("no dead-letter destination %q is configured", r.FormValue("dest")))
			return
		}
		c.render(w, r, "deadletters", "Dead letters", v)
		return
	}
	v.Dest, v.Label = d.Name, d.Label
	ctx, cancel := context.WithTimeout(r.Context(), consoleTimeout)
	defer cancel()
	err := withBackend(ctx, d, func(b dlqBackend) error {
		res, err := collectLetters(ctx, b, &selection{}, c.cfg.limit, c.cfg.scan)
		if err != nil {
			return err
		}
		v.Groups, v.More = res.groups, res.more
		for _, l := range res.letters {
			v.Letters = append(v.Letters, newLetterView(l, false))
		}
		return nil
	})
	if err != nil {
		v.Err = err.Error()
	}
	c.render(w, r, "deadletters", "Dead letters", v)
}

// letterPage is one letter's page.
type letterPage struct {
	Dest, Label string
	ID          string
	Letter      *letterView
	Err         string
	Scan        int
}

func (c *console) dlqShowPage(w http.ResponseWriter, r *http.Request) {
	d := c.dest(r)
	if d == nil {
		c.fail(w, r, http.StatusNotFound, errors.New("no such dead-letter destination is configured"))
		return
	}
	v := letterPage{Dest: d.Name, Label: d.Label, ID: r.FormValue("id"), Scan: c.cfg.scan}
	if v.ID == "" {
		c.fail(w, r, http.StatusBadRequest, errors.New("which letter? give its id"))
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), consoleTimeout)
	defer cancel()
	err := withBackend(ctx, d, func(b dlqBackend) error {
		l, err := findLetter(ctx, b, v.ID, c.cfg.scan)
		if l != nil {
			lv := newLetterView(l, true)
			v.Letter = &lv
		}
		return err
	})
	if err != nil {
		v.Err = err.Error()
	}
	status := http.StatusOK
	if v.Letter == nil && err == nil {
		status = http.StatusNotFound
	}
	c.renderStatus(w, r, status, "letter", "Dead letter", v)
}

// seenBackend is a backend that keeps the letters read through it.
type seenBackend struct {
	dlqBackend
	seen []*deadLetter
}

func (s *seenBackend) next(ctx context.Context) (*deadLetter, error) {
	d, err := s.dlqBackend.next(ctx)
	if d != nil {
		s.seen = append(s.seen, d)
	}
	return d, err
}

// dlqActPage replays or discards a selection: the first POST shows what
// would be done (a dry run) with the form that does it, which names the
// letters shown by id; the POST of that form (confirm=yes) does it, to
// those letters (and to copies of them: letters of the same id).
func (c *console) dlqActPage(w http.ResponseWriter, r *http.Request) {
	d := c.dest(r)
	if d == nil {
		c.fail(w, r, http.StatusNotFound, errors.New("no such dead-letter destination is configured"))
		return
	}
	action := r.PostFormValue("action")
	if action != "replay" && action != "discard" {
		c.fail(w, r, http.StatusBadRequest, fmt.Errorf("unknown action %q: want replay or discard", action))
		return
	}
	sel := selection{reasons: r.PostForm["reason"], ids: r.PostForm["id"], all: r.PostFormValue("all") == "yes"}
	switch {
	case !sel.all && len(sel.reasons) == 0 && len(sel.ids) == 0:
		c.fail(w, r, http.StatusBadRequest, fmt.Errorf("%s needs a selection: tick letters or reasons, or all", action))
		return
	case sel.all && (len(sel.reasons) > 0 || len(sel.ids) > 0):
		c.fail(w, r, http.StatusBadRequest, errors.New("all selects every letter: untick the letters and reasons"))
		return
	case len(sel.ids) > c.cfg.limit:
		c.fail(w, r, http.StatusBadRequest, fmt.Errorf("at most %d letters at once (--limit)", c.cfg.limit))
		return
	}
	confirmed := r.PostFormValue("confirm") == "yes"
	v := actionView{Action: action, Target: d.Label, Post: "/deadletters/act", Back: "/deadletters?dest=" + d.Name}
	v.Fields = append(v.Fields, field{"dest", d.Name}, field{"action", action})
	ctx, cancel := context.WithTimeout(r.Context(), consoleTimeout)
	defer cancel()
	var out bytes.Buffer
	err := withBackend(ctx, d, func(b dlqBackend) error {
		if confirmed {
			return dlqAct(ctx, b, action, &sel, c.cfg.limit, c.cfg.scan, false, &out)
		}
		// The dry run: the confirm form names the letters it showed, by
		// id, so that a letter parked after it is not acted on unseen.
		seen := &seenBackend{dlqBackend: b}
		err := dlqAct(ctx, seen, action, &sel, c.cfg.limit, c.cfg.scan, true, &out)
		ids := map[string]bool{}
		for _, l := range seen.seen {
			if id := newLetterView(l, false).Sel; sel.match(l) && !ids[id] {
				ids[id] = true
				v.Fields = append(v.Fields, field{"id", id})
			}
		}
		return err
	})
	v.Lines = slices.DeleteFunc(strings.Split(out.String(), "\n"), func(s string) bool { return s == "" })
	for _, l := range v.Lines {
		if !strings.HasPrefix(l, "deadletter ") && !strings.HasPrefix(l, "not replayed") {
			v.Count++
		}
	}
	switch {
	case errors.Is(err, errFailed):
		v.Err = "some selected letters could not be replayed: see the lines above"
	case err != nil:
		v.Err = err.Error()
	}
	if !confirmed {
		if v.Count == 0 && v.Err == "" {
			v.Err = "the selection matches no letter (among the first --scan read)"
		}
		c.render(w, r, "confirm", "Confirm "+action, v)
		return
	}
	c.render(w, r, "result", strings.ToUpper(action[:1])+action[1:], v)
}
