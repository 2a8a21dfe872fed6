package dedup_test

import (
	"errors"
	"fmt"
	"time"

	"github.com/idemkit/idem/dedup"
)

// A key names who processes a message (the scope) and which message it is
// (the producer's id). Stores validate keys before they touch the backend;
// a bad key is refused with an error that wraps ErrInvalidKey and names the
// part at fault.
func ExampleKey_Validate() {
	payload := []byte(`{"order":"A-1","amount":100}`)
	good := dedup.NewKey("billing-consumer/charge", "order-A-1", payload)
	// A key prints as its hash, so logs and errors never hold the raw id.
	fmt.Println(good.Scope+"/"+good.ID, good, good.Validate())

	for _, k := range []dedup.Key{
		{Scope: "billing-consumer/charge", ID: ""},           // header missing
		{Scope: "billing-consumer/charge", ID: "order\nA-1"}, // control byte
		{Scope: "", ID: "order-A-1"},                         // no scope
	} {
		err := k.Validate()
		fmt.Println(errors.Is(err, dedup.ErrInvalidKey), err)
	}
	// Output:
	// billing-consumer/charge/order-A-1 #4d142f57c24bd397 <nil>
	// true dedup: invalid key: id is empty
	// true dedup: invalid key: id has control byte 0xa at offset 5
	// true dedup: invalid key: scope is empty
}

// FingerprintOf hashes a message's content so that a reused id with other
// content is caught as a conflict. Each part is length-prefixed, so moving a
// byte from one part to the next changes the fingerprint.
func ExampleFingerprintOf() {
	body := []byte(`{"amount":100}`)
	first := dedup.FingerprintOf([]byte("POST"), []byte("/payments"), body)
	retry := dedup.FingerprintOf([]byte("POST"), []byte("/payments"), body)
	other := dedup.FingerprintOf([]byte("POST"), []byte("/payments"), []byte(`{"amount":900}`))
	fmt.Println("retry matches:", retry.Matches(first))
	fmt.Println("other body matches:", other.Matches(first))

	fmt.Println("parts are delimited:", dedup.FingerprintOf([]byte("ab"), []byte("c")) != dedup.FingerprintOf([]byte("a"), []byte("bc")))

	// The zero fingerprint means "not known" and matches anything.
	var none dedup.Fingerprint
	fmt.Println("zero:", none.IsZero(), none.Matches(first))
	fmt.Println("hex digits:", len(first.String()))
	// Output:
	// retry matches: true
	// other body matches: false
	// parts are delimited: true
	// zero: true true
	// hex digits: 64
}

// A claim that does not win returns a *ClaimError. errors.Is sees through it
// (and through any wrapping) to the sentinel; StoredResult hands back what
// the first owner stored, so a duplicate can be answered with the original
// result.
func ExampleStoredResult() {
	key := dedup.NewKey("billing-consumer/charge", "order-A-1", []byte(`{"amount":100}`))

	// What a store returns for a completed key, wrapped by a caller.
	err := fmt.Errorf("handle delivery: %w", &dedup.ClaimError{Err: dedup.ErrDuplicate, Key: key, Result: []byte("charged ch_42")})
	fmt.Println(err)
	fmt.Println("duplicate:", errors.Is(err, dedup.ErrDuplicate))
	if result, ok := dedup.StoredResult(err); ok {
		fmt.Printf("stored result: %s\n", result)
	}

	// Another owner holds the lease: retry later, after RetryAfter.
	err = &dedup.ClaimError{Err: dedup.ErrInFlight, Key: key, RetryAfter: 12 * time.Second}
	var ce *dedup.ClaimError
	if errors.As(err, &ce) && errors.Is(err, dedup.ErrInFlight) {
		fmt.Println("in flight, retry after", ce.RetryAfter)
	}
	_, ok := dedup.StoredResult(err)
	fmt.Println("in flight is a duplicate:", ok)

	// Same key, different content: never processed, dead-lettered.
	err = &dedup.ClaimError{Err: dedup.ErrFingerprintMismatch, Key: key}
	fmt.Println("mismatch:", errors.Is(err, dedup.ErrFingerprintMismatch))
	// Output:
	// handle delivery: dedup: duplicate: already processed (key #4d142f57c24bd397)
	// duplicate: true
	// stored result: charged ch_42
	// in flight, retry after 12s
	// in flight is a duplicate: false
	// mismatch: true
}

// A store finds a key by its digest, and logs show the digest's first half
// as the key's Hash, so a log line can be matched to a row or a Redis key.
// ParseDigest reads a digest back, as pgtable's key column prints it (a
// uuid) or as plain hex.
func ExampleDigestOf() {
	k := dedup.Key{Scope: "billing-consumer/charge", ID: "order-A-1"}
	d := k.Digest()
	fmt.Println(d.Hash() == k.Hash(), len(d.String()))
	u := d.String()
	back, err := dedup.ParseDigest(u[:8] + "-" + u[8:12] + "-" + u[12:16] + "-" + u[16:20] + "-" + u[20:])
	fmt.Println(back == d, err)
	_, err = dedup.ParseDigest(k.Hash())
	fmt.Println(err != nil)
	// Output:
	// true 32
	// true <nil>
	// true
}
