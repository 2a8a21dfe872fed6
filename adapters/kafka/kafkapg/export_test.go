package kafkapg

import (
	"context"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/pgtx"
)

// ClaimRange is OffsetsOnly's claim of a batch, for tests that run it
// without a Consumer: it returns the transaction holding pos's partition
// position and the offset from which the records before pos.Offset are
// not done.
func ClaimRange(ctx context.Context, o *Offsets, db pgtable.DB, pos idemkafka.Position, first int64) (*pgtx.Tx, int64, error) {
	return o.claimRange(ctx, db, pos, first)
}
