package idemnats

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/effectstest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// The worker child process: the test binary re-executed with childEnv set
// runs a Consumer (TestMain dispatches to runChild) with the pgtable oracle
// of the schema and the stream named by the other variables, until SIGKILL
// — its own, at a named point, or the parent's — or SIGTERM, on which it
// stops gracefully and exits 0.
//
// Set to "worker", it kills itself at childPointEnv once childAfterEnv
// messages were acknowledged:
//
//   - before_tx: the handler chain started, no transaction open yet;
//   - in_tx: the effect's INSERT ran, the transaction not committed;
//   - after_commit: the transaction committed, the message not acknowledged.
//
// Set to "poison", its handler panics, without consumer.Recover, on a
// message whose id starts with "poison", so that the process dies.
const (
	childEnv       = "IDEM_NATS_TEST_CHILD" // "worker" or "poison"
	childURLEnv    = "IDEM_NATS_TEST_CHILD_URL"
	childStreamEnv = "IDEM_NATS_TEST_CHILD_STREAM"
	childSchemaEnv = "IDEM_NATS_TEST_CHILD_SCHEMA"
	childPointEnv  = "IDEM_NATS_TEST_CHILD_POINT"
	childAfterEnv  = "IDEM_NATS_TEST_CHILD_AFTER"
	childReadyLine = "idem-child: ready"
)

// namedPoints are the points where a worker child kills itself.
var namedPoints = []string{"before_tx", "in_tx", "after_commit"}

// childMaxDeliveries is the poison child's MaxDeliveries.
const childMaxDeliveries = 5

// childCommand returns the command that runs a child of kind ("worker" or
// "poison") on the stream; point and after are the worker's kill point.
func childCommand(kind, url, stream, schema, point string, after int) *exec.Cmd {
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+kind, childURLEnv+"="+url, childStreamEnv+"="+stream,
		childSchemaEnv+"="+schema, childPointEnv+"="+point, childAfterEnv+"="+strconv.Itoa(after))
	cmd.Stderr = os.Stderr
	return cmd
}

func runChild() int {
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	ctx, cancel := context.WithTimeout(ctx, 5*time.Minute)
	defer cancel()
	fail := func(err error) int {
		fmt.Fprintln(os.Stderr, "idem-child:", err)
		return 2
	}
	cfg, err := pgxpool.ParseConfig(testenv.PostgresURL())
	if err != nil {
		return fail(err)
	}
	cfg.MaxConns = 6
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return fail(err)
	}
	defer pool.Close()
	o, err := effectstest.Open(pool, os.Getenv(childSchemaEnv))
	if err != nil {
		return fail(err)
	}
	nc, err := nats.Connect(os.Getenv(childURLEnv), nats.MaxReconnects(-1), nats.ReconnectWait(50*time.Millisecond))
	if err != nil {
		return fail(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return fail(err)
	}

	kind, point := os.Getenv(childEnv), os.Getenv(childPointEnv)
	after, _ := strconv.ParseInt(os.Getenv(childAfterEnv), 10, 64)
	var acked atomic.Int64
	die := func(at string) {
		if kind == "worker" && point == at && acked.Load() >= after {
			_ = syscall.Kill(os.Getpid(), syscall.SIGKILL)
			select {} // the signal is on its way
		}
	}
	var before func(context.Context, *consumer.Message) error
	if kind == "poison" {
		before = func(_ context.Context, msg *consumer.Message) error {
			if strings.HasPrefix(msg.ID, "poison") {
				panic("poison message " + msg.ID)
			}
			return nil
		}
	}
	inTx := func(context.Context, *consumer.Message) error { die("in_tx"); return nil }
	tx, err := o.TxHandler(before, inTx)
	if err != nil {
		return fail(err)
	}
	h := consumer.Chain(tx, func(next consumer.Handler) consumer.Handler {
		return consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
			die("before_tx")
			err := next.Handle(ctx, msg)
			if err == nil {
				die("after_commit")
			}
			return err
		})
	})
	opts := ConsumerOptions{
		Concurrency: 4, Prefetch: 16, Backoff: testBackoff,
		Telemetry: consumer.Telemetry{Logger: quiet(), OnOutcome: func(_ context.Context, r consumer.Report) {
			if r.Result.Action == consumer.ActionAck {
				acked.Add(1)
			}
		}},
		Config: jetstream.ConsumerConfig{AckWait: time.Second},
	}
	if kind == "poison" {
		opts.MaxDeliveries = childMaxDeliveries
	}
	c, err := NewConsumer(js, os.Getenv(childStreamEnv), "work", h, opts)
	if err != nil {
		return fail(err)
	}
	go func() {
		select {
		case <-c.Ready():
			fmt.Println(childReadyLine)
		case <-ctx.Done():
		}
	}()
	if err := c.Run(ctx); err != nil {
		return fail(err)
	}
	return 0
}
