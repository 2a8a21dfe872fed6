package consumer_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/memstore"
)

// A payment handler behind Dedup and Retry: the broker delivers the same
// message twice, the card is charged once, and both deliveries are
// acknowledged.
func Example() {
	store, err := memstore.New(memstore.Options{})
	if err != nil {
		panic(err)
	}
	defer store.Close()

	charge := consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		fmt.Printf("charging for %s\n", msg.ID)
		consumer.SetResult(ctx, []byte("receipt-42"))
		return nil
	})

	deadLetter, err := consumer.DeadLetter(func(ctx context.Context, msg *consumer.Message, reason consumer.Outcome, cause error) error {
		fmt.Printf("dead letter %s: %s\n", msg.ID, reason)
		return nil
	})
	if err != nil {
		panic(err)
	}
	retry, err := consumer.Retry(consumer.RetryOptions{MaxAttempts: 3})
	if err != nil {
		panic(err)
	}
	dd, err := consumer.Dedup(store, consumer.DedupOptions{Scope: "billing/charge-card"})
	if err != nil {
		panic(err)
	}
	h := consumer.Chain(charge, deadLetter, retry, consumer.Recover(), consumer.Timeout(30*time.Second), dd)

	ctx := context.Background()
	msg := &consumer.Message{ID: "order-1", Payload: []byte(`{"amount":100}`), Topic: "orders"}
	for delivery := 1; delivery <= 2; delivery++ {
		r := consumer.Process(ctx, h, msg)
		stored, _ := dedup.StoredResult(r.Err)
		fmt.Printf("delivery %d: %s duplicate=%v stored=%q\n", delivery, r.Action, r.Duplicate, stored)
	}

	// Same id, other content: a conflict, parked and never charged.
	r := consumer.Process(ctx, h, &consumer.Message{ID: "order-1", Payload: []byte(`{"amount":999}`)})
	fmt.Printf("conflict: %s dead-lettered=%v reason=%s\n", r.Action, r.DeadLettered, r.Reason)

	// Output:
	// charging for order-1
	// delivery 1: ack duplicate=false stored=""
	// delivery 2: ack duplicate=true stored="receipt-42"
	// dead letter order-1: fingerprint_mismatch
	// conflict: ack dead-lettered=true reason=fingerprint_mismatch
}

func ExampleDecide() {
	key := dedup.Key{Scope: "billing/charge-card", ID: "order-1"}
	for _, err := range []error{
		nil,
		&dedup.ClaimError{Err: dedup.ErrDuplicate, Key: key},
		&dedup.ClaimError{Err: dedup.ErrInFlight, Key: key, RetryAfter: 5 * time.Second},
		errors.New("connection reset"),
		consumer.Permanent(errors.New("amount is negative")),
		&dedup.ClaimError{Err: dedup.ErrFingerprintMismatch, Key: key},
		fmt.Errorf("wrapped: %w", consumer.Permanent(dedup.ErrInFlight)),
	} {
		r := consumer.Decide(err)
		fmt.Printf("%-11s %-20s retry-after=%v\n", r.Action, r.Reason, r.RetryAfter)
	}
	// Output:
	// ack                              retry-after=0s
	// ack         duplicate            retry-after=0s
	// retry       in_flight            retry-after=5s
	// retry       transient            retry-after=0s
	// dead_letter permanent            retry-after=0s
	// dead_letter fingerprint_mismatch retry-after=0s
	// retry       in_flight            retry-after=0s
}

// Permanent marks an error that a redelivery cannot fix.
func ExamplePermanent() {
	h := consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		if len(msg.Payload) == 0 {
			return consumer.Permanent(errors.New("empty payload"))
		}
		return nil
	})
	r := consumer.Process(context.Background(), h, &consumer.Message{ID: "m1"})
	fmt.Println(r.Action, r.Reason, r.Err)
	// Output:
	// dead_letter permanent empty payload
}
