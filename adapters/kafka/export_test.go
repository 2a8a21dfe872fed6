package idemkafka

import (
	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemkit/idem/consumer"
)

// Test seams for package kafka_test.

// SetAfterEffect sets a function called when the handler acknowledged a
// record, before the record is marked done. Call before Run.
func SetAfterEffect(c *Consumer, f func(msg *consumer.Message)) { c.hooks.afterEffect = f }

// SetCommitHooks sets functions called around each offset commit. Call
// before Run.
func SetCommitHooks(c *Consumer, before, after func(offsets map[string]map[int]int64)) {
	c.hooks.beforeCommit, c.hooks.afterCommit = before, after
}

// SetQueued sets a function called when a fetched record was handed to the
// workers (several workers, or a BatchHandler). Call before Run.
func SetQueued(c *Consumer, f func(km *kafkago.Message)) { c.hooks.queued = f }
