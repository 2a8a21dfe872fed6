package redisnx

import "github.com/redis/go-redis/v9"

// Record layout (see the package doc): byte 1 is the state, bytes 2..33 the
// fingerprint, bytes 34.. the token (in flight) or the result (done).
const (
	stateInFlight = 'L'
	stateDone     = 'D'
	fpLen         = 32
	headerLen     = 1 + fpLen
)

// claimScript is the claim on Redis before 7.0, which refuses SET NX GET:
// KEYS[1] the record key; ARGV[1] the in-flight record to set
// ('L' .. fingerprint .. token); ARGV[2] the lease in milliseconds. It
// replies 0 when it set the record, else {stored record, PTTL}: what SET NX
// GET and PTTL answer on Redis 7.
var claimScript = redis.NewScript(claimSrc)

const claimSrc = `
local v = redis.call('GET', KEYS[1])
if not v then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 0
end
return {v, redis.call('PTTL', KEYS[1])}
`

// ownedCheck is the prologue of the three token scripts: it leaves the record
// in v and returns 0 unless the key is in flight under the token ARGV[1].
const ownedCheck = `
local v = redis.call('GET', KEYS[1])
if not v or string.len(v) < 33 or string.sub(v, 1, 1) ~= 'L' or string.sub(v, 34) ~= ARGV[1] then
  return 0
end
`

// extendScript: ARGV[1] token, ARGV[2] lease in milliseconds.
var extendScript = redis.NewScript(extendSrc)

const extendSrc = ownedCheck + `
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
`

// completeScript: ARGV[1] token, ARGV[2] result, ARGV[3] retention in
// milliseconds. The done record keeps the fingerprint and drops the token.
var completeScript = redis.NewScript(completeSrc)

const completeSrc = ownedCheck + `
redis.call('SET', KEYS[1], 'D' .. string.sub(v, 2, 33) .. ARGV[2], 'PX', ARGV[3])
return 1
`

// releaseScript: ARGV[1] token.
var releaseScript = redis.NewScript(releaseSrc)

const releaseSrc = ownedCheck + `
redis.call('DEL', KEYS[1])
return 1
`
