package idemkafka_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestMain runs the tests under goleak, or, when the crash tests re-execute
// the test binary with childEnv set, the consumer child process instead.
//
// kafka-go and kfake need no goleak ignores: kfake's Close joins its
// goroutines, the Consumer closes its partition Readers and its dead-letter
// Writer's Transport before Run returns, and every Writer and Client the
// tests make has a Transport of its own whose idle connections are closed at
// the end (kafka-go's DefaultTransport would keep them, and its goroutines,
// alive).
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		os.Exit(childMain())
	}
	goleak.VerifyTestMain(m, testenv.LeakOptions()...)
}
