package redisnx

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/dedup"
)

// claimOp is one key's claim on its way to Redis and back.
type claimOp struct {
	key   dedup.Key
	rkey  string
	token string
	rec   []byte
	// cmd is SET NX GET (reply: nil when granted, else the stored record),
	// or, when script is set, the claim script (reply: 0 when granted,
	// else {stored record, PTTL}).
	cmd    *redis.Cmd
	script bool
	// old reads the key's record in the previous layout (oldKey); when
	// there is one, it answers the claim (see claimAll).
	oldKey string
	old    *redis.SliceCmd
	// retryAfter is the PTTL of a key found in flight.
	retryAfter time.Duration
	// args holds SET NX GET's arguments: passed as a slice of it, they
	// need no allocation of their own per claim.
	args [7]any
}

func (s *Store) newClaimOp(op *claimOp, key dedup.Key) {
	op.key = key
	sum := digest(key)
	op.rkey = s.redisKey(&sum)
	if s.oldPrefix != "" {
		op.oldKey = s.oldKeyOf(key, &sum)
	}
	op.token = newToken()
	op.rec = inFlightRecord(key.Fingerprint, op.token)
}

// send issues op's commands on p: the read of the previous layout's key
// (same slot, same node), and the claim. The read is an MGET, whose reply
// is never the nil reply: a pipeline whose first reply is nil makes the
// client run its retry classification on it (errors.As through a chain of
// error types) on every round trip.
func (s *Store) send(ctx context.Context, p redis.Pipeliner, op *claimOp, legacy bool) {
	if op.oldKey != "" {
		op.old = p.MGet(ctx, op.oldKey)
	}
	op.script = legacy
	if legacy {
		op.cmd = s.claim.EvalSha(ctx, p, []string{op.rkey}, op.rec, s.leaseArg)
	} else {
		// SET NX GET: one atomic command that claims, or tells what is
		// stored. It needs Redis 7.0.
		op.args = [7]any{"set", op.rkey, op.rec, "px", s.leaseArg, "nx", "get"}
		op.cmd = p.Do(ctx, op.args[:]...)
	}
}

// granted reports whether op's claim set the key (or found it set by
// itself: the client resent the command after losing the first reply).
func (op *claimOp) granted() bool {
	if op.script {
		if n, err := op.cmd.Int64(); err == nil {
			return n == 0
		}
		arr, _ := op.cmd.Val().([]any)
		if len(arr) == 2 {
			v, _ := arr[0].(string)
			state, _, rest, ok := parseRecord(v)
			return ok && state == stateInFlight && rest == op.token
		}
		return false
	}
	v, err := op.cmd.Text()
	if errors.Is(err, redis.Nil) {
		return true
	}
	state, _, rest, ok := parseRecord(v)
	return err == nil && ok && state == stateInFlight && rest == op.token
}

// oldRecord returns the record op found under the previous layout's key.
func (op *claimOp) oldRecord() (string, bool) {
	if op.old == nil {
		return "", false
	}
	vals, err := op.old.Result()
	if err != nil || len(vals) != 1 {
		return "", false
	}
	v, ok := vals[0].(string)
	return v, ok
}

// claimAll claims the keys of ops: two commands per key (the claim and the
// read of the previous layout's key), all of them in one pipeline (one
// round trip). It returns an error only when Redis could not be reached; an
// error that Redis returns for one key stays in that op.
//
// Two answers make it send some claims again, each of which had no effect:
// a Redis older than 7.0 refuses SET NX GET as a syntax error (the store
// then uses the claim script from now on), and a server that lacks the
// script (a restart, SCRIPT FLUSH, a new cluster node) answers NOSCRIPT to
// EVALSHA (the script is then loaded).
//
// A record under the previous layout's key answers the claim; a claim that
// was granted meanwhile is released. Keys found in flight get their PTTL,
// as the RetryAfter hint. Both go in one more round trip, which only these
// cases need; the PTTL is only a hint, so a failure there leaves it at
// zero, and a failed release leaves a lease that runs out.
//
// With sent, the claims went out already (see runOps): it starts from
// their replies.
func (s *Store) claimAll(ctx context.Context, ops []*claimOp, sent bool) error {
	todo := ops
	for attempt := 0; attempt < 3 && len(todo) > 0; attempt++ {
		if attempt > 0 || !sent {
			legacy := s.legacy.Load()
			_, _ = s.client.Pipelined(ctx, func(p redis.Pipeliner) error {
				for _, op := range todo {
					s.send(ctx, p, op, legacy)
				}
				return nil
			})
		}
		var again []*claimOp
		load := false
		for _, op := range todo {
			err := op.cmd.Err()
			switch {
			case err == nil || errors.Is(err, redis.Nil):
			case !isReplyError(err):
				return err
			case !op.script && redis.HasErrorPrefix(err, "syntax error"):
				// Redis 6 answers "ERR syntax error" (HasErrorPrefix
				// trims the "ERR ").
				s.legacy.Store(true)
				again = append(again, op)
			case op.script && isNoScript(err):
				load = true
				again = append(again, op)
			}
		}
		if load {
			if err := s.claim.Load(ctx, s.client).Err(); err != nil {
				return fmt.Errorf("loading the claim script: %w", err)
			}
		}
		todo = again
	}

	type pttl struct {
		op  *claimOp
		cmd *redis.DurationCmd
	}
	var waiting []pttl
	var undo []*claimOp
	for _, op := range ops {
		if v, ok := op.oldRecord(); ok {
			if op.granted() {
				undo = append(undo, op)
			}
			if state, fp, _, ok := parseRecord(v); ok && state == stateInFlight && op.key.Fingerprint.Matches(fp) {
				waiting = append(waiting, pttl{op: op})
			}
			continue
		}
		if op.script {
			continue // the script answered the PTTL
		}
		if v, err := op.cmd.Text(); err == nil {
			if state, fp, token, ok := parseRecord(v); ok && state == stateInFlight && token != op.token && op.key.Fingerprint.Matches(fp) {
				waiting = append(waiting, pttl{op: op})
			}
		}
	}
	if len(waiting) == 0 && len(undo) == 0 {
		return nil
	}
	_, _ = s.client.Pipelined(ctx, func(p redis.Pipeliner) error {
		for i, w := range waiting {
			key := w.op.rkey
			if _, ok := w.op.oldRecord(); ok {
				key = w.op.oldKey
			}
			waiting[i].cmd = p.PTTL(ctx, key)
		}
		for _, op := range undo {
			(&scriptCall{script: s.release, key: op.rkey, args: []any{op.token}}).issue(ctx, p, true)
		}
		return nil
	})
	for _, w := range waiting {
		if d, err := w.cmd.Result(); err == nil && d > 0 {
			w.op.retryAfter = d
		}
	}
	return nil
}

// result turns op's replies into a lease or the claim error.
func (s *Store) result(op *claimOp) (*dedup.Lease, error) {
	if op.old != nil {
		if err := op.old.Err(); err != nil && !errors.Is(err, redis.Nil) {
			return nil, fmt.Errorf("redisnx: claim %s: %w", op.key, err)
		}
		if v, ok := op.oldRecord(); ok {
			return s.answer(op, v)
		}
	}
	var stored string
	if !op.script { // SET NX GET
		v, err := op.cmd.Text()
		switch {
		case errors.Is(err, redis.Nil):
			return &dedup.Lease{Key: op.key, Token: op.token, TTL: s.lease}, nil
		case err != nil:
			return nil, fmt.Errorf("redisnx: claim %s: %w", op.key, err)
		}
		stored = v
	} else {
		reply, err := op.cmd.Result()
		if err != nil {
			return nil, fmt.Errorf("redisnx: claim %s: %w", op.key, err)
		}
		if n, ok := reply.(int64); ok && n == 0 {
			return &dedup.Lease{Key: op.key, Token: op.token, TTL: s.lease}, nil
		}
		arr, _ := reply.([]any)
		var ok1, ok2 bool
		var ms int64
		if len(arr) == 2 {
			stored, ok1 = arr[0].(string)
			ms, ok2 = arr[1].(int64)
		}
		if !ok1 || !ok2 {
			return nil, fmt.Errorf("redisnx: claim %s: unexpected reply %v from the claim script", op.key, reply)
		}
		op.retryAfter = time.Duration(ms) * time.Millisecond
	}
	return s.answer(op, stored)
}

// answer is the claim's answer when it found the record stored.
func (s *Store) answer(op *claimOp, stored string) (*dedup.Lease, error) {
	state, fp, rest, ok := parseRecord(stored)
	switch {
	case ok && state == stateInFlight && rest == op.token:
		// Our own record: the client resent the command after losing
		// the first reply (go-redis retries on network errors).
		return &dedup.Lease{Key: op.key, Token: op.token, TTL: s.lease}, nil
	case !ok:
		return nil, fmt.Errorf("redisnx: claim %s: its Redis key (Store.RedisKey) holds a value that is not an idem record; refusing to process (delete the key if it is stale, and give idem its own Options.Prefix)", op.key)
	case !op.key.Fingerprint.Matches(fp):
		return nil, &dedup.ClaimError{Err: dedup.ErrFingerprintMismatch, Key: op.key}
	case state == stateDone:
		var result []byte
		if rest != "" {
			result = []byte(rest)
		}
		return nil, &dedup.ClaimError{Err: dedup.ErrDuplicate, Key: op.key, Result: result}
	}
	return nil, &dedup.ClaimError{Err: dedup.ErrInFlight, Key: op.key, RetryAfter: max(op.retryAfter, 0)} // PTTL's -1 and -2 become 0
}

// Claim implements dedup.LeaseStore in one round trip (SET NX GET PX), plus
// one PTTL when the key is in flight, for the answer's RetryAfter.
func (s *Store) Claim(ctx context.Context, key dedup.Key) (*dedup.Lease, error) {
	if err := dedup.ValidateKey(key, s.maxKeyLen); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("redisnx: claim %s: %w", key, err)
	}
	op := new(claimOp)
	s.newClaimOp(op, key)
	n, err := s.nodeOf(ctx, op.rkey)
	if err == nil {
		err = n.ops.do(ctx, []nodeOp{{claim: op}})
	}
	if err != nil {
		return nil, fmt.Errorf("redisnx: claim %s: %w", key, err)
	}
	return s.result(op)
}

// ClaimBatch implements dedup.BatchLeaseStore: the claims of all valid keys
// go to Redis in one pipeline (one round trip, plus one for the RetryAfter
// of keys found in flight); on a Redis Cluster, one pipeline per master,
// side by side. Invalid keys get dedup.ErrInvalidKey without I/O. A key repeated in the batch is claimed once; its later copies see
// dedup.ErrInFlight.
//
// When Redis (on a cluster: the master of one of the keys) cannot be
// reached, or ctx ends, ClaimBatch returns a nil slice and the error: no
// lease is handed out. Claims of that batch that reached
// Redis before the failure stay in flight until their lease runs out, as
// after a crashed worker. An error that Redis returns for one key only (such
// as a refused write under maxmemory) is that key's BatchResult.Err.
func (s *Store) ClaimBatch(ctx context.Context, keys []dedup.Key) ([]dedup.BatchResult, error) {
	out := make([]dedup.BatchResult, len(keys))
	idx := make([]int, 0, len(keys))
	for i, k := range keys {
		if err := dedup.ValidateKey(k, s.maxKeyLen); err != nil {
			out[i].Err = err
			continue
		}
		idx = append(idx, i)
	}
	if len(idx) == 0 {
		return out, nil
	}
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("redisnx: claim batch: %w", err)
	}
	ops := make([]*claimOp, len(idx))
	all := make([]claimOp, len(idx)) // one allocation for the batch
	for j, i := range idx {
		ops[j] = &all[j]
		s.newClaimOp(ops[j], keys[i])
	}
	if err := s.claimOnNodes(ctx, ops); err != nil {
		return nil, fmt.Errorf("redisnx: claim batch of %d keys: %w", len(keys), err)
	}
	for j, i := range idx {
		out[i].Lease, out[i].Err = s.result(ops[j])
	}
	return out, nil
}

// claimOnNodes claims ops through the groups of their nodes, the nodes side
// by side, and returns the first node's error, if any.
func (s *Store) claimOnNodes(ctx context.Context, ops []*claimOp) error {
	if s.cluster == nil {
		return s.single.ops.do(ctx, nodeOps(ops))
	}
	byNode := map[*node][]*claimOp{}
	var order []*node
	for _, op := range ops {
		n, err := s.nodeOf(ctx, op.rkey)
		if err != nil {
			return err
		}
		if byNode[n] == nil {
			order = append(order, n)
		}
		byNode[n] = append(byNode[n], op)
	}
	if len(order) == 1 {
		return order[0].ops.do(ctx, nodeOps(ops))
	}
	errs := make([]error, len(order))
	var wg sync.WaitGroup
	for i, n := range order {
		wg.Go(func() { errs[i] = n.ops.do(ctx, nodeOps(byNode[n])) })
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

func isNoScript(err error) bool { return redis.HasErrorPrefix(err, "NOSCRIPT") }
