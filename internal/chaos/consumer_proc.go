package chaos

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// proc is one child process of a SIGKILL cell.
type proc struct {
	cmd     *exec.Cmd
	cfg     childConfig
	plan    killPlan
	start   time.Time
	ready   chan struct{} // closed at childReadyLine
	started chan struct{} // closed at the first delivery
	exited  chan struct{} // closed when the process is reaped; then err is set
	err     error
	stderr  *tailBuffer
	// signalled is set when the runner sent SIGKILL.
	signalled bool
	// armedAt is when the runner armed the child's named point.
	armedAt time.Time
	stdin   io.WriteCloser
}

// startProc runs the child registered as child with cfg.
func startProc(env *Env, child string, cfg childConfig) (*proc, error) {
	js, err := json.Marshal(cfg)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(env.Exe)
	cmd.Env = append(os.Environ(), ChildEnv+"="+child, childConfigEnv+"="+string(js))
	setDeathSignal(cmd)
	p := &proc{cmd: cmd, cfg: cfg, start: time.Now(), ready: make(chan struct{}), started: make(chan struct{}),
		exited: make(chan struct{}), stderr: &tailBuffer{max: 16 << 10}}
	cmd.Stderr = p.stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if p.stdin, err = cmd.StdinPipe(); err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	outDone := make(chan struct{})
	go func() {
		defer close(outDone)
		var readyOnce, startedOnce sync.Once
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			switch sc.Text() {
			case childReadyLine:
				readyOnce.Do(func() { close(p.ready) })
			case childStartedLine:
				startedOnce.Do(func() { close(p.started) })
			}
		}
		_, _ = io.Copy(io.Discard, out)
	}()
	go func() {
		<-outDone
		p.err = cmd.Wait()
		close(p.exited)
	}()
	return p, nil
}

// sigkill sends SIGKILL (once the process is still there).
func (p *proc) sigkill() {
	select {
	case <-p.exited:
	default:
		p.signalled = true
		_ = p.cmd.Process.Signal(syscall.SIGKILL)
	}
}

// arm tells the child to kill itself at its named point from now on.
func (p *proc) arm(now time.Time) error {
	p.armedAt = now
	if _, err := io.WriteString(p.stdin, childArmLine+"\n"); err != nil {
		select {
		case <-p.exited: // it died meanwhile: the exit is handled next
			return nil
		default:
		}
		return fmt.Errorf("arm child %s: %w", p.cfg.Name, err)
	}
	return nil
}

// killed reports whether the exited process died of SIGKILL.
func (p *proc) killed() bool {
	var ee *exec.ExitError
	if errors.As(p.err, &ee) {
		if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() && ws.Signal() == syscall.SIGKILL {
			return true
		}
	}
	return false
}

// stop stops the child gracefully (SIGTERM), SIGKILLing it after limit. It
// returns an error when the child did not exit cleanly.
func (p *proc) stop(limit time.Duration) error {
	select {
	case <-p.ready: // SIGTERM before the handler is installed would kill it
	case <-p.exited:
	case <-time.After(limit):
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.exited:
	case <-time.After(limit):
		p.sigkill()
		<-p.exited
		return fmt.Errorf("child %s did not stop within %v of SIGTERM%s", p.cfg.Name, limit, p.stderr.tail())
	}
	if p.err != nil {
		return fmt.Errorf("child %s: %w%s", p.cfg.Name, p.err, p.stderr.tail())
	}
	return nil
}

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	b   []byte
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b = append(t.b, p...)
	if len(t.b) > t.max {
		t.b = append(t.b[:0], t.b[len(t.b)-t.max:]...)
	}
	return len(p), nil
}

// tail returns the kept output as a suffix for an error message.
func (t *tailBuffer) tail() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := strings.TrimSpace(string(t.b))
	if s == "" {
		return ""
	}
	if len(s) > 2000 {
		s = "..." + s[len(s)-2000:]
	}
	return "; its stderr ends with:\n" + s
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
