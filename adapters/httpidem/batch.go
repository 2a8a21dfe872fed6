package httpidem

import (
	"context"
	"slices"
	"sync"
	"time"

	"github.com/idemkit/idem/dedup"
)

// maxBatch bounds the keys of one batched claim.
const maxBatch = 128

// batcher groups concurrent claims into one dedup.BatchLeaseStore.ClaimBatch
// (one round trip to Redis for many requests), the way a database groups
// commits: at most lanes claims (single or batched) are in flight at a time;
// a claim that arrives while all lanes are busy waits, and when a lane frees
// up, everything that waited goes out together. No claim waits for a timer:
// at low load each claim goes out at once, alone. No goroutine is started:
// one of the waiting requests sends the batch.
type batcher struct {
	store   dedup.BatchLeaseStore
	lanes   int
	timeout time.Duration

	mu    sync.Mutex
	busy  int
	queue []*pendingClaim
}

type pendingClaim struct {
	key   dedup.Key
	lease *dedup.Lease
	err   error
	// wake is closed when the result is in, or when this claim must send
	// lead, a batch that includes itself.
	wake chan struct{}
	lead []*pendingClaim
}

func (b *batcher) claim(ctx context.Context, key dedup.Key) (*dedup.Lease, error) {
	b.mu.Lock()
	if b.busy < b.lanes {
		b.busy++
		b.mu.Unlock()
		lease, err := b.store.Claim(ctx, key)
		b.next()
		return lease, err
	}
	p := &pendingClaim{key: key, wake: make(chan struct{})}
	b.queue = append(b.queue, p)
	b.mu.Unlock()
	<-p.wake
	if p.lead != nil {
		b.send(p.lead)
		b.next()
	}
	return p.lease, p.err
}

// next frees the caller's lane, or hands it to the waiting claims.
func (b *batcher) next() {
	b.mu.Lock()
	if len(b.queue) == 0 {
		b.busy--
		b.mu.Unlock()
		return
	}
	n := min(len(b.queue), maxBatch)
	batch := b.queue[:n:n]
	b.queue = append([]*pendingClaim(nil), b.queue[n:]...)
	b.mu.Unlock()
	batch[0].lead = batch
	close(batch[0].wake)
}

// send claims the batch's keys and wakes the others in it. The batch is
// not any one request's: it runs detached from their contexts, bounded by
// the timeout.
func (b *batcher) send(batch []*pendingClaim) {
	ctx, cancel := context.WithTimeout(context.Background(), b.timeout)
	defer cancel()
	if len(batch) == 1 {
		batch[0].lease, batch[0].err = b.store.Claim(ctx, batch[0].key)
		return
	}
	// A key repeated in the batch (a retry storm on one key) is sent once:
	// its copies get what claims sent one after the other would have got,
	// the same duplicate or mismatch, or "in flight" when the first copy
	// won the lease.
	keys, slot := distinctKeys(batch)
	var (
		res []dedup.BatchResult
		err error
	)
	if len(keys) == 1 {
		// One key, maybe many copies (the replays of one hot key): a
		// plain claim gives the same answer at a lower cost.
		lease, cerr := b.store.Claim(ctx, keys[0])
		res = []dedup.BatchResult{{Lease: lease, Err: cerr}}
	} else {
		res, err = b.store.ClaimBatch(ctx, keys)
	}
	for i, p := range batch {
		j := slot[i]
		switch {
		case err != nil:
			p.err = err
		case j >= len(res):
			// A store that answered fewer results than keys: the
			// middleware answers "neither a lease nor an error".
		case res[j].Lease != nil && slices.Index(slot, j) != i:
			// A later copy of the key whose first copy got the lease.
			p.err = dedup.InFlight(p.key, res[j].Lease.TTL)
		case res[j].Lease != nil:
			p.lease = res[j].Lease
		default:
			p.err = res[j].Err
		}
		if i > 0 {
			close(p.wake)
		}
	}
}

// smallBatch is the batch size up to which distinctKeys finds copies by a
// scan, cheaper than a map there.
const smallBatch = 16

// distinctKeys returns the batch's keys without copies, in the order of
// their first copy, and for each claim of the batch the index of its key.
func distinctKeys(batch []*pendingClaim) ([]dedup.Key, []int) {
	keys := make([]dedup.Key, 0, len(batch))
	slot := make([]int, len(batch))
	var first map[dedup.Key]int
	if len(batch) > smallBatch {
		first = make(map[dedup.Key]int, len(batch))
	}
	for i, p := range batch {
		j := -1
		if first == nil {
			j = slices.Index(keys, p.key)
		} else if k, seen := first[p.key]; seen {
			j = k
		}
		if j < 0 {
			j = len(keys)
			keys = append(keys, p.key)
			if first != nil {
				first[p.key] = j
			}
		}
		slot[i] = j
	}
	return keys, slot
}
