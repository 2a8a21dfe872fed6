// Package redisnx is a dedup.LeaseStore and dedup.BatchLeaseStore on Redis,
// through a go-redis/v9 redis.UniversalClient: a single node, Sentinel or
// Redis Cluster.
//
// # Semantics
//
// Each (scope, id) is one Redis string key that holds the whole state of the
// message, so every transition is one atomic command or Lua script on one
// key:
//
//	absent --Claim--> in flight (token, fingerprint; expires after Lease)
//	in flight --Complete(token)--> done (fingerprint, result; expires after TTL)
//	in flight --Release(token)--> absent
//	in flight --lease runs out--> absent (the next delivery runs again)
//
// Claim is one round trip: SET key record NX GET PX lease, which sets the
// key if it is absent and otherwise returns what is stored, atomically and
// without a script (with a read, MGET, of the key's previous layout in the
// same pipeline; see Key layout). From the stored record Claim answers
// dedup.ErrFingerprintMismatch when both fingerprints are present and
// differ, dedup.ErrDuplicate with the stored result when the key is done,
// and dedup.ErrInFlight when another owner holds it (then one more round
// trip reads the lease's PTTL for RetryAfter). SET NX GET needs Redis 7.0
// (or Valkey); on an older server, which refuses it as a syntax error, the
// Store switches to a Lua script with the same effect (EVALSHA).
//
// A granted lease carries a random 128-bit token. Extend, Complete and
// Release compare that token inside a Lua script (EVALSHA) and return an
// error wrapping dedup.ErrLeaseLost when the key is absent, held by another
// token, or already done: a stale owner never overwrites the new owner, and
// a completed key is never released. ClaimBatch sends the claims of a whole
// batch in one pipeline.
//
// Every Redis error (unreachable server, timeout, a refused write) is
// returned wrapped and never as a duplicate or in-flight answer, so callers
// fail closed: the message is not acknowledged and is delivered again.
//
// Complete and Release are sent at most once, whatever the client's
// MaxRetries: go-redis sends a command again after a broken connection,
// and a second run of a Complete or Release whose first run took effect
// (only its reply was lost, say to a Redis killed and restarted) would find
// the key no longer in flight under its token and answer "lease lost" to an
// owner whose call succeeded. Such a call returns an error wrapping
// dedup.ErrOutcomeUnknown instead: it may or may not have taken effect, and
// the redelivery's claim tells which. Claims and Extend are still sent
// again (a second run finds the caller's own token and succeeds).
//
// Concurrent calls, claims and token scripts alike, share round trips, as a
// group commit does: a call that finds fewer than two in flight is sent at
// once, and the calls that arrive while two are go together in one pipeline
// when one returns. On a Redis Cluster the calls are grouped per master
// node, so a dead or slow node delays only the keys of its own slots.
//
// # Redis Cluster
//
// Pass a *redis.ClusterClient (or redis.NewUniversalClient with several
// addresses). Each key and its whole state live in one slot (see the key
// layout), so no command spans slots. go-redis learns that a master has
// been replaced from a MOVED reply or by reloading its slot map every
// ClusterStateReloadInterval (60s by default), and a dead master sends no
// MOVED. So when a call cannot reach its key's node, the Store asks the
// client to reload the slot map (ClusterClient.ReloadState) and tries again
// every 100ms, for up to Options.FailoverWait (2s by default) within the
// call's ctx; meanwhile it fails closed, returning the error and never an
// answer about the key. A failed-over shard's keys are served again about
// a second after the replica's promotion (the time for a try against the
// dead node to fail and a reload to land), whatever the reload interval.
//
// Settings that matter on the servers and the client:
//
//   - cluster-require-full-coverage no on every node: otherwise the whole
//     cluster refuses all keys (CLUSTERDOWN) while one shard has no master,
//     and a dead shard stops the healthy ones.
//   - cluster-node-timeout: a master is failed over after about this long
//     plus an election (15s by default); claims on its slots fail until
//     then. A smaller value heals sooner and risks failovers on short
//     network hiccups.
//   - ClusterOptions.ReadOnly and RouteByLatency/RouteRandomly must stay
//     off (the default): claims are writes and must reach the master.
//   - ClusterOptions.DialTimeout, ReadTimeout and WriteTimeout bound how
//     long a call waits for a node that is unreachable without refusing
//     connections (a host that went away); keep them short (the defaults are
//     5s each) so such calls fail closed quickly.
//   - ClusterOptions.ClusterStateReloadInterval may stay at its default;
//     the Store reloads the slot map itself when a node is unreachable.
//
// # Key layout
//
//	<Prefix>:2{<tag>}<rest>
//
// "2" versions the layout and the record format. Tag and rest are the first
// 16 bytes of SHA-256(scope, 0x00, id): the tag the first 8 in hex, a Redis
// Cluster hash tag, so the key's slot depends on the tag alone and keys
// spread evenly over the cluster; the rest the next 8 in unpadded
// base64url. Prefix may not contain braces, so the tag is always the first
// {...} of the key. With the default prefix a key is 35 bytes whatever the
// scope and id; two (scope, id) pairs share a key only if 128 bits of
// SHA-256 collide. Store.RedisKey returns the key of a dedup.Key, for
// operators (the key does not reveal the scope and id: look a message up
// by computing its key). Store.Inspect reads a key's record as a
// dedup.KeyState (state, expiry, fingerprint, result) in one MULTI, and
// InspectDigest does so by the key's dedup.Digest alone ("idem dedup
// show").
//
// The value is a binary record: one state byte, the 32-byte fingerprint
// only when the key has one ('L' in flight, 'D' done; without a
// fingerprint 'l' and 'd'), then the owner's token while in flight or the
// result, if any, once done. A done mark without fingerprint and result is
// "1", which Redis keeps as a shared integer object (unless maxmemory is
// set with an LRU or LFU policy, which turns sharing off): with the
// default prefix it then takes about as much memory as a bare SET of a
// UUID key to "1" (see TestMarkMemory for the figures). The key's expiry is
// the lease while in flight and the retention (TTL) once done.
//
// The previous layout, <Prefix>:v1:{<tag>}:<len(scope)>:<scope>:<id> with
// the same tag and a record that always holds 32 fingerprint bytes, is
// still read: each claim also reads that key (same slot, same pipeline)
// and, when a record is there, answers from it (a duplicate, in flight or a
// fingerprint mismatch) and releases the claim it may have just made. So
// marks written before an upgrade are honoured until they expire;
// Options.SkipPreviousLayout turns the read off once none is left. A
// process that writes only the previous layout reads nothing of this one:
// during a rolling upgrade, a message completed by an upgraded process and
// delivered again to one not yet upgraded (a rebalance during the
// rollout), or delivered to both at the same moment, may run twice. Where
// that matters, drain the consumers before the upgrade rather than rolling
// it.
//
// # Durability
//
// Redis marks are best effort. A restart without AOF persistence, a failover
// to a replica that had not received the latest writes, or eviction under
// maxmemory loses marks, and a lost mark lets a duplicate through. Run the
// dedup Redis with "maxmemory-policy noeviction" (then a full Redis refuses
// claims, and callers fail closed, instead of forgetting marks). Where a
// duplicate costs money, keep dedup/pgtable (or the two-level store in
// dedup/twolevel, Redis in front of PostgreSQL) as the source of truth and
// use redisnx alone only where a rare duplicate is acceptable.
//
// The Store does not own the client: closing the client is the caller's job,
// and the Store starts no goroutine.
package redisnx
