package sqloutbox

import (
	"database/sql"

	"github.com/idemkit/idem/outbox"
)

// Test seams.

// SetAfterPublish makes r call f after each Publish returned and before the
// batch's rows are marked, with the claim's transaction (nil on SQLite).
func SetAfterPublish(r *Relay, f func(tx *sql.Tx, msgs []*outbox.Message, err error)) {
	r.hooks.afterPublish = f
}

// SetAfterCleanupBatch makes o call f with the rows each cleanup statement
// deleted.
func SetAfterCleanupBatch(o *Outbox, f func(n int64)) { o.afterCleanupBatch = f }
