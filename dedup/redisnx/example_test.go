package redisnx_test

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/redisnx"
)

// A payment is delivered twice. The first delivery claims the key, charges
// and completes; the redelivery is a duplicate and gets the stored result
// back instead of charging again.
func Example() {
	ctx := context.Background()
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	defer client.Close()

	store, err := redisnx.New(client, redisnx.Options{
		Prefix: "example-" + rand.Text(), // fresh keys on every run
		Lease:  30 * time.Second,
		TTL:    time.Minute,
	})
	if err != nil {
		fmt.Println(err)
		return
	}

	payload := []byte(`{"order":"A-1","amount":100}`)
	key := dedup.NewKey("billing/charge", "order-A-1", payload)
	for delivery := 1; delivery <= 2; delivery++ {
		lease, err := store.Claim(ctx, key)
		if result, dup := dedup.StoredResult(err); dup {
			fmt.Printf("delivery %d: duplicate, already %s\n", delivery, result)
			continue
		}
		if errors.Is(err, dedup.ErrInFlight) {
			fmt.Printf("delivery %d: in flight elsewhere, retry later\n", delivery)
			continue
		}
		if err != nil { // Redis down, mismatch, invalid key: do not ACK
			fmt.Printf("delivery %d: %v\n", delivery, err)
			continue
		}
		fmt.Printf("delivery %d: charging\n", delivery)
		if err := store.Complete(ctx, lease, []byte("charged ch_42")); err != nil {
			fmt.Println(err)
		}
	}
	// Output:
	// delivery 1: charging
	// delivery 2: duplicate, already charged ch_42
}

// A handler that fails releases its claim, so the redelivery runs it again.
// A stale owner (one whose lease ran out and was taken over) cannot complete.
func ExampleStore_Release() {
	ctx := context.Background()
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:6379"})
	defer client.Close()
	store, err := redisnx.New(client, redisnx.Options{Prefix: "example-" + rand.Text(), TTL: time.Minute})
	if err != nil {
		fmt.Println(err)
		return
	}
	key := dedup.NewKey("email/welcome", "user-7", nil)

	first, err := store.Claim(ctx, key)
	if err != nil {
		fmt.Println(err)
		return
	}
	// The mail server is down: give the key back.
	if err := store.Release(ctx, first); err != nil {
		fmt.Println(err)
		return
	}
	second, err := store.Claim(ctx, key)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println("redelivery claimed:", second != nil)
	err = store.Complete(ctx, first, nil)
	fmt.Println("first owner completes:", errors.Is(err, dedup.ErrLeaseLost))
	fmt.Println("second owner completes:", store.Complete(ctx, second, nil) == nil)
	// Output:
	// redelivery claimed: true
	// first owner completes: true
	// second owner completes: true
}

// On a Redis Cluster, pass a cluster client. The Store groups calls per
// master and, when a master is unreachable, reloads the slot map and tries
// again for up to FailoverWait. The servers need
// cluster-require-full-coverage no, so that a shard without a master stops
// only its own keys.
func ExampleNew_cluster() {
	client := redis.NewClusterClient(&redis.ClusterOptions{
		Addrs: []string{"10.0.0.1:6379", "10.0.0.2:6379", "10.0.0.3:6379"},
		// Claims are writes: keep ReadOnly, RouteByLatency and
		// RouteRandomly off (the default). Short timeouts make a call to
		// a host that went away fail closed quickly.
		DialTimeout:  2 * time.Second,
		ReadTimeout:  2 * time.Second,
		WriteTimeout: 2 * time.Second,
	})
	defer client.Close()
	store, err := redisnx.New(client, redisnx.Options{FailoverWait: 3 * time.Second})
	if err != nil {
		fmt.Println(err)
		return
	}
	_ = store // Claim, Complete and Release as with a single Redis.
}
