package idemwatermill_test

import (
	"context"
	"fmt"
	"sort"
	"sync/atomic"
	"testing"
	"time"

	wm "github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/idem/adapters/watermill"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestConcurrentDeliveriesOneEffect: 100 deliveries of one message at once
// — four instances of a service (four routers), each with 25 subscriptions
// of the topic under one scope — apply its effect once, on the stores shared
// between processes (real Redis and PostgreSQL), with the effects in an
// oracle table without a unique constraint. Deliveries that find the key in
// flight are retried by Watermill's Retry middleware until the first one
// completed and they are duplicates. Five messages, one after the other.
//
// The metrics agree with the oracle: as many first claims and completed
// handlers as effects, every other delivery attempt a duplicate or in
// flight, every delivery acknowledged once and every in-flight attempt a
// retry.
func TestConcurrentDeliveriesOneEffect(t *testing.T) {
	t.Parallel()
	const (
		routers      = 4
		subsPerRoute = 25
		messages     = 5
	)
	for _, k := range append(sharedKinds(), memKind()) {
		t.Run(k.name, func(t *testing.T) {
			fx := k.setup(t)
			mp := telemetrytest.NewMetrics(t)
			ps := newGoChannel(t)
			topic := testenv.Name("payments")
			var (
				runs     atomic.Int32
				outcomes [10]atomic.Int32
			)
			names := []consumer.Outcome{consumer.OutcomeCompleted, consumer.OutcomeDuplicate, consumer.OutcomeInFlight, consumer.OutcomeStoreError}
			onOutcome := func(_ context.Context, r consumer.Report) {
				o := r.Outcome
				for i, n := range names {
					if n == o {
						outcomes[i].Add(1)
					}
				}
			}
			for r := range routers {
				router := newRouter(t)
				router.AddMiddleware(
					fastRetry(1000).Middleware,
					// Each router is another instance on the same store.
					fx.middleware(t, idemwatermill.Options{Scope: "billing/charge", Telemetry: consumer.Telemetry{OnOutcome: onOutcome, MeterProvider: mp}}),
				)
				for s := range subsPerRoute {
					router.AddConsumerHandler(fmt.Sprintf("charge-%d-%d", r, s), topic, ps, func(msg *message.Message) error {
						runs.Add(1)
						if err := fx.oracle.record(msg, "charge"); err != nil {
							return err
						}
						// A slow payment gateway: the other deliveries
						// arrive while this one holds the key.
						time.Sleep(20 * time.Millisecond)
						return nil
					})
				}
				startRouter(t, router)
			}

			var want []string
			for range messages {
				msg := message.NewMessage(wm.NewUUID(), []byte(`{"amount":100}`))
				want = append(want, "charge/"+msg.UUID)
				// Returns once all 100 deliveries were acknowledged.
				if err := ps.Publish(topic, msg); err != nil {
					t.Fatal(err)
				}
			}

			effects := fx.oracle.counts(t)
			if d := duplicates(effects); len(d) > 0 {
				sort.Strings(d)
				t.Errorf("duplicate effects: %v", d)
			}
			for _, w := range want {
				if effects[w] != 1 {
					t.Errorf("%s: %d effects, want 1", w, effects[w])
				}
			}
			if len(effects) != messages {
				t.Errorf("%d ids have effects, want %d", len(effects), messages)
			}
			if n := runs.Load(); n != messages {
				t.Errorf("handler ran %d times for %d messages", n, messages)
			}
			if got := outcomes[0].Load(); got != messages {
				t.Errorf("completed = %d, want %d", got, messages)
			}
			if got := outcomes[1].Load(); got != messages*(routers*subsPerRoute-1) {
				t.Errorf("duplicates = %d, want %d", got, messages*(routers*subsPerRoute-1))
			}
			claims := func(outcome string) float64 {
				return mp.Sum(telemetry.MetricClaims, telemetry.AttrScope.String("billing/charge"), telemetry.AttrOutcome.String(outcome))
			}
			msgs := func(result string) float64 {
				return mp.Sum(telemetry.MetricMessages, telemetry.AttrDestination.String(topic), telemetry.AttrResult.String(result))
			}
			effectsApplied := 0
			for _, n := range effects {
				effectsApplied += n
			}
			first, dup, inFlight := claims(telemetry.ClaimFirst), claims(telemetry.ClaimDuplicate), claims(telemetry.ClaimInFlight)
			if first != float64(effectsApplied) || mp.Sum(telemetry.MetricHandlerDuration, telemetry.AttrOutcome.String("completed")) != float64(effectsApplied) {
				t.Errorf("claims{first} = %v, handler{completed} = %v; the oracle counted %d effects",
					first, mp.Sum(telemetry.MetricHandlerDuration, telemetry.AttrOutcome.String("completed")), effectsApplied)
			}
			deliveries := float64(messages * routers * subsPerRoute)
			if dup != deliveries-first || inFlight != float64(outcomes[2].Load()) || mp.Sum(telemetry.MetricClaims) != first+dup+inFlight {
				t.Errorf("claims: first %v, duplicate %v, in_flight %v, all %v; want duplicate = %v deliveries - first, in_flight = %d",
					first, dup, inFlight, mp.Sum(telemetry.MetricClaims), deliveries, outcomes[2].Load())
			}
			if msgs("ack") != deliveries || msgs("retry") != inFlight || msgs("dead_letter") != 0 {
				t.Errorf("messages: ack %v, retry %v, dead_letter %v; want %v, %v, 0", msgs("ack"), msgs("retry"), msgs("dead_letter"), deliveries, inFlight)
			}
			mp.NoValueContains(want...)
			t.Logf("%d messages × %d deliveries: %d effects each; outcomes completed=%d duplicate=%d in_flight=%d store_error=%d",
				messages, routers*subsPerRoute, 1, outcomes[0].Load(), outcomes[1].Load(), outcomes[2].Load(), outcomes[3].Load())
		})
	}
}
