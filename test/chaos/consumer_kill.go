package chaos

import (
	"context"
	"fmt"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"
)

// workload is the broker side of a SIGKILL cell: it feeds inputs, tells how
// far the children got, and says when everything produced was
// acknowledged.
type workload interface {
	// child is the name of the registered child function.
	child() string
	// config is the base configuration of a child in slot.
	config(slot int) childConfig
	// produce makes ids available to the children (publishes them, or
	// hands them to the HTTP clients).
	produce(ctx context.Context, ids []string) error
	// progress returns how many inputs are done (have an effect, or were
	// answered): it paces production and random kills.
	progress(ctx context.Context) (int, error)
	// drained reports whether every produced input was acknowledged by the
	// broker's own account (offsets committed to the end, queues empty),
	// given how long progress has not moved.
	drained(ctx context.Context, idle time.Duration) (bool, error)
	// settle checks, once the children stopped, that nothing is left
	// unacknowledged.
	settle(ctx context.Context) error
}

// killSpec sizes a kill loop.
type killSpec struct {
	ids     []string
	kills   int
	workers int
	// points are the named points; plans alternate the next named point
	// and a random kill.
	points []string
	// named bounds how long an armed child may run without reaching its
	// named point; then the runner kills it (counted as a missed point).
	named time.Duration
	// limit bounds the whole run.
	limit time.Duration
}

// killPlan is how a child is to die.
type killPlan struct {
	armed bool   // false: runs until stopped
	point string // named point, or "" for a random kill by the runner
	// target is the number of inputs done (over the whole cell) at which
	// the plan goes off: the runner kills the child (random), or arms it
	// through its stdin, after which it kills itself at its point
	// (named).
	target int
	after  int     // named: passes of the point once armed before it may fire
	prob   float64 // named: then the chance it fires at each pass
}

// killStats is what a kill loop did.
type killStats struct {
	kills, restarts int
	byPoint         map[string]int
	missed          int // named points not reached, killed by the runner
	elapsed         time.Duration
}

// note renders the kills by point for Result.Note.
func (s killStats) note() string {
	keys := make([]string, 0, len(s.byPoint))
	for k := range s.byPoint {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, 0, len(keys))
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s %d", k, s.byPoint[k]))
	}
	out := "kills: " + strings.Join(parts, ", ")
	if s.missed > 0 {
		out += fmt.Sprintf(" (%d named points not reached in time, killed by the runner)", s.missed)
	}
	return out
}

// killTargets returns, for each of kills kills, the number of inputs done
// at which it goes off: evenly spread over the first 90% of n inputs (a
// named point needs deliveries left to be reached), each moved by a random
// amount (env.Rand) within a quarter of the spacing.
func killTargets(env *Env, n, kills int) []int {
	step := n * 9 / 10 / (kills + 1)
	out := make([]int, kills)
	for i := range out {
		jitter := 0
		if q := step / 4; q > 0 {
			jitter = env.Rand.IntN(2*q+1) - q
		}
		out[i] = max(1, (i+1)*step+jitter)
	}
	return out
}

// runKills produces every input of w, runs spec.workers children and
// SIGKILLs them spec.kills times, spread evenly over the run: each kill
// goes off when the cell's inputs done reach its target (killTargets). A
// random kill is the runner's SIGKILL at that moment; a named kill arms
// the child, which kills itself at its point within a few passes. Each
// killed child is restarted at once with the next plan. Then the last
// children (unarmed) drain everything, are stopped gracefully, and w
// settles.
func runKills(ctx context.Context, env *Env, w workload, spec killSpec) (st killStats, err error) {
	begin := time.Now()
	ctx, cancel := context.WithTimeout(ctx, spec.limit)
	defer cancel()
	st.byPoint = map[string]int{}
	targets := killTargets(env, len(spec.ids), spec.kills)

	procs := make([]*proc, spec.workers)
	defer func() {
		for _, p := range procs {
			if p != nil {
				p.Kill()
				<-p.Exited()
			}
		}
	}()
	gen, plans := 0, 0
	nextPlan := func() killPlan {
		if plans >= spec.kills {
			return killPlan{}
		}
		i := plans
		plans++
		// Named and random in turn, the last one random: it needs no
		// work left.
		if len(spec.points) > 0 && (spec.kills-1-i)%2 == 1 {
			return killPlan{armed: true, point: spec.points[(i/2)%len(spec.points)], target: targets[i],
				after: env.Rand.IntN(4), prob: 0.5}
		}
		return killPlan{armed: true, target: targets[i]}
	}
	startSlot := func(s int) error {
		gen++
		cfg := w.config(s)
		cfg.Name = fmt.Sprintf("w%d.%d", s, gen)
		prefix := "deliveries"
		if lp, ok := w.(interface{ logPrefix() string }); ok {
			prefix = lp.logPrefix()
		}
		cfg.Log = filepath.Join(env.TempDir, fmt.Sprintf("%s-%04d.log", prefix, gen))
		plan := nextPlan()
		cfg.Point, cfg.After, cfg.Prob, cfg.Seed, cfg.Gated = plan.point, plan.after, plan.prob, env.Rand.Uint64(), true
		p, err := startProc(env, w.child(), cfg)
		if err != nil {
			return fmt.Errorf("start child: %w", err)
		}
		p.plan = plan
		procs[s] = p
		return nil
	}
	unexpected := func(p *proc) error {
		return fmt.Errorf("child %s exited on its own (%w)%s", p.cfg.Name, p.Err(), p.StderrTail())
	}

	var (
		done       int
		lastPoll   time.Time
		lastDone   int
		lastDoneAt = time.Now()
		lastLog    = time.Now()
	)
	poll := func(now time.Time) error {
		if now.Sub(lastPoll) < 50*time.Millisecond {
			return nil
		}
		lastPoll = now
		n, err := w.progress(ctx)
		if err != nil {
			return fmt.Errorf("progress: %w", err)
		}
		done = n
		if n != lastDone {
			lastDone, lastDoneAt = n, now
		}
		return nil
	}

	if err := w.produce(ctx, spec.ids); err != nil {
		return st, fmt.Errorf("produce: %w", err)
	}
	for s := range procs {
		if err := startSlot(s); err != nil {
			return st, err
		}
	}
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for st.kills < spec.kills {
		select {
		case <-ctx.Done():
			return st, fmt.Errorf("kill phase stalled: %d of %d kills, %d of %d inputs done after %v", st.kills, spec.kills, done, len(spec.ids), time.Since(begin).Round(time.Second))
		case <-tick.C:
		}
		now := time.Now()
		if err := poll(now); err != nil {
			return st, err
		}
		for s, p := range procs {
			select {
			case <-p.Exited():
				if !p.DiedOfSIGKILL() {
					return st, unexpected(p)
				}
				st.kills++
				switch {
				case !p.Signalled():
					st.byPoint[p.plan.point]++
				case p.plan.point != "":
					st.missed++
					st.byPoint["random"]++
				default:
					st.byPoint["random"]++
				}
				env.Logf("kill %d/%d: %s (%s), %d of %d inputs done", st.kills, spec.kills, p.cfg.Name, planName(p), done, len(spec.ids))
				if err := startSlot(s); err != nil {
					return st, err
				}
				st.restarts++
				continue
			default:
			}
			if !p.plan.armed || p.Signalled() {
				continue
			}
			if !p.armedAt.IsZero() {
				if now.Sub(p.armedAt) > spec.named {
					p.Kill() // the named point was not reached
				}
				continue
			}
			// The plan goes off once the target is reached and the child
			// has work (its first delivery), or has had 5s to get some.
			select {
			case <-p.started:
			default:
				if now.Sub(p.start) < 5*time.Second {
					continue
				}
			}
			if done < p.plan.target {
				continue
			}
			if p.plan.point == "" {
				p.Kill()
			} else if err := p.arm(now); err != nil {
				return st, err
			}
		}
	}
	env.Logf("%d kills done in %v; draining %d inputs", st.kills, time.Since(begin).Round(100*time.Millisecond), len(spec.ids))

	// Drain: the last children (no plan) run until the broker says
	// everything was acknowledged.
	var lastCheck time.Time
	for {
		select {
		case <-ctx.Done():
			return st, fmt.Errorf("drain stalled: %d of %d inputs done after %v", done, len(spec.ids), time.Since(begin).Round(time.Second))
		case <-tick.C:
		}
		for _, p := range procs {
			select {
			case <-p.Exited():
				return st, unexpected(p)
			default:
			}
		}
		now := time.Now()
		if now.Sub(lastCheck) < 200*time.Millisecond {
			continue
		}
		lastCheck = now
		lastPoll = time.Time{}
		if err := poll(now); err != nil {
			return st, err
		}
		if now.Sub(lastLog) >= 2*time.Second {
			lastLog = now
			env.Logf("draining: %d of %d inputs done", done, len(spec.ids))
		}
		ok, err := w.drained(ctx, now.Sub(lastDoneAt))
		if err != nil {
			return st, fmt.Errorf("drained: %w", err)
		}
		if ok {
			break
		}
	}

	// Stop the children gracefully, at once.
	errs := make([]error, len(procs))
	var wg sync.WaitGroup
	for i, p := range procs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = p.stop(30 * time.Second)
		}()
	}
	wg.Wait()
	procs = make([]*proc, len(procs)) // reaped
	for _, e := range errs {
		if e != nil {
			return st, e
		}
	}
	if err := w.settle(ctx); err != nil {
		return st, fmt.Errorf("settle: %w", err)
	}
	st.elapsed = time.Since(begin)
	return st, nil
}

func planName(p *proc) string {
	switch {
	case p.plan.point != "" && !p.Signalled():
		return fmt.Sprintf("named point %s, armed at %d inputs done", p.plan.point, p.plan.target)
	case p.plan.point != "":
		return "named point " + p.plan.point + " not reached, killed by the runner"
	default:
		return fmt.Sprintf("random, at %d inputs done", p.plan.target)
	}
}

// makeIDs returns n ids with prefix.
func makeIDs(prefix string, n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("%s-%06d", prefix, i)
	}
	return out
}
