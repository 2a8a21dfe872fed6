package memstore_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/memstore"
)

// A message is delivered twice. The first delivery claims the key, does the
// work and completes with a result; the redelivery is a duplicate and gets
// that result back instead of doing the work again.
func Example() {
	ctx := context.Background()
	store, err := memstore.New(memstore.Options{TTL: time.Hour})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer store.Close()

	payload := []byte(`{"user":"u-7","template":"welcome"}`)
	key := dedup.NewKey("mailer/welcome", "msg-0001", payload)
	for delivery := 1; delivery <= 2; delivery++ {
		lease, err := store.Claim(ctx, key)
		if result, dup := dedup.StoredResult(err); dup {
			fmt.Printf("delivery %d: duplicate (%v), already %s\n", delivery, errors.Is(err, dedup.ErrDuplicate), result)
			continue
		}
		if err != nil { // in flight, mismatch, invalid key: do not ACK
			fmt.Printf("delivery %d: %v\n", delivery, err)
			continue
		}
		fmt.Printf("delivery %d: sending the email\n", delivery)
		if err := store.Complete(ctx, lease, []byte("sent as mail-991")); err != nil {
			fmt.Println(err)
		}
	}
	// Output:
	// delivery 1: sending the email
	// delivery 2: duplicate (true), already sent as mail-991
}

// A handler that fails releases its claim, so the redelivery runs the handler
// again instead of being dropped as a duplicate.
func ExampleStore_Release() {
	ctx := context.Background()
	store, err := memstore.New(memstore.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer store.Close()

	key := dedup.NewKey("mailer/welcome", "msg-0002", nil)
	send := func(attempt int) error {
		if attempt == 1 {
			return errors.New("smtp: connection refused")
		}
		return nil
	}
	for attempt := 1; attempt <= 2; attempt++ {
		lease, err := store.Claim(ctx, key)
		if err != nil {
			fmt.Printf("attempt %d: %v\n", attempt, err)
			continue
		}
		if err := send(attempt); err != nil {
			fmt.Printf("attempt %d: %v; releasing the key\n", attempt, err)
			if err := store.Release(ctx, lease); err != nil {
				fmt.Println(err)
			}
			continue
		}
		fmt.Printf("attempt %d: sent\n", attempt)
		if err := store.Complete(ctx, lease, nil); err != nil {
			fmt.Println(err)
		}
	}
	// Output:
	// attempt 1: smtp: connection refused; releasing the key
	// attempt 2: sent
}

// With a clock that moves only when told to, the lease runs out without sleeping. While the lease is
// live a second claim is in flight and told how long to wait; once it has
// expired the key can be claimed again, and the first owner, now stale, can
// no longer complete.
func ExampleNew_manualClock() {
	ctx := context.Background()
	clock := &manualClock{now: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
	store, err := memstore.New(memstore.Options{Lease: 30 * time.Second, Clock: clock})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer store.Close()

	key := dedup.NewKey("payments/capture", "pay-17", nil)
	first, err := store.Claim(ctx, key)
	if err != nil {
		fmt.Println(err)
		return
	}

	clock.Advance(10 * time.Second)
	_, err = store.Claim(ctx, key)
	var ce *dedup.ClaimError
	if errors.As(err, &ce) && errors.Is(err, dedup.ErrInFlight) {
		fmt.Println("in flight, retry after", ce.RetryAfter)
	}

	// The first owner hangs and never extends its lease.
	clock.Advance(25 * time.Second)
	second, err := store.Claim(ctx, key)
	fmt.Println("claimed after expiry:", err == nil)

	err = store.Complete(ctx, first, nil)
	fmt.Println("stale owner completes:", errors.Is(err, dedup.ErrLeaseLost))
	fmt.Println("new owner completes:", store.Complete(ctx, second, nil) == nil)
	// Output:
	// in flight, retry after 20s
	// claimed after expiry: true
	// stale owner completes: true
	// new owner completes: true
}

// manualClock is a dedup.Clock that moves only when told to.
type manualClock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *manualClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *manualClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}
