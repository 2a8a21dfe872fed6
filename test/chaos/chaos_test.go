package chaos

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"
)

// The helpers of the SIGKILL and RabbitMQ cells; the matrix itself runs
// from cmd/chaos, never from go test.

func TestCountDeliveries(t *testing.T) {
	dir := t.TempDir()
	write := func(name, s string) {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(s), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write("deliveries-0001.log", "a\nb\n")
	write("deliveries-0002.log", "b\nc\n\n")
	write("publishes-0003.log", "a\na\n")
	n, distinct, err := countDeliveries(dir, "deliveries")
	if err != nil || n != 4 || distinct != 3 {
		t.Fatalf("deliveries: %d, %d, %v; want 4, 3", n, distinct, err)
	}
	n, distinct, err = countDeliveries(dir, "publishes")
	if err != nil || n != 2 || distinct != 1 {
		t.Fatalf("publishes: %d, %d, %v; want 2, 1", n, distinct, err)
	}
}

func TestDeliveryLogAppends(t *testing.T) {
	path := filepath.Join(t.TempDir(), "deliveries-0001.log")
	d, err := openDeliveryLog(path)
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for i := range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d.record(makeIDs("x", 50)[i])
		}()
	}
	wg.Wait()
	_ = d.f.Close()
	n, distinct, err := countDeliveries(filepath.Dir(path), "deliveries")
	if err != nil || n != 50 || distinct != 50 {
		t.Fatalf("%d, %d, %v; want 50, 50", n, distinct, err)
	}
}

func TestKillerIgnoresOtherPoints(t *testing.T) {
	k := newKiller(childConfig{Point: pointAfterCommit, After: 1})
	for range 10 {
		k.at(pointBeforeTx) // would kill the test if it fired
	}
	var none *killer
	none.at(pointAfterCommit)
	if k.passes.Load() != 0 {
		t.Fatalf("%d passes counted at another point", k.passes.Load())
	}
}

// paced sends in paced batches until over is closed (here, after two
// batches), then sends the rest: every id, in order.
func TestPacedSendsEverything(t *testing.T) {
	ids := makeIDs("p", 95)
	over := make(chan struct{})
	var (
		got     []string
		batches int
	)
	done := make(chan error, 1)
	go func() {
		done <- paced(context.Background(), ids, time.Second, over, func(_ context.Context, b []string) error {
			got = append(got, b...)
			if batches++; batches == 2 {
				close(over)
			}
			return nil
		})
	}()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if strings.Join(got, ",") != strings.Join(ids, ",") {
		t.Fatalf("sent %d ids out of order or not all (want %d)", len(got), len(ids))
	}
}

func TestVhostOf(t *testing.T) {
	for url, want := range map[string]string{
		"amqp://guest:guest@127.0.0.1:5672/":        "/",
		"amqp://guest:guest@127.0.0.1:5672":         "/",
		"amqp://guest:guest@127.0.0.1:5672/chaos_1": "chaos_1",
	} {
		if got := vhostOf(url); got != want {
			t.Errorf("vhostOf(%q) = %q, want %q", url, got, want)
		}
	}
}

func TestKillStatsNote(t *testing.T) {
	s := killStats{byPoint: map[string]int{"random": 3, pointBeforeTx: 1}, missed: 1}
	want := "kills: before_tx 1, random 3 (1 named points not reached in time, killed by the runner)"
	if got := s.note(); got != want {
		t.Fatalf("note %q, want %q", got, want)
	}
}

func TestCellsRegistered(t *testing.T) {
	names := map[string]bool{}
	for _, n := range Names() {
		names[n] = true
	}
	for _, adapter := range []string{"kafka", "amqp", "watermill", "http"} {
		for _, store := range []string{storePG, storeRedis} {
			if n := adapter + "/" + store + "/sigkill"; !names[n] {
				t.Errorf("cell %s is not registered", n)
			}
		}
	}
	for _, n := range []string{"relay/kafka/sigkill", "relay/amqp/sigkill", "rabbit/amqp/close-all+stop-app", "rabbit/relay/close-all+stop-app",
		"wal/amqp/sigkill", "wal/pg/immediate", "wal/proxy/amqp", "proxy/outbox-amqp", "redis/cluster/master-kill",
		"nats/pgtable/sigkill", "nats/pgtable/server-kill"} {
		if !names[n] {
			t.Errorf("cell %s is not registered", n)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	for _, n := range []string{"rabbit/amqp/close-all+stop-app", "rabbit/relay/close-all+stop-app"} {
		if !cells[n].Last {
			t.Errorf("cell %s does not run last", n)
		}
	}
	if !cells["kafka/redisnx/sigkill"].ExpectDuplicates || cells["kafka/pgtable/sigkill"].ExpectDuplicates {
		t.Error("only the redisnx cells expect duplicates")
	}
}

func TestTotalLineSeparatesExpectedDuplicates(t *testing.T) {
	var total tally
	total.add(Cell{Name: "pg"}, Result{Messages: 1000, Kills: 3, Restarts: 1, Redeliveries: 40})
	total.add(Cell{Name: "lease", ExpectDuplicates: true}, Result{Messages: 2000, Kills: 2, Redeliveries: 10, Duplicates: 185})
	total.add(Cell{Name: "broken"}, Result{Messages: 1000, Duplicates: 2, Lost: 1})
	want := "chaos: total: 4000 messages, 5 kills, 1 restarts, 50 redeliveries, 2 duplicate effects where 0 was promised, " +
		"185 in the lease cells where they are expected (9.250% of their 2000 messages), 1 lost"
	if got := total.line(); got != want {
		t.Fatalf("total line\n%s\nwant\n%s", got, want)
	}

	var none tally
	none.add(Cell{Name: "pg"}, Result{Messages: 10})
	want = "chaos: total: 10 messages, 0 kills, 0 restarts, 0 redeliveries, 0 duplicate effects where 0 was promised, 0 lost"
	if got := none.line(); got != want {
		t.Fatalf("total line without lease cells\n%s\nwant\n%s", got, want)
	}
}
