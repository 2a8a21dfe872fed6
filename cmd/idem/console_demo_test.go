package main

import (
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestConsoleDemo runs "idem demo --console" on kfake and memstore: once
// the run has printed its table, the console serves the run's Kafka
// dead-letter topic until the command is interrupted, and the command
// exits with the run's status.
func TestConsoleDemo(t *testing.T) {
	b := newBrowser(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var out, errOut syncBuffer
	code := make(chan int, 1)
	exited := make(chan struct{})
	go func() {
		defer close(exited)
		code <- run(ctx, []string{"demo", "--payments", "100", "--progress", "none", "--console", "--console-listen", "127.0.0.1:0"}, &out, &errOut)
	}()
	// A test that fails early still waits for the command it started.
	t.Cleanup(func() { cancel(); <-exited })
	url := regexp.MustCompile(`idem console: (http://127\.0\.0\.1:\d+/)`)
	var base string
	testenv.Eventually(t, 2*time.Minute, "the console's URL", func() bool {
		select {
		case c := <-code:
			t.Fatalf("demo exited %d before serving the console:\n%s\n%s", c, out.String(), errOut.String())
		default:
		}
		if m := url.FindStringSubmatch(out.String()); m != nil {
			base = m[1]
			return true
		}
		return false
	})
	if !strings.Contains(out.String(), "demo: 100 payments") {
		t.Errorf("the run's table comes before the console:\n%s", out.String())
	}
	b.open(base + "deadletters")
	if body := b.text("main"); !regexp.MustCompile(`0 dead letters in Kafka topic "payments-[0-9a-f]+\.dlq"`).MatchString(body) {
		t.Errorf("dead letters of the run's topic:\n%s", body)
	}
	b.open(base + "dedup")
	if body := b.text("main"); !strings.Contains(body, "The demo's dedup marks are in memstore") {
		t.Errorf("dedup page of a memstore run:\n%s", body)
	}
	cancel()
	if c := <-code; c != 0 {
		t.Errorf("demo --console exited %d, want 0 (the run's status)\n%s", c, errOut.String())
	}
}
