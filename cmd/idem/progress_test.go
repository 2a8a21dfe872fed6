package main

import (
	"bytes"
	"strconv"
	"strings"
	"testing"
	"unicode/utf8"
)

// TestProgressFitsWidth checks that every redraw of the bar is narrower than
// the terminal (COLUMNS, else 80), so that it never wraps onto a new line.
func TestProgressFitsWidth(t *testing.T) {
	for _, cols := range []string{"", "40", "80", "120", "200"} {
		t.Run("COLUMNS="+cols, func(t *testing.T) {
			t.Setenv("COLUMNS", cols)
			want := 80
			if cols != "" {
				want, _ = strconv.Atoi(cols)
			}
			var buf bytes.Buffer
			p := newProgress("bar", &buf, 1_000_000)
			for _, s := range []progressState{
				{},
				{submitted: 1, published: 2, naive: 1, idem: 1},
				{submitted: 500_000, published: 1_234_567, naive: 1_000_000, idem: 999_999, crashes: 321},
				{submitted: 1_000_000, published: 2_345_678, naive: 2_345_678, idem: 2_345_678, crashes: 1234, relayDone: true},
			} {
				p.update(s)
			}
			p.finish()
			draws := strings.Split(buf.String(), "\r")
			if len(draws) < 4 {
				t.Fatalf("%d redraws, want 4 and the final clear: %q", len(draws)-1, buf.String())
			}
			for _, d := range draws {
				d = strings.TrimSuffix(d, "\x1b[K")
				if strings.Contains(d, "\n") {
					t.Errorf("redraw %q has a newline", d)
				}
				if n := utf8.RuneCountInString(d); n >= want {
					t.Errorf("redraw of %d columns on a %d-column terminal: %q", n, want, d)
				}
			}
		})
	}
}
