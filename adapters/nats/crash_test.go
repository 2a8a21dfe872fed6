package idemnats

import (
	"bufio"
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/effectstest"
	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// child is a started worker child process.
type child struct {
	pid   int
	done  chan error
	ready chan struct{}
	kill  func()
}

// startChild starts a child and waits until its Consumer is ready.
func startChild(t testing.TB, kind, url, stream, schema, point string, after int) *child {
	t.Helper()
	cmd := childCommand(kind, url, stream, schema, point, after)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ch := &child{pid: cmd.Process.Pid, done: make(chan error, 1), ready: make(chan struct{}), kill: func() { _ = cmd.Process.Kill() }}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if sc.Text() == childReadyLine {
				close(ch.ready)
			}
		}
		ch.done <- cmd.Wait()
	}()
	t.Cleanup(ch.kill)
	return ch
}

// signalled reports whether err is the exit of a process SIGKILL ended.
func signalled(err error) bool {
	return err != nil && strings.Contains(err.Error(), "signal: killed")
}

// A worker child is SIGKILLed over and over while it applies messages:
// at random moments by the test, and by itself at each named point
// (before the transaction, after the effect before the commit, after the
// commit before the acknowledgement). Copies of messages are published
// again past the duplicate window meanwhile. With pgtable every message is
// applied exactly once, and nothing is dead-lettered.
func TestConsumerChildSIGKILL(t *testing.T) {
	t.Parallel()
	_, js := testenv.NATS(t)
	s := newStream(t, js, 100*time.Millisecond)
	o := effectstest.New(t, 4)
	var ids []string
	batch := 0
	publish := func(n int) {
		more := s.publishN(t, fmt.Sprintf("b%d", batch), n)
		batch++
		ids = append(ids, more...)
		// Copies of a random tenth of everything so far.
		for range n / 10 {
			id := ids[rand.N(len(ids))]
			s.publish(t, id, []byte("p-"+id), nil)
		}
	}
	publish(400)
	kills := 0
	for round := range 12 {
		if _, d := o.Counts(t); d >= len(ids)-50 {
			time.Sleep(150 * time.Millisecond) // past the duplicate window
			publish(300)
		}
		rows0, _ := o.Counts(t)
		point := ""
		if round%2 == 1 {
			point = namedPoints[(round/2)%len(namedPoints)]
		}
		ch := startChild(t, "worker", testenv.NATSURL(), s.name, o.Schema, point, rand.N(40))
		<-ch.ready
		if point == "" {
			more := rand.N(60)
			testenv.Eventually(t, 60*time.Second, "the child to apply effects", func() bool { r, _ := o.Counts(t); return r > rows0+more })
			ch.kill()
		}
		select {
		case err := <-ch.done:
			if !signalled(err) {
				t.Fatalf("child (point %q) ended with %v, want SIGKILL", point, err)
			}
		case <-time.After(90 * time.Second):
			t.Fatalf("the child with point %q did not die", point)
		}
		kills++
	}
	// The last child drains the stream and stops on SIGTERM.
	ch := startChild(t, "worker", testenv.NATSURL(), s.name, o.Schema, "", 0)
	<-ch.ready
	testenv.Eventually(t, 120*time.Second, "every message applied", func() bool { _, d := o.Counts(t); return d >= len(ids) })
	testenv.Eventually(t, 60*time.Second, "nothing pending", func() bool { return pending(t, js, s.name, "work") == 0 })
	stopChild(t, ch)
	rows, distinct := o.Counts(t)
	t.Logf("%d messages, %d SIGKILLs: %d effect rows for %d ids", len(ids), kills, rows, distinct)
	o.Check(t, ids)
	if n := len(s.deadLetters(t)); n != 0 {
		t.Errorf("%d messages dead-lettered", n)
	}
}

func stopChild(t testing.TB, ch *child) {
	t.Helper()
	// The child ignores nothing but SIGTERM for a clean stop.
	_ = syscall.Kill(ch.pid, syscall.SIGTERM)
	select {
	case err := <-ch.done:
		if err != nil {
			t.Errorf("the last child: %v", err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("the last child did not stop on SIGTERM")
	}
}

// Messages that kill the worker process each time it runs them (a panic
// without consumer.Recover) are dead-lettered with reason redelivery_limit
// once JetStream delivered them more than MaxDeliveries times, and the
// messages pulled with them are not: none of the innocent messages is
// dead-lettered, each is applied once.
func TestConsumerCrashLoop(t *testing.T) {
	t.Parallel()
	_, js := testenv.NATS(t)
	s := newStream(t, js, 0)
	o := effectstest.New(t, 4)
	var innocent []string
	for i := range 150 {
		id := fmt.Sprintf("ok-%d", i)
		if i%50 == 25 {
			s.publish(t, fmt.Sprintf("poison-%d", i), []byte("boom"), nil)
		}
		s.publish(t, id, []byte("p-"+id), nil)
		innocent = append(innocent, id)
	}
	deaths := 0
	for {
		ch := startChild(t, "poison", testenv.NATSURL(), s.name, o.Schema, "", 0)
		var err error
		select {
		case err = <-ch.done:
		case <-time.After(20 * time.Second):
			// Alive and quiet for 20s: nothing left that kills it.
			stopChild(t, ch)
		}
		if err == nil {
			break
		}
		if !strings.Contains(err.Error(), "exit status 2") && !signalled(err) {
			t.Fatalf("child: %v", err)
		}
		deaths++
		if deaths > 3*(childMaxDeliveries+2) {
			t.Fatalf("%d deaths: the crash loop is not bounded", deaths)
		}
	}
	testenv.Eventually(t, 30*time.Second, "nothing pending", func() bool { return pending(t, js, s.name, "work") == 0 })
	o.Check(t, innocent)
	dls := s.deadLetters(t)
	seen := map[string]int{}
	for _, m := range dls {
		id := m.Headers().Get(HeaderMessageID)
		seen[id]++
		if !strings.HasPrefix(id, "poison") {
			t.Errorf("innocent message %s dead-lettered (%s, %s deliveries)", id, m.Headers().Get(HeaderReason), m.Headers().Get(HeaderAttempts))
		} else if r := m.Headers().Get(HeaderReason); r != string(ReasonRedeliveryLimit) {
			t.Errorf("%s dead-lettered with reason %q, want %q", id, r, ReasonRedeliveryLimit)
		}
	}
	if len(seen) != 3 || len(dls) != 3 {
		t.Errorf("dead letters %v, want the 3 poison messages once each", seen)
	}
	t.Logf("%d worker deaths; dead letters %v", deaths, seen)
}

// The NATS server is SIGKILLed and restarted on the same store while a
// Consumer applies messages: nats.go reconnects, the Consumer pulls
// again, and every message is applied exactly once.
func TestConsumerServerRestart(t *testing.T) {
	t.Parallel()
	srv, err := fault.StartNATS(context.Background(), fault.NATSOptions{})
	if err != nil {
		if testenv.Required() {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	t.Cleanup(func() { _ = srv.Close() })
	_, js := testenv.NATSAt(t, srv.URL())
	s := newStream(t, js, 0)
	o := effectstest.New(t, 8)
	slow := func(ctx context.Context, _ *consumer.Message) error {
		select {
		case <-time.After(2 * time.Millisecond):
			return nil
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	c, err := NewConsumer(js, s.name, "work", o.Handler(t, slow), ConsumerOptions{
		Concurrency: 4, Telemetry: consumer.Telemetry{Logger: quiet()}, Backoff: testBackoff, Config: jetstream.ConsumerConfig{AckWait: 2 * time.Second},
	})
	if err != nil {
		t.Fatal(err)
	}
	ids := s.publishN(t, "a", 300)
	stop := runConsumer(t, c)
	for k := range 3 {
		rows0, _ := o.Counts(t)
		testenv.Eventually(t, 60*time.Second, "effects before the crash", func() bool { r, _ := o.Counts(t); return r > rows0+20 })
		if err := srv.Kill(); err != nil {
			t.Fatal(err)
		}
		if err := srv.Restart(context.Background()); err != nil {
			t.Fatal(err)
		}
		more := fmt.Sprintf("r%d", k)
		for i := range 100 {
			id := fmt.Sprintf("%s-%d", more, i)
			publishRetrying(t, js, s.subject(), id)
			ids = append(ids, id)
		}
	}
	testenv.Eventually(t, 120*time.Second, "every message applied", func() bool { _, d := o.Counts(t); return d >= len(ids) })
	testenv.Eventually(t, 60*time.Second, "nothing pending", func() bool { return pending(t, js, s.name, "work") == 0 })
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	o.Check(t, ids)
	t.Logf("%d messages over 3 server crashes: stats %+v", len(ids), c.Stats())
}

// publishRetrying publishes until JetStream confirms: the server may be
// starting.
func publishRetrying(t testing.TB, js jetstream.JetStream, subject, id string) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, err := js.PublishMsg(ctx, &nats.Msg{Subject: subject, Data: []byte("p-" + id), Header: nats.Header{nats.MsgIdHdr: []string{id}}})
		cancel()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("publish %s: %v", id, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
