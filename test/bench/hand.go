package bench

import (
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/dedup"
)

// The commands-by-hand sides of the Redis rows: the baseline's work plus the Redis
// commands idem sends for the path, sent by hand with the bare go-redis
// client, on keys and values of redisnx's layout. Per message, redisnx
// sends (MONITOR on a private redis-server shows it):
//
//	claim, one pipeline:  MGET <prefix>:v1:{<tag>}:<len(scope)>:<scope>:<id>
//	                      SET <prefix>:2{<tag>}<rest> <record> px <lease ms> nx get
//	complete:             EVALSHA <complete script> 1 <prefix>:2{<tag>}<rest> <token> <result> <ttl ms>
//
// The record is 'l' and the token (a key without fingerprint) or 'L', the
// 32-byte fingerprint and the token. A replay of a completed key sends the
// claim pipeline alone: its SET NX GET returns the stored record ('D', the
// fingerprint and the result). redisnx shares round trips between
// concurrent callers (group commit); a hand side sends each message's
// commands on its own, as a user writing them would.

// handRedis sends redisnx's commands by hand, under its own key prefix.
type handRedis struct {
	rdb       *redis.Client
	prefix    string // <prefix>:2{, redisnx's key layout
	oldPrefix string // <prefix>:v1:{, the previous layout, which every claim also reads
	lease     string // the claim's PX in milliseconds: redisnx's default lease, 30s
	ttl       string // the complete's PX in milliseconds: the rows' TTL
}

// redisTTL is the retention of the Redis rows' stores (redisnx.Options.TTL),
// which their commands-by-hand sides use too.
const redisTTL = 10 * time.Minute

// newHandRedis returns the hand client of rdb on the keys of prefix (a
// redisnx.Options.Prefix).
func newHandRedis(rdb *redis.Client, prefix string) *handRedis {
	return &handRedis{rdb: rdb, prefix: prefix + ":2{", oldPrefix: prefix + ":v1:{", lease: "30000",
		ttl: strconv.FormatInt(redisTTL.Milliseconds(), 10)}
}

// keys returns the key of (scope, id) in redisnx's layout, and its key in
// the previous layout: SHA-256(scope, 0x00, id), its first 8 bytes in hex
// as the hash tag, the next 8 in unpadded base64url.
func (h *handRedis) keys(scope, id string) (key, old string) {
	sum := sha256.Sum256([]byte(scope + "\x00" + id))
	tag := hex.EncodeToString(sum[:8])
	return h.prefix + tag + "}" + base64.RawURLEncoding.EncodeToString(sum[8:16]),
		h.oldPrefix + tag + "}:" + strconv.Itoa(len(scope)) + ":" + scope + ":" + id
}

// handToken is a lease's owner token: 16 random bytes in hex, as redisnx's.
func handToken() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return hex.EncodeToString(b[:])
}

// fingerprint is a message's fingerprint, dedup.FingerprintOf(body), as
// the fixed-size array the records hold.
func fingerprint(body []byte) [sha256.Size]byte {
	var sum [sha256.Size]byte
	copy(sum[:], dedup.FingerprintOf(body).Bytes())
	return sum
}

// inFlight is the record a claim sets: state 'l' and the token, or 'L',
// the fingerprint and the token when fp is set.
func inFlight(fp *[sha256.Size]byte, token string) []byte {
	if fp == nil {
		return append(append(make([]byte, 0, 1+len(token)), 'l'), token...)
	}
	rec := make([]byte, 0, 1+len(fp)+len(token))
	rec = append(rec, 'L')
	rec = append(rec, fp[:]...)
	return append(rec, token...)
}

// claim sends the claim pipeline (one round trip): MGET of the previous
// layout's key, then SET key rec PX lease NX GET. It returns the record
// SET NX GET found stored, or found false when the key was absent and now
// holds rec. The bench's keys are fresh: a record under the previous
// layout's key is an error.
func (h *handRedis) claim(ctx context.Context, key, old string, rec []byte) (stored string, found bool, err error) {
	var (
		mget *redis.SliceCmd
		set  *redis.Cmd
	)
	_, _ = h.rdb.Pipelined(ctx, func(p redis.Pipeliner) error {
		mget = p.MGet(ctx, old)
		set = p.Do(ctx, "set", key, rec, "px", h.lease, "nx", "get")
		return nil
	})
	vals, err := mget.Result()
	if err != nil {
		return "", false, err
	}
	if len(vals) != 1 || vals[0] != nil {
		return "", false, fmt.Errorf("claim %s: the previous layout's key holds %v", key, vals)
	}
	stored, err = set.Text()
	switch {
	case errors.Is(err, redis.Nil):
		return "", false, nil
	case err != nil:
		return "", false, err
	}
	return stored, true, nil
}

// claimNew is claim on a fresh key: finding a record there is an error.
func (h *handRedis) claimNew(ctx context.Context, key, old string, rec []byte) error {
	stored, found, err := h.claim(ctx, key, old, rec)
	if err == nil && found {
		err = fmt.Errorf("claim %s: a fresh key holds %q", key, stored)
	}
	return err
}

// complete runs the complete script, EVALSHA (EVAL when the server answers
// NOSCRIPT), which replies 1 when key was in flight under token.
func (h *handRedis) complete(ctx context.Context, key, token string, result []byte) error {
	if result == nil {
		result = []byte{}
	}
	n, err := handComplete.Run(ctx, h.rdb, []string{key}, token, result, h.ttl).Int64()
	if err != nil {
		return fmt.Errorf("complete %s: %w", key, err)
	}
	if n != 1 {
		return fmt.Errorf("complete %s: the key is not in flight under the token", key)
	}
	return nil
}

// handComplete is redisnx's complete script, copied word for word (the
// package keeps its text unexported): the same text, so the same SHA-1,
// and the server runs the very script redisnx's Complete runs
// (TestHandSendsRedisnxCommands checks both). KEYS[1] the record key;
// ARGV[1] token, ARGV[2] result, ARGV[3] retention in milliseconds.
var handComplete = redis.NewScript(`
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
`)
