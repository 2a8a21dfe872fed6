package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/idemkit/idem/internal/childproc"
)

// The parent side of the idem consumer's child processes (demo_child.go):
// one child at a time consumes the idem pipeline; when the demo draws a
// crash (--crash-rate, on the child's handled idem records, with the
// run's seeded generator), it SIGKILLs the child and starts another, which
// gets what the dead one left unacknowledged or uncommitted. With a lease
// store (--redis) the child is first frozen between deliveries: a SIGKILL
// between a charge and the Complete of its lease would charge again once
// the lease ran out, the limit of lease stores the README states. With
// pgtable the kill lands anywhere: the claim and the charge commit
// together.

// Bounds of the child's stops.
const (
	childFreezeWait = 3 * time.Second // for "frozen", then SIGKILL anyway
	childStopWait   = 5 * time.Second // after EOF on stdin, then SIGKILL
)

// childProc is one child process.
type childProc struct {
	*childproc.Proc
	// crash is closed when the demo drew a crash for this child; frozen
	// when the child reported "frozen".
	crash, frozen         chan struct{}
	crashOnce, frozenOnce sync.Once
	crashing              bool // only the reader goroutine reads and writes it
}

// runChildren runs the group as child processes, one at a time, until ctx
// ends, SIGKILLing and restarting them. Every child has exited when it
// returns.
func (g *group) runChildren(ctx context.Context) error {
	cfg, err := json.Marshal(g.child)
	if err != nil {
		return err
	}
	for first := true; ctx.Err() == nil; first = false {
		p, err := g.startChild(cfg)
		if err != nil {
			return err
		}
		if !first {
			g.restarts.Add(1)
		}
		select {
		case <-ctx.Done():
			return p.stop()
		case <-p.Exited():
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("the idem consumer's child process exited: %w%s", p.ExitErr(), p.StderrTail())
		case <-p.crash:
			if err := g.kill(p); err != nil {
				return err
			}
		}
	}
	return nil
}

// startChild starts a child with the JSON configuration cfg and a goroutine
// that reads its reports until it exits.
func (g *group) startChild(cfg []byte) (*childProc, error) {
	cmd := exec.Command(g.exe)
	cmd.Env = append(os.Environ(), demoChildEnv+"=1")
	p := &childProc{crash: make(chan struct{}), frozen: make(chan struct{})}
	// report uses only p's own channels, never p.Proc, which is set below.
	proc, err := childproc.Start(cmd, 8<<10, func(line string) { g.report(p, line) })
	if err != nil {
		return nil, fmt.Errorf("start the idem consumer's child process: %w", err)
	}
	p.Proc = proc
	// The pipe's buffer holds the line: the child reads it when it starts.
	_, _ = p.Stdin.Write(append(cfg, '\n'))
	return p, nil
}

// report handles one line of p's reports (see demo_child.go).
func (g *group) report(p *childProc, line string) {
	f := strings.Fields(line)
	if len(f) == 0 {
		return
	}
	switch f[0] {
	case "d":
		if len(f) != 5 {
			return
		}
		po, ok := parseCopyID(f[1])
		if !ok {
			return
		}
		n, _ := strconv.Atoi(f[3])
		req := f[4]
		if req == "-" {
			req = ""
		}
		g.ledger.classify(po, f[2], req, n)
	case "c":
		if len(f) != 3 {
			return
		}
		n, _ := strconv.Atoi(f[1])
		cents, _ := strconv.ParseInt(f[2], 10, 64)
		g.ledger.charge(n, cents)
	case "h":
		if len(f) != 3 {
			return
		}
		if po, ok := parseCopyID(f[1]); ok {
			g.markHandled(po)
		}
		if f[2] == "1" && !p.crashing && g.rng.Float64() < g.crashRate {
			p.crashing = true
			p.crashOnce.Do(func() { close(p.crash) })
		}
	case "frozen":
		p.frozenOnce.Do(func() { close(p.frozen) })
	}
}

// kill SIGKILLs p (frozen first when the group says so) and waits for it.
func (g *group) kill(p *childProc) error {
	if g.freeze {
		_, _ = io.WriteString(p.Stdin, "freeze\n")
		select {
		case <-p.frozen:
		case <-p.Exited():
		case <-time.After(childFreezeWait):
		}
	}
	p.Kill()
	<-p.Exited()
	if !p.DiedOfSIGKILL() {
		return fmt.Errorf("the idem consumer's child process exited before its SIGKILL: %w%s", p.ExitErr(), p.StderrTail())
	}
	g.kills.Add(1)
	g.crashes.Add(1)
	return nil
}

// stop stops p gracefully (EOF on its stdin), SIGKILLing it after
// childStopWait, and waits for it.
func (p *childProc) stop() error {
	_ = p.Stdin.Close()
	select {
	case <-p.Exited():
		if p.Err() != nil {
			return fmt.Errorf("the idem consumer's child process: %w%s", p.Err(), p.StderrTail())
		}
		return nil
	case <-time.After(childStopWait):
		p.Kill()
		<-p.Exited()
		return fmt.Errorf("the idem consumer's child process did not stop within %v%s", childStopWait, p.StderrTail())
	}
}
