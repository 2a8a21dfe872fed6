package main

import (
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"
)

// progressState is a snapshot of the demo's pipeline. The numbers shown
// are the table's: deliveries and consumer crashes per pipeline.
type progressState struct {
	submitted int64
	published int64 // records of both pipelines
	naive     int64 // records (of both pipelines) handled by the naive group, for the fraction
	idem      int64 // records (of both pipelines) handled by the idem group, for the fraction
	// deliveries of each pipeline's records to its consumer, and the
	// consumer crashes of each: the table's rows.
	naiveDeliveries, idemDeliveries int64
	naiveCrashes, idemCrashes       int64
	relayDone                       bool
}

// progress shows the demo's progress: a bar redrawn in place on a terminal,
// a plain line every second otherwise, or nothing.
type progress struct {
	mode     string // "bar", "plain" or "none"
	w        io.Writer
	payments int64
	// cols is the width of the terminal: a bar line stays shorter, so
	// that it never wraps and its redraw stays on one line.
	cols     int
	last     time.Time
	lastLine string
	drawn    bool
}

func newProgress(mode string, w io.Writer, payments int) *progress {
	if mode == "auto" {
		mode = "plain"
		if isTerminal(w) {
			mode = "bar"
		}
	}
	return &progress{mode: mode, w: w, payments: int64(payments), cols: columns(w)}
}

// defaultColumns is the width assumed when nothing tells it.
const defaultColumns = 80

// columns returns the width of the terminal w writes to: COLUMNS when it is
// set, else what the terminal says, else defaultColumns.
func columns(w io.Writer) int {
	if n, err := strconv.Atoi(os.Getenv("COLUMNS")); err == nil && n > 0 {
		return n
	}
	if f, ok := w.(*os.File); ok && isTerminal(w) {
		if n := ttyColumns(f); n > 0 {
			return n
		}
	}
	return defaultColumns
}

// isTerminal reports whether w is a character device (a terminal), without
// golang.org/x/term.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}

// fraction estimates how far the run is: half for submitting, half for
// consuming what was published.
func (p *progress) fraction(s progressState) float64 {
	sub := float64(s.submitted) / float64(p.payments)
	con := 0.0
	if s.published > 0 {
		con = min(1, float64(min(s.naive, s.idem))/float64(s.published))
		if !s.relayDone {
			con *= sub
		}
	}
	return min(1, (sub+con)/2)
}

func (p *progress) text(s progressState) string {
	return fmt.Sprintf("payments %d/%d · published %d · deliveries naive %d, idem %d · consumer crashes naive %d, idem %d",
		s.submitted, p.payments, s.published, s.naiveDeliveries, s.idemDeliveries, s.naiveCrashes, s.idemCrashes)
}

// shortText is text for a narrow terminal.
func (p *progress) shortText(s progressState) string {
	return fmt.Sprintf("%d/%d paid, %d pub, dlv %d/%d, crash %d/%d",
		s.submitted, p.payments, s.published, s.naiveDeliveries, s.idemDeliveries, s.naiveCrashes, s.idemCrashes)
}

// barLine is the bar and the text, in fewer than p.cols columns: the
// full text beside a 30-column bar when it fits, else the short text
// beside a 10-column one, cut at the width.
func (p *progress) barLine(s progressState) string {
	f := p.fraction(s)
	line := func(width int, text string) string {
		full := int(f * float64(width))
		return fmt.Sprintf("[%s%s] %3.0f%% %s", strings.Repeat("#", full), strings.Repeat(".", width-full), f*100, text)
	}
	room := p.cols - 1 // the last column would wrap on some terminals
	if l := line(30, p.text(s)); utf8.RuneCountInString(l) <= room {
		return l
	}
	l := line(10, p.shortText(s))
	if utf8.RuneCountInString(l) > room {
		l = string([]rune(l)[:max(room, 0)])
	}
	return l
}

func (p *progress) update(s progressState) {
	switch p.mode {
	case "bar":
		line := "\r" + p.barLine(s)
		if line != p.lastLine {
			fprint(p.w, line+"\x1b[K")
			p.lastLine = line
			p.drawn = true
		}
	case "plain":
		now := time.Now()
		if now.Sub(p.last) < time.Second {
			return
		}
		p.last = now
		fprintf(p.w, "progress: %3.0f%% %s\n", p.fraction(s)*100, p.text(s))
	}
}

// finish shows the final state s, the numbers the table prints: a plain
// line, whatever the time since the last one; the bar is cleared instead,
// the table following it.
func (p *progress) finish(s progressState) {
	switch p.mode {
	case "bar":
		if p.drawn {
			fprint(p.w, "\r\x1b[K")
		}
	case "plain":
		fprintf(p.w, "progress: %3.0f%% %s\n", p.fraction(s)*100, p.text(s))
	}
}
