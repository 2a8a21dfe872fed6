package pgoutbox_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestMain runs the tests under a goroutine leak check. When the test binary
// is started as a relay child process (childEnv set, see child_test.go), it
// runs the relay instead of the tests.
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(runChild())
	}
	goleak.VerifyTestMain(m, testenv.LeakOptions()...)
}
