package dedup_test

import (
	"bytes"
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
