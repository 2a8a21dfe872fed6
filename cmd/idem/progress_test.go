package main

import (
	"bytes"
	"context"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
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
				{submitted: 500_000, published: 1_234_567, naive: 1_000_000, idem: 999_999, naiveDeliveries: 600_000, idemDeliveries: 550_000, naiveCrashes: 321, idemCrashes: 300},
				{submitted: 1_000_000, published: 2_345_678, naive: 2_345_678, idem: 2_345_678, naiveDeliveries: 1_234_567, idemDeliveries: 1_111_111, naiveCrashes: 1234, idemCrashes: 1200, relayDone: true},
			} {
				p.update(s)
			}
			p.finish(progressState{})
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

// TestDemoProgressAgreesWithTable: the demo's last progress line shows the
// numbers of its table: records published, deliveries to each consumer and
// each consumer's crashes.
func TestDemoProgressAgreesWithTable(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	code, out, errOut := runCmd(ctx, t, "demo", "--payments", "500", "--progress", "plain",
		"--crash-rate", "0.01", "--republish-rate", "0.2", "--seed", "7")
	if code != 0 {
		t.Fatalf("exit status %d; stderr:\n%s", code, errOut)
	}
	lines := strings.Split(strings.TrimRight(errOut, "\n"), "\n")
	last := lines[len(lines)-1]
	m := regexp.MustCompile(`^progress: +\d+% payments (\d+)/(\d+) · published (\d+) · deliveries naive (\d+), idem (\d+) · consumer crashes naive (\d+), idem (\d+)$`).FindStringSubmatch(last)
	if m == nil {
		t.Fatalf("last progress line %q does not show the table's numbers; stderr:\n%s", last, errOut)
	}
	n := make([]int, len(m))
	for i := 1; i < len(m); i++ {
		n[i], _ = strconv.Atoi(m[i])
	}
	r := &demoRun{out: out}
	pub := regexp.MustCompile(`(?m)^500 payments: (\d+) records published`).FindStringSubmatch(out)
	if pub == nil {
		t.Fatalf("no records published line:\n%s", out)
	}
	published, _ := strconv.Atoi(pub[1])
	naiveDeliveries, idemDeliveries := r.row(t, "deliveries to the consumer")
	naiveCrashes, idemCrashes := r.row(t, "consumer crashes (restarted)")
	got := []int{n[1], n[2], n[3], n[4], n[5], n[6], n[7]}
	want := []int{500, 500, published, naiveDeliveries, idemDeliveries, naiveCrashes, idemCrashes}
	if !slices.Equal(got, want) {
		t.Errorf("last progress line %q: submitted, payments, published, deliveries naive/idem, crashes naive/idem = %v; the table says %v\n%s",
			last, got, want, out)
	}
	if naiveCrashes == 0 || idemCrashes == 0 {
		t.Errorf("crashes naive %d, idem %d: pick a seed where both consumers crash", naiveCrashes, idemCrashes)
	}
}
