package adaptertest_test

import (
	"fmt"
	"testing"

	"github.com/idemkit/idem/adapters/adaptertest"
)

// Run names each case as a subtest, in this order, so one case runs alone
// with go test -run 'TestConformance/DeadLetter'.
func ExampleCases() {
	for _, c := range adaptertest.Cases() {
		fmt.Println(c)
	}
	// Output:
	// AckRule
	// Duplicate
	// TransientRetry
	// DeadLetter
	// DeadLetterResent
	// Order
	// GracefulStop
	// Reconnect
	// StoreDown
}

// A harness whose broker lives in the test process (an in-process pub/sub)
// cannot survive the SIGKILL of a consumer process, and has no connection
// to cut: it declares those cases unsupported, with the reason the skipped
// subtests print, and says what order the broker keeps. The adapter's test
// is then one line.
func ExampleCapabilities() {
	caps := adaptertest.Capabilities{
		Ordering: adaptertest.OrderPerDestination,
		Unsupported: map[adaptertest.Case]string{
			adaptertest.CaseAckRule:          "the pub/sub lives in the test process: a killed consumer process takes it along",
			adaptertest.CaseDeadLetterResent: "the pub/sub lives in the test process: a killed consumer process takes it along",
			adaptertest.CaseReconnect:        "an in-process pub/sub has no connection to lose",
		},
	}
	for _, c := range adaptertest.Cases() {
		if why, ok := caps.Unsupported[c]; ok {
			fmt.Printf("%s: skipped: %s\n", c, why)
		}
	}
	fmt.Println("order:", caps.Ordering)
	// In the adapter's _test.go file, with h its Harness:
	_ = func(t *testing.T, h adaptertest.Harness) { adaptertest.Run(t, h) }
	// Output:
	// AckRule: skipped: the pub/sub lives in the test process: a killed consumer process takes it along
	// DeadLetterResent: skipped: the pub/sub lives in the test process: a killed consumer process takes it along
	// Reconnect: skipped: an in-process pub/sub has no connection to lose
	// order: per destination
}
