package idemwatermill_test

import (
	"testing"
	"time"

	wm "github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	"github.com/idemkit/idem/adapters/watermill"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// twoHandlers runs the handlers "audit" and "charge" on one topic behind mw
// (router-level middleware), publishes three messages twice each, and
// returns the effects per "handler/id".
func twoHandlers(t *testing.T, mw message.HandlerMiddleware, o oracle) ([]string, map[string]int) {
	t.Helper()
	ps := newGoChannel(t)
	r := newRouter(t)
	r.AddMiddleware(mw)
	topic := testenv.Name("orders")
	for _, name := range []string{"audit", "charge"} {
		r.AddConsumerHandler(name, topic, ps, func(msg *message.Message) error {
			return o.record(msg, name)
		})
	}
	startRouter(t, r)
	var ids []string
	for range 3 {
		msg := message.NewMessage(wm.NewUUID(), []byte(`{"order":"C-3"}`))
		ids = append(ids, msg.UUID)
		for range 2 {
			if err := ps.Publish(topic, msg.Copy()); err != nil {
				t.Fatal(err)
			}
		}
	}
	return ids, o.counts(t)
}

// TestTwoHandlersEachApplyOnce: two handlers subscribed to the same topic
// each apply every message once: the scope defaults to the handler name, so
// each handler has its own keys, and the duplicate is dropped for each.
func TestTwoHandlersEachApplyOnce(t *testing.T) {
	t.Parallel()
	for _, k := range allKinds() {
		t.Run(k.name, func(t *testing.T) {
			fx := k.setup(t)
			ids, effects := twoHandlers(t, fx.middleware(t, idemwatermill.Options{}), fx.oracle)
			for _, id := range ids {
				for _, h := range []string{"audit", "charge"} {
					if n := effects[h+"/"+id]; n != 1 {
						t.Errorf("%s applied %s %d times, want 1", h, id, n)
					}
				}
			}
			if len(effects) != 2*len(ids) {
				t.Errorf("effects: %v", effects)
			}
		})
	}
}

// TestStockDeduplicatorSharesKeysBetweenHandlers documents another property
// of Watermill's Deduplicator as router-level middleware: all handlers share
// one key space, so of two handlers of a topic only the first to see a
// message applies it. Asserted, so the test notices if Watermill changes.
func TestStockDeduplicatorSharesKeysBetweenHandlers(t *testing.T) {
	t.Parallel()
	d := &middleware.Deduplicator{
		KeyFactory: uuidKey,
		Repository: must(middleware.NewMapExpiringKeyRepository(time.Hour)),
		Timeout:    10 * time.Second,
	}
	ids, effects := twoHandlers(t, d.Middleware, newMemOracle())
	for _, id := range ids {
		if n := effects["audit/"+id] + effects["charge/"+id]; n != 1 {
			t.Errorf("message %s applied %d times by the two handlers; Watermill's Deduplicator used to let one handler through", id, n)
		}
	}
	t.Logf("stock Deduplicator, two handlers, %d messages: %d effects in all (idem: %d)", len(ids), len(effects), 2*len(ids))
}
