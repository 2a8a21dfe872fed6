package walrelay_test

import (
	"context"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/idemkit/idem/internal/fault"
	"github.com/idemkit/idem/internal/testenv"
)

// TestMain runs the tests under a goroutine leak check, and stops the
// throwaway PostgreSQL they share. When the test binary is started as a
// relay child process (childEnv set, see child_test.go), it runs the relay
// instead of the tests.
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(runChild())
	}
	code := m.Run()
	if cluster.pg != nil {
		if err := cluster.pg.Close(); err != nil {
			fmt.Fprintln(os.Stderr, "walrelay tests: stop the throwaway PostgreSQL:", err)
			code = 1
		}
	}
	if code == 0 {
		if err := goleak.Find(testenv.LeakOptions()...); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// cluster is the throwaway PostgreSQL with wal_level = logical that the
// tests and examples share (the shared test database is not reconfigured),
// started on first use. Each test uses its own schema, slot and
// publication.
var cluster struct {
	once sync.Once
	pg   *fault.Postgres
	err  error
}

// logicalURL starts the cluster if needed and returns its URL. A missing
// PostgreSQL installation skips the test (fails it under CI=true).
func logicalURL(t testing.TB) string {
	t.Helper()
	url, err := startCluster()
	if err != nil {
		if strings.Contains(err.Error(), "not found") || strings.Contains(err.Error(), "no postgres OS user") {
			testenv.Unavailable(t, "a throwaway PostgreSQL with wal_level = logical cannot start: "+err.Error())
		}
		t.Fatal(err)
	}
	return url
}

func startCluster() (string, error) {
	cluster.once.Do(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		cluster.pg, cluster.err = fault.StartPostgres(ctx, fault.PostgresOptions{Settings: map[string]string{
			"wal_level":             "logical",
			"max_wal_senders":       "40",
			"max_replication_slots": "40",
			"max_connections":       "150",
			// The tests do not test durability against a machine crash.
			"synchronous_commit": "off",
		}})
	})
	if cluster.err != nil {
		return "", cluster.err
	}
	return cluster.pg.URL(), nil
}
