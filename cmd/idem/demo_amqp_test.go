package main

import (
	"errors"
	"net/url"
	"regexp"
	"strings"
	"testing"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// requireRabbitMQ skips the test (fails it under CI=true) when the test
// broker does not accept connections.
func requireRabbitMQ(t *testing.T) {
	t.Helper()
	u, err := url.Parse(testenv.AMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	host := u.Host
	if u.Port() == "" {
		host += ":5672"
	}
	testenv.RequireTCP(t, "RabbitMQ", host)
}

// checkAMQPDeleted checks that the run's exchange and queues are gone.
func checkAMQPDeleted(t *testing.T, r *demoRun) {
	t.Helper()
	m := regexp.MustCompile(`fanout exchange (\S+) and a queue per consumer`).FindStringSubmatch(r.out)
	if m == nil {
		t.Fatal("the header names no exchange")
	}
	exchange := m[1]
	// Other suites may restart the shared broker: wait a little for it.
	var (
		conn *amqp091.Connection
		err  error
	)
	defer func() {
		if conn == nil {
			t.Logf("last dial: %v", err)
		}
	}()
	testenv.Eventually(t, 20*time.Second, "the broker to accept a connection", func() bool {
		conn, err = amqp091.DialConfig(testenv.AMQPURL(), amqp091.Config{Dial: amqp091.DefaultDial(5 * time.Second)})
		return err == nil
	})
	defer func() { _ = conn.Close() }()
	// A passive declare of what does not exist closes the channel with
	// NOT_FOUND: one channel per probe.
	probe := func(what, name string, declare func(ch *amqp091.Channel) error) {
		ch, err := conn.Channel()
		if err != nil {
			t.Fatal(err)
		}
		err = declare(ch)
		var ae *amqp091.Error
		switch {
		case err == nil:
			_ = ch.Close()
			t.Errorf("%s %s is still there after the demo", what, name)
		case !errors.As(err, &ae) || ae.Code != amqp091.NotFound:
			t.Errorf("%s %s: %v", what, name, err)
		}
	}
	probe("exchange", exchange, func(ch *amqp091.Channel) error {
		return ch.ExchangeDeclarePassive(exchange, amqp091.ExchangeFanout, false, false, false, false, nil)
	})
	for _, q := range []string{".billing-naive", ".billing-idem", ".billing-idem.dlq", ".billing-idem" + ".retry.50ms"} {
		probe("queue", exchange+q, func(ch *amqp091.Channel) error {
			_, err := ch.QueueDeclarePassive(exchange+q, false, false, false, false, nil)
			return err
		})
	}
}

func TestDemoAMQP(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	requireRabbitMQ(t)
	r := runDemoChecked(t, 400, "--amqp", testenv.AMQPURL(), "--crash-rate", "0.002", "--republish-rate", "0.2", "--seed", "7")
	if !regexp.MustCompile(`RabbitMQ at `).MatchString(r.out) {
		t.Error("the header does not name RabbitMQ")
	}
	// The idem group's crashes follow from the seed (see the child
	// tests): at least one, and the delivery it crashed on comes back
	// unacknowledged, a redelivery.
	if _, crashes := r.row(t, "consumer crashes (restarted)"); crashes <= 0 {
		t.Errorf("idem consumer crashes %d: want > 0", crashes)
	}
	if _, redelivered := r.row(t, "  redelivery (consumer crash)"); redelivered <= 0 {
		t.Errorf("idem redeliveries %d: want > 0", redelivered)
	}
	checkAMQPDeleted(t, r)
}

// TestDemoAMQPPostgres runs the idem consumer as child processes on
// RabbitMQ: a SIGKILLed child's unacknowledged deliveries go back to the
// queue, and pgtable finds the ones whose charge committed.
func TestDemoAMQPPostgres(t *testing.T) {
	if testing.Short() {
		t.Skip("short")
	}
	requireRabbitMQ(t)
	pool := testenv.Pool(t, 2)
	schema := testenv.Schema(t, pool)
	r := runDemoChecked(t, 400, "--amqp", testenv.AMQPURL(), "--postgres", testenv.PostgresURL(), "--schema", schema,
		"--crash-rate", "0.002", "--republish-rate", "0.2", "--seed", "7")
	checkChildren(t, r)
	checkAMQPDeleted(t, r)
}

// TestDemoAMQPRefused: a broker that answers and refuses the login or the
// virtual host says so, instead of calling the broker unreachable.
func TestDemoAMQPRefused(t *testing.T) {
	requireRabbitMQ(t)
	u, err := url.Parse(testenv.AMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	badPassword := *u
	badPassword.User = url.UserPassword(u.User.Username(), "not-the-password")
	badVhost := *u
	badVhost.Path = "/" + testenv.Name("idem-no-such-vhost")
	for _, tc := range []struct {
		name, url, want string
	}{
		{"password", badPassword.String(), "refused the login: check the user name and password"},
		{"vhost", badVhost.String(), "refused the virtual host"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			code, _, errOut := runCmd(t.Context(), t, "demo", "--amqp", tc.url, "--payments", "10", "--progress", "none")
			if code != 1 || !strings.Contains(errOut, tc.want) || strings.Contains(errOut, "unreachable") {
				t.Errorf("exit %d, stderr %q; want exit 1 and %q", code, errOut, tc.want)
			}
			if strings.Contains(errOut, "not-the-password") {
				t.Errorf("stderr shows the password: %q", errOut)
			}
		})
	}
}
