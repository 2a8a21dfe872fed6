package chaos

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime/pprof"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// The stall detector of the Kafka cells. A partition that has records past
// the group's committed offset (lag) and whose committed offset does not
// move for longer than stallBound fails the cell, whatever the kill loop
// is doing: a partition nobody fetches while the group looks settled would
// otherwise only show as a drain that runs out of time. When it fires, the
// detector writes what a reliability engineer needs next to the failure:
// the group as the broker sees it (state, generation, every member and the
// partitions assigned to it, the committed offsets and the ends) and the
// goroutines of every live consumer child (each writes them to a file on
// SIGUSR1, see dumpGoroutinesOn).

// stallBound is how long an assigned partition may keep lag without its
// committed offset moving. A kill costs a partition the session timeout,
// a rebalance and a restarted child's start, a few seconds each; the
// bound is well above a run of them.
const stallBound = 30 * time.Second

// stallDetector watches a group's committed offsets.
type stallDetector struct {
	k          *kafkaEnv
	group      string
	topic      string
	partitions int
	dir        string // where the children write their pid and goroutine files
	bound      time.Duration

	stop context.CancelFunc
	done chan struct{}

	mu  sync.Mutex
	err error
}

// startStallDetector polls the group every second until stop.
func startStallDetector(ctx context.Context, k *kafkaEnv, group, topic string, partitions int, dir string, bound time.Duration) *stallDetector {
	ctx, cancel := context.WithCancel(ctx)
	d := &stallDetector{k: k, group: group, topic: topic, partitions: partitions, dir: dir, bound: bound, stop: cancel, done: make(chan struct{})}
	go func() {
		defer close(d.done)
		d.run(ctx)
	}()
	return d
}

// close stops the detector and waits for it.
func (d *stallDetector) close() {
	d.stop()
	<-d.done
}

// failed returns the detector's error once it fired.
func (d *stallDetector) failed() error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.err
}

func (d *stallDetector) run(ctx context.Context) {
	type seen struct {
		committed int64
		since     time.Time
	}
	last := make([]seen, d.partitions)
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		now := time.Now()
		qctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		ends, err := d.k.ends(qctx, d.topic, d.partitions)
		var com []int64
		if err == nil {
			com, err = d.k.committed(qctx, d.group, d.topic, d.partitions)
		}
		cancel()
		if err != nil {
			continue // the broker is busy; the next poll tries again
		}
		var stalled []int
		for p := range last {
			if last[p].since.IsZero() || com[p] != last[p].committed {
				last[p] = seen{committed: com[p], since: now}
				continue
			}
			if com[p] < ends[p] && now.Sub(last[p].since) > d.bound {
				stalled = append(stalled, p)
			}
		}
		if len(stalled) == 0 {
			continue
		}
		var b strings.Builder
		for _, p := range stalled {
			fmt.Fprintf(&b, "partition %d: committed %d of %d, no progress for %v; ", p, com[p], ends[p], now.Sub(last[p].since).Round(time.Second))
		}
		report := d.dump(ctx, ends, com)
		d.mu.Lock()
		d.err = fmt.Errorf("stall detector: %sgroup and goroutines follow\n%s", b.String(), report)
		d.mu.Unlock()
		return
	}
}

// dump renders the group as kfake sees it and the children's goroutines.
func (d *stallDetector) dump(ctx context.Context, ends, com []int64) string {
	var b strings.Builder
	fmt.Fprintf(&b, "--- group %s, topic %s\n", d.group, d.topic)
	for p := range ends {
		fmt.Fprintf(&b, "partition %d: committed %d, end %d\n", p, com[p], ends[p])
	}
	if gi := d.k.cluster.GroupInfo(d.group); gi == nil {
		b.WriteString("the broker knows no such group\n")
	} else {
		fmt.Fprintf(&b, "state %s, generation %d, %d members\n", gi.State, gi.Epoch, len(gi.Members))
		for _, m := range gi.Members {
			fmt.Fprintf(&b, "member %s (client %s, host %s): %v\n", m.MemberID, m.ClientID, m.ClientHost, m.Assignment)
		}
	}
	b.WriteString(dumpChildren(ctx, d.dir))
	return b.String()
}

// goroutineSuffix and pidSuffix name a child's files next to its
// deliveries log.
const (
	pidSuffix       = ".pid"
	goroutineSuffix = ".goroutines"
)

// dumpChildren asks every live child that wrote a pid file in dir for its
// goroutines (SIGUSR1) and returns what they wrote.
func dumpChildren(ctx context.Context, dir string) string {
	pids, _ := filepath.Glob(filepath.Join(dir, "*"+pidSuffix))
	sort.Strings(pids)
	var b strings.Builder
	type asked struct{ base, out string }
	var live []asked
	for _, f := range pids {
		raw, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(raw)))
		if err != nil {
			continue
		}
		base := strings.TrimSuffix(f, pidSuffix)
		out := base + goroutineSuffix
		_ = os.Remove(out)
		if syscall.Kill(pid, syscall.SIGUSR1) != nil {
			continue // SIGKILLed earlier
		}
		live = append(live, asked{filepath.Base(base), out})
	}
	deadline := time.Now().Add(10 * time.Second)
	for _, a := range live {
		var raw []byte
		for {
			// The child writes to a temporary name and renames it.
			if r, err := os.ReadFile(a.out); err == nil {
				raw = r
				break
			}
			if time.Now().After(deadline) || ctx.Err() != nil {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		fmt.Fprintf(&b, "--- goroutines of the child of %s\n", a.base)
		if raw == nil {
			b.WriteString("(no answer to SIGUSR1)\n")
			continue
		}
		b.Write(raw)
	}
	if len(live) == 0 {
		b.WriteString("--- no live child answered\n")
	}
	return b.String()
}

// dumpGoroutinesOn makes a child write its pid to base+pidSuffix and, on
// every SIGUSR1, all its goroutines to base+goroutineSuffix. The returned
// function stops it.
func dumpGoroutinesOn(base string) (func(), error) {
	if err := os.WriteFile(base+pidSuffix, []byte(strconv.Itoa(os.Getpid())), 0o600); err != nil {
		return nil, err
	}
	ch := make(chan os.Signal, 1)
	signal.Notify(ch, syscall.SIGUSR1)
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			select {
			case <-done:
				return
			case <-ch:
			}
			tmp := base + goroutineSuffix + ".tmp"
			f, err := os.Create(tmp)
			if err != nil {
				continue
			}
			_ = pprof.Lookup("goroutine").WriteTo(f, 2)
			_ = f.Close()
			_ = os.Rename(tmp, base+goroutineSuffix)
		}
	})
	return func() {
		signal.Stop(ch)
		close(done)
		wg.Wait()
	}, nil
}
