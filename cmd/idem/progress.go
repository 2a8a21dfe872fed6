package main

import (
	"fmt"
	"io"
	"os"
	"strings"
	"time"
)

// progressState is a snapshot of the demo's pipeline.
type progressState struct {
	submitted int64
	published int64
	naive     int64 // records handled by the naive group
	idem      int64 // records handled by the idem group
	crashes   int64
	relayDone bool
}

// progress shows the demo's progress: a bar redrawn in place on a terminal,
// a plain line every second otherwise, or nothing.
type progress struct {
	mode     string // "bar", "plain" or "none"
	w        io.Writer
	payments int64
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
	return &progress{mode: mode, w: w, payments: int64(payments)}
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
	return fmt.Sprintf("payments %d/%d · published %d · handled naive %d, idem %d · consumer crashes %d",
		s.submitted, p.payments, s.published, s.naive, s.idem, s.crashes)
}

func (p *progress) update(s progressState) {
	switch p.mode {
	case "bar":
		const width = 30
		f := p.fraction(s)
		full := int(f * width)
		line := fmt.Sprintf("\r[%s%s] %3.0f%% %s", strings.Repeat("#", full), strings.Repeat(".", width-full), f*100, p.text(s))
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

// finish ends the bar's line.
func (p *progress) finish() {
	if p.mode == "bar" && p.drawn {
		fprint(p.w, "\r\x1b[K")
	}
}
