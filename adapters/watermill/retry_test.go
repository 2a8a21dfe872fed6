package idemwatermill_test

import (
	"sync/atomic"
	"testing"
	"time"

	wm "github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/idemkit/idem/adapters/watermill"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// How a failed attempt comes back: the broker redelivers the nacked message
// (gochannel resends it at once), or Watermill's Retry middleware runs the
// handler again in process.
var retryModes = []string{"redelivery", "retry_middleware"}

// failOnceScenario runs one handler whose first attempt fails before its
// effect (a payment gateway timeout) and whose later attempts succeed,
// behind dedup (any handler middleware), and publishes the same message twice
// (a producer duplicate). It returns how often the handler ran and the
// effects per "handler/id".
func failOnceScenario(t *testing.T, mode string, dedupMW message.HandlerMiddleware, o oracle) (attempts int32, id string, effects map[string]int) {
	t.Helper()
	ps := newGoChannel(t)
	r := newRouter(t)
	if mode == "retry_middleware" {
		r.AddMiddleware(fastRetry(3).Middleware)
	}
	r.AddMiddleware(dedupMW)
	var n atomic.Int32
	topic := testenv.Name("payments")
	r.AddConsumerHandler("charge", topic, ps, func(msg *message.Message) error {
		if n.Add(1) == 1 {
			return errGateway
		}
		return o.record(msg, "charge")
	})
	startRouter(t, r)

	msg := message.NewMessage(wm.NewUUID(), []byte(`{"order":"A-1","amount":100}`))
	for range 2 { // the second publish is a producer duplicate
		if err := ps.Publish(topic, msg.Copy()); err != nil {
			t.Fatal(err)
		}
	}
	return n.Load(), msg.UUID, o.counts(t)
}

// TestFailOnceThenSucceedRunsOnce: a handler that fails once and succeeds on
// retry applies its effect exactly once, on every store, whether the retry
// is a broker redelivery or Watermill's Retry middleware; the producer's
// duplicate is acknowledged without running the handler.
func TestFailOnceThenSucceedRunsOnce(t *testing.T) {
	t.Parallel()
	for _, k := range allKinds() {
		for _, mode := range retryModes {
			t.Run(k.name+"/"+mode, func(t *testing.T) {
				fx := k.setup(t)
				attempts, id, effects := failOnceScenario(t, mode, fx.middleware(t, idemwatermill.Options{}), fx.oracle)
				if attempts != 2 {
					t.Errorf("handler ran %d times, want 2 (the failure, then the retry; the duplicate is dropped)", attempts)
				}
				if got := effects["charge/"+id]; got != 1 {
					t.Errorf("effects = %d, want exactly 1 (%v)", got, effects)
				}
			})
		}
	}
}

// TestStockDeduplicatorDropsRetry documents why the idem middleware exists:
// the same scenario behind Watermill's own middleware.Deduplicator (key =
// UUID) loses the message. The Deduplicator marks the message before the
// handler runs and never unmarks it, so the retry of the failed attempt is
// taken for a duplicate and acknowledged without running: zero effects. The
// test asserts the drop, so it keeps passing — and keeps documenting the
// difference — as long as Watermill behaves this way (v1.5.1 in go.mod).
func TestStockDeduplicatorDropsRetry(t *testing.T) {
	t.Parallel()
	for _, mode := range retryModes {
		t.Run(mode, func(t *testing.T) {
			// Timeout set: the zero value means 5ms (not the one minute
			// the doc's default suggests).
			d := &middleware.Deduplicator{KeyFactory: uuidKey,
				Repository: must(middleware.NewMapExpiringKeyRepository(time.Hour)), Timeout: 10 * time.Second}
			attempts, id, effects := failOnceScenario(t, mode, d.Middleware, newMemOracle())
			if attempts != 1 {
				t.Errorf("handler ran %d times; Watermill's Deduplicator used to run it once and drop the retry", attempts)
			}
			if got := effects["charge/"+id]; got != 0 {
				t.Errorf("effects = %d; Watermill's Deduplicator used to drop the retry (0 effects): has it stopped marking before the handler? Update the docs of this package", got)
			}
		})
	}
}
