package dedup_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/idemkit/idem/dedup"
)

func TestHeld(t *testing.T) {
	k := dedup.Key{Scope: "s", ID: "i"}
	for _, c := range []struct {
		err  error
		want bool
	}{
		{dedup.Duplicate(k, []byte("r")), true},
		{dedup.InFlight(k, time.Second), true},
		{dedup.Mismatch(k), true},
		{fmt.Errorf("pgtable: commit: %w", dedup.Duplicate(k, nil)), true},
		{nil, false},
		{dedup.ErrLeaseLost, false},
		{dedup.ErrInvalidKey, false},
		{dedup.ErrClosed, false},
		{context.DeadlineExceeded, false},
		{errors.New("connection refused"), false},
	} {
		if got := dedup.Held(c.err); got != c.want {
			t.Errorf("Held(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}
