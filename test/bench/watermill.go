package bench

import (
	"context"
	"fmt"
	"sync"
	"time"

	wm "github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"
	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/adapters/watermill"
	"github.com/idemkit/idem/dedup/memstore"
	"github.com/idemkit/idem/dedup/pgtable"
)

// wmLanes is the number of router handlers, each on its own topic of an
// in-process gochannel, and of publishers feeding them.
const wmLanes = 8

// wmSide runs a router with wmLanes handlers h behind mw (none when nil),
// publishes a round's messages to it (each Publish returns once the
// handler acknowledged the message) and returns the rate.
func wmSide(e *env, mw message.HandlerMiddleware, h message.NoPublishHandlerFunc) side {
	return func(ctx context.Context, warm bool) (float64, error) {
		n := warmed(e.size.deliveries, warm)
		ps := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, wm.NopLogger{})
		defer func() { _ = ps.Close() }()
		r, err := message.NewRouter(message.RouterConfig{CloseTimeout: time.Minute}, wm.NopLogger{})
		if err != nil {
			return 0, err
		}
		if mw != nil {
			r.AddMiddleware(mw)
		}
		for i := range wmLanes {
			r.AddConsumerHandler(fmt.Sprint("h", i), fmt.Sprint("orders-", i), ps, h)
		}
		rctx, cancel := context.WithCancel(ctx)
		defer cancel()
		go func() { _ = r.Run(rctx) }()
		defer func() { _ = r.Close() }()
		<-r.Running()
		prefix := e.id("wm") + "-"
		start := time.Now()
		var wg sync.WaitGroup
		errs := make(chan error, wmLanes)
		for lane := range wmLanes {
			wg.Go(func() {
				for i := lane; i < n; i += wmLanes {
					if err := ps.Publish(fmt.Sprint("orders-", lane), message.NewMessage(fmt.Sprint(prefix, i), payload)); err != nil {
						errs <- err
						return
					}
				}
			})
		}
		wg.Wait()
		rate := float64(n) / time.Since(start).Seconds()
		select {
		case err := <-errs:
			return 0, err
		default:
			return rate, nil
		}
	}
}

func wmTxRow() row {
	return row{
		path:     "Watermill, transactional mode (idemwatermill.Transactional)",
		baseline: "router handler doing the same INSERT in its own tx, 8 handlers",
		target:   0.90, unit: "msg/s", floor: txFloor,
		build: func(ctx context.Context, e *env) (side, side, error) {
			bareInsert, err := e.effects(ctx, "wm_tx_bare")
			if err != nil {
				return nil, nil, err
			}
			idemInsert, err := e.effects(ctx, "wm_tx_idem")
			if err != nil {
				return nil, nil, err
			}
			claims, err := e.claims(ctx, "wm_tx_claims", pgtable.Options{})
			if err != nil {
				return nil, nil, err
			}
			mw, err := idemwatermill.Transactional(claims, idemwatermill.Options{Scope: "bench/wm"})
			if err != nil {
				return nil, nil, err
			}
			bare := wmSide(e, nil, func(msg *message.Message) error {
				ctx := msg.Context()
				return pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
					_, err := tx.Exec(ctx, bareInsert, msg.UUID, []byte(msg.Payload))
					return err
				})
			})
			idem := wmSide(e, mw, func(msg *message.Message) error {
				ctx := msg.Context()
				_, err := idemwatermill.Tx[pgx.Tx](ctx).Exec(ctx, idemInsert, msg.UUID, []byte(msg.Payload))
				return err
			})
			return bare, idem, nil
		},
	}
}

func wmMemRow() row {
	return row{
		path:     "Watermill, memstore (idemwatermill.Dedup)",
		baseline: "Watermill's middleware.Deduplicator (in-memory), same handler (decode the order)",
		target:   1.0, unit: "msg/s",
		build: func(_ context.Context, e *env) (side, side, error) {
			store, err := memstore.New(memstore.Options{})
			if err != nil {
				return nil, nil, err
			}
			e.onClose(func(context.Context) { _ = store.Close() })
			mw, err := idemwatermill.Dedup(store, idemwatermill.Options{Scope: "bench/wm"})
			if err != nil {
				return nil, nil, err
			}
			repo, err := middleware.NewMapExpiringKeyRepository(time.Hour)
			if err != nil {
				return nil, nil, err
			}
			d := &middleware.Deduplicator{
				KeyFactory: func(msg *message.Message) (string, error) { return msg.UUID, nil },
				Repository: repo, Timeout: time.Minute,
			}
			h := func(msg *message.Message) error { return decodeOrder(msg.Payload) }
			return wmSide(e, d.Middleware, h), wmSide(e, mw, h), nil
		},
	}
}
