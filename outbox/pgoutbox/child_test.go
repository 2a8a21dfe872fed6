package pgoutbox_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	idemamqp "github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// The relay child process: the test binary re-executed with childEnv set
// runs a relay (TestMain dispatches to runChild) on the schema and broker
// named by the other variables.
const (
	childEnv         = "IDEM_OUTBOX_TEST_CHILD"      // "relay"
	childSchemaEnv   = "IDEM_OUTBOX_TEST_SCHEMA"     // the outbox's schema
	childAMQPEnv     = "IDEM_OUTBOX_TEST_AMQP_URL"   // the broker
	childKillEnv     = "IDEM_OUTBOX_TEST_KILL_POINT" // "after-publish": SIGKILL itself there
	childDrainEnv    = "IDEM_OUTBOX_TEST_DRAIN"      // "1": exit 0 once nothing is pending
	childKillPoint   = "after-publish"
	childExitTimeout = 3 // the child gave up
)

// childCommand returns the command that runs the relay child.
func childCommand(ctx context.Context, schema, amqpURL string, env ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"=relay", childSchemaEnv+"="+schema, childAMQPEnv+"="+amqpURL)
	cmd.Env = append(cmd.Env, env...)
	cmd.Stdout = os.Stderr
	cmd.Stderr = os.Stderr
	return cmd
}

// runChild is the child's main. With the kill point set, it kills itself
// with SIGKILL right after the first Publish call that returned nil: the
// broker confirmed the batch, the rows are not marked yet.
func runChild() int {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "relay child:", err)
		return 2
	}
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		return fail(err)
	}
	cfg.MaxConns = 3
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	ob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: os.Getenv(childSchemaEnv), Logger: quiet()})
	if err != nil {
		return fail(err)
	}
	pub, err := idemamqp.NewPublisher(os.Getenv(childAMQPEnv), idemamqp.PublisherOptions{Logger: quiet()})
	if err != nil {
		return fail(err)
	}
	defer pub.Close()
	r, err := pgoutbox.NewRelay(ob, pub, fastRelay(pgoutbox.RelayOptions{}))
	if err != nil {
		return fail(err)
	}
	if os.Getenv(childKillEnv) == childKillPoint {
		pgoutbox.SetAfterPublish(r, func(msgs []*outbox.Message, err error) {
			if err == nil {
				_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
				select {} // SIGKILL is not deliverable late; never mark
			}
		})
	}
	rctx, stop := context.WithCancel(ctx)
	defer stop()
	done := make(chan error, 1)
	go func() { done <- r.Run(rctx) }()
	if os.Getenv(childDrainEnv) == "1" {
		for {
			n, _, err := ob.Backlog(ctx)
			if err == nil && n == 0 {
				stop()
				if err := <-done; err != nil {
					return fail(err)
				}
				return 0
			}
			select {
			case <-ctx.Done():
				stop()
				if err := <-done; err != nil {
					return fail(err)
				}
				return childExitTimeout
			case <-time.After(20 * time.Millisecond):
			}
		}
	}
	select {
	case err := <-done:
		if err != nil {
			return fail(err)
		}
		return 0
	case <-ctx.Done():
		stop()
		if err := <-done; err != nil {
			return fail(err)
		}
		return childExitTimeout
	}
}
