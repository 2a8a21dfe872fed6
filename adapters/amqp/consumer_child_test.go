package idemamqp

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/effectstest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// The worker child process: the test binary re-executed with consChildEnv
// set to "worker" runs a Consumer (TestMain dispatches to consRunChild) with the
// pgtable oracle of the schema and the queue named by the other variables,
// until SIGKILL — or SIGTERM, on which it stops gracefully and exits 0.
// Set to "poison", it runs the worker of consPoisonChildCommand.
const (
	consChildEnv       = "IDEM_AMQP_CONSUMER_CHILD" // "worker" or "poison"
	consChildURLEnv    = "IDEM_AMQP_CONSUMER_URL"
	consChildQueueEnv  = "IDEM_AMQP_CONSUMER_QUEUE"
	consChildSchemaEnv = "IDEM_AMQP_CONSUMER_SCHEMA"
	// consChildConcEnv, for the "poison" child, is its Concurrency.
	consChildConcEnv = "IDEM_AMQP_CONSUMER_CONCURRENCY"
	// consChildMaxEnv, for the "poison" child, is its MaxDeliveries
	// when set; consPoisonMaxDeliveries otherwise.
	consChildMaxEnv = "IDEM_AMQP_CONSUMER_MAX_DELIVERIES"
)

// consPoisonMaxDeliveries is the "poison" child's MaxDeliveries.
const consPoisonMaxDeliveries = 3

// consSettledLine starts the line the poison child writes to stdout for
// each delivery it settled.
const consSettledLine = "settled:"

// consPoisonChildCommand returns the command that runs the "poison" child:
// a worker of the quorum queue queue (Prefetch 50, MaxDeliveries
// consPoisonMaxDeliveries) whose handler panics, without Recover, on a
// message whose id starts with "poison", so that the process dies.
func consPoisonChildCommand(rawURL, queue, schema string, concurrency int) *exec.Cmd {
	cmd := consChildCommand(rawURL, queue, schema)
	cmd.Env = append(cmd.Env, consChildEnv+"=poison", consChildConcEnv+"="+strconv.Itoa(concurrency))
	cmd.Stdout = nil
	cmd.Stderr = nil
	return cmd
}

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
	o, err := effectstest.Open(pool, os.Getenv(consChildSchemaEnv))
	if err != nil {
		return fail(err)
	}
	opts := ConsumerOptions{Concurrency: 4, Prefetch: 50, Backoff: consTestBackoff, Telemetry: consumer.Telemetry{Logger: consQuiet()}}
	var before func(context.Context, *consumer.Message) error
	if os.Getenv(consChildEnv) == "poison" {
		opts.QuorumQueue, opts.MaxDeliveries = true, consPoisonMaxDeliveries
		if opts.Concurrency, err = strconv.Atoi(os.Getenv(consChildConcEnv)); err != nil {
			return fail(err)
		}
		if v := os.Getenv(consChildMaxEnv); v != "" {
			if opts.MaxDeliveries, err = strconv.Atoi(v); err != nil {
				return fail(err)
			}
		}
		// Each settled delivery is a line on stdout, for the test to
		// count.
		opts.OnOutcome = func(_ context.Context, r consumer.Report) {
			fmt.Println(consSettledLine, r.Outcome)
		}
		before = func(_ context.Context, msg *consumer.Message) error {
			if strings.HasPrefix(msg.ID, "poison") {
				panic("poison message " + msg.ID)
			}
			return nil
		}
	}
	h, err := o.TxHandler(before, nil)
	if err != nil {
		return fail(err)
	}
	c, err := NewConsumer(os.Getenv(consChildURLEnv), os.Getenv(consChildQueueEnv), h, opts)
	if err != nil {
		return fail(err)
	}
	if err := c.Run(ctx); err != nil {
		return fail(err)
	}
	return 0
}
