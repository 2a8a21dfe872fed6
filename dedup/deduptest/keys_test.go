package deduptest

import (
	"errors"
	"testing"

	"github.com/idemkit/idem/dedup"
)

// TestInvalidKeys: every key of the suite's invalid-key list is refused by
// dedup.ValidateKey with dedup.ErrInvalidKey, so a store that refuses it
// agrees with the key model.
func TestInvalidKeys(t *testing.T) {
	keys := invalidKeys()
	if len(keys) != 10 {
		t.Fatalf("%d invalid keys, want 10", len(keys))
	}
	for name, k := range keys {
		if err := dedup.ValidateKey(k, 0); !errors.Is(err, dedup.ErrInvalidKey) {
			t.Errorf("%s: ValidateKey = %v, want ErrInvalidKey", name, err)
		}
	}
}
