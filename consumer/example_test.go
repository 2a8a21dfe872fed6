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

// A Backoff's delays: Initial·Factor^(n-1), capped at Max. Every retry loop
// of idem, a message's retries and a client's reconnects alike, is
// configured with one.
func ExampleBackoff() {
	b := consumer.Backoff{Initial: time.Second, Max: 2 * time.Minute, Factor: 5}
	for n := 1; n <= 5; n++ {
		fmt.Println(n, b.Delay(n))
	}
	// Zero fields take the defaults of the options struct holding it.
	d, err := consumer.Backoff{Max: time.Minute}.WithDefaults(consumer.Backoff{Initial: 100 * time.Millisecond, Max: 10 * time.Second})
	fmt.Println(d, err)
	_, err = consumer.Backoff{Factor: 0.5}.WithDefaults(consumer.Backoff{Initial: time.Second, Max: time.Minute})
	fmt.Println(err)
	// Output:
	// 1 1s
	// 2 5s
	// 3 25s
	// 4 2m0s
	// 5 2m0s
	// {100ms 1m0s 2} <nil>
	// Factor is 0.5; it must be at least 1 (or zero for 2)
}
