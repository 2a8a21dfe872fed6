package pgoutbox

import "github.com/idemkit/idem/outbox"

// Test seams.

// SetAfterPublish makes r call f after each Publish returned and before the
// batch's rows are marked.
func SetAfterPublish(r *Relay, f func(msgs []*outbox.Message, err error)) { r.hooks.afterPublish = f }

// SetOnConnect makes r call f with the backend pid of each connection its
// sessions open.
func SetOnConnect(r *Relay, f func(pid uint32)) { r.hooks.connected = f }

// SetOnIdle makes r call f each time a session starts waiting for a
// notification.
func SetOnIdle(r *Relay, f func()) { r.hooks.idle = f }

// RelayNS is the advisory lock namespace (classid in pg_locks) of o's relays.
func RelayNS(o *Outbox) int32 { return o.relayNS }
