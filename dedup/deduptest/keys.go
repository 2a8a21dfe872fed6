package deduptest

import (
	"errors"
	"strings"
	"testing"

	"github.com/idemkit/idem/dedup"
)

// invalidKeys are keys every store must refuse with dedup.ErrInvalidKey.
func invalidKeys() map[string]dedup.Key {
	return map[string]dedup.Key{
		"empty id":        {Scope: "s", ID: ""},
		"empty scope":     {Scope: "", ID: "x"},
		"oversized id":    {Scope: "s", ID: strings.Repeat("a", dedup.DefaultMaxKeyLen+1)},
		"oversized scope": {Scope: strings.Repeat("s", dedup.DefaultMaxKeyLen+1), ID: "x"},
		"NUL byte":        {Scope: "s", ID: "a\x00b"},
		"newline":         {Scope: "s", ID: "a\nb"},
		"DEL byte":        {Scope: "s", ID: "a\x7fb"},
		"C1 control":      {Scope: "s", ID: "a\u0085b"},
		"invalid UTF-8":   {Scope: "s", ID: "a\xffb"},
		"control scope":   {Scope: "s\r", ID: "x"},
	}
}

// testLeaseInvalidKeys: bad keys are refused, nothing is stored, nothing
// panics; a key of exactly the limit is fine.
func testLeaseInvalidKeys(t *testing.T, h LeaseHarness) {
	inst := h.New(t, longConfig())
	ctx := testCtx(t)
	for name, k := range invalidKeys() {
		l, err := inst.Store.Claim(ctx, k)
		if !errors.Is(err, dedup.ErrInvalidKey) || l != nil {
			t.Errorf("%s: Claim = (%v, %v), want ErrInvalidKey and no lease", name, l, err)
		}
	}
	full := dedup.Key{Scope: uniqueID("s"), ID: uniqueID("x")}
	full.ID += strings.Repeat("a", dedup.DefaultMaxKeyLen-len(full.ID))
	l, err := inst.Store.Claim(ctx, full)
	if err != nil {
		t.Fatalf("key of exactly %d bytes: %v", dedup.DefaultMaxKeyLen, err)
	}
	if err := inst.Store.Release(ctx, l); err != nil {
		t.Fatalf("Release: %v", err)
	}
	unicodeKey := dedup.Key{Scope: uniqueID("s"), ID: uniqueID("заказ-订单")}
	l, err = inst.Store.Claim(ctx, unicodeKey)
	if err != nil {
		t.Fatalf("printable UTF-8 key: %v", err)
	}
	if err := inst.Store.Release(ctx, l); err != nil {
		t.Fatalf("Release: %v", err)
	}
}
