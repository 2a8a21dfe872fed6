package outbox_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/idemkit/idem/outbox"
)

// nackSecond is a Publisher that confirms every message but the second.
type nackSecond struct{}

func (nackSecond) Publish(_ context.Context, msgs []*outbox.Message) error {
	if len(msgs) < 2 {
		return nil
	}
	return &outbox.PublishError{Failed: map[int]error{1: errors.New("nacked")}}
}

// A publisher reports the messages it could not publish by their index in
// the batch; the relay retries those and marks the others published.
func ExamplePublishError() {
	var p outbox.Publisher = nackSecond{}
	batch := []*outbox.Message{{ID: "a"}, {ID: "b"}, {ID: "c"}}
	err := p.Publish(context.Background(), batch)
	var pe *outbox.PublishError
	if errors.As(err, &pe) {
		for i, m := range batch {
			if cause, failed := pe.Failed[i]; failed {
				fmt.Println(m.ID, "retry:", cause)
			} else {
				fmt.Println(m.ID, "published")
			}
		}
	}
	// Output:
	// a published
	// b retry: nacked
	// c published
}
