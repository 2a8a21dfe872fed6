package redisnx

import (
	"context"
	"errors"
	"regexp"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/deduptest"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestScriptsTouchOneKey: every script names KEYS[1] only, so each call
// touches one key and one Cluster slot.
func TestScriptsTouchOneKey(t *testing.T) {
	t.Parallel()
	keysRef := regexp.MustCompile(`KEYS\[[^\]]*\]`)
	for name, src := range map[string]string{
		"claim": claimSrc, "extend": extendSrc, "complete": completeSrc, "release": releaseSrc,
	} {
		refs := keysRef.FindAllString(src, -1)
		if len(refs) == 0 {
			t.Errorf("%s script names no key", name)
		}
		for _, r := range refs {
			if r != "KEYS[1]" {
				t.Errorf("%s script names %s; each script must touch KEYS[1] only", name, r)
			}
		}
	}
}

// legacyStore returns a store that claims through the claim script, as on
// Redis before 7.0, with a script body unique to it: the server does not
// know the script, so the first claims meet NOSCRIPT (as after a restart or
// SCRIPT FLUSH) without a global SCRIPT FLUSH that would disturb other tests.
func legacyStore(t testing.TB, opts Options) (*Store, *redis.Client) {
	c := testenv.Redis(t)
	opts.Prefix = testenv.Name("redisnx")
	s, err := New(c, opts)
	if err != nil {
		t.Fatal(err)
	}
	s.legacy.Store(true)
	s.claim = redis.NewScript(claimSrc + "\n-- " + opts.Prefix + "\n")
	t.Cleanup(func() { deleteKeys(t, c, opts.Prefix) })
	return s, c
}

func deleteKeys(t testing.TB, c *redis.Client, prefix string) {
	ctx := context.Background()
	it := c.Scan(ctx, 0, prefix+":*", 1000).Iterator()
	for it.Next(ctx) {
		c.Unlink(ctx, it.Val())
	}
	if err := it.Err(); err != nil {
		t.Logf("cleanup of %s:*: %v", prefix, err)
	}
}

// TestConformanceLegacy runs the suite on the claim script path.
func TestConformanceLegacy(t *testing.T) {
	t.Parallel()
	deduptest.RunLease(t, deduptest.LeaseHarness{
		New: func(t testing.TB, cfg deduptest.Config) deduptest.LeaseInstance {
			s, _ := legacyStore(t, Options{Lease: cfg.Lease, TTL: cfg.TTL})
			return deduptest.LeaseInstance{Store: s}
		},
		Down: func(t testing.TB) dedup.LeaseStore {
			c := redis.NewClient(&redis.Options{Addr: testenv.DeadAddr(t), MaxRetries: -1, DialerRetries: 1})
			t.Cleanup(func() { _ = c.Close() })
			s, err := New(c, Options{})
			if err != nil {
				t.Fatal(err)
			}
			s.legacy.Store(true)
			return s
		},
	})
}

// TestClaimBatchLoadsMissingScript: a pipeline that meets NOSCRIPT loads the
// script and claims again.
func TestClaimBatchLoadsMissingScript(t *testing.T) {
	t.Parallel()
	s, c := legacyStore(t, Options{})
	ctx := testenv.Ctx(t)
	if ok := s.claim.Exists(ctx, c).Val(); len(ok) != 1 || ok[0] {
		t.Fatalf("SCRIPT EXISTS = %v, want the fresh script unknown", ok)
	}
	scope := testenv.UniqueID("s")
	k1 := dedup.NewKey(scope, "a", []byte("1"))
	k2 := dedup.NewKey(scope, "b", []byte("2"))
	res, err := s.ClaimBatch(ctx, []dedup.Key{k1, k2, k1})
	if err != nil {
		t.Fatalf("ClaimBatch without the script loaded: %v", err)
	}
	if res[0].Err != nil || res[1].Err != nil || !errors.Is(res[2].Err, dedup.ErrInFlight) {
		t.Fatalf("results %+v, want lease, lease, in flight", res)
	}
	if ok := s.claim.Exists(ctx, c).Val(); len(ok) != 1 || !ok[0] {
		t.Fatalf("SCRIPT EXISTS after the batch = %v, want the script loaded", ok)
	}
}

// replyError is an error reply as a Redis server would send it.
type replyError string

func (e replyError) Error() string { return string(e) }
func (replyError) RedisError()     {}

// oldRedis makes the client answer SET ... GET the way Redis 6 does.
type oldRedis struct{}

func (oldRedis) DialHook(next redis.DialHook) redis.DialHook { return next }

func (oldRedis) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if isSetGet(cmd) {
			cmd.SetErr(replyError("ERR syntax error"))
			return cmd.Err()
		}
		return next(ctx, cmd)
	}
}

func (oldRedis) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		rest := cmds[:0:0]
		for _, cmd := range cmds {
			if isSetGet(cmd) {
				cmd.SetErr(replyError("ERR syntax error"))
				continue
			}
			rest = append(rest, cmd)
		}
		if len(rest) == 0 {
			return nil
		}
		return next(ctx, rest)
	}
}

func isSetGet(cmd redis.Cmder) bool {
	args := cmd.Args()
	return cmd.Name() == "set" && len(args) > 0 && args[len(args)-1] == "get"
}

// TestOldRedisFallsBack: when Redis refuses SET NX GET, the store switches to
// the claim script and the claim still succeeds, without a double claim.
func TestOldRedisFallsBack(t *testing.T) {
	t.Parallel()
	c := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr()})
	t.Cleanup(func() { _ = c.Close() })
	testenv.Redis(t) // skips when Redis is missing
	c.AddHook(oldRedis{})
	prefix := testenv.Name("redisnx")
	s, err := New(c, Options{Prefix: prefix})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { deleteKeys(t, c, prefix) })
	ctx := testenv.Ctx(t)
	key := dedup.NewKey(testenv.UniqueID("s"), "a", []byte("1"))
	l, err := s.Claim(ctx, key)
	if err != nil {
		t.Fatalf("Claim on an old Redis: %v", err)
	}
	if !s.legacy.Load() {
		t.Fatal("the store did not switch to the claim script")
	}
	if _, err := s.Claim(ctx, key); !errors.Is(err, dedup.ErrInFlight) {
		t.Fatalf("second claim = %v, want ErrInFlight", err)
	}
	if err := s.Complete(ctx, l, []byte("r")); err != nil {
		t.Fatal(err)
	}
	s2, _ := New(c, Options{Prefix: prefix})
	res, err := s2.ClaimBatch(ctx, []dedup.Key{key, dedup.NewKey(key.Scope, "b", nil)})
	if err != nil {
		t.Fatal(err)
	}
	if r, ok := dedup.StoredResult(res[0].Err); !ok || string(r) != "r" || res[1].Err != nil {
		t.Fatalf("batch on an old Redis = %+v", res)
	}
}

// TestClaimResult covers the answers to a claim that found a stored record,
// without Redis.
func TestClaimResult(t *testing.T) {
	t.Parallel()
	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"}) // never dialled
	defer c.Close()
	s, err := New(c, Options{Lease: 7 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	fpA := dedup.FingerprintOf([]byte("a"))
	fpB := dedup.FingerprintOf([]byte("b"))
	key := dedup.Key{Scope: "s", ID: "1", Fingerprint: fpA}
	done := func(fp dedup.Fingerprint, result string) string {
		return string(append(append([]byte{stateDone}, fp[:]...), result...))
	}
	for _, tc := range []struct {
		name    string
		key     dedup.Key
		stored  any // nil: SET NX GET set the key
		want    error
		result  string
		granted bool
	}{
		{name: "absent", key: key, granted: true},
		{name: "our own record (a resent command)", key: key, stored: string(inFlightRecord(fpA, "tok")), granted: true},
		{name: "another owner", key: key, stored: string(inFlightRecord(fpA, "other")), want: dedup.ErrInFlight},
		{name: "another owner, no fingerprint stored", key: key, stored: string(inFlightRecord(dedup.Fingerprint{}, "other")), want: dedup.ErrInFlight},
		{name: "another owner, other content", key: key, stored: string(inFlightRecord(fpB, "other")), want: dedup.ErrFingerprintMismatch},
		{name: "done", key: key, stored: done(fpA, "r"), want: dedup.ErrDuplicate, result: "r"},
		{name: "done, claim without fingerprint", key: dedup.Key{Scope: "s", ID: "1"}, stored: done(fpB, "r"), want: dedup.ErrDuplicate, result: "r"},
		{name: "done, other content", key: key, stored: done(fpB, "r"), want: dedup.ErrFingerprintMismatch},
		{name: "no fingerprint, another owner", key: key, stored: string(inFlightRecord(dedup.Fingerprint{}, "other")), want: dedup.ErrInFlight},
		{name: "no fingerprint, our own record", key: dedup.Key{Scope: "s", ID: "1"}, stored: string(inFlightRecord(dedup.Fingerprint{}, "tok")), granted: true},
		{name: "no fingerprint, done", key: key, stored: "dr", want: dedup.ErrDuplicate, result: "r"},
		{name: "no fingerprint, done, no result", key: key, stored: "d", want: dedup.ErrDuplicate},
		{name: "foreign short value", key: key, stored: "hello"},
		{name: "foreign short record", key: key, stored: "D" + string(make([]byte, 10))},
		{name: "foreign state byte", key: key, stored: "X" + string(make([]byte, 40))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			op := claimOp{key: tc.key, rkey: s.RedisKey(tc.key), token: "tok", cmd: redis.NewCmd(context.Background()), retryAfter: 3 * time.Second}
			if tc.stored == nil {
				op.cmd.SetErr(redis.Nil)
			} else {
				op.cmd.SetVal(tc.stored)
			}
			l, err := s.result(&op)
			if tc.granted {
				if err != nil || l == nil || l.Token != "tok" || l.TTL != 7*time.Second || l.Key != tc.key {
					t.Fatalf("result = (%+v, %v), want a lease", l, err)
				}
				return
			}
			if l != nil || err == nil {
				t.Fatalf("result = (%+v, %v), want an error", l, err)
			}
			if tc.want == nil {
				for _, sentinel := range []error{dedup.ErrDuplicate, dedup.ErrInFlight, dedup.ErrFingerprintMismatch} {
					if errors.Is(err, sentinel) {
						t.Fatalf("result = %v; a foreign value must not look like %v", err, sentinel)
					}
				}
				return
			}
			if !errors.Is(err, tc.want) {
				t.Fatalf("result = %v, want %v", err, tc.want)
			}
			var ce *dedup.ClaimError
			if !errors.As(err, &ce) {
				t.Fatalf("%T is not a *dedup.ClaimError", err)
			}
			if string(ce.Result) != tc.result {
				t.Fatalf("result %q, want %q", ce.Result, tc.result)
			}
			if tc.want == dedup.ErrInFlight && ce.RetryAfter != 3*time.Second {
				t.Fatalf("RetryAfter = %v, want the PTTL", ce.RetryAfter)
			}
		})
	}
}

// TestLegacyReadsPreviousLayout: on the claim script's path too, a record
// of the previous layout answers the claim and the claim leaves no key.
func TestLegacyReadsPreviousLayout(t *testing.T) {
	t.Parallel()
	s, c := legacyStore(t, Options{})
	ctx := testenv.Ctx(t)
	fp := dedup.FingerprintOf([]byte("p"))
	done := dedup.Key{Scope: testenv.UniqueID("s"), ID: "done", Fingerprint: fp}
	busy := dedup.Key{Scope: done.Scope, ID: "busy"}
	if err := c.Set(ctx, s.oldKey(done), string(append(append([]byte{stateDone}, fp[:]...), "r"...)), time.Hour).Err(); err != nil {
		t.Fatal(err)
	}
	if err := c.Set(ctx, s.oldKey(busy), string(inFlightRecord(fp, "other")), time.Minute).Err(); err != nil {
		t.Fatal(err)
	}
	res, err := s.ClaimBatch(ctx, []dedup.Key{done, busy})
	if err != nil {
		t.Fatal(err)
	}
	if r, ok := dedup.StoredResult(res[0].Err); !ok || string(r) != "r" {
		t.Fatalf("claim of a done key of the previous layout = %v", res[0].Err)
	}
	var ce *dedup.ClaimError
	if !errors.As(res[1].Err, &ce) || !errors.Is(ce, dedup.ErrInFlight) || ce.RetryAfter <= 0 || ce.RetryAfter > time.Minute {
		t.Fatalf("claim of an in-flight key of the previous layout = %v, want ErrInFlight with its PTTL", res[1].Err)
	}
	for _, k := range []dedup.Key{done, busy} {
		if n := c.Exists(ctx, s.RedisKey(k)).Val(); n != 0 {
			t.Fatalf("the claim of %s left its key behind", k)
		}
	}
}

// TestMixedBatch: one batch that carries claims and token scripts together
// (a claim queued behind another caller's Complete) gives each its own
// answer, also when the server lacks the scripts (NOSCRIPT for both kinds)
// and when it refuses SET NX GET.
func TestMixedBatch(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name  string
		store func(t *testing.T) (*Store, *redis.Client)
		// doneClaim is the answer to the claim of a key whose Complete
		// is in the same batch: the scripts go first, but a script sent
		// again after NOSCRIPT runs after the claims.
		doneClaim error
	}{
		{"SET NX GET", func(t *testing.T) (*Store, *redis.Client) {
			s, c := legacyStore(t, Options{})
			s.legacy.Store(false)
			return s, c
		}, dedup.ErrDuplicate},
		{"scripts unknown to the server", func(t *testing.T) (*Store, *redis.Client) {
			s, c := legacyStore(t, Options{})
			s.complete = newTokenScript(completeSrc+"\n-- "+testenv.UniqueID("mixed")+"\n", true)
			s.release = newTokenScript(releaseSrc+"\n-- "+testenv.UniqueID("mixed")+"\n", true)
			return s, c
		}, dedup.ErrInFlight},
		{"SET NX GET refused", func(t *testing.T) (*Store, *redis.Client) {
			c := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr()})
			t.Cleanup(func() { _ = c.Close() })
			testenv.Redis(t) // skips when Redis is missing
			c.AddHook(oldRedis{})
			prefix := testenv.Name("redisnx")
			s, err := New(c, Options{Prefix: prefix})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { deleteKeys(t, c, prefix) })
			return s, c
		}, dedup.ErrDuplicate},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, c := tc.store(t)
			ctx := testenv.Ctx(t)
			scope := testenv.UniqueID("s")
			done := dedup.NewKey(scope, "done", []byte("1"))
			gone := dedup.NewKey(scope, "gone", []byte("2"))
			lDone, err := s.Claim(ctx, done)
			if err != nil {
				t.Fatal(err)
			}
			lGone, err := s.Claim(ctx, gone)
			if err != nil {
				t.Fatal(err)
			}
			fresh := dedup.NewKey(scope, "fresh", []byte("3"))
			var claimFresh, claimDone claimOp
			s.newClaimOp(&claimFresh, fresh)
			s.newClaimOp(&claimDone, done) // in flight under lDone
			complete := &scriptCall{script: s.complete, key: s.RedisKey(done), args: []any{lDone.Token, []byte("r"), s.ttlArg}}
			stale := &scriptCall{script: s.complete, key: s.RedisKey(gone), args: []any{"not-the-token", []byte("x"), s.ttlArg}}
			release := &scriptCall{script: s.release, key: s.RedisKey(gone), args: []any{lGone.Token}}
			rt := &pipelineCount{}
			c.AddHook(rt)
			ops := []nodeOp{{call: complete}, {claim: &claimFresh}, {call: stale}, {claim: &claimDone}, {call: release}}
			if err := s.runOps(ctx, ops); err != nil {
				t.Fatalf("runOps: %v", err)
			}
			if n := rt.pipelines.Load(); tc.name == "SET NX GET" && n != 1 {
				t.Errorf("the batch took %d pipelines, want 1", n)
			}
			for _, sc := range []struct {
				name string
				call *scriptCall
				want int64
			}{{"complete", complete, 1}, {"complete with a stale token", stale, 0}, {"release", release, 1}} {
				if n, err := sc.call.cmd.Int64(); err != nil || n != sc.want {
					t.Errorf("%s = (%d, %v), want %d", sc.name, n, err, sc.want)
				}
			}
			if l, err := s.result(&claimFresh); err != nil || l.Token != claimFresh.token {
				t.Errorf("claim of a fresh key = (%+v, %v), want its lease", l, err)
			}
			if _, err := s.result(&claimDone); !errors.Is(err, tc.doneClaim) {
				t.Errorf("claim of the key completed in the same batch = %v, want %v", err, tc.doneClaim)
			}
			if r, ok := dedup.StoredResult(func() error { _, err := s.Claim(ctx, done); return err }()); !ok || string(r) != "r" {
				t.Errorf("claim after the batch: result %q (duplicate %v), want the stored %q", r, ok, "r")
			}
			if l, err := s.Claim(ctx, gone); err != nil {
				t.Errorf("claim of the released key = %v, want a lease", err)
			} else if err := s.Complete(ctx, lGone, nil); !errors.Is(err, dedup.ErrLeaseLost) {
				t.Errorf("Complete with the released lease = %v, want ErrLeaseLost", err)
			} else {
				_ = s.Release(ctx, l)
			}
		})
	}
}

// pipelineCount counts the pipelines a client sends.
type pipelineCount struct{ pipelines atomic.Int64 }

func (*pipelineCount) DialHook(next redis.DialHook) redis.DialHook          { return next }
func (*pipelineCount) ProcessHook(next redis.ProcessHook) redis.ProcessHook { return next }
func (p *pipelineCount) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		p.pipelines.Add(1)
		return next(ctx, cmds)
	}
}
