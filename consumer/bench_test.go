package consumer_test

import (
	"context"
	"strconv"
	"testing"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/memstore"
)

// BenchmarkDedup is the per-message cost of the Dedup middleware on
// memstore (claim, heartbeat set-up, complete), beside the bare handler.
//
//	go test -run '^$' -bench Dedup -benchmem ./consumer/
func BenchmarkDedup(b *testing.B) {
	ctx := context.Background()
	noop := consumer.HandlerFunc(func(context.Context, *consumer.Message) error { return nil })
	payload := []byte(`{"amount":100,"currency":"EUR"}`)
	b.Run("bare", func(b *testing.B) {
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			i++
			msg := &consumer.Message{ID: "m-" + strconv.Itoa(i), Payload: payload}
			if r := consumer.Process(ctx, noop, msg); r.Action != consumer.ActionAck {
				b.Fatal(r.Err)
			}
		}
	})
	b.Run("memstore", func(b *testing.B) {
		store, err := memstore.New(memstore.Options{SweepInterval: -1})
		if err != nil {
			b.Fatal(err)
		}
		defer func() { _ = store.Close() }()
		mw, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "bench"})
		if err != nil {
			b.Fatal(err)
		}
		h := consumer.Chain(noop, mw)
		b.ReportAllocs()
		i := 0
		for b.Loop() {
			i++
			msg := &consumer.Message{ID: "m-" + strconv.Itoa(i), Payload: payload}
			if r := consumer.Process(ctx, h, msg); r.Action != consumer.ActionAck {
				b.Fatal(r.Err)
			}
		}
	})
}
