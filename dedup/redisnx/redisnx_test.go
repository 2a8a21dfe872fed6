package redisnx_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/deduptest"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m, testenv.LeakOptions()...) }

// newStore returns a Store with its own prefix on the test Redis, and deletes
// the prefix's keys when the test ends.
func newStore(t testing.TB, opts redisnx.Options) (*redisnx.Store, *redis.Client) {
	t.Helper()
	c := testenv.Redis(t)
	if opts.Prefix == "" {
		opts.Prefix = testenv.Name("redisnx")
	}
	s, err := redisnx.New(c, opts)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { deletePrefix(t, c, opts.Prefix) })
	return s, c
}

// scanPrefix returns every key under prefix.
func scanPrefix(t testing.TB, c *redis.Client, prefix string) []string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var keys []string
	it := c.Scan(ctx, 0, prefix+":*", 1000).Iterator()
	for it.Next(ctx) {
		keys = append(keys, it.Val())
	}
	if err := it.Err(); err != nil {
		t.Fatalf("SCAN %s:*: %v", prefix, err)
	}
	return keys
}

func deletePrefix(t testing.TB, c *redis.Client, prefix string) {
	keys := scanPrefix(t, c, prefix)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for len(keys) > 0 {
		n := min(len(keys), 500)
		if err := c.Unlink(ctx, keys[:n]...).Err(); err != nil {
			t.Logf("cleanup of %s:*: %v", prefix, err)
			return
		}
		keys = keys[n:]
	}
}

// downClient is a client on a port nothing listens on, that gives up at once.
func downClient(t testing.TB) *redis.Client {
	c := redis.NewClient(&redis.Options{
		Addr:          testenv.DeadAddr(t),
		DialTimeout:   200 * time.Millisecond,
		MaxRetries:    -1,
		DialerRetries: 1,
	})
	t.Cleanup(func() { _ = c.Close() })
	return c
}

func TestConformance(t *testing.T) {
	t.Parallel()
	deduptest.RunLease(t, deduptest.LeaseHarness{
		New: func(t testing.TB, cfg deduptest.Config) deduptest.LeaseInstance {
			s, _ := newStore(t, redisnx.Options{Lease: cfg.Lease, TTL: cfg.TTL})
			return deduptest.LeaseInstance{Store: s} // Redis's clock: the suite sleeps
		},
		Down: func(t testing.TB) dedup.LeaseStore {
			s, err := redisnx.New(downClient(t), redisnx.Options{Prefix: testenv.Name("redisnx")})
			if err != nil {
				t.Fatal(err)
			}
			return s
		},
	})
}

func TestNewErrors(t *testing.T) {
	t.Parallel()
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // New does no I/O
	defer c.Close()
	for _, tc := range []struct {
		name   string
		client redis.UniversalClient
		opts   redisnx.Options
		want   string
	}{
		{"nil client", nil, redisnx.Options{}, "client"},
		{"typed nil client", (*redis.Client)(nil), redisnx.Options{}, "client"},
		{"typed nil cluster client", (*redis.ClusterClient)(nil), redisnx.Options{}, "client"},
		{"negative lease", c, redisnx.Options{Lease: -time.Second}, "Options.Lease"},
		{"negative TTL", c, redisnx.Options{TTL: -time.Second}, "Options.TTL"},
		{"negative MaxKeyLen", c, redisnx.Options{MaxKeyLen: -1}, "Options.MaxKeyLen"},
		{"prefix with a space", c, redisnx.Options{Prefix: "a b"}, "Options.Prefix"},
		{"prefix with a semicolon", c, redisnx.Options{Prefix: "x;y"}, "Options.Prefix"},
		{"prefix with a brace", c, redisnx.Options{Prefix: "app{1}"}, "Options.Prefix"},
		{"prefix with a glob", c, redisnx.Options{Prefix: "app*"}, "Options.Prefix"},
		{"prefix with non-ASCII", c, redisnx.Options{Prefix: "заказ"}, "Options.Prefix"},
		{"prefix with a newline", c, redisnx.Options{Prefix: "a\nb"}, "Options.Prefix"},
		{"prefix too long", c, redisnx.Options{Prefix: strings.Repeat("p", 65)}, "Options.Prefix"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, err := redisnx.New(tc.client, tc.opts)
			if err == nil || s != nil {
				t.Fatalf("New = (%v, %v), want an error", s, err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not name %s", err, tc.want)
			}
		})
	}
	for _, p := range []string{"idem", "a", "app-1_prod.eu:dedup", strings.Repeat("p", 64)} {
		if _, err := redisnx.New(c, redisnx.Options{Prefix: p}); err != nil {
			t.Errorf("Prefix %q: %v", p, err)
		}
	}
}

func TestDefaults(t *testing.T) {
	t.Parallel()
	s, c := newStore(t, redisnx.Options{})
	ctx := testenv.Ctx(t)
	l, err := s.Claim(ctx, dedup.NewKey(testenv.UniqueID("s"), testenv.UniqueID("id"), []byte("p")))
	if err != nil {
		t.Fatal(err)
	}
	if l.TTL != 30*time.Second {
		t.Fatalf("lease TTL = %v, want 30s", l.TTL)
	}
	if len(l.Token) != 32 {
		t.Fatalf("token %q, want 32 hex digits", l.Token)
	}
	if _, err := hex.DecodeString(l.Token); err != nil {
		t.Fatalf("token %q is not hex: %v", l.Token, err)
	}
	if err := s.Complete(ctx, l, nil); err != nil {
		t.Fatal(err)
	}
	pttl := c.PTTL(ctx, s.RedisKey(l.Key)).Val()
	if pttl > 24*time.Hour || pttl < 24*time.Hour-time.Minute {
		t.Fatalf("PTTL of a completed key with default options = %v, want about 24h", pttl)
	}
	def, err := redisnx.New(c, redisnx.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if k := def.RedisKey(l.Key); !strings.HasPrefix(k, "idem:2{") || len(k) != 35 {
		t.Fatalf("default key %q does not start with idem:2{ or is not 35 bytes", k)
	}
}

// TestExpiries: Redis really expires what the store writes: an in-flight key
// after the lease, a completed key after the TTL.
func TestExpiries(t *testing.T) {
	t.Parallel()
	const lease, ttl = 20 * time.Second, 3 * time.Hour
	s, c := newStore(t, redisnx.Options{Lease: lease, TTL: ttl})
	ctx := testenv.Ctx(t)
	key := dedup.NewKey(testenv.UniqueID("s"), testenv.UniqueID("id"), []byte("p"))
	rk := s.RedisKey(key)
	near := func(what string, got, want time.Duration) {
		t.Helper()
		if got > want || got < want-5*time.Second {
			t.Fatalf("PTTL %s = %v, want about %v", what, got, want)
		}
	}

	l, err := s.Claim(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	near("after Claim", c.PTTL(ctx, rk).Val(), lease)
	if err := c.PExpire(ctx, rk, time.Second).Err(); err != nil { // age the lease
		t.Fatal(err)
	}
	if err := s.Extend(ctx, l); err != nil {
		t.Fatal(err)
	}
	near("after Extend", c.PTTL(ctx, rk).Val(), lease)
	_, err = s.Claim(ctx, key)
	var ce *dedup.ClaimError
	if !errors.As(err, &ce) || !errors.Is(err, dedup.ErrInFlight) {
		t.Fatalf("second claim = %v, want ErrInFlight", err)
	}
	if ce.RetryAfter > lease || ce.RetryAfter < lease-5*time.Second {
		t.Fatalf("RetryAfter = %v, want about %v", ce.RetryAfter, lease)
	}
	if err := s.Complete(ctx, l, []byte("ok")); err != nil {
		t.Fatal(err)
	}
	near("after Complete", c.PTTL(ctx, rk).Val(), ttl)

	// A short TTL really runs out in Redis.
	short, c2 := newStore(t, redisnx.Options{Lease: time.Second, TTL: 300 * time.Millisecond})
	l, err = short.Claim(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if err := short.Complete(ctx, l, nil); err != nil {
		t.Fatal(err)
	}
	// The key carries the short TTL (-2: it already ran out), and Redis
	// removes it.
	if got := c2.PTTL(ctx, short.RedisKey(key)).Val(); got != -2 && (got <= 0 || got > 300*time.Millisecond) {
		t.Fatalf("PTTL after Complete = %v, want at most the 300ms TTL", got)
	}
	testenv.Eventually(t, 10*time.Second, "Redis to expire the completed key", func() bool {
		return c2.Exists(ctx, short.RedisKey(key)).Val() == 0
	})
}

// collisionKeys are pairs that a naive "scope:id" or brace-unaware layout
// would confuse.
var collisionKeys = []dedup.Key{
	{Scope: "a:b", ID: "c"},
	{Scope: "a", ID: "b:c"},
	{Scope: "a:", ID: "b"},
	{Scope: "a", ID: ":b"},
	{Scope: "1:a", ID: "b"},
	{Scope: "1", ID: "a:b"},
	{Scope: "{x}", ID: "y"},
	{Scope: "{x", ID: "}y"},
	{Scope: "{x}y", ID: "z"},
	{Scope: "x", ID: "{y}z"},
	{Scope: "}{", ID: "}{"},
	{Scope: "a b", ID: "c"},
	{Scope: "a", ID: "b c"},
	{Scope: "заказ", ID: "订单"},
	{Scope: "заказ:订单", ID: "x"},
	{Scope: "10", ID: "x"},
	{Scope: "1", ID: "0:x"},
}

func TestKeyEncodingNeverCollides(t *testing.T) {
	t.Parallel()
	s, _ := newStore(t, redisnx.Options{})
	seen := map[string]dedup.Key{}
	for _, k := range collisionKeys {
		rk := s.RedisKey(k)
		if prev, ok := seen[rk]; ok {
			t.Fatalf("%q and %q share the Redis key %q", prev, k, rk)
		}
		seen[rk] = k
	}
	// And against Redis (the store's prefix is unique to this test): every
	// pair is claimed independently.
	ctx := testenv.Ctx(t)
	for _, k := range collisionKeys {
		l, err := s.Claim(ctx, k)
		if err != nil {
			t.Fatalf("claim %q: %v", k, err)
		}
		if err := s.Complete(ctx, l, []byte(k.Scope+"|"+k.ID)); err != nil {
			t.Fatal(err)
		}
		_, err = s.Claim(ctx, k)
		if r, ok := dedup.StoredResult(err); !ok || string(r) != k.Scope+"|"+k.ID {
			t.Fatalf("claim %q again = %v (result %q), want its own result", k, err, r)
		}
	}
}

// hashTag applies Redis Cluster's rule: the hashed part of a key is what lies
// between the first '{' and the first '}' after it, when that is non-empty.
func hashTag(key string) string {
	i := strings.IndexByte(key, '{')
	if i < 0 {
		return key
	}
	j := strings.IndexByte(key[i+1:], '}')
	if j <= 0 {
		return key
	}
	return key[i+1 : i+1+j]
}

// slot is Redis Cluster's key slot: CRC16-XMODEM of the hash tag mod 16384.
func slot(key string) int {
	var crc uint16
	for _, b := range []byte(hashTag(key)) {
		crc ^= uint16(b) << 8
		for range 8 {
			if crc&0x8000 != 0 {
				crc = crc<<1 ^ 0x1021
			} else {
				crc <<= 1
			}
		}
	}
	return int(crc) % 16384
}

func TestHashTag(t *testing.T) {
	t.Parallel()
	if got := slot("123456789"); got != 0x31C3%16384 {
		t.Fatalf("slot(123456789) = %d; the CRC16 in this test is wrong", got)
	}
	if slot("{user1000}.following") != slot("{user1000}.followers") {
		t.Fatal("hashTag in this test is wrong")
	}
	s, _ := newStore(t, redisnx.Options{Prefix: "app.prod:dedup-1"})
	slots := map[int]bool{}
	for i, k := range collisionKeys {
		rk := s.RedisKey(k)
		if !strings.HasPrefix(rk, "app.prod:dedup-1:2{") {
			t.Fatalf("key %q does not start with the prefix and version", rk)
		}
		sum := sha256.Sum256([]byte(k.Scope + "\x00" + k.ID))
		want := hex.EncodeToString(sum[:8])
		if tag := hashTag(rk); tag != want {
			t.Fatalf("%d: key %q hashes on %q, want the tag %q whatever the scope and id hold", i, rk, tag, want)
		}
		slots[slot(rk)] = true
	}
	if len(slots) < len(collisionKeys)-2 {
		t.Fatalf("%d keys fall in only %d slots", len(collisionKeys), len(slots))
	}
}

// TestOneRedisKeyPerMessage: a message's whole life (claim, extend,
// complete, duplicate claims) lives in one Redis key, so it has one slot.
func TestOneRedisKeyPerMessage(t *testing.T) {
	t.Parallel()
	prefix := testenv.Name("redisnx")
	s, c := newStore(t, redisnx.Options{Prefix: prefix})
	ctx := testenv.Ctx(t)
	key := dedup.NewKey("billing:{charge}", testenv.UniqueID("order:{1}"), []byte("p"))
	l, err := s.Claim(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Extend(ctx, l); err != nil {
		t.Fatal(err)
	}
	if keys := scanPrefix(t, c, prefix); len(keys) != 1 || keys[0] != s.RedisKey(key) {
		t.Fatalf("keys while in flight = %q, want only %q", keys, s.RedisKey(key))
	}
	if err := s.Complete(ctx, l, []byte("r")); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Claim(ctx, key); !errors.Is(err, dedup.ErrDuplicate) {
		t.Fatalf("claim after complete = %v", err)
	}
	if keys := scanPrefix(t, c, prefix); len(keys) != 1 || keys[0] != s.RedisKey(key) {
		t.Fatalf("keys once done = %q, want only %q", keys, s.RedisKey(key))
	}
	if typ := c.Type(ctx, s.RedisKey(key)).Val(); typ != "string" {
		t.Fatalf("record type %q, want string", typ)
	}
}

func TestResults(t *testing.T) {
	t.Parallel()
	s, _ := newStore(t, redisnx.Options{})
	ctx := testenv.Ctx(t)
	scope := testenv.UniqueID("s")
	for name, result := range map[string][]byte{
		"nil":    nil,
		"empty":  {},
		"binary": {0, 1, 0xff, 0xfe, '\n', 0},
		"json":   []byte(`{"status":"charged","id":"ch_1"}`),
		"large":  []byte(strings.Repeat("r", 1<<20)),
	} {
		key := dedup.NewKey(scope, testenv.UniqueID(name), []byte(name))
		l, err := s.Claim(ctx, key)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if err := s.Complete(ctx, l, result); err != nil {
			t.Fatalf("%s: Complete: %v", name, err)
		}
		_, err = s.Claim(ctx, key)
		got, ok := dedup.StoredResult(err)
		if !ok || string(got) != string(result) {
			t.Fatalf("%s: stored result %q (%v), want %q", name, got, err, result)
		}
		if len(result) == 0 && got != nil {
			t.Fatalf("%s: an empty result comes back as %q, want nil", name, got)
		}
	}
}

// TestForeignValue: a key that holds something idem did not write is an
// error, never a duplicate or in-flight answer.
func TestForeignValue(t *testing.T) {
	t.Parallel()
	s, c := newStore(t, redisnx.Options{})
	ctx := testenv.Ctx(t)
	scope := testenv.UniqueID("s")
	short := dedup.Key{Scope: scope, ID: "short"}
	c.Set(ctx, s.RedisKey(short), "hello", time.Minute)
	badState := dedup.Key{Scope: scope, ID: "bad-state"}
	c.Set(ctx, s.RedisKey(badState), "X"+strings.Repeat("\x00", 40), time.Minute)
	list := dedup.Key{Scope: scope, ID: "list"}
	c.RPush(ctx, s.RedisKey(list), "x")
	for _, k := range []dedup.Key{short, badState, list} {
		l, err := s.Claim(ctx, k)
		if err == nil || l != nil {
			t.Fatalf("%s: Claim = (%v, %v), want an error", k, l, err)
		}
		for _, sentinel := range []error{dedup.ErrDuplicate, dedup.ErrInFlight, dedup.ErrFingerprintMismatch, dedup.ErrInvalidKey} {
			if errors.Is(err, sentinel) {
				t.Fatalf("%s: Claim = %v, must not look like %v", k, err, sentinel)
			}
		}
		res, err := s.ClaimBatch(ctx, []dedup.Key{k})
		if err == nil && (res[0].Err == nil || res[0].Lease != nil) {
			t.Fatalf("%s: ClaimBatch granted %+v", k, res[0])
		}
		forged := &dedup.Lease{Key: k, Token: "t"}
		if err := s.Release(ctx, forged); err == nil {
			t.Fatalf("%s: Release of a foreign value succeeded", k)
		}
	}
	if n := c.Exists(ctx, s.RedisKey(short), s.RedisKey(badState), s.RedisKey(list)).Val(); n != 3 {
		t.Fatalf("foreign values were touched: %d of 3 left", n)
	}
}

func TestNilLeaseAndCanceledContext(t *testing.T) {
	t.Parallel()
	s, _ := newStore(t, redisnx.Options{})
	ctx := testenv.Ctx(t)
	if err := s.Extend(ctx, nil); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("Extend(nil) = %v", err)
	}
	if err := s.Complete(ctx, nil, nil); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("Complete(nil) = %v", err)
	}
	if err := s.Release(ctx, nil); !errors.Is(err, dedup.ErrLeaseLost) {
		t.Fatalf("Release(nil) = %v", err)
	}
	canceled, cancel := context.WithCancel(ctx)
	cancel()
	key := dedup.NewKey(testenv.UniqueID("s"), testenv.UniqueID("id"), nil)
	if l, err := s.Claim(canceled, key); !errors.Is(err, context.Canceled) || l != nil {
		t.Fatalf("Claim on a canceled context = (%v, %v)", l, err)
	}
	if res, err := s.ClaimBatch(canceled, []dedup.Key{key}); !errors.Is(err, context.Canceled) || res != nil {
		t.Fatalf("ClaimBatch on a canceled context = (%v, %v)", res, err)
	}
	// Nothing was written.
	if _, err := s.Claim(ctx, key); err != nil {
		t.Fatalf("claim after the canceled ones = %v, want a lease", err)
	}
}

func TestStoreDown(t *testing.T) {
	t.Parallel()
	s, err := redisnx.New(downClient(t), redisnx.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx := testenv.Ctx(t)
	key := dedup.NewKey("s", "id", []byte("p"))
	res, err := s.ClaimBatch(ctx, []dedup.Key{key, key, {Scope: "s", ID: ""}})
	if err == nil || res != nil {
		t.Fatalf("ClaimBatch on a down store = (%v, %v), want (nil, error)", res, err)
	}
	// Invalid keys alone need no I/O.
	res, err = s.ClaimBatch(ctx, []dedup.Key{{Scope: "s", ID: ""}})
	if err != nil || len(res) != 1 || !errors.Is(res[0].Err, dedup.ErrInvalidKey) {
		t.Fatalf("ClaimBatch of an invalid key on a down store = (%v, %v)", res, err)
	}
	l := &dedup.Lease{Key: key, Token: "t"}
	for name, err := range map[string]error{
		"Extend":   s.Extend(ctx, l),
		"Complete": s.Complete(ctx, l, nil),
		"Release":  s.Release(ctx, l),
	} {
		if err == nil || errors.Is(err, dedup.ErrLeaseLost) {
			t.Fatalf("%s on a down store = %v, want a store error (not ErrLeaseLost)", name, err)
		}
	}
}

func TestPrefixesAreIsolated(t *testing.T) {
	t.Parallel()
	a, _ := newStore(t, redisnx.Options{})
	b, _ := newStore(t, redisnx.Options{})
	ctx := testenv.Ctx(t)
	key := dedup.NewKey(testenv.UniqueID("s"), testenv.UniqueID("id"), []byte("p"))
	if _, err := a.Claim(ctx, key); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Claim(ctx, key); err != nil {
		t.Fatalf("the same key under another prefix = %v, want a lease", err)
	}
}

func TestClaimBatchLarge(t *testing.T) {
	t.Parallel()
	s, _ := newStore(t, redisnx.Options{})
	ctx := testenv.Ctx(t)
	scope := testenv.UniqueID("s")
	keys := make([]dedup.Key, 2000)
	for i := range keys {
		keys[i] = dedup.NewKey(scope, testenv.UniqueID("id"), []byte{byte(i)})
	}
	res, err := s.ClaimBatch(ctx, keys)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range res {
		if r.Err != nil || r.Lease == nil || r.Lease.Key != keys[i] {
			t.Fatalf("%d: %+v", i, r)
		}
	}
	if err := s.Complete(ctx, res[7].Lease, []byte("seven")); err != nil {
		t.Fatal(err)
	}
	res, err = s.ClaimBatch(ctx, keys[:10])
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range res {
		want := dedup.ErrInFlight
		if i == 7 {
			want = dedup.ErrDuplicate
		}
		if !errors.Is(r.Err, want) || r.Lease != nil {
			t.Fatalf("%d: %+v, want %v", i, r, want)
		}
	}
}

// roundTrips counts what the client sends: single commands and pipelines.
type roundTrips struct{ singles, pipelines atomic.Int64 }

func (*roundTrips) DialHook(next redis.DialHook) redis.DialHook { return next }
func (r *roundTrips) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		r.singles.Add(1)
		return next(ctx, cmd)
	}
}
func (r *roundTrips) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		r.pipelines.Add(1)
		return next(ctx, cmds)
	}
}

// Concurrent claims and completes share round trips (group commit), and
// every caller still gets its own answer: one lease per key, completes
// that stick, duplicates afterwards.
func TestConcurrentCallsShareRoundTrips(t *testing.T) {
	t.Parallel()
	s, c := newStore(t, redisnx.Options{})
	rt := &roundTrips{}
	c.AddHook(rt)
	const n = 200
	var wg sync.WaitGroup
	errs := make(chan error, n)
	start := make(chan struct{})
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-start
			key := dedup.NewKey("group", fmt.Sprintf("m-%d", i), []byte("p"))
			l, err := s.Claim(t.Context(), key)
			if err != nil {
				errs <- fmt.Errorf("claim %d: %w", i, err)
				return
			}
			if err := s.Complete(t.Context(), l, []byte(fmt.Sprint(i))); err != nil {
				errs <- fmt.Errorf("complete %d: %w", i, err)
				return
			}
			_, err = s.Claim(t.Context(), key)
			if res, dup := dedup.StoredResult(err); !dup || string(res) != fmt.Sprint(i) {
				errs <- fmt.Errorf("claim again %d = %w, want a duplicate with result %d", i, err, i)
			}
		}()
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	trips := rt.singles.Load() + rt.pipelines.Load()
	t.Logf("%d calls in %d round trips (%d pipelines)", 3*n, trips, rt.pipelines.Load())
	if trips >= 3*n {
		t.Errorf("%d calls took %d round trips: concurrent calls were not coalesced", 3*n, trips)
	}
}

// hookFunc runs f before every command and pipeline the client sends.
type hookFunc func(cmds []redis.Cmder)

func (hookFunc) DialHook(next redis.DialHook) redis.DialHook { return next }
func (f hookFunc) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		f([]redis.Cmder{cmd})
		return next(ctx, cmd)
	}
}
func (f hookFunc) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		f(cmds)
		return next(ctx, cmds)
	}
}

func mentions(cmds []redis.Cmder, s string) bool {
	for _, c := range cmds {
		for _, a := range c.Args() {
			if v, ok := a.(string); ok && strings.Contains(v, s) {
				return true
			}
		}
	}
	return false
}

// A caller queued behind slow round trips leaves when its own context
// ends, and the store goes on working after the slow calls return. The slow
// round trips, as many as a group lets in flight at once, are held in the
// client's hook until the queued caller has returned, so the verdict does
// not depend on how fast any goroutine is scheduled: a caller that waited
// for a round trip instead of its context would not return at all while
// they are held.
func TestGroupedCallerHonoursItsContext(t *testing.T) {
	t.Parallel()
	s, c := newStore(t, redisnx.Options{})
	started := make(chan struct{}, redisnx.MaxInFlight) // a slow claim reached the client
	release := make(chan struct{})                      // lets the slow claims go on
	var releaseOnce sync.Once
	letGo := func() { releaseOnce.Do(func() { close(release) }) }
	t.Cleanup(letGo) // runs before newStore's cleanup, which goes through the hook too
	c.AddHook(hookFunc(func(cmds []redis.Cmder) {
		if mentions(cmds, "slow-one") {
			started <- struct{}{}
			<-release
		}
	}))
	slowDone := make(chan error, redisnx.MaxInFlight)
	for i := range redisnx.MaxInFlight {
		go func() {
			_, err := s.Claim(t.Context(), dedup.NewKey("group", fmt.Sprintf("slow-one-%d", i), nil))
			slowDone <- err
		}()
	}
	for range redisnx.MaxInFlight {
		select {
		case <-started: // every slot of the group is held: the next claim queues
		case <-time.After(10 * time.Second):
			t.Fatal("a slow claim never reached the client")
		}
	}
	ctx, cancel := context.WithTimeout(t.Context(), 50*time.Millisecond)
	defer cancel()
	impatient := make(chan error, 1)
	go func() {
		_, err := s.Claim(ctx, dedup.NewKey("group", "impatient", nil))
		impatient <- err
	}()
	select {
	case err := <-impatient:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("queued claim with a 50ms deadline = %v, want DeadlineExceeded", err)
		}
	case <-time.After(10 * time.Second):
		letGo()
		t.Fatal("queued claim did not return when its context ended: it waited for the slow round trips")
	}
	letGo()
	for range redisnx.MaxInFlight {
		if err := <-slowDone; err != nil {
			t.Fatalf("slow claim: %v", err)
		}
	}
	if _, err := s.Claim(t.Context(), dedup.NewKey("group", "after", nil)); err != nil {
		t.Fatalf("claim after the slow ones: %v", err)
	}
}

// A panic inside the client (a hook) reaches its caller and leaves the
// store usable: the group is released, not stuck.
func TestGroupSurvivesPanickingHook(t *testing.T) {
	t.Parallel()
	s, c := newStore(t, redisnx.Options{})
	c.AddHook(hookFunc(func(cmds []redis.Cmder) {
		if mentions(cmds, "boom") {
			panic("hook exploded")
		}
	}))
	func() {
		defer func() {
			if r := recover(); r == nil {
				t.Fatal("the hook's panic did not reach the caller")
			}
		}()
		_, _ = s.Claim(t.Context(), dedup.NewKey("group", "boom", nil))
	}()
	done := make(chan error, 1)
	go func() {
		_, err := s.Claim(t.Context(), dedup.NewKey("group", "fine", nil))
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("claim after the panic: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the store is stuck after a panic in the client")
	}
}

// previousKey is a key in the previous layout, which the Store still reads:
// <prefix>:v1:{<tag>}:<len(scope)>:<scope>:<id>.
func previousKey(prefix string, k dedup.Key) string {
	sum := sha256.Sum256([]byte(k.Scope + "\x00" + k.ID))
	return fmt.Sprintf("%s:v1:{%s}:%d:%s:%s", prefix, hex.EncodeToString(sum[:8]), len(k.Scope), k.Scope, k.ID)
}

// previousRecord is a record of the previous layout: the state, 32
// fingerprint bytes (zeros when absent), then the token or the result.
func previousRecord(state byte, fp dedup.Fingerprint, rest string) string {
	return string(state) + string(fp[:]) + rest
}

// TestReadsPreviousLayout: marks and leases written in the previous key
// layout answer claims, single and batched, and the claim leaves no key of
// its own behind.
func TestReadsPreviousLayout(t *testing.T) {
	t.Parallel()
	prefix := testenv.Name("redisnx")
	s, c := newStore(t, redisnx.Options{Prefix: prefix})
	ctx := testenv.Ctx(t)
	scope := testenv.UniqueID("billing/charge")
	fpA := dedup.FingerprintOf([]byte("a"))
	fpB := dedup.FingerprintOf([]byte("b"))
	type tc struct {
		name   string
		key    dedup.Key
		stored string
		ttl    time.Duration
		want   error
		result string
	}
	cases := []tc{
		{name: "done with result", key: dedup.Key{Scope: scope, ID: "1", Fingerprint: fpA}, stored: previousRecord('D', fpA, "r1"), ttl: time.Hour, want: dedup.ErrDuplicate, result: "r1"},
		{name: "done without fingerprint", key: dedup.Key{Scope: scope, ID: "2", Fingerprint: fpA}, stored: previousRecord('D', dedup.Fingerprint{}, ""), ttl: time.Hour, want: dedup.ErrDuplicate},
		{name: "done, other content", key: dedup.Key{Scope: scope, ID: "3", Fingerprint: fpA}, stored: previousRecord('D', fpB, ""), ttl: time.Hour, want: dedup.ErrFingerprintMismatch},
		{name: "in flight", key: dedup.Key{Scope: scope, ID: "4"}, stored: previousRecord('L', fpA, "0123456789abcdef0123456789abcdef"), ttl: 20 * time.Second, want: dedup.ErrInFlight},
	}
	for _, batch := range []bool{false, true} {
		for _, tc := range cases {
			t.Run(fmt.Sprintf("%s/batch=%v", tc.name, batch), func(t *testing.T) {
				old := previousKey(prefix, tc.key)
				if slot(old) != slot(s.RedisKey(tc.key)) {
					t.Fatalf("%q and %q are in different slots", old, s.RedisKey(tc.key))
				}
				if err := c.Set(ctx, old, tc.stored, tc.ttl).Err(); err != nil {
					t.Fatal(err)
				}
				var err error
				if batch {
					res, berr := s.ClaimBatch(ctx, []dedup.Key{tc.key, dedup.NewKey(scope, testenv.UniqueID("fresh"), nil)})
					if berr != nil {
						t.Fatal(berr)
					}
					if res[1].Err != nil {
						t.Fatalf("a fresh key in the batch: %v", res[1].Err)
					}
					err = res[0].Err
				} else {
					_, err = s.Claim(ctx, tc.key)
				}
				if !errors.Is(err, tc.want) {
					t.Fatalf("claim = %v, want %v", err, tc.want)
				}
				var ce *dedup.ClaimError
				if !errors.As(err, &ce) || string(ce.Result) != tc.result {
					t.Fatalf("claim = %#v, want the result %q", err, tc.result)
				}
				if tc.want == dedup.ErrInFlight && (ce.RetryAfter <= 0 || ce.RetryAfter > tc.ttl) {
					t.Fatalf("RetryAfter = %v, want the old lease's PTTL", ce.RetryAfter)
				}
				if n := c.Exists(ctx, s.RedisKey(tc.key)).Val(); n != 0 {
					t.Fatalf("the claim left its key %q behind", s.RedisKey(tc.key))
				}
				if err := c.Del(ctx, old).Err(); err != nil {
					t.Fatal(err)
				}
			})
		}
	}

	// With SkipPreviousLayout the old record is not read.
	skip, err := redisnx.New(c, redisnx.Options{Prefix: prefix, SkipPreviousLayout: true})
	if err != nil {
		t.Fatal(err)
	}
	key := dedup.Key{Scope: scope, ID: "skipped"}
	if err := c.Set(ctx, previousKey(prefix, key), previousRecord('D', dedup.Fingerprint{}, ""), time.Hour).Err(); err != nil {
		t.Fatal(err)
	}
	if _, err := skip.Claim(ctx, key); err != nil {
		t.Fatalf("claim with SkipPreviousLayout = %v, want a lease", err)
	}
}

// TestRecordsWithoutFingerprint: a key without fingerprint stores none, and
// a done record holds the result only when there is one.
func TestRecordsWithoutFingerprint(t *testing.T) {
	t.Parallel()
	s, c := newStore(t, redisnx.Options{})
	ctx := testenv.Ctx(t)
	for _, result := range []string{"", "r"} {
		key := dedup.Key{Scope: testenv.UniqueID("s"), ID: testenv.UniqueID("id")}
		l, err := s.Claim(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		if v := c.Get(ctx, s.RedisKey(key)).Val(); v != "l"+l.Token {
			t.Fatalf("in-flight record %q, want %q", v, "l"+l.Token)
		}
		if err := s.Complete(ctx, l, []byte(result)); err != nil {
			t.Fatal(err)
		}
		want := "d" + result
		if result == "" {
			want = "1"
		}
		if v := c.Get(ctx, s.RedisKey(key)).Val(); v != want {
			t.Fatalf("done record %q, want %q", v, want)
		}
		for _, k := range []dedup.Key{key, {Scope: key.Scope, ID: key.ID, Fingerprint: dedup.FingerprintOf([]byte("p"))}} {
			_, err = s.Claim(ctx, k)
			if r, ok := dedup.StoredResult(err); !ok || string(r) != result {
				t.Fatalf("claim again = %v (result %q), want a duplicate with %q", err, r, result)
			}
		}
	}
}
