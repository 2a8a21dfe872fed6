package idemnats

import (
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestMain runs the package's tests under a goroutine leak check. When the
// test binary is started as a consumer child process (childEnv set, see
// child_test.go), it runs the worker instead of the tests.
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(runChild())
	}
	goleak.VerifyTestMain(m, testenv.LeakOptions()...)
}
