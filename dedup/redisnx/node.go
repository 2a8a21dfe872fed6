package redisnx

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// failoverRetryEvery is the pause between two tries of a call that could
// not reach its Redis Cluster node (the slot map is reloaded meanwhile).
const failoverRetryEvery = 100 * time.Millisecond

// nodeIdle is how long a cluster master's groups outlive their last use,
// and how often the Store looks for groups to drop.
const nodeIdle = time.Minute

// pruneTimeout bounds a look at the cluster's topology. The look runs
// beside the calls, never in their way: the node it asks may be the one
// that is down.
const pruneTimeout = 10 * time.Second

// node coalesces the concurrent claims and token scripts of the keys of
// one Redis node into shared pipelines (see group): a claim and another
// caller's Complete can share a round trip. Grouping per node keeps a node
// that is down or slow from delaying the keys of the others.
type node struct {
	ops  *group[nodeOp]
	used time.Time // the last nodeOf that returned it; under Store.nodesMu
}

// busy reports whether a batch of the node is in flight.
func (n *node) busy() bool { return n.ops.busy() }

// nodeOp is one item of a node's batch: a claim or a token script.
type nodeOp struct {
	claim *claimOp
	call  *scriptCall
}

// cmd is the item's command (the claim's SET NX GET or script), nil
// before it is sent.
func (o nodeOp) cmd() *redis.Cmd {
	if o.claim != nil {
		return o.claim.cmd
	}
	return o.call.cmd
}

func (s *Store) newNode() *node {
	return &node{
		ops: &group[nodeOp]{
			run: func(ctx context.Context, ops []nodeOp) error {
				return retryFailover(ctx, s, ops, s.runOps, nodeOp.resend)
			},
			errOf: func(ops []nodeOp, batchErr error) error {
				for _, o := range ops {
					if err := transportErr(o.cmd(), batchErr); err != nil {
						return err
					}
				}
				return nil
			},
		},
	}
}

// resend reports whether the item may be sent again after its batch failed
// with batchErr (see retryFailover): when it got no answer, and it is a
// claim or a script that may run twice, or it never left the client.
func (o nodeOp) resend(batchErr error) bool {
	err := transportErr(o.cmd(), batchErr)
	return err != nil && (o.call == nil || !o.call.script.once || unsent(err))
}

// nodeOps wraps claims as items of a node's batch.
func nodeOps(claims []*claimOp) []nodeOp {
	ops := make([]nodeOp, len(claims))
	for i, op := range claims {
		ops[i].claim = op
	}
	return ops
}

// runOps sends the token scripts and the claims of ops in one pipeline (one
// round trip), then finishes each kind as runScripts and claimAll do. It
// returns an error only when Redis could not be reached.
func (s *Store) runOps(ctx context.Context, ops []nodeOp) error {
	var claims []*claimOp
	var calls []*scriptCall
	for _, o := range ops {
		if o.claim != nil {
			claims = append(claims, o.claim)
		} else {
			calls = append(calls, o.call)
		}
	}
	switch {
	case len(calls) == 0:
		return s.claimAll(ctx, claims, false)
	case len(claims) == 0:
		return s.runScripts(ctx, calls, false)
	}
	legacy := s.legacy.Load()
	// The scripts first: their replies are never nil (see send).
	_, _ = s.client.Pipelined(ctx, func(p redis.Pipeliner) error {
		for _, c := range calls {
			c.issue(ctx, p, false)
		}
		for _, op := range claims {
			s.send(ctx, p, op, legacy)
		}
		return nil
	})
	err := s.runScripts(ctx, calls, true)
	if cerr := s.claimAll(ctx, claims, true); err == nil {
		err = cerr
	}
	return err
}

// nodeOf returns the groups of the node that holds rkey: the one group of a
// client that is not a cluster client, else the groups of the key's master
// in the client's slot map.
func (s *Store) nodeOf(ctx context.Context, rkey string) (*node, error) {
	if s.cluster == nil {
		return s.single, nil
	}
	master, err := s.cluster.MasterForKey(ctx, rkey)
	if err != nil {
		s.cluster.ReloadState(ctx)
		return nil, err
	}
	addr := master.Options().Addr
	now := s.now()
	s.nodesMu.Lock()
	n := s.nodes[addr]
	if n == nil {
		n = s.newNode()
		s.nodes[addr] = n
	}
	n.used = now
	prune := !now.Before(s.pruneAt)
	if prune {
		s.pruneAt = now.Add(nodeIdle)
	}
	s.nodesMu.Unlock()
	if prune {
		// In its own goroutine, which ends within pruneTimeout: the
		// CLUSTER SLOTS it sends may go to a frozen or dead node, and the
		// call that happened to start the look must not wait for it.
		if s.pruning.CompareAndSwap(false, true) {
			go s.pruneNodes(context.WithoutCancel(ctx), now)
		}
	}
	return n, nil
}

// pruneNodes drops the groups of the addresses that are no longer masters
// in the cluster's topology (a failed-over or removed node: one CLUSTER
// SLOTS, as the client reloads its slot map), and of the masters that no
// call used for nodeIdle and that have no batch in flight. A caller that
// still holds a dropped node's groups finishes with them; the next call
// for that address starts new ones.
func (s *Store) pruneNodes(ctx context.Context, now time.Time) {
	if s.pruned != nil {
		defer s.pruned() // after the flag below is cleared
	}
	defer s.pruning.Store(false)
	ctx, cancel := context.WithTimeout(ctx, pruneTimeout)
	defer cancel()
	var mu sync.Mutex
	masters := map[string]bool{}
	err := s.cluster.ForEachMaster(ctx, func(_ context.Context, c *redis.Client) error {
		mu.Lock()
		masters[c.Options().Addr] = true
		mu.Unlock()
		return nil
	})
	s.nodesMu.Lock()
	defer s.nodesMu.Unlock()
	for addr, n := range s.nodes {
		gone := err == nil && !masters[addr]
		idle := now.Sub(n.used) >= nodeIdle && !n.busy()
		if gone || idle {
			delete(s.nodes, addr)
		}
	}
}

// retryFailover runs items through run and, on a Redis Cluster, tries the
// items that could not reach their node again (see Options.FailoverWait):
// it asks the client to reload its slot map, waits a moment and sends them
// again, until they get answers, FailoverWait has passed or ctx ends. An
// item answered once is never sent again, nor is one that resend refuses
// (a complete or release that may have run: a second run would answer
// "lease lost" to its owner). Resending a claim is safe: the claim finds
// its own token and is granted (see result).
func retryFailover[T any](ctx context.Context, s *Store, items []T, run func(context.Context, []T) error, resend func(T, error) bool) error {
	err := run(ctx, items)
	if err == nil || s.cluster == nil || !retryable(err) {
		return err
	}
	var deadline time.Time
	for {
		s.cluster.ReloadState(ctx)
		if deadline.IsZero() {
			deadline = time.Now().Add(s.failoverWait)
		}
		var todo []T
		for _, it := range items {
			if resend(it, err) {
				todo = append(todo, it)
			}
		}
		if len(todo) == 0 || time.Until(deadline) < failoverRetryEvery {
			return err
		}
		t := time.NewTimer(failoverRetryEvery)
		select {
		case <-ctx.Done():
			t.Stop()
			return err
		case <-t.C:
		}
		items = todo
		if err = run(ctx, items); err == nil || !retryable(err) {
			return err
		}
	}
}

// retryable reports whether err is a failure to reach a Redis node that a
// new slot map may cure: not a context's end, nor a closed client.
func retryable(err error) bool {
	return !errors.Is(err, context.Canceled) && !errors.Is(err, context.DeadlineExceeded) &&
		!errors.Is(err, redis.ErrClosed) && !isReplyError(err)
}

// transportErr is the error of one command of a batch that failed with
// batchErr: batchErr when the command was never sent, the command's own
// error when it did not get an answer, nil when Redis answered it (the
// answer, an error reply included, is the command's result).
func transportErr(cmd *redis.Cmd, batchErr error) error {
	if cmd == nil {
		return batchErr
	}
	if err := cmd.Err(); err != nil && !errors.Is(err, redis.Nil) && !isReplyError(err) {
		return err
	}
	return nil
}

// isReplyError reports whether err is an error reply from Redis about one
// command, as opposed to a failure to reach Redis at all.
func isReplyError(err error) bool {
	var re redis.Error
	return errors.As(err, &re)
}
