package chaos

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"
)

// rabbitCtl runs the broker's CLI, rabbitmqctl, which works only on the
// broker's own machine (like internal/testkit/testenv.Rabbitmqctl, without a
// testing.TB): against the shared broker (newRabbitCtl), or against a
// throwaway node (rabbitNode), named with -n and reached with the node's
// environment (its HOME holds the Erlang cookie).
type rabbitCtl struct {
	bin  string
	node string   // -n; empty: the default node
	env  []string // added to the environment
}

// newRabbitCtl finds rabbitmqctl for the broker at amqpURL; it fails when
// the broker is not local or the CLI is missing.
func newRabbitCtl(amqpURL string) (*rabbitCtl, error) {
	u, err := url.Parse(amqpURL)
	if err != nil {
		return nil, err
	}
	host := u.Hostname()
	if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
		return nil, fmt.Errorf("rabbitmqctl needs the broker on this machine; the AMQP URL points at %s", host)
	}
	bin, err := exec.LookPath("rabbitmqctl")
	if err != nil {
		if _, serr := os.Stat("/usr/sbin/rabbitmqctl"); serr != nil {
			return nil, errors.New("rabbitmqctl is not installed")
		}
		bin = "/usr/sbin/rabbitmqctl"
	}
	return &rabbitCtl{bin: bin}, nil
}

// run runs one command and returns its output.
func (c *rabbitCtl) run(ctx context.Context, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 120*time.Second)
	defer cancel()
	if c.node != "" {
		args = append([]string{"-n", c.node}, args...)
	}
	cmd := exec.CommandContext(ctx, c.bin, args...)
	if c.env != nil {
		cmd.Env = append(os.Environ(), c.env...)
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		return string(out), fmt.Errorf("rabbitmqctl %s: %w: %s", strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return string(out), nil
}

// queueDepths returns the ready and unacknowledged messages of the queues
// of vhost.
func (c *rabbitCtl) queueDepths(ctx context.Context, vhost string) (map[string][2]int, error) {
	out, err := c.run(ctx, "--quiet", "list_queues", "-p", vhost, "--no-table-headers", "name", "messages_ready", "messages_unacknowledged")
	if err != nil {
		return nil, err
	}
	m := map[string][2]int{}
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) != 3 {
			continue
		}
		ready, err1 := strconv.Atoi(f[1])
		unacked, err2 := strconv.Atoi(f[2])
		if err1 != nil || err2 != nil {
			continue
		}
		m[f[0]] = [2]int{ready, unacked}
	}
	return m, nil
}

// closeAll closes every client connection of vhost and returns how many
// it closed.
func (c *rabbitCtl) closeAll(ctx context.Context, vhost string) (int, error) {
	out, err := c.run(ctx, "close_all_connections", "-p", vhost, "idem chaos")
	if err != nil {
		return 0, err
	}
	// "Closed 3 connections"
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) >= 2 && f[0] == "Closed" {
			if n, err := strconv.Atoi(f[1]); err == nil {
				return n, nil
			}
		}
	}
	return 0, nil
}

// vhost creates a fresh virtual host with full permissions for the URL's
// user and returns its name, the URL that connects to it, and a function
// that deletes it.
func (c *rabbitCtl) vhost(ctx context.Context, amqpURL, name string) (string, func(), error) {
	u, err := url.Parse(amqpURL)
	if err != nil {
		return "", nil, err
	}
	user := u.User.Username()
	if user == "" {
		user = "guest"
	}
	if _, err := c.run(ctx, "--quiet", "add_vhost", name); err != nil {
		return "", nil, err
	}
	del := func() {
		dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 60*time.Second)
		defer cancel()
		_, _ = c.run(dctx, "--quiet", "delete_vhost", name)
	}
	if _, err := c.run(ctx, "--quiet", "set_permissions", "-p", name, user, ".*", ".*", ".*"); err != nil {
		del()
		return "", nil, err
	}
	u.Path = "/" + name
	u.RawPath = ""
	return u.String(), del, nil
}

// vhostOf returns the virtual host an AMQP URL names ("/" by default).
func vhostOf(amqpURL string) string {
	u, err := url.Parse(amqpURL)
	if err != nil || u.Path == "" || u.Path == "/" {
		return "/"
	}
	return strings.TrimPrefix(u.Path, "/")
}
