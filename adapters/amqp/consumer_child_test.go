package amqp

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// The worker child process: the test binary re-executed with consChildEnv
// set runs a Consumer (TestMain dispatches to consRunChild) with the
// pgtable oracle of the schema and the queue named by the other variables,
// until SIGKILL — or SIGTERM, on which it stops gracefully and exits 0.
const (
	consChildEnv       = "IDEM_AMQP_CONSUMER_CHILD" // "worker"
	consChildURLEnv    = "IDEM_AMQP_CONSUMER_URL"
	consChildQueueEnv  = "IDEM_AMQP_CONSUMER_QUEUE"
	consChildSchemaEnv = "IDEM_AMQP_CONSUMER_SCHEMA"
)

// consChildCommand returns the command that runs the worker child.
func consChildCommand(rawURL, queue, schema string) *exec.Cmd {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), consChildEnv+"=worker", consChildURLEnv+"="+rawURL,
		consChildQueueEnv+"="+queue, consChildSchemaEnv+"="+schema)
	cmd.Stdout = os.Stderr
	cmd.Stderr = os.Stderr
	return cmd
}

func consRunChild() int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, 120*time.Second)
	defer cancel()
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "consumer child:", err)
		return 2
	}
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		return fail(err)
	}
	cfg.MaxConns = 4
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	o, err := consOpenOracle(pool, os.Getenv(consChildSchemaEnv))
	if err != nil {
		return fail(err)
	}
	h, err := o.txHandler(nil)
	if err != nil {
		return fail(err)
	}
	c, err := NewConsumer(os.Getenv(consChildURLEnv), os.Getenv(consChildQueueEnv), h, ConsumerOptions{
		Concurrency: 4, Prefetch: 50, Logger: consQuiet(), RetryDelays: consTestDelays,
	})
	if err != nil {
		return fail(err)
	}
	if err := c.Run(ctx); err != nil {
		return fail(err)
	}
	return 0
}
