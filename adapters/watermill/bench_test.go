package idemwatermill_test

import (
	"context"
	"encoding/json"
	"runtime"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/ThreeDotsLabs/watermill/message/router/middleware"
	"github.com/ThreeDotsLabs/watermill/pubsub/gochannel"

	"github.com/idemkit/idem/adapters/watermill"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// benchLanes is the number of handlers (one topic each) the messages are
// spread over; gochannel hands a subscription its next message only once the
// previous one was acknowledged, so lanes are what runs in parallel.
const benchLanes = 8

// BenchmarkRouter sends messages through a Watermill router on gochannel,
// side by side in one run:
//
//   - none: no dedup middleware;
//   - deduplicator: Watermill's middleware.Deduplicator with its in-memory
//     repository (NewMapExpiringKeyRepository) and key = msg.UUID;
//   - idem_memstore: Dedup over dedup/memstore;
//   - idem_redisnx: Dedup over dedup/redisnx on the local Redis (two round
//     trips per message: claim, complete).
//
// One op is one message published and acknowledged after its handler ran;
// every message has a new UUID (first deliveries, the common case). The
// handler decodes the JSON payload, the same work in every variant (the
// convention of idem's other side-by-side benchmarks).
//
// The in-memory variants keep every key, so their cost per message depends
// on how many they hold: compare them at a fixed number of messages. And
// go test -count runs one variant's rounds back to back, so on a noisy
// machine run rounds as separate invocations, which interleaves the
// variants:
//
//	go test -c -o /tmp/wm.test ./adapters/watermill/
//	for i in 1 2 3 4 5 6 7 8; do
//		/tmp/wm.test -test.run '^$' -test.bench 'BenchmarkRouter/(none|deduplicator|idem_memstore)$' -test.benchtime 200000x
//		/tmp/wm.test -test.run '^$' -test.bench 'BenchmarkRouter/idem_redisnx$' -test.benchtime 20000x
//	done
func BenchmarkRouter(b *testing.B) {
	for _, v := range benchVariants() {
		b.Run(v.name, func(b *testing.B) { benchRouter(b, v.mw(b)) })
	}
}

// BenchmarkMiddleware is the middleware alone, without router and pub/sub:
// one op is one first delivery through the middleware to a handler that
// decodes the payload. It isolates the CPU cost of each variant from the
// router's goroutine hand-offs, which dominate BenchmarkRouter.
func BenchmarkMiddleware(b *testing.B) {
	for _, v := range benchVariants() {
		b.Run(v.name, func(b *testing.B) {
			mw := v.mw(b)
			h := message.HandlerFunc(decodeOrder)
			if mw != nil {
				h = mw(h)
			}
			ctx := context.Background()
			prefix := testenv.Name("msg") + "-"
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				msg := message.NewMessageWithContext(ctx, prefix+strconv.Itoa(i), benchPayload)
				if _, err := h(msg); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

var benchPayload = []byte(`{"order":"A-1","amount":100,"currency":"EUR"}`)

// decodeOrder is the benchmarks' handler.
func decodeOrder(msg *message.Message) ([]*message.Message, error) {
	var o struct {
		Order    string `json:"order"`
		Amount   int64  `json:"amount"`
		Currency string `json:"currency"`
	}
	return nil, json.Unmarshal(msg.Payload, &o)
}

type benchVariant struct {
	name string
	mw   func(b *testing.B) message.HandlerMiddleware
}

func benchVariants() []benchVariant {
	return []benchVariant{
		{"none", func(*testing.B) message.HandlerMiddleware { return nil }},
		{"deduplicator", func(*testing.B) message.HandlerMiddleware {
			d := &middleware.Deduplicator{
				KeyFactory: uuidKey,
				Repository: must(middleware.NewMapExpiringKeyRepository(time.Hour)),
				Timeout:    time.Minute,
			}
			return d.Middleware
		}},
		{"idem_memstore", func(b *testing.B) message.HandlerMiddleware {
			return must(idemwatermill.Dedup(newMemstore(b), idemwatermill.Options{Scope: "bench"}))
		}},
		{"idem_redisnx", func(b *testing.B) message.HandlerMiddleware {
			s := must(redisnx.New(testenv.Redis(b), redisnx.Options{Prefix: testenv.Name("idemwmbench"), TTL: time.Minute}))
			return must(idemwatermill.Dedup(s, idemwatermill.Options{Scope: "bench"}))
		}},
	}
}

func benchRouter(b *testing.B, mw message.HandlerMiddleware) {
	ps := gochannel.NewGoChannel(gochannel.Config{BlockPublishUntilSubscriberAck: true}, nopLogger)
	b.Cleanup(func() { _ = ps.Close() })
	r := newRouter(b)
	if mw != nil {
		r.AddMiddleware(mw)
	}
	var handled atomic.Int64
	topics := make([]string, benchLanes)
	for i := range topics {
		topics[i] = "orders-" + strconv.Itoa(i)
		r.AddConsumerHandler("handler-"+strconv.Itoa(i), topics[i], ps, func(msg *message.Message) error {
			_, err := decodeOrder(msg)
			handled.Add(1)
			return err
		})
	}
	startRouter(b, r)

	prefix := testenv.Name("msg") + "-"
	var seq, lane atomic.Int64
	b.SetParallelism(max(1, benchLanes/runtime.GOMAXPROCS(0)))
	b.ReportAllocs()
	b.ResetTimer()
	b.RunParallel(func(pb *testing.PB) {
		topic := topics[int(lane.Add(1)-1)%benchLanes]
		for pb.Next() {
			msg := message.NewMessage(prefix+strconv.FormatInt(seq.Add(1), 10), benchPayload)
			if err := ps.Publish(topic, msg); err != nil {
				b.Error(err)
				return
			}
		}
	})
	b.StopTimer()
	if got := handled.Load(); got != int64(b.N) {
		b.Fatalf("handled %d of %d messages", got, b.N)
	}
}
