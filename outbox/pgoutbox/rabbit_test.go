package pgoutbox_test

import (
	"testing"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// rabbitmqctl runs the broker's CLI (see testenv.Rabbitmqctl).
func rabbitmqctl(t testing.TB) func(args ...string) { t.Helper(); return testenv.Rabbitmqctl(t) }

// vhost creates a fresh virtual host for the test and returns its broker URL
// (see testenv.RabbitVhost).
func vhost(t testing.TB, ctl func(args ...string)) string {
	t.Helper()
	_, u := testenv.RabbitVhost(t, ctl)
	return u
}
