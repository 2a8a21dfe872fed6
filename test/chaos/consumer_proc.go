package chaos

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/idemkit/idem/internal/childproc"
)

// proc is one child process of a SIGKILL cell.
type proc struct {
	*childproc.Proc
	cfg     childConfig
	plan    killPlan
	start   time.Time
	ready   chan struct{} // closed at childReadyLine
	started chan struct{} // closed at the first delivery
	// armedAt is when the runner armed the child's named point.
	armedAt time.Time
}

// startProc runs the child registered as child with cfg.
func startProc(env *Env, child string, cfg childConfig) (*proc, error) {
	js, err := json.Marshal(cfg)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(env.Exe)
	cmd.Env = append(os.Environ(), ChildEnv+"="+child, childConfigEnv+"="+string(js))
	p := &proc{cfg: cfg, start: time.Now(), ready: make(chan struct{}), started: make(chan struct{})}
	var readyOnce, startedOnce sync.Once
	// The callback uses only p's own channels, never p.Proc, set below.
	cp, err := childproc.Start(cmd, 16<<10, func(line string) {
		switch line {
		case childReadyLine:
			readyOnce.Do(func() { close(p.ready) })
		case childStartedLine:
			startedOnce.Do(func() { close(p.started) })
		}
	})
	if err != nil {
		return nil, err
	}
	p.Proc = cp
	return p, nil
}

// arm tells the child to kill itself at its named point from now on.
func (p *proc) arm(now time.Time) error {
	p.armedAt = now
	if _, err := io.WriteString(p.Stdin, childArmLine+"\n"); err != nil {
		select {
		case <-p.Exited(): // it died meanwhile: the exit is handled next
			return nil
		default:
		}
		return fmt.Errorf("arm child %s: %w", p.cfg.Name, err)
	}
	return nil
}

// stop stops the child gracefully (SIGTERM), SIGKILLing it after limit. It
// returns an error when the child did not exit cleanly.
func (p *proc) stop(limit time.Duration) error {
	select {
	case <-p.ready: // SIGTERM before the handler is installed would kill it
	case <-p.Exited():
	case <-time.After(limit):
	}
	_ = p.Cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.Exited():
	case <-time.After(limit):
		p.Kill()
		<-p.Exited()
		return fmt.Errorf("child %s did not stop within %v of SIGTERM%s", p.cfg.Name, limit, p.StderrTail())
	}
	if p.Err() != nil {
		return fmt.Errorf("child %s: %w%s", p.cfg.Name, p.Err(), p.StderrTail())
	}
	return nil
}

// countDeliveries reads the delivery logs in dir whose names start with
// prefix: the number of deliveries and of distinct ids.
func countDeliveries(dir, prefix string) (deliveries, distinct int, err error) {
	files, err := filepath.Glob(filepath.Join(dir, prefix+"-*.log"))
	if err != nil {
		return 0, 0, err
	}
	seen := map[string]struct{}{}
	for _, name := range files {
		f, err := os.Open(name)
		if err != nil {
			return 0, 0, err
		}
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if id := sc.Text(); id != "" {
				deliveries++
				seen[id] = struct{}{}
			}
		}
		_ = f.Close()
		if err := sc.Err(); err != nil {
			return 0, 0, err
		}
	}
	return deliveries, len(seen), nil
}

// sleepCtx sleeps d or until ctx ends.
func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
