package idemkafka

import (
	"context"
	"fmt"
	"sort"
	"strings"

	"github.com/idemkit/idem/consumer"
)

// BatchHandler handles several records of one partition at once, in offset
// order: typically in one database transaction, with one batch claim
// (kafkapg.Batch, or kafkapg.BatchAll for one handler call per batch).
// NewBatchConsumer runs it.
//
// It returns nil when every message is done (its effect committed, or it
// was a duplicate). A *BatchError reports per-message outcomes of a batch
// that otherwise committed. Any other error means nothing of the batch
// committed: the Consumer then hands the messages over again one at a time,
// in order, so that one poison message is isolated and dead-lettered without
// holding the others back.
type BatchHandler func(ctx context.Context, msgs []*consumer.Message) error

// BatchError reports the outcome of some messages of a batch whose other
// messages are done. Errs maps an index in the batch to that message's error,
// which the Consumer classifies like a single handler's (consumer.Decide): a
// duplicate is acknowledged, a poison message dead-lettered, any other error
// retried for that message alone. Messages without an entry, or with a nil
// one, are done.
type BatchError struct {
	Errs map[int]error
}

func (e *BatchError) Error() string {
	idx := make([]int, 0, len(e.Errs))
	for i, err := range e.Errs {
		if err != nil {
			idx = append(idx, i)
		}
	}
	sort.Ints(idx)
	parts := make([]string, 0, len(idx))
	for _, i := range idx {
		parts = append(parts, fmt.Sprintf("#%d: %v", i, e.Errs[i]))
	}
	return fmt.Sprintf("kafka: %d messages of the batch not done: %s", len(idx), strings.Join(parts, "; "))
}
