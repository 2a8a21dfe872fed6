package bench

import (
	"context"
	"fmt"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/adapters/httpidem"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// recorder is a go-redis hook that records the round trips a client sends:
// each one a list of commands, each command its arguments.
type recorder struct {
	mu    sync.Mutex
	trips [][][]string
}

func (r *recorder) DialHook(next redis.DialHook) redis.DialHook { return next }

func (r *recorder) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		r.add(cmd)
		return next(ctx, cmd)
	}
}

func (r *recorder) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		r.add(cmds...)
		return next(ctx, cmds)
	}
}

func (r *recorder) add(cmds ...redis.Cmder) {
	trip := make([][]string, len(cmds))
	for i, c := range cmds {
		for _, a := range c.Args() {
			var s string
			switch a := a.(type) {
			case string:
				s = a
			case []byte:
				s = string(a)
			default:
				s = fmt.Sprint(a)
			}
			trip[i] = append(trip[i], s)
		}
	}
	r.mu.Lock()
	r.trips = append(r.trips, trip)
	r.mu.Unlock()
}

// take returns the round trips recorded since the last take, with every
// occurrence of the strings in hide replaced by "…".
func (r *recorder) take(hide ...string) [][][]string {
	r.mu.Lock()
	trips := r.trips
	r.trips = nil
	r.mu.Unlock()
	for _, trip := range trips {
		for _, cmd := range trip {
			for i := range cmd {
				for _, h := range hide {
					cmd[i] = strings.ReplaceAll(cmd[i], h, "…")
				}
			}
		}
	}
	return trips
}

func recordingClient(t *testing.T) (*redis.Client, *recorder, string) {
	t.Helper()
	testenv.Redis(t) // skips, or fails under CI, when Redis is down
	rdb := redis.NewClient(&redis.Options{Addr: testenv.RedisAddr()})
	prefix := testenv.Name("idembench_handtest")
	t.Cleanup(func() {
		ctx := context.Background()
		keys, _ := rdb.Keys(ctx, prefix+"*").Result()
		if len(keys) > 0 {
			_ = rdb.Unlink(ctx, keys...).Err()
		}
		_ = rdb.Close()
	})
	rec := new(recorder)
	rdb.AddHook(rec)
	return rdb, rec, prefix
}

// TestHandSendsRedisnxCommands checks that the commands-by-hand sides of
// the redisnx and RabbitMQ lease rows send, round trip by round trip, the very
// commands redisnx sends for a claim and a complete of the same key: the
// same keys, values, arguments and script, but for the owner token, which
// is random.
func TestHandSendsRedisnxCommands(t *testing.T) {
	rdb, rec, prefix := recordingClient(t)
	ctx := testenv.Ctx(t)
	store, err := redisnx.New(rdb, redisnx.Options{Prefix: prefix, TTL: redisTTL})
	if err != nil {
		t.Fatal(err)
	}
	h := newHandRedis(rdb, prefix)
	// A first complete loads the script, so that neither side below meets
	// NOSCRIPT (its EVAL fallback is one more round trip).
	l, err := store.Claim(ctx, dedup.Key{Scope: "bench", ID: "warm"})
	if err == nil {
		err = store.Complete(ctx, l, nil)
	}
	if err != nil {
		t.Fatal(err)
	}
	rec.take()

	for _, tc := range []struct {
		name   string
		key    dedup.Key
		fp     *[32]byte
		result []byte
	}{
		{name: "redisnx row", key: dedup.Key{Scope: "bench", ID: "a1"}, result: []byte("ok")},
		{name: "RabbitMQ lease row", key: dedup.Key{Scope: "bench/amqp", ID: "m1-0", Fingerprint: dedup.FingerprintOf(payload)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, err := store.Claim(ctx, tc.key)
			if err != nil {
				t.Fatal(err)
			}
			if err := store.Complete(ctx, l, tc.result); err != nil {
				t.Fatal(err)
			}
			idem := rec.take(l.Token)
			if err := rdb.Del(ctx, store.RedisKey(tc.key)).Err(); err != nil {
				t.Fatal(err)
			}
			rec.take()

			key, old := h.keys(tc.key.Scope, tc.key.ID)
			if key != store.RedisKey(tc.key) {
				t.Errorf("hand key %q, redisnx's %q", key, store.RedisKey(tc.key))
			}
			var fp *[32]byte
			if !tc.key.Fingerprint.IsZero() {
				f := fingerprint(payload)
				fp = &f
			}
			token := handToken()
			if err := h.claimNew(ctx, key, old, inFlight(fp, token)); err != nil {
				t.Fatal(err)
			}
			if err := h.complete(ctx, key, token, tc.result); err != nil {
				t.Fatal(err)
			}
			hand := rec.take(token)

			if !slices.EqualFunc(idem, hand, func(a, b [][]string) bool {
				return slices.EqualFunc(a, b, slices.Equal)
			}) {
				t.Errorf("round trips differ:\nredisnx %q\nhand    %q", idem, hand)
			}
			if len(idem) != 2 || len(idem[0]) != 2 || len(idem[1]) != 1 {
				t.Errorf("redisnx sent %q; want a claim pipeline of two commands, then the complete", idem)
			}
		})
	}
}

// TestHandReplaysAsHttpidem checks that the HTTP replay row's
// commands-by-hand side sends what httpidem.New on redisnx sends for a
// replay: one round trip, MGET of the previous layout's key and SET NX GET
// PX on the key, with an in-flight record of the same size (the
// fingerprints differ: httpidem's digests the request otherwise).
func TestHandReplaysAsHttpidem(t *testing.T) {
	rdb, rec, prefix := recordingClient(t)
	ctx := testenv.Ctx(t)
	store, err := redisnx.New(rdb, redisnx.Options{Prefix: prefix, TTL: redisTTL})
	if err != nil {
		t.Fatal(err)
	}
	mw, err := httpidem.New(store, httpidem.Options{})
	if err != nil {
		t.Fatal(err)
	}
	h := newHandRedis(rdb, prefix)

	srv := httptest.NewServer(mw.Handler(payments(nil)))
	defer srv.Close()
	if err := post(ctx, srv.Client(), srv.URL, "hot-idem"); err != nil {
		t.Fatal(err)
	}
	rec.take()
	if err := post(ctx, srv.Client(), srv.URL, "hot-idem"); err != nil {
		t.Fatal(err)
	}
	idem := rec.take()

	hot := "hot-hand"
	key, _ := h.keys(replayScope, hot)
	if err := h.rdb.Set(ctx, key, handReplayRecord(), redisTTL).Err(); err != nil {
		t.Fatal(err)
	}
	hsrv := httptest.NewServer(replayByHand(h))
	defer hsrv.Close()
	rec.take()
	if err := post(ctx, hsrv.Client(), hsrv.URL, hot); err != nil {
		t.Fatal(err)
	}
	hand := rec.take()

	if len(idem) != 1 || len(hand) != 1 || len(idem[0]) != 2 || len(hand[0]) != 2 {
		t.Fatalf("want one round trip of two commands each:\nhttpidem %q\nhand     %q", idem, hand)
	}
	for i, id := range []string{"hot-idem", "hot-hand"} {
		trip := [][][]string{idem[0], hand[0]}[i]
		key, old := h.keys(replayScope, id)
		mget, set := trip[0], trip[1]
		if !slices.Equal(mget, []string{"mget", old}) {
			t.Errorf("%s: %q, want MGET %s", id, mget, old)
		}
		if len(set) != 7 || set[0] != "set" || set[1] != key || !slices.Equal(set[3:], []string{"px", h.lease, "nx", "get"}) {
			t.Errorf("%s: %q, want SET %s <record> px %s nx get", id, set, key, h.lease)
		}
	}
	if a, b := idem[0][1][2], hand[0][1][2]; len(a) != len(b) || a[0] != b[0] {
		t.Errorf("in-flight records differ in shape: httpidem %q, hand %q", a, b)
	}
}
