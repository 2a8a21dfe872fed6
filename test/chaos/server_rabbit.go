package chaos

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/testkit/fault"
)

// rabbitNode is a throwaway RabbitMQ node, started by a rabbit/ cell from
// the installed server so that its faults (stop_app, a SIGKILL of the
// node) never reach the shared broker. It has a node name of its own
// (idemchaos-<pid>-<n>@localhost), its own AMQP and distribution ports on
// 127.0.0.1, no plugins (so no management or Prometheus listener), and its
// data, logs, configuration and Erlang cookie in its directory: the shared
// node's configuration (/etc/rabbitmq) is never read. It registers with the
// machine's epmd like any node. Its guest user logs in from 127.0.0.1.
type rabbitNode struct {
	name     string // idemchaos-<pid>-<n>@localhost
	dir      string
	port     int // AMQP
	distPort int // Erlang distribution
	server   string
	env      []string
	ctl      *rabbitCtl

	mu   sync.Mutex
	proc *exec.Cmd
	done chan struct{} // closed when proc exited and was reaped
}

// rabbitNodes numbers the nodes of this process.
var rabbitNodes atomic.Int64

// rabbitStartTimeout bounds each start of a node: a RabbitMQ node takes
// several seconds to boot, more on a loaded machine.
const rabbitStartTimeout = 3 * time.Minute

// rabbitSbin returns the directory of the real rabbitmq-server and
// rabbitmqctl scripts. Debian's /usr/sbin ones are wrappers that switch to
// the rabbitmq user and its home, which would lose the node's environment
// (HOME, where its Erlang cookie is), so their targets are run instead.
// $IDEM_RABBITMQ_SBIN overrides the search.
func rabbitSbin() (string, error) {
	if d := os.Getenv("IDEM_RABBITMQ_SBIN"); d != "" {
		return d, nil
	}
	if _, err := os.Stat("/usr/lib/rabbitmq/bin/rabbitmq-server"); err == nil {
		return "/usr/lib/rabbitmq/bin", nil
	}
	p, err := exec.LookPath("rabbitmq-server")
	if err != nil {
		return "", errors.New("rabbitmq-server is not installed (or set IDEM_RABBITMQ_SBIN to the directory of rabbitmq-server and rabbitmqctl)")
	}
	if target, err := filepath.EvalSymlinks(p); err == nil {
		p = target
	}
	if filepath.Base(p) != "rabbitmq-server" {
		return "", fmt.Errorf("rabbitmq-server is a wrapper (%s); set IDEM_RABBITMQ_SBIN to the directory of the real rabbitmq-server and rabbitmqctl", p)
	}
	return filepath.Dir(p), nil
}

// startRabbitNode starts a node with its files under dir and waits until
// it accepts AMQP logins. The caller must close it.
func startRabbitNode(ctx context.Context, dir string) (*rabbitNode, error) {
	sbin, err := rabbitSbin()
	if err != nil {
		return nil, err
	}
	n := &rabbitNode{
		name:   fmt.Sprintf("idemchaos-%d-%d@localhost", os.Getpid(), rabbitNodes.Add(1)),
		dir:    dir,
		server: filepath.Join(sbin, "rabbitmq-server"),
	}
	for _, sub := range []string{"mnesia", "log"} {
		if err := os.MkdirAll(filepath.Join(dir, sub), 0o755); err != nil {
			return nil, err
		}
	}
	// The Erlang cookie: in the node's HOME, readable by its owner only
	// (Erlang refuses it otherwise), shared by the node and rabbitmqctl.
	cookie := make([]byte, 20)
	for i := range cookie {
		cookie[i] = byte('A' + rand.IntN(26))
	}
	if err := os.WriteFile(filepath.Join(dir, ".erlang.cookie"), cookie, 0o400); err != nil {
		return nil, err
	}
	files := map[string]string{
		"rabbitmq-env.conf": "",    // instead of /etc/rabbitmq/rabbitmq-env.conf
		"enabled_plugins":   "[].", // no management, no Prometheus
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			return nil, err
		}
	}
	var lastErr error
	for range 3 {
		if err := n.pickPorts(); err != nil {
			return nil, err
		}
		if lastErr = n.start(ctx); lastErr == nil {
			return n, nil
		}
		if ctx.Err() != nil {
			break
		}
	}
	return nil, fmt.Errorf("rabbitmq node %s: %w", n.name, lastErr)
}

// pickPorts chooses free ports and writes the configuration and the
// environment that name them.
func (n *rabbitNode) pickPorts() error {
	var err error
	if n.port, err = fault.FreePort(); err != nil {
		return err
	}
	if n.distPort, err = fault.FreePort(); err != nil {
		return err
	}
	conf := fmt.Sprintf("listeners.tcp.default = 127.0.0.1:%d\n", n.port)
	if err := os.WriteFile(filepath.Join(n.dir, "rabbitmq.conf"), []byte(conf), 0o644); err != nil {
		return err
	}
	n.env = []string{
		"HOME=" + n.dir,
		"RABBITMQ_NODENAME=" + n.name,
		"RABBITMQ_NODE_IP_ADDRESS=127.0.0.1",
		"RABBITMQ_NODE_PORT=" + strconv.Itoa(n.port),
		"RABBITMQ_DIST_PORT=" + strconv.Itoa(n.distPort),
		"RABBITMQ_CONF_ENV_FILE=" + filepath.Join(n.dir, "rabbitmq-env.conf"),
		"RABBITMQ_CONFIG_FILE=" + filepath.Join(n.dir, "rabbitmq.conf"),
		"RABBITMQ_ADVANCED_CONFIG_FILE=" + filepath.Join(n.dir, "advanced.config"),
		"RABBITMQ_ENABLED_PLUGINS_FILE=" + filepath.Join(n.dir, "enabled_plugins"),
		"RABBITMQ_MNESIA_BASE=" + filepath.Join(n.dir, "mnesia"),
		"RABBITMQ_LOG_BASE=" + filepath.Join(n.dir, "log"),
		"RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=-kernel inet_dist_use_interface {127,0,0,1}",
		"ERL_EPMD_ADDRESS=127.0.0.1",
		// The script then execs the Erlang VM instead of waiting on it
		// in a shell: the VM is the child, and gets the death signal.
		"RUNNING_UNDER_SYSTEMD=true",
	}
	n.ctl = &rabbitCtl{bin: filepath.Join(filepath.Dir(n.server), "rabbitmqctl"), node: n.name, env: n.env}
	return nil
}

// url is the AMQP URL of the node's default vhost.
func (n *rabbitNode) url() string {
	return fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", n.port)
}

// start runs the server in a process group of its own and waits until an
// AMQP login succeeds (the listener opens last in the boot).
func (n *rabbitNode) start(ctx context.Context) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.proc != nil {
		return errors.New("the node is running")
	}
	out, err := os.OpenFile(filepath.Join(n.dir, "server.out"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer func() { _ = out.Close() }()
	cmd := exec.Command(n.server)
	cmd.Dir = n.dir
	cmd.Env = append(os.Environ(), n.env...)
	cmd.Stdout, cmd.Stderr = out, out
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	childproc.SetDeathSignal(cmd, syscall.SIGKILL)
	done := make(chan struct{})
	started := make(chan error, 1)
	go func() {
		// The death signal fires when the thread that started the
		// process exits: this goroutine keeps it until the process ends.
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := cmd.Start(); err != nil {
			started <- err
			close(done)
			return
		}
		started <- nil
		_ = cmd.Wait()
		close(done)
	}()
	if err := <-started; err != nil {
		return err
	}
	n.proc, n.done = cmd, done
	sctx, cancel := context.WithTimeout(ctx, rabbitStartTimeout)
	defer cancel()
	for {
		c, err := amqp091.DialConfig(n.url(), amqp091.Config{Dial: amqp091.DefaultDial(5 * time.Second)})
		if err == nil {
			_ = c.Close()
			return nil
		}
		select {
		case <-done:
			n.proc = nil
			return fmt.Errorf("the server exited while starting: %s", n.logTail())
		case <-sctx.Done():
			n.killLocked()
			return fmt.Errorf("no AMQP login after %v: %w: %s", rabbitStartTimeout, err, n.logTail())
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// kill SIGKILLs the node's process group (the Erlang VM and its helpers)
// and waits until the VM is reaped: a crash. Messages the
// node confirmed are on disk; acknowledgements not yet written are not.
func (n *rabbitNode) kill() {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.killLocked()
}

func (n *rabbitNode) killLocked() {
	if n.proc == nil {
		return
	}
	_ = syscall.Kill(-n.proc.Process.Pid, syscall.SIGKILL)
	<-n.done
	n.proc = nil
	// epmd forgets the name when the VM's connection to it closes; the
	// next start registers it again.
}

// restart starts the node again after kill, on the same ports, name and
// data: durable queues come back with their persistent messages.
func (n *rabbitNode) restart(ctx context.Context) error {
	return n.start(context.WithoutCancel(ctx))
}

// close stops the node for good. Its directory is the cell's and goes
// with it.
func (n *rabbitNode) close() { n.kill() }

// logTail is the end of the node's output and log, for errors.
func (n *rabbitNode) logTail() string {
	var s string
	for _, f := range []string{filepath.Join(n.dir, "server.out"), filepath.Join(n.dir, "log", n.name+".log")} {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		if len(b) > 1500 {
			b = b[len(b)-1500:]
		}
		s += fmt.Sprintf("[%s] %s ", filepath.Base(f), b)
	}
	return s
}
