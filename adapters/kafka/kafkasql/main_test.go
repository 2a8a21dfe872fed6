package kafkasql_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestMain runs the tests under goleak or, when the crash test re-executes
// the test binary with childEnv set, the consumer child process instead.
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(childMain())
	}
	goleak.VerifyTestMain(m, testenv.LeakOptions()...)
}
