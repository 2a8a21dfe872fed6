package watermill

import (
	"bytes"
	"testing"

	"github.com/idemkit/idem/dedup"
)

// TestPayloadFingerprint: the pooled fingerprint is dedup.FingerprintOf's.
func TestPayloadFingerprint(t *testing.T) {
	for _, n := range []int{0, 1, 55, 56, 64, 1000, 1024, 5000, 64 << 10, 64<<10 + 1} {
		p := bytes.Repeat([]byte{byte(n)}, n)
		if got, want := payloadFingerprint(p), dedup.FingerprintOf(p); got != want {
			t.Errorf("%d bytes: %x, want %x", n, got, want)
		}
	}
	if payloadFingerprint(nil) != dedup.FingerprintOf(nil) {
		t.Error("nil payload")
	}
}
