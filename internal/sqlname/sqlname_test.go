package sqlname

import "testing"

func TestCheck(t *testing.T) {
	for _, ok := range []string{"processed_events", "_x", "a1", "idem_outbox_v2"} {
		if err := Check("Table", ok); err != nil {
			t.Errorf("Check(%q) = %v", ok, err)
		}
	}
	for _, bad := range []string{"", "events; drop table x", "Events", "1abc", `a"b`, "a-b", "a.b", "ä", "a b",
		"x23456789012345678901234567890123456789012345678901234567890abcd"} {
		if err := Check("Table", bad); err == nil {
			t.Errorf("Check(%q) accepted", bad)
		}
	}
}

func FuzzCheckQuote(f *testing.F) {
	f.Add("processed_events")
	f.Add(`x"; drop table y; --`)
	f.Fuzz(func(t *testing.T, s string) {
		if Check("T", s) != nil {
			return
		}
		q := Quote(s)
		if q != `"`+s+`"` {
			t.Fatalf("an allowed name needed escaping: %q", s)
		}
	})
}
