package redisnx

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/dedup"
)

// The defaults of the zero Options, as each field's doc states them.
const (
	defaultLease        = 30 * time.Second
	defaultTTL          = 24 * time.Hour
	defaultPrefix       = "idem"
	defaultFailoverWait = 2 * time.Second
)

// failoverRetryEvery is the pause between two tries of a call that could
// not reach its Redis Cluster node (the slot map is reloaded meanwhile).
const failoverRetryEvery = 100 * time.Millisecond

// maxPrefixLen limits Options.Prefix.
const maxPrefixLen = 64

// Options configure a Store. The zero value is usable.
type Options struct {
	// Lease is how long a claim is held without Extend. A worker that
	// crashes mid-message blocks the key's redelivery for at most this
	// long. Rounded up to whole milliseconds. Defaults to 30s.
	Lease time.Duration
	// TTL is how long a completed key is remembered (its retention); it
	// must outlive the longest redelivery horizon of the broker. Rounded
	// up to whole milliseconds. Defaults to 24h.
	TTL time.Duration
	// Prefix starts every Redis key, so several applications or
	// environments can share one Redis. 1 to 64 characters from
	// [A-Za-z0-9_.:-]. Defaults to "idem".
	Prefix string
	// MaxKeyLen limits scope and id, in bytes. Defaults to
	// dedup.DefaultMaxKeyLen.
	MaxKeyLen int
	// FailoverWait applies to a *redis.ClusterClient only: it bounds how
	// long a call keeps trying a key whose node it cannot reach. On such
	// an error the Store asks the client to reload the slot map
	// (ClusterClient.ReloadState) and tries again every 100ms, so a call
	// made while a replica takes over from a dead master succeeds as soon
	// as the new master is known, whatever the client's
	// ClusterStateReloadInterval. Meanwhile the call waits, and after
	// FailoverWait (or when its ctx ends) it returns the error: it never
	// answers as if the key were absent. A negative value returns the
	// error at once (the slot map is still reloaded). Defaults to 2s.
	FailoverWait time.Duration
	// SkipPreviousLayout stops claims from reading the key of the
	// previous key layout (see the package doc), which saves one read per
	// claim. Set it only when no mark of that layout can still be
	// live: a TTL after the last process that wrote them stopped.
	// Defaults to false (read it).
	SkipPreviousLayout bool
}

// Store is a lease store on Redis. It is safe for concurrent use. It holds no
// resources of its own: close the client when done.
type Store struct {
	client    redis.UniversalClient
	lease     time.Duration
	ttl       time.Duration
	prefix    string // Prefix + ":2{"
	oldPrefix string // Prefix + ":v1:{", the previous layout; "" to skip it
	maxKeyLen int
	leaseArg  any // lease in milliseconds, as a script argument
	ttlArg    any // TTL in milliseconds, as a script argument

	// legacy is set once Redis has refused SET NX GET (Redis before 7.0):
	// claims then go through the claim script.
	legacy atomic.Bool

	// The scripts are package variables in production; tests swap in
	// scripts unknown to the server to exercise the NOSCRIPT path.
	claim                     *redis.Script
	extend, complete, release *tokenScript

	// cluster is the client when it is a Redis Cluster client: calls
	// are then grouped per master node, and a call that cannot reach its
	// node reloads the slot map and tries again for up to failoverWait.
	cluster      *redis.ClusterClient
	failoverWait time.Duration

	// single holds the groups of a client that is not a cluster client;
	// nodes those of each master of a cluster, by address. The entries of
	// masters that left the cluster's topology, or that no call used for
	// nodeIdle, are dropped (see pruneNodes), at most once per nodeIdle,
	// from pruneAt on.
	single  *node
	nodesMu sync.Mutex
	nodes   map[string]*node
	pruneAt time.Time
	now     func() time.Time // time.Now; tests move it on
	pruned  func()           // called when a look at the topology ends; tests wait on it
	pruning atomic.Bool      // a look is running: the next one waits for its turn
}

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

var (
	_ dedup.LeaseStore      = (*Store)(nil)
	_ dedup.BatchLeaseStore = (*Store)(nil)
)

// New returns a Store on client. It does no I/O. It returns an error when
// client is nil or an option is out of range.
func New(client redis.UniversalClient, opts Options) (*Store, error) {
	if isNil(client) {
		return nil, errors.New("redisnx: New: client is nil; pass a redis.UniversalClient, for example redis.NewClient(&redis.Options{Addr: \"127.0.0.1:6379\"})")
	}
	lease, err := duration("Lease", opts.Lease, defaultLease, "30s")
	if err != nil {
		return nil, err
	}
	ttl, err := duration("TTL", opts.TTL, defaultTTL, "24h")
	if err != nil {
		return nil, err
	}
	prefix := opts.Prefix
	if prefix == "" {
		prefix = defaultPrefix
	}
	if err := validPrefix(prefix); err != nil {
		return nil, err
	}
	maxKeyLen := opts.MaxKeyLen
	switch {
	case maxKeyLen < 0:
		return nil, fmt.Errorf("redisnx: Options.MaxKeyLen is %d; it must be positive (or zero for the default of %d bytes)", maxKeyLen, dedup.DefaultMaxKeyLen)
	case maxKeyLen == 0:
		maxKeyLen = dedup.DefaultMaxKeyLen
	}
	failoverWait := opts.FailoverWait
	if failoverWait == 0 {
		failoverWait = defaultFailoverWait
	}
	s := &Store{
		client:    client,
		lease:     lease,
		ttl:       ttl,
		prefix:    prefix + ":2{",
		oldPrefix: prefix + ":v1:{",
		maxKeyLen: maxKeyLen,
		leaseArg:  strconv.FormatInt(lease.Milliseconds(), 10),
		ttlArg:    strconv.FormatInt(ttl.Milliseconds(), 10),
		claim:     claimScript,
		extend:    extendScript,
		complete:  completeScript,
		release:   releaseScript,

		failoverWait: failoverWait,
		nodes:        map[string]*node{},
		now:          time.Now,
	}
	if opts.SkipPreviousLayout {
		s.oldPrefix = ""
	}
	s.cluster, _ = client.(*redis.ClusterClient)
	s.single = s.newNode()
	s.pruneAt = s.now().Add(nodeIdle)
	return s, nil
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

// isNil reports whether client is nil, including a typed nil pointer such as
// (*redis.Client)(nil), which would panic on first use.
func isNil(client redis.UniversalClient) bool {
	if client == nil {
		return true
	}
	v := reflect.ValueOf(client)
	return v.Kind() == reflect.Pointer && v.IsNil()
}

// duration applies the default to a zero duration, refuses a negative one
// and rounds the rest up to whole milliseconds, the unit of Redis expiries.
func duration(name string, d, def time.Duration, defText string) (time.Duration, error) {
	switch {
	case d == 0:
		return def, nil
	case d < 0:
		return 0, fmt.Errorf("redisnx: Options.%s is %v; it must be positive (or zero for the %s default)", name, d, defText)
	}
	if r := d % time.Millisecond; r != 0 {
		d += time.Millisecond - r
	}
	return d, nil
}

func validPrefix(p string) error {
	if len(p) > maxPrefixLen {
		return fmt.Errorf("redisnx: Options.Prefix is %d bytes; the limit is %d (or leave it empty for %q)", len(p), maxPrefixLen, defaultPrefix)
	}
	for i := 0; i < len(p); i++ {
		c := p[i]
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' ||
			c == '_' || c == '.' || c == ':' || c == '-'
		if !ok {
			return fmt.Errorf("redisnx: Options.Prefix %q has %q at offset %d; use only letters, digits and _ . : - (or leave it empty for %q)", p, c, i, defaultPrefix)
		}
	}
	return nil
}

// RedisKey returns the Redis key that holds k, for operators and tests. The
// fingerprint is not part of the key. See the package doc for the layout.
func (s *Store) RedisKey(k dedup.Key) string {
	sum := digest(k)
	return s.redisKey(&sum)
}

// redisKey is RedisKey of the key whose digest is sum.
func (s *Store) redisKey(sum *[sha256.Size]byte) string {
	var b [16 + 1 + 11]byte
	hex.Encode(b[:16], sum[:8])
	b[16] = '}'
	base64.RawURLEncoding.Encode(b[17:], sum[8:16])
	return s.prefix + string(b[:])
}

// oldKey returns the key of k in the previous layout, which Claim still
// reads (see the package doc). It shares RedisKey's hash tag, so both keys
// live in the same slot.
func (s *Store) oldKey(k dedup.Key) string {
	sum := digest(k)
	return s.oldKeyOf(k, &sum)
}

// oldKeyOf is oldKey of k, whose digest is sum.
func (s *Store) oldKeyOf(k dedup.Key, sum *[sha256.Size]byte) string {
	var tag [16]byte
	hex.Encode(tag[:], sum[:8])
	n := strconv.Itoa(len(k.Scope))
	var b strings.Builder
	b.Grow(len(s.oldPrefix) + len(tag) + 2 + len(n) + 1 + len(k.Scope) + 1 + len(k.ID))
	b.WriteString(s.oldPrefix)
	b.Write(tag[:])
	b.WriteString("}:")
	b.WriteString(n)
	b.WriteByte(':')
	b.WriteString(k.Scope)
	b.WriteByte(':')
	b.WriteString(k.ID)
	return b.String()
}

// digest is SHA-256(scope, 0x00, id).
func digest(k dedup.Key) [sha256.Size]byte {
	var stack [2*dedup.DefaultMaxKeyLen + 1]byte
	in := append(stack[:0], k.Scope...)
	in = append(in, 0)
	in = append(in, k.ID...)
	return sha256.Sum256(in)
}

func newToken() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand, Go 1.24+)
	return hex.EncodeToString(b[:])
}

// inFlightRecord is the value a claim sets: the fingerprint only when the
// key has one.
func inFlightRecord(fp dedup.Fingerprint, token string) []byte {
	if fp.IsZero() {
		return append([]byte{stateInFlightNF}, token...)
	}
	rec := make([]byte, 0, 1+fpLen+len(token))
	rec = append(rec, stateInFlight)
	rec = append(rec, fp[:]...)
	return append(rec, token...)
}

// parseRecord splits a stored record, of this layout or the previous one
// (which always has a fingerprint, all zeros when absent). state is
// stateInFlight or stateDone whether or not the record holds a fingerprint;
// ok is false when the value is not a record (idem does not share its
// prefix, but someone may write there).
func parseRecord(v string) (state byte, fp dedup.Fingerprint, rest string, ok bool) {
	if v == "" {
		return 0, fp, "", false
	}
	if v == doneBare {
		return stateDone, fp, "", true
	}
	switch v[0] {
	case stateInFlightNF:
		return stateInFlight, fp, v[1:], true
	case stateDoneNF:
		return stateDone, fp, v[1:], true
	case stateInFlight, stateDone:
		if len(v) < 1+fpLen {
			return 0, fp, "", false
		}
		copy(fp[:], v[1:1+fpLen])
		return v[0], fp, v[1+fpLen:], true
	}
	return 0, fp, "", false
}

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

// cmdable is what token scripts are sent through: the client or a
// pipeline.
type cmdable interface {
	Process(ctx context.Context, cmd redis.Cmder) error
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

func isNoScript(err error) bool { return redis.HasErrorPrefix(err, "NOSCRIPT") }

// owned runs one of the token scripts and maps its reply.
func (s *Store) owned(ctx context.Context, op string, sc *tokenScript, l *dedup.Lease, args ...any) error {
	if l == nil {
		return fmt.Errorf("redisnx: %s: nil lease: %w", op, dedup.ErrLeaseLost)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("redisnx: %s %s: %w", op, l.Key, err)
	}
	call := &scriptCall{script: sc, key: s.RedisKey(l.Key), args: args}
	nd, err := s.nodeOf(ctx, call.key)
	if err != nil {
		return fmt.Errorf("redisnx: %s %s: %w", op, l.Key, err)
	}
	err = nd.ops.do(ctx, []nodeOp{{call: call}})
	var n int64
	if err == nil {
		n, err = call.cmd.Int64()
	}
	if err != nil {
		if sc.once && mayHaveRun(err) {
			return fmt.Errorf("redisnx: %s %s: %w: %w", op, l.Key, dedup.ErrOutcomeUnknown, err)
		}
		return fmt.Errorf("redisnx: %s %s: %w", op, l.Key, err)
	}
	if n != 1 {
		return fmt.Errorf("redisnx: %s %s: %w", op, l.Key, dedup.ErrLeaseLost)
	}
	return nil
}

// Extend implements dedup.LeaseStore: the lease runs for Options.Lease from
// now.
func (s *Store) Extend(ctx context.Context, l *dedup.Lease) error {
	if l == nil {
		return s.owned(ctx, "extend", s.extend, l)
	}
	return s.owned(ctx, "extend", s.extend, l, l.Token, s.leaseArg)
}

// Complete implements dedup.LeaseStore: the key is done, holds result, and
// is remembered for Options.TTL.
func (s *Store) Complete(ctx context.Context, l *dedup.Lease, result []byte) error {
	if l == nil {
		return s.owned(ctx, "complete", s.complete, l)
	}
	if result == nil {
		result = []byte{}
	}
	return s.owned(ctx, "complete", s.complete, l, l.Token, result, s.ttlArg)
}

// Release implements dedup.LeaseStore: the key is deleted so a redelivery
// runs again. A completed key is never released.
func (s *Store) Release(ctx context.Context, l *dedup.Lease) error {
	if l == nil {
		return s.owned(ctx, "release", s.release, l)
	}
	return s.owned(ctx, "release", s.release, l, l.Token)
}

// scriptCall is one run of a token script (extend, complete, release) on
// its way to Redis and back.
type scriptCall struct {
	script *tokenScript
	key    string
	args   []any
	cmd    *redis.Cmd
}

// issue sends the call through c (queues it, on a pipeline): EVALSHA, or
// with full EVAL and the script's source. The command of a script marked
// once goes as a onceCmd.
func (c *scriptCall) issue(ctx context.Context, to cmdable, full bool) {
	args := make([]any, 0, 4+len(c.args))
	if full {
		args = append(args, "eval", c.script.src)
	} else {
		args = append(args, "evalsha", c.script.sha)
	}
	args = append(args, 1, c.key)
	args = append(args, c.args...)
	c.cmd = redis.NewCmd(ctx, args...)
	if c.script.once {
		_ = to.Process(ctx, onceCmd{c.cmd})
		return
	}
	_ = to.Process(ctx, c.cmd)
}

// onceCmd is a command go-redis sends at most once. go-redis sends a
// command again after an error that broke its connection (up to
// Options.MaxRetries times; a pipeline as a whole, and on a cluster up to
// MaxRedirects times), although the first send may have run it and only
// its reply was lost. A command whose NoRetry answers true is never sent
// again, nor is a pipeline that holds one; redirections (MOVED, ASK),
// which Redis answers without running the command, are still followed.
type onceCmd struct{ *redis.Cmd }

// NoRetry implements redis.Cmder.
func (onceCmd) NoRetry() bool { return true }

// mayHaveRun reports whether a call that failed with err may have run on
// Redis: err is no reply from Redis (which answers a call it ran, or
// refused), and not one that says the call never left the client.
func mayHaveRun(err error) bool {
	return !isReplyError(err) && !unsent(err)
}

// unsent reports whether err says the command never left the client: the
// caller gave up while it waited for its batch (errUnsent), no connection
// could be had (a dial that failed, the pool's timeout), or the client is
// closed.
func unsent(err error) bool {
	var op *net.OpError
	return errors.Is(err, errUnsent) || errors.Is(err, redis.ErrClosed) || errors.Is(err, redis.ErrPoolTimeout) ||
		errors.As(err, &op) && op.Op == "dial"
}

// runScripts runs calls with EVALSHA: alone, or in one pipeline. A call
// answered NOSCRIPT (a restarted server, SCRIPT FLUSH, a new cluster node)
// has had no effect: it is sent again with EVAL, the whole script, which
// also caches it on that server (no SCRIPT LOAD, which on a cluster would
// need every shard). It returns an error only when Redis could not be
// reached; an error Redis returns for one call stays in its cmd. With sent,
// the calls went out already (see runOps): it starts from their replies.
func (s *Store) runScripts(ctx context.Context, calls []*scriptCall, sent bool) error {
	send := func(todo []*scriptCall, full bool) {
		// A Redis Cluster client routes a lone command through its
		// COMMAND table, which it fetches once from any node, perhaps one
		// that is down or frozen; a pipeline routes by slot alone.
		if len(todo) == 1 && s.cluster == nil {
			todo[0].issue(ctx, s.client, full)
			return
		}
		_, _ = s.client.Pipelined(ctx, func(p redis.Pipeliner) error {
			for _, c := range todo {
				c.issue(ctx, p, full)
			}
			return nil
		})
	}
	todo := calls
	for _, full := range []bool{false, true} {
		if full || !sent {
			send(todo, full)
		}
		var again []*scriptCall
		for _, c := range todo {
			err := c.cmd.Err()
			switch {
			case err == nil || errors.Is(err, redis.Nil):
			case !isReplyError(err):
				return err
			case isNoScript(err):
				again = append(again, c)
			}
		}
		if len(again) == 0 {
			return nil
		}
		todo = again
	}
	return nil
}
