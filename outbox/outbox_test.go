package outbox_test

import (
	"errors"
	"testing"

	"go.uber.org/goleak"

	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m, testenv.LeakOptions()...) }

func TestPublishError(t *testing.T) {
	err := error(&outbox.PublishError{Failed: map[int]error{3: errors.New("c"), 1: errors.New("a")}})
	if got, want := err.Error(), "outbox: 2 of the batch not confirmed: #1: a; #3: c"; got != want {
		t.Fatalf("Error() = %q, want %q", got, want)
	}
	var pe *outbox.PublishError
	if !errors.As(err, &pe) || len(pe.Failed) != 2 {
		t.Fatal("errors.As")
	}
}
