package main

import (
	"context"
	"io"
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m, testenv.LeakOptions()...) }

// TestExample runs the example against the local PostgreSQL, in a fresh
// schema: every order charged once, one receipt and one email each, the
// forged message poisoned, the failed charge retried.
func TestExample(t *testing.T) {
	pool := testenv.Pool(t, 1) // skips, or fails under CI=true, when PostgreSQL is down
	pool.Close()
	out := io.Discard
	if testing.Verbose() {
		out = os.Stdout
	}
	const orders = 5
	sum, err := run(context.Background(), config{postgres: testenv.PostgresURL(), schema: testenv.Name("idem_example_wm"), orders: orders}, out)
	if err != nil {
		t.Fatal(err)
	}
	t.Log(sum)
	want := summary{
		Orders: orders, Published: 2*orders + 1,
		Charges: orders, Receipts: orders, Emails: orders,
		Poisoned: 1, PoisonReason: "fingerprint_mismatch",
		Failed: 1,
	}
	got := sum
	got.ChargeAttempts = 0 // checked below
	got.Duplicates = 0     // at least one per order; an ack cut short by the stop adds one
	if got != want {
		t.Errorf("summary:\n got %+v\nwant %+v", got, want)
	}
	if sum.Duplicates < orders {
		t.Errorf("%d duplicates dropped, want at least %d (each order was published twice)", sum.Duplicates, orders)
	}
	if sum.ChargeAttempts != orders+1 {
		t.Errorf("charge ran %d times, want %d (each order once, plus the retry of the failed one)", sum.ChargeAttempts, orders+1)
	}
}
