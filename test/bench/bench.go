package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"time"
)

// Config is one run's settings.
type Config struct {
	// Quick shrinks every row to a smoke run of a few minutes.
	Quick bool
	// Rounds is the number of measured rounds per row. Defaults to 3.
	Rounds int
	// Kfake is the kfake command (test/bench/cmd/kfake) the Kafka rows run
	// their broker with. Defaults to "kfake" next to the running binary.
	Kfake string
	// Only, when set, keeps the rows whose path matches it.
	Only *regexp.Regexp
	// Out receives the table. Defaults to os.Stdout.
	Out io.Writer
	// Log receives progress. Defaults to os.Stderr.
	Log io.Writer
}

// sizes is how much work one side does in one round.
type sizes struct {
	records    int           // Kafka records
	deliveries int           // RabbitMQ deliveries, Watermill messages, outbox messages
	duration   time.Duration // closed-loop rows (PostgreSQL, Redis, HTTP)
	pgbench    int           // pgbench -T, seconds
}

func (c Config) sizes() sizes {
	if c.Quick {
		return sizes{records: 3000, deliveries: 1500, duration: time.Second, pgbench: 2}
	}
	return sizes{records: 100000, deliveries: 20000, duration: 10 * time.Second, pgbench: 10}
}

// side runs one round of one side of a row and returns its rate. warm is a
// shorter run whose rate is thrown away.
type side func(ctx context.Context, warm bool) (float64, error)

// row is one line of the table. build prepares both sides (tables,
// stores, queues); what it creates is removed with the env.
type row struct {
	path     string
	baseline string
	target   float64
	unit     string
	floor    *floor // the SQL floor of a database path, or nil
	build    func(ctx context.Context, e *env) (bare, idem side, err error)
	// byHand, when set, builds the row's commands-by-hand side: the
	// baseline's work plus the Redis commands idem sends for the path,
	// sent by hand with go-redis. It runs as a third side in the row's
	// rounds.
	byHand func(ctx context.Context, e *env) (side, error)
	// handNote, when set, says under the table what the row's by-hand
	// side sends; the Redis rows share one note.
	handNote string
	// peer, when set, builds the side of a peer library doing the same
	// work (peerName). It runs as one more side in the row's rounds.
	peer func(ctx context.Context, e *env) (side, error)
}

// result is a measured row.
type result struct {
	row
	bare, idem []float64    // rates per round
	hand       []float64    // the commands-by-hand side's rates per round, when the row has one
	peer       []float64    // the peer's rates per round, when the row has one
	err        error        // why the row was not measured
	sql        *floorResult // the row's SQL floor, measured right after it
}

func (r result) ratio() float64 { return median(r.idem) / median(r.bare) }

// Run measures every row and prints the table.
func Run(ctx context.Context, cfg Config) error {
	if cfg.Rounds <= 0 {
		cfg.Rounds = 3
	}
	if cfg.Out == nil {
		cfg.Out = os.Stdout
	}
	if cfg.Log == nil {
		cfg.Log = os.Stderr
	}
	e, err := newEnv(ctx, cfg)
	if err != nil {
		return err
	}
	defer e.close()
	started := time.Now()
	var results []result
	for _, r := range rows() {
		if cfg.Only != nil && !cfg.Only.MatchString(r.path) {
			continue
		}
		res := result{row: r}
		res.bare, res.idem, res.hand, res.peer, res.err = measureRow(ctx, e, r)
		if res.err != nil {
			e.logf("%s: not measured: %v", r.path, res.err)
		}
		if r.floor != nil {
			f := measureFloor(ctx, e, r.floor)
			res.sql = &f
		}
		results = append(results, res)
	}
	lat := measureLatency(ctx, e, func(path string) bool { return cfg.Only == nil || cfg.Only.MatchString(path) })
	printTable(cfg.Out, results, started, cfg)
	printLatency(cfg.Out, lat)
	return nil
}

func measureRow(ctx context.Context, e *env, r row) (bare, idem, hand, peer []float64, err error) {
	e.logf("%s: setting up", r.path)
	b, i, err := r.build(ctx, e)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	sides := []side{b, i}
	handAt, peerAt := -1, -1
	if r.byHand != nil {
		h, err := r.byHand(ctx, e)
		if err != nil {
			return nil, nil, nil, nil, fmt.Errorf("commands-by-hand side: %w", err)
		}
		handAt, sides = len(sides), append(sides, h)
	}
	if r.peer != nil {
		p, err := r.peer(ctx, e)
		if err != nil {
			return nil, nil, nil, nil, fmt.Errorf("peer side: %w", err)
		}
		peerAt, sides = len(sides), append(sides, p)
	}
	rates, err := alternate(ctx, e, r.path, e.cfg.Rounds, sides...)
	if err != nil {
		return nil, nil, nil, nil, err
	}
	if handAt >= 0 {
		hand = rates[handAt]
	}
	if peerAt >= 0 {
		peer = rates[peerAt]
	}
	return rates[0], rates[1], hand, peer, nil
}

// alternate runs a warm-up of every side, then rounds in which the sides
// take turns going first (round i starts with side i mod len(sides), the
// others following in their order), and returns each side's rates.
func alternate(ctx context.Context, e *env, name string, rounds int, sides ...side) ([][]float64, error) {
	for _, s := range sides {
		if _, err := s(ctx, true); err != nil {
			return nil, fmt.Errorf("warm-up: %w", err)
		}
	}
	rates := make([][]float64, len(sides))
	got := make([]float64, len(sides))
	for i := range rounds {
		for j := range sides {
			k := (i + j) % len(sides)
			var err error
			if got[k], err = sides[k](ctx, false); err != nil {
				return nil, fmt.Errorf("round %d: %w", i+1, err)
			}
		}
		figures := make([]string, len(sides))
		for k, v := range got {
			rates[k] = append(rates[k], v)
			figures[k] = fmt.Sprintf("%.0f", v)
		}
		e.logf("%s: round %d/%d: %s (load %s)", name, i+1, rounds, strings.Join(figures, " / "), loadavg())
	}
	return rates, nil
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s)%2 == 0 {
		return (s[len(s)/2-1] + s[len(s)/2]) / 2
	}
	return s[len(s)/2]
}

func printTable(w io.Writer, results []result, started time.Time, cfg Config) {
	p := func(format string, args ...any) { _, _ = fmt.Fprintf(w, format, args...) }
	kind := "full run"
	if cfg.Quick {
		kind = "quick run (QUICK=1): smoke figures only"
	}
	p("Machine: %s\n", machine())
	p("Date: %s (%s, %d rounds per row, medians; %s)\n\n", started.UTC().Format("2006-01-02 15:04 MST"), kind, cfg.Rounds, runtime.Version())
	if len(results) > 0 { // none when ONLY kept only latency rows
		p("| path | baseline | baseline rate | idem rate | ratio | target |\n|---|---|---:|---:|---:|---:|\n")
	}
	for _, r := range results {
		if r.err != nil {
			p("| %s | %s | not measured | not measured | – | ≥ %.2f |\n", r.path, r.baseline, r.target)
			continue
		}
		p("| %s | %s | %s | %s | %.2f | ≥ %.2f |\n", r.path, r.baseline, rate(median(r.bare), r.unit), rate(median(r.idem), r.unit), r.ratio(), r.target)
	}
	for _, r := range results {
		if r.err != nil {
			p("\nnot measured: %s: %v\n", r.path, r.err)
		}
	}
	printSQLFloors(p, results)
	printByHand(p, results)
	printPeers(p, results)
	p("\n")
}

// printSQLFloors prints the table of the SQL floors, when a row has one.
func printSQLFloors(p func(format string, args ...any), results []result) {
	if !slices.ContainsFunc(results, func(r result) bool { return r.sql != nil }) {
		return
	}
	p("\nSQL floors (pgbench -M prepared -c %d -j %d, the statements each side sends; test/bench/testdata):\n\n", pgbenchClients, pgbenchThreads)
	p("| path | baseline floor | idem floor | floor ratio | baseline / its floor | idem / its floor |\n|---|---:|---:|---:|---:|---:|\n")
	for _, r := range results {
		f := r.sql
		if f == nil {
			continue
		}
		if f.err != nil {
			p("| %s | not measured | not measured | – | – | – |\n", r.path)
			continue
		}
		fb, fi := median(f.bare)*float64(r.floor.rows), median(f.idem)*float64(r.floor.rows)
		goB, goI := "–", "–"
		if r.err == nil {
			goB, goI = fmt.Sprintf("%.2f", median(r.bare)/fb), fmt.Sprintf("%.2f", median(r.idem)/fi)
		}
		p("| %s | %s | %s | %.2f | %s | %s |\n", r.path, rate(fb, r.unit), rate(fi, r.unit), fi/fb, goB, goI)
	}
	p("\nfloor ratio is idem's floor over the baseline's: the ratio the SQL alone allows on this machine; " +
		"baseline / its floor and idem / its floor are the Go paths' rates over the pgbench rate of their statements " +
		"(pgbench is a client on the same cores, so a Go path can pass it).\n")
	for _, r := range results {
		if r.sql != nil && r.sql.err != nil {
			p("\nSQL floor of %s not measured: %v\n", r.path, r.sql.err)
		}
	}
}

// printByHand prints the table of the by-hand sides, when a row has one.
// Such a side shares its row's rounds: when the row was not measured,
// neither was it, and the reason is under the first table.
func printByHand(p func(format string, args ...any), results []result) {
	if !slices.ContainsFunc(results, func(r result) bool { return r.byHand != nil }) {
		return
	}
	p("\nThe commands and statements idem sends, by hand with the bare client (a third side in the rounds of these rows):\n\n")
	p("| path | baseline rate | by-hand rate | hand ratio | idem / hand |\n|---|---:|---:|---:|---:|\n")
	redis := false
	var notes []string
	for _, r := range results {
		if r.byHand == nil {
			continue
		}
		if r.handNote == "" {
			redis = true
		} else if !slices.Contains(notes, r.handNote) {
			notes = append(notes, r.handNote)
		}
		if r.err != nil {
			p("| %s | not measured | not measured | – | – |\n", r.path)
			continue
		}
		b, i, h := median(r.bare), median(r.idem), median(r.hand)
		p("| %s | %s | %s | %.2f | %.2f |\n", r.path, rate(b, r.unit), rate(h, r.unit), h/b, i/h)
	}
	if redis {
		p("\nFor the Redis rows, by-hand is the baseline's work plus the Redis commands idem sends " +
			"for the path (the claim pipeline, MGET of the previous layout's key and SET NX GET PX, then EVALSHA of the complete script; " +
			"a replay sends the pipeline alone), by the same clients with the bare go-redis client and no idem code, " +
			"each message's commands in their own round trips (test/bench/hand.go). " +
			"hand ratio is its rate over the baseline's: what the commands cost a user who sends them a round trip per message; " +
			"idem / hand is idem's rate over it: above 1 when redisnx's group commit shares round trips " +
			"between concurrent callers.\n")
	}
	for _, n := range notes {
		p("\n%s\n", n)
	}
}

func rate(v float64, unit string) string {
	return fmt.Sprintf("%s %s", thousands(int64(v+0.5)), unit)
}

func thousands(n int64) string {
	s := fmt.Sprint(n)
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	return b.String()
}

func machine() string {
	cpu := runtime.GOARCH
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if name, ok := strings.CutPrefix(l, "model name"); ok {
				cpu = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(name), ":"))
				break
			}
		}
	}
	return fmt.Sprintf("%s, %d cores, %s/%s, load %s at the end", cpu, runtime.NumCPU(), runtime.GOOS, runtime.GOARCH, loadavg())
}

func loadavg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "?"
	}
	return strings.Join(f[:3], " ")
}

// printPeers prints the table of the peer sides, when a row has one.
func printPeers(p func(format string, args ...any), results []result) {
	if !slices.ContainsFunc(results, func(r result) bool { return r.peer != nil || (r.err != nil && r.row.peer != nil) }) {
		return
	}
	p("\nThe same work by a peer, %s, in the same rounds:\n\n", peerName)
	p("| path | baseline rate | idem rate | peer rate | idem / peer | peer / baseline |\n|---|---:|---:|---:|---:|---:|\n")
	for _, r := range results {
		if r.row.peer == nil {
			continue
		}
		if r.err != nil {
			p("| %s | not measured | not measured | not measured | – | – |\n", r.path)
			continue
		}
		b, i, x := median(r.bare), median(r.idem), median(r.peer)
		p("| %s | %s | %s | %s | %.2f | %.2f |\n", r.path, rate(b, r.unit), rate(i, r.unit), rate(x, r.unit), i/x, x/b)
	}
}
