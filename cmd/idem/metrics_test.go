package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// idem relay --metrics-addr serves the relay's OpenTelemetry metrics in the
// Prometheus text format: after it published the rows, a scrape over HTTP
// finds the idem_outbox_* series with the table and topic labels.
func TestRelayServesMetrics(t *testing.T) {
	pool := testenv.Pool(t, 4)
	schema := testenv.Schema(t, pool)
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	pg := []string{"--postgres", testenv.PostgresURL(), "--schema", schema}
	if code, _, errOut := runCmd(ctx, t, append([]string{"migrate", "up"}, pg...)...); code != 0 {
		t.Fatalf("migrate up: %s", errOut)
	}
	cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "payments"))
	if err != nil {
		t.Fatal(err)
	}
	defer cluster.Close()

	ob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	const n = 20
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		msgs := make([]outbox.Message, n)
		for i := range msgs {
			msgs[i] = outbox.Message{Topic: "payments", Key: fmt.Appendf(nil, "c%d", i%3), Payload: fmt.Appendf(nil, "%d", i)}
		}
		_, err := ob.Enqueue(ctx, tx, msgs...)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}

	addr := testenv.DeadAddr(t)
	rctx, rcancel := context.WithCancel(ctx)
	var (
		wg        sync.WaitGroup
		code      int
		out, eOut string
	)
	wg.Go(func() {
		code, out, eOut = runCmd(rctx, t, append([]string{"relay", "--kafka", cluster.ListenAddrs()[0], "--poll", "50ms",
			"--log-level", "warn", "--metrics-addr", addr}, pg...)...)
	})
	defer func() {
		rcancel()
		wg.Wait()
		if code != 0 {
			t.Errorf("relay exit %d: %s%s", code, out, eOut)
		}
	}()

	client := &http.Client{Timeout: 5 * time.Second}
	get := func(path string) (int, string, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+path, nil)
		if err != nil {
			return 0, "", err
		}
		resp, err := client.Do(req)
		if err != nil {
			return 0, "", err
		}
		defer func() { _ = resp.Body.Close() }()
		body, err := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body), err
	}
	published := `idem_outbox_published_total{idem_outbox_table="` + schema + `.outbox",messaging_destination_name="payments"`
	var scrape string
	scraped := false
	defer func() {
		if !scraped {
			t.Logf("last scrape:\n%s", scrape)
		}
	}()
	deadline, _ := ctx.Deadline()
	testenv.Eventually(t, time.Until(deadline), fmt.Sprintf("a scrape with %d published", n), func() bool {
		status, body, err := get("/metrics")
		if err != nil || status != http.StatusOK {
			return false
		}
		scrape = body
		// The backlog gauge is sampled every 5s: present, perhaps not 0 yet.
		return value(scrape, published) == n && value(scrape, "idem_outbox_backlog{") >= 0
	})
	scraped = true
	for _, want := range []string{
		"idem_outbox_backlog{",
		"idem_outbox_oldest_age_seconds{",
		"idem_outbox_publish_duration_seconds_bucket{",
		`idem_result="ok"`,
		"idem_outbox_delay_seconds_bucket{",
		"idem_outbox_delay_seconds_count{",
		"go_goroutines ",
		`target_info{`,
		`service_name="idem-relay"`,
	} {
		if !strings.Contains(scrape, want) {
			t.Errorf("scrape lacks %s", want)
		}
	}
	if got := value(scrape, "idem_outbox_delay_seconds_count{"); got != n {
		t.Errorf("idem_outbox_delay_seconds_count = %v, want %d", got, n)
	}
	if status, body, err := get("/healthz"); err != nil || status != http.StatusOK {
		t.Errorf("/healthz: %d %q %v", status, body, err)
	}
}

// value returns the value of the first sample line of a scrape that
// starts with prefix, or -1.
func value(scrape, prefix string) float64 {
	sc := bufio.NewScanner(strings.NewReader(scrape))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, prefix) {
			continue
		}
		f := strings.Fields(line[strings.LastIndexByte(line, '}')+1:])
		if len(f) == 0 {
			return -1
		}
		v, err := strconv.ParseFloat(f[0], 64)
		if err != nil {
			return -1
		}
		return v
	}
	return -1
}
