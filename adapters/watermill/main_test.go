package idemwatermill_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestMain checks for leaked goroutines with idem's usual options, plus one
// ignore Watermill needs: the stock middleware.NewMapExpiringKeyRepository
// starts a cleanup goroutine on context.Background() that nothing can stop
// (watermill v1.5.1, message/router/middleware/deduplicator.go). The tests
// that show the Deduplicator's dropped retry create such repositories.
func TestMain(m *testing.M) {
	opts := append(testenv.LeakOptions(),
		goleak.IgnoreAnyFunction("github.com/ThreeDotsLabs/watermill/message/router/middleware.(*mapExpiringKeyRepository).cleanOutLoop"),
	)
	goleak.VerifyTestMain(m, opts...)
}
