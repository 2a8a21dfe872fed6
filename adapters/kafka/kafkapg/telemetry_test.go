package kafkapg_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/adapters/kafka/kafkapg"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/telemetry"
	"github.com/idemkit/idem/internal/testkit/telemetrytest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// Batch counts each message's claim by outcome and each handler run by how
// the batch ended, with scope and store only, and records its claim, handle
// and commit spans under the batch's span.
func TestBatchTelemetry(t *testing.T) {
	pool := testenv.Pool(t, 4)
	schema := testenv.Schema(t, pool)
	ctx := context.Background()
	claims, err := pgtable.New(pool, pgtable.Options{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := claims.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	errBoom := errors.New("boom")
	h := func(_ context.Context, _ pgx.Tx, msg *consumer.Message) error {
		if string(msg.Payload) == "boom" {
			return errBoom
		}
		return nil
	}
	mp := telemetrytest.NewMetrics(t)
	spans := telemetrytest.NewSpans(t)
	bh, err := kafkapg.Batch(pool, claims, kafkapg.BatchOptions{Scope: "test/batch", Telemetry: consumer.Telemetry{MeterProvider: mp, TracerProvider: spans}}, h)
	if err != nil {
		t.Fatal(err)
	}
	msg := func(id, payload string) *consumer.Message {
		return &consumer.Message{ID: "secret-" + id, Payload: []byte(payload)}
	}
	bctx, batchSpan := spans.Tracer("test").Start(ctx, "process batch")
	_ = bh(bctx, []*consumer.Message{msg("a", "1"), msg("b", "2")})
	_ = bh(bctx, []*consumer.Message{msg("a", "1"), msg("c", "3"), msg("c", "3"), msg("b", "other")})
	_ = bh(bctx, []*consumer.Message{msg("d", "4"), msg("e", "boom")})
	batchSpan.End()

	scope, store := telemetry.AttrScope.String("test/batch"), telemetry.AttrStore.String("pgtable")
	for outcome, want := range map[string]float64{
		telemetry.ClaimFirst: 5, telemetry.ClaimDuplicate: 2, telemetry.ClaimFingerprintMismatch: 1,
	} {
		if got := mp.Sum(telemetry.MetricClaims, scope, store, telemetry.AttrOutcome.String(outcome)); got != want {
			t.Errorf("%s{outcome=%s} = %v, want %v", telemetry.MetricClaims, outcome, got, want)
		}
	}
	if got := mp.Sum(telemetry.MetricClaims); got != 8 {
		t.Errorf("claims in all = %v, want 8", got)
	}
	for outcome, want := range map[consumer.Outcome]float64{consumer.OutcomeCompleted: 3, consumer.OutcomeReleased: 2} {
		if got := mp.Sum(telemetry.MetricHandlerDuration, scope, store, telemetry.AttrOutcome.String(string(outcome))); got != want {
			t.Errorf("%s{outcome=%s} = %v, want %v", telemetry.MetricHandlerDuration, outcome, got, want)
		}
	}
	mp.NoValueContains("secret-")

	parent := batchSpan.SpanContext().SpanID()
	for name, want := range map[string]int{"idem.claim": 3, "idem.handle": 5, "idem.commit": 2} {
		got := spans.Named(name)
		if len(got) != want {
			t.Errorf("%d %s spans, want %d", len(got), name, want)
		}
		for _, s := range got {
			if s.Parent().SpanID() != parent {
				t.Errorf("%s's parent = %v, want the batch span %v", name, s.Parent().SpanID(), parent)
			}
			for _, kv := range s.Attributes() {
				if v := kv.Value.String(); strings.Contains(v, "secret-") {
					t.Errorf("%s attribute %s = %q holds an id", name, kv.Key, v)
				}
			}
		}
	}
}

// BatchAll records one handle span, with the number of messages, and one
// handler duration per handler call, whatever the number of messages it
// handles; the claims are counted per message as with Batch.
func TestBatchAllTelemetry(t *testing.T) {
	pool := testenv.Pool(t, 4)
	schema := testenv.Schema(t, pool)
	ctx := context.Background()
	claims, err := pgtable.New(pool, pgtable.Options{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := claims.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	errBoom := errors.New("boom")
	h := func(_ context.Context, _ pgx.Tx, msgs []*consumer.Message) error {
		for _, m := range msgs {
			if string(m.Payload) == "boom" {
				return errBoom
			}
		}
		return nil
	}
	mp := telemetrytest.NewMetrics(t)
	spans := telemetrytest.NewSpans(t)
	bh, err := kafkapg.BatchAll(pool, claims, kafkapg.BatchOptions{Scope: "test/batch", Telemetry: consumer.Telemetry{MeterProvider: mp, TracerProvider: spans}}, h)
	if err != nil {
		t.Fatal(err)
	}
	msg := func(id, payload string) *consumer.Message {
		return &consumer.Message{ID: "secret-" + id, Payload: []byte(payload)}
	}
	bctx, batchSpan := spans.Tracer("test").Start(ctx, "process batch")
	_ = bh(bctx, []*consumer.Message{msg("a", "1"), msg("b", "2")})
	_ = bh(bctx, []*consumer.Message{msg("a", "1"), msg("c", "3"), msg("c", "3"), msg("b", "other")})
	_ = bh(bctx, []*consumer.Message{msg("a", "1"), msg("b", "2")}) // no new record: no handler call
	_ = bh(bctx, []*consumer.Message{msg("d", "4"), msg("e", "boom"), msg("f", "6")})
	batchSpan.End()

	scope, store := telemetry.AttrScope.String("test/batch"), telemetry.AttrStore.String("pgtable")
	for outcome, want := range map[string]float64{
		telemetry.ClaimFirst: 6, telemetry.ClaimDuplicate: 4, telemetry.ClaimFingerprintMismatch: 1,
	} {
		if got := mp.Sum(telemetry.MetricClaims, scope, store, telemetry.AttrOutcome.String(outcome)); got != want {
			t.Errorf("%s{outcome=%s} = %v, want %v", telemetry.MetricClaims, outcome, got, want)
		}
	}
	for outcome, want := range map[consumer.Outcome]float64{consumer.OutcomeCompleted: 2, consumer.OutcomeReleased: 1} {
		if got := mp.Sum(telemetry.MetricHandlerDuration, scope, store, telemetry.AttrOutcome.String(string(outcome))); got != want {
			t.Errorf("%s{outcome=%s} = %v, want %v", telemetry.MetricHandlerDuration, outcome, got, want)
		}
	}
	mp.NoValueContains("secret-")

	// One span per handler call: the number of messages, or the key's hash
	// for a call with one message.
	var got []string
	for _, s := range spans.Named("idem.handle") {
		if s.Parent().SpanID() != batchSpan.SpanContext().SpanID() {
			t.Errorf("idem.handle's parent = %v, want the batch span", s.Parent().SpanID())
		}
		for _, kv := range s.Attributes() {
			switch kv.Key {
			case "messaging.batch.message_count":
				got = append(got, fmt.Sprint(kv.Value.AsInt64()))
			case telemetry.AttrKeyHash:
				got = append(got, "hash")
			}
		}
	}
	if fmt.Sprint(got) != "[2 hash 3]" {
		t.Errorf("idem.handle spans %v, want [2 hash 3]: one span per handler call", got)
	}
}
