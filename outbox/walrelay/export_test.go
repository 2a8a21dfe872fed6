package walrelay

import "github.com/idemkit/idem/outbox"

// Test seams.

// ErrBatchNeedsMessages is what QueueEnqueue returns for SourceTable.
var ErrBatchNeedsMessages = errBatchNeedsMessages

// SetOnStreaming makes r call f each time it starts streaming its slot.
func SetOnStreaming(r *Relay, f func()) { r.hooks.streaming = f }

// SetOnSlotBusy makes r call f each time it finds its slot streamed by
// another relay.
func SetOnSlotBusy(r *Relay, f func()) { r.hooks.slotBusy = f }

// SetAfterPublish makes r call f after each Publish returned, before the
// outcome is recorded and the position confirmed.
func SetAfterPublish(r *Relay, f func(msgs []*outbox.Message, err error)) { r.hooks.afterPublish = f }

// SetBeforeCommit makes r's reader call f after it handed a transaction's
// messages to the publishing side and before it hands the commit.
func SetBeforeCommit(r *Relay, f func()) { r.hooks.beforeCommit = f }
