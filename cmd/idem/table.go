package main

import (
	"fmt"
	"io"
	"time"
)

// print writes the demo's table and its last line.
func (r *demoResult) print(w io.Writer) {
	n, d := r.naive, r.idem
	fprintf(w, "\n%d payments: %d records published (%d of them again by %d relay crashes)\n\n",
		r.cfg.payments, r.published, r.republish, r.relayCrash)
	row := func(name string, a, b any) { fprintf(w, "%-32s %14v %14v\n", name, a, b) }
	row("", "naive", "idem")
	row("payments accepted by the API", n.accepted.len(), d.accepted.len())
	row("  requests replayed by httpidem", "-", d.replayed)
	row("deliveries to the consumer", n.deliveries, d.deliveries)
	row("duplicate deliveries", n.duplicates(), d.duplicates())
	row("  double click", n.causes[causeDoubleClick], d.causes[causeDoubleClick])
	row("  client retry after timeout", n.causes[causeRetry], d.causes[causeRetry])
	row("  re-publish (relay crash)", n.causes[causeRepublish], d.causes[causeRepublish])
	row("  redelivery (consumer crash)", n.causes[causeRedelivery], d.causes[causeRedelivery])
	row("consumer crashes (restarted)", n.crashes, d.crashes)
	if r.children {
		row("  child processes SIGKILLed", "-", r.kills)
		row("  child processes restarted", "-", r.restarts)
	}
	row("effects applied (charges)", n.effects(), d.effects())
	row("extra charges", n.extra(), d.extra())
	row("extra amount charged", money(n.extraCents()), money(d.extraCents()))
	row("lost payments", n.lost(), d.lost())
	fprintln(w)
	fprintf(w, "Ran in %v.\n", r.elapsed.Round(10*time.Millisecond))
	fprintf(w, "Rerun with: idem demo %s\n", r.cfg.rerun)
	fprintf(w, "demo: %d payments, %d duplicate deliveries, naive %d extra, idem %d extra, %d lost\n",
		r.cfg.payments, n.duplicates(), n.extra(), d.extra(), d.lost())
}

// money formats cents as dollars with thousands separators.
func money(cents int64) string {
	s := fmt.Sprintf("%d", cents/100)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return fmt.Sprintf("$%s.%02d", s, cents%100)
}
