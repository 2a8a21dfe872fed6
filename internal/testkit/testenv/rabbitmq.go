package testenv

import (
	"context"
	"net"
	"net/url"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// Unavailable skips the test with msg, or fails it under CI=true or
// IDEM_REQUIRE_SERVICES=1.
func Unavailable(t testing.TB, msg string) {
	t.Helper()
	if Required() {
		t.Fatal(msg + "; CI=true or IDEM_REQUIRE_SERVICES=1 makes this a failure")
	}
	t.Skip(msg)
}

// Rabbitmqctl returns a function that runs the broker's CLI and fails the
// test when a command fails. The CLI works only on the broker's own machine:
// the test is skipped (failed under CI=true) when IDEM_TEST_AMQP_URL is not
// local or the CLI is missing or cannot reach the broker.
func Rabbitmqctl(t testing.TB) func(args ...string) {
	t.Helper()
	u, err := url.Parse(AMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	host := u.Hostname()
	if ip := net.ParseIP(host); host != "localhost" && (ip == nil || !ip.IsLoopback()) {
		Unavailable(t, "rabbitmqctl needs the broker on this machine; IDEM_TEST_AMQP_URL points at "+host)
	}
	bin, err := exec.LookPath("rabbitmqctl")
	if err != nil {
		if _, serr := os.Stat("/usr/sbin/rabbitmqctl"); serr == nil {
			bin = "/usr/sbin/rabbitmqctl"
		} else {
			Unavailable(t, "rabbitmqctl is not installed")
		}
	}
	run := func(args ...string) ([]byte, error) {
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		return exec.CommandContext(ctx, bin, append([]string{"--quiet"}, args...)...).CombinedOutput()
	}
	if out, err := run("status"); err != nil {
		Unavailable(t, "rabbitmqctl status failed: "+strings.TrimSpace(string(out))+": "+err.Error())
	}
	return func(args ...string) {
		t.Helper()
		if out, err := run(args...); err != nil {
			t.Fatalf("rabbitmqctl %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
}

// RabbitVhost creates a fresh virtual host through ctl (from Rabbitmqctl),
// deleted when the test ends, so close_all_connections hits only the test's
// own connections. It returns the vhost's name and its broker URL.
func RabbitVhost(t testing.TB, ctl func(args ...string)) (name, rawURL string) {
	t.Helper()
	u, err := url.Parse(AMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	name = Name("idemtest_vh")
	user := u.User.Username()
	if user == "" {
		user = "guest"
	}
	ctl("add_vhost", name)
	t.Cleanup(func() { ctl("delete_vhost", name) })
	ctl("set_permissions", "-p", name, user, ".*", ".*", ".*")
	u.Path = "/" + name
	u.RawPath = ""
	return name, u.String()
}
