package dedup_test

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"github.com/idemkit/idem/dedup"
)

func TestKeyNeverPrintsRaw(t *testing.T) {
	k := dedup.Key{Scope: "billing/charge", ID: "alice@example.com"}
	var buf bytes.Buffer
	log := slog.New(slog.NewJSONHandler(&buf, nil))
	log.Info("claimed", "key", k)
	err := fmt.Errorf("claim %s: %w", k, dedup.ErrDuplicate)
	for _, out := range []string{buf.String(), err.Error(), k.String(), fmt.Sprint(k)} {
		if strings.Contains(out, "alice") {
			t.Errorf("raw id in %q", out)
		}
		if !strings.Contains(out, k.Hash()) {
			t.Errorf("hash %s missing from %q", k.Hash(), out)
		}
	}
	if got, want := k.Hash(), dedup.HashKey("billing/charge", "alice@example.com"); got != want || len(got) != 16 {
		t.Fatalf("Hash %q, HashKey %q", got, want)
	}
	// Scope and id are separated: moving a byte across the boundary changes the hash.
	if dedup.HashKey("ab", "c") == dedup.HashKey("a", "bc") {
		t.Fatal("hash ignores the scope/id boundary")
	}
}

// TestFingerprintFraming pins FingerprintOf to its definition, SHA-256 over
// each part prefixed with its length as 8 little-endian bytes, for parts of
// many sizes and a reused (pooled) digest: stored fingerprints must not
// change with the implementation.
func TestFingerprintFraming(t *testing.T) {
	for _, sizes := range [][]int{{}, {0}, {1}, {31}, {248}, {249}, {120, 120}, {120, 121}, {4096}, {0, 0, 3}} {
		var parts [][]byte
		var framed []byte
		for i, n := range sizes {
			p := bytes.Repeat([]byte{byte('a' + i)}, n)
			parts = append(parts, p)
			var l [8]byte
			for j := range l {
				l[j] = byte(uint64(n) >> (8 * j))
			}
			framed = append(append(framed, l[:]...), p...)
		}
		if got, want := dedup.FingerprintOf(parts...), dedup.Fingerprint(sha256.Sum256(framed)); got != want {
			t.Errorf("sizes %v: FingerprintOf %x, want %x", sizes, got, want)
		}
	}
	if dedup.FingerprintOf([]byte("ab"), []byte("c")) == dedup.FingerprintOf([]byte("a"), []byte("bc")) {
		t.Fatal("the parts' boundary does not count")
	}
}

// TestDigest: a key's digest is the first 16 bytes of SHA-256(scope, 0x00,
// id), whose first 8 are Key.Hash.
func TestDigest(t *testing.T) {
	k := dedup.Key{Scope: "billing/charge", ID: "p-1"}
	sum := sha256.Sum256([]byte("billing/charge\x00p-1"))
	if d := k.Digest(); !bytes.Equal(d[:], sum[:16]) || d.Hash() != k.Hash() {
		t.Fatalf("Digest %s, want %x with Hash %s", d, sum[:16], k.Hash())
	}
	for _, in := range []string{"", "zz", k.Hash(), strings.Repeat("g", 32), k.Digest().String() + "00"} {
		if _, err := dedup.ParseDigest(in); err == nil {
			t.Errorf("ParseDigest(%q) = nil error", in)
		}
	}
	if d, err := dedup.ParseDigest(strings.ToUpper(k.Digest().String())); err != nil || d != k.Digest() {
		t.Errorf("ParseDigest of upper-case hex = %s, %v", d, err)
	}
	var st dedup.KeyState
	if st.Held() || st.Status.String() != "absent" {
		t.Errorf("zero KeyState: held %v, status %s", st.Held(), st.Status)
	}
	st = dedup.KeyState{Status: dedup.KeyDone, Expired: true}
	if st.Held() {
		t.Error("an expired done key is held")
	}
}
