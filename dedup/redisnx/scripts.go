package redisnx

import "github.com/redis/go-redis/v9"

// Record layout (see the package doc): byte 1 is the state; with the states
// that carry a fingerprint ('L', 'D') bytes 2..33 are the fingerprint; the
// rest is the token (in flight) or the result (done).
const (
	stateInFlight   = 'L' // in flight, with a fingerprint
	stateDone       = 'D' // done, with a fingerprint
	stateInFlightNF = 'l' // in flight, no fingerprint
	stateDoneNF     = 'd' // done, no fingerprint
	fpLen           = 32
	// doneBare is the done record without fingerprint and result: an
	// integer, which Redis stores as a shared object (no allocation).
	doneBare = "1"
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
// in v, the length of its header (state and fingerprint) in h, and returns 0
// unless the key is in flight under the token ARGV[1].
const ownedCheck = `
local v = redis.call('GET', KEYS[1])
if not v then
  return 0
end
local s = string.sub(v, 1, 1)
local h
if s == 'L' then
  h = 33
elseif s == 'l' then
  h = 1
else
  return 0
end
if string.len(v) < h or string.sub(v, h + 1) ~= ARGV[1] then
  return 0
end
`

// tokenScript is one of the scripts that act on a key in flight under a
// token (extend, complete, release).
type tokenScript struct {
	src string
	sha string // SHA-1 of src, for EVALSHA
	// once marks a script whose second run for one call would answer
	// wrong: after a first run that took effect, complete and release
	// find the key no longer in flight under their token and answer 0,
	// "lease lost", to an owner whose call succeeded. Their commands are
	// sent at most once (see onceCmd); a call whose reply was lost
	// answers dedup.ErrOutcomeUnknown. Extend is not marked: its second
	// run finds its own lease and extends it again.
	once bool
}

func newTokenScript(src string, once bool) *tokenScript {
	return &tokenScript{src: src, sha: redis.NewScript(src).Hash(), once: once}
}

// extendScript: ARGV[1] token, ARGV[2] lease in milliseconds.
var extendScript = newTokenScript(extendSrc, false)

const extendSrc = ownedCheck + `
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
`

// completeScript: ARGV[1] token, ARGV[2] result, ARGV[3] retention in
// milliseconds. The done record keeps the fingerprint, if any, and drops the
// token; without fingerprint and result it is doneBare.
var completeScript = newTokenScript(completeSrc, true)

const completeSrc = ownedCheck + `
local done
if s == 'L' then
  done = 'D' .. string.sub(v, 2, h) .. ARGV[2]
elseif ARGV[2] == '' then
  done = '1'
else
  done = 'd' .. ARGV[2]
end
redis.call('SET', KEYS[1], done, 'PX', ARGV[3])
return 1
`

// releaseScript: ARGV[1] token.
var releaseScript = newTokenScript(releaseSrc, true)

const releaseSrc = ownedCheck + `
redis.call('DEL', KEYS[1])
return 1
`
