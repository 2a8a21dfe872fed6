package main

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestWorker runs the example and checks what it reports: every
// well-formed order paid once, the malformed one dead-lettered.
func TestWorker(t *testing.T) {
	testenv.NATS(t)    // skips, or fails under CI=true, when NATS is down
	testenv.Pool(t, 1) // the same for PostgreSQL
	var out bytes.Buffer
	if err := run(context.Background(), config{natsURL: testenv.NATSURL(), pgURL: testenv.PostgresURL(), n: 50, out: &out}); err != nil {
		t.Fatal(err)
	}
	t.Log(out.String())
	for _, want := range []string{"5 of them twice (the stream dropped 5 copies), 1 malformed", "49 payments (one per well-formed order); 1 retried, 1 dead-lettered"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q", want)
		}
	}
}

func TestWorkerNATSUnreachable(t *testing.T) {
	err := run(context.Background(), config{natsURL: "nats://" + testenv.DeadAddr(t), pgURL: testenv.PostgresURL(), n: 1, out: &bytes.Buffer{}})
	if err == nil || !strings.Contains(err.Error(), "is unreachable") {
		t.Errorf("run with an unreachable NATS: %v, want an error saying it is unreachable", err)
	}
}
