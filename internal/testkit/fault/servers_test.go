//go:build unix

package fault_test

import (
	"context"
	"errors"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

func startPostgres(t *testing.T) *fault.Postgres {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	p, err := fault.StartPostgres(ctx, fault.PostgresOptions{})
	if err != nil {
		if strings.Contains(err.Error(), "not found") {
			testenv.Unavailable(t, err.Error())
		}
		t.Fatal(err)
	}
	t.Cleanup(func() {
		dir := p.Dir()
		if err := p.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
		if _, err := os.Stat(dir); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("the cluster's directory %s is still there after Close: %v", dir, err)
		}
	})
	return p
}

// A committed row survives an immediate stop (fsync on, crash recovery on
// Start), an uncommitted one does not; the server refuses connections while
// stopped and comes back on the same URL.
func TestPostgresCrashAndRecover(t *testing.T) {
	p := startPostgres(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, p.URL())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Exec(ctx, "CREATE TABLE t (v int); INSERT INTO t VALUES (1)"); err != nil {
		t.Fatal(err)
	}
	tx, err := c.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tx.Exec(ctx, "INSERT INTO t VALUES (2)"); err != nil {
		t.Fatal(err)
	}
	if err := p.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if p.Running() {
		t.Fatal("Running after Stop")
	}
	if err := tx.Commit(ctx); err == nil {
		t.Fatal("commit on a crashed server succeeded")
	}
	_ = c.Close(ctx)
	if _, err := pgx.Connect(ctx, p.URL()); err == nil {
		t.Fatal("connected to a stopped server")
	}
	if err := p.Stop(ctx); err != nil {
		t.Fatalf("second Stop: %v", err)
	}
	if err := p.Start(ctx); err != nil {
		t.Fatal(err)
	}
	if err := p.Start(ctx); err == nil {
		t.Fatal("Start of a running server succeeded")
	}
	c, err = pgx.Connect(ctx, p.URL())
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Close(ctx) }()
	var n, sum int
	if err := c.QueryRow(ctx, "SELECT count(*), coalesce(sum(v), 0) FROM t").Scan(&n, &sum); err != nil {
		t.Fatal(err)
	}
	if n != 1 || sum != 1 {
		t.Fatalf("after recovery: %d rows summing to %d, want the committed row only", n, sum)
	}
	var fsync string
	if err := c.QueryRow(ctx, "SHOW fsync").Scan(&fsync); err != nil || fsync != "on" {
		t.Fatalf("fsync = %q, %v", fsync, err)
	}
}

func startRedis(t *testing.T) *fault.Redis {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, err := fault.StartRedis(ctx, fault.RedisOptions{})
	if err != nil {
		if strings.Contains(err.Error(), "not found") {
			testenv.Unavailable(t, err.Error())
		}
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := r.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return r
}

// Kill loses every key; Restart comes back empty on the same address;
// ClientKill drops the connections of clients.
func TestRedisKillRestartClientKill(t *testing.T) {
	r := startRedis(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := fault.RedisCommand(ctx, r.Addr(), "SET", "k", "v"); err != nil {
		t.Fatal(err)
	}
	if v, err := fault.RedisCommand(ctx, r.Addr(), "GET", "k"); err != nil || v != "v" {
		t.Fatalf("GET k = %q, %v", v, err)
	}
	if err := r.Kill(); err != nil {
		t.Fatal(err)
	}
	if r.Running() {
		t.Fatal("Running after Kill")
	}
	if _, err := fault.RedisCommand(ctx, r.Addr(), "PING"); err == nil {
		t.Fatal("PING of a killed server succeeded")
	}
	if err := r.Restart(ctx); err != nil {
		t.Fatal(err)
	}
	if v, err := fault.RedisCommand(ctx, r.Addr(), "GET", "k"); err != nil || v != "" {
		t.Fatalf("after restart GET k = %q, %v; want nothing (no persistence)", v, err)
	}
	if _, err := fault.RedisCommand(ctx, r.Addr(), "NOSUCHCOMMAND"); err == nil {
		t.Fatal("an error reply was not an error")
	}

	// A client connection that CLIENT KILL must close.
	c, err := net.DialTimeout("tcp", r.Addr(), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = c.Close() }()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte("PING\r\n")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	if n, err := c.Read(buf); err != nil || string(buf[:n]) != "+PONG\r\n" {
		t.Fatalf("PING = %q, %v", buf[:n], err)
	}
	n, err := r.ClientKill(ctx)
	if err != nil || n != 1 {
		t.Fatalf("ClientKill = %d, %v; want the one client", n, err)
	}
	if _, err := c.Read(buf); err == nil {
		t.Fatal("a killed client connection still reads")
	}
}

// Pause stops a process (state T), Resume continues it.
func TestPauseResume(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("fault.State reads /proc")
	}
	cmd := exec.Command("sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = cmd.Process.Kill(); _ = cmd.Wait() }()
	waitState := func(want byte) {
		t.Helper()
		testenv.Eventually(t, 5*time.Second, "state "+string(want), func() bool {
			s, err := fault.State(cmd.Process.Pid)
			return err == nil && s == want
		})
	}
	waitState('S')
	if err := fault.Pause(cmd.Process); err != nil {
		t.Fatal(err)
	}
	waitState('T')
	if err := fault.Resume(cmd.Process); err != nil {
		t.Fatal(err)
	}
	waitState('S')
}

func TestFreePort(t *testing.T) {
	p, err := fault.FreePort()
	if err != nil || p <= 0 || p > 65535 {
		t.Fatalf("FreePort = %d, %v", p, err)
	}
}
