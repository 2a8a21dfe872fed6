package watermill_test

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message/router/middleware"

	idemwm "github.com/idemkit/idem/adapters/watermill"
	"github.com/idemkit/idem/internal/testenv"
)

// Both repositories are drop-ins for Watermill's Deduplicator.
var (
	_ middleware.ExpiringKeyRepository = (*idemwm.RedisKeyRepository)(nil)
	_ middleware.ExpiringKeyRepository = (*idemwm.PostgresKeyRepository)(nil)
)

type keyRepo struct {
	name string
	// setup returns the repository and a function that makes key's mark
	// expire now.
	setup func(t *testing.T) (middleware.ExpiringKeyRepository, func(key string))
}

func keyRepos() []keyRepo {
	return []keyRepo{
		{"redis", func(t *testing.T) (middleware.ExpiringKeyRepository, func(string)) {
			client := testenv.Redis(t)
			r := must(idemwm.NewRedisKeyRepository(client, idemwm.RedisKeyRepositoryOptions{Prefix: testenv.Name("wmdedup"), Window: time.Hour}))
			t.Cleanup(func() {
				keys, _ := client.Keys(context.Background(), r.RedisKey("*")).Result()
				if len(keys) > 0 {
					_ = client.Del(context.Background(), keys...).Err()
				}
			})
			return r, func(key string) {
				if err := client.Del(context.Background(), r.RedisKey(key)).Err(); err != nil {
					t.Fatal(err)
				}
			}
		}},
		{"postgres", func(t *testing.T) (middleware.ExpiringKeyRepository, func(string)) {
			pool, schema := pgEnv(t)
			r := must(idemwm.NewPostgresKeyRepository(pool, idemwm.PostgresKeyRepositoryOptions{Schema: schema, Window: time.Hour}))
			if err := r.Migrate(context.Background()); err != nil {
				t.Fatal(err)
			}
			return r, func(string) {
				// Every mark is past its window.
				if _, err := pool.Exec(context.Background(), "UPDATE "+r.Table()+" SET expires_at = now() - interval '1 second'"); err != nil {
					t.Fatal(err)
				}
			}
		}},
	}
}

// TestKeyRepositories: the first sight of a key is not a duplicate, later
// ones are until the mark expires; binary and long keys work; of concurrent
// first sights exactly one wins.
func TestKeyRepositories(t *testing.T) {
	for _, kr := range keyRepos() {
		t.Run(kr.name, func(t *testing.T) {
			repo, expire := kr.setup(t)
			ctx := context.Background()
			dup := func(key string) bool {
				t.Helper()
				d, err := repo.IsDuplicate(ctx, key)
				if err != nil {
					t.Fatal(err)
				}
				return d
			}
			long := strings.Repeat("k", 300)
			for _, key := range []string{"uuid-1", "\x00\x01\xfe\xff", long, long[:299] + "j"} {
				if dup(key) {
					t.Errorf("%q: first sight is a duplicate", key)
				}
				if !dup(key) {
					t.Errorf("%q: second sight is not a duplicate", key)
				}
			}
			expire("uuid-1")
			if dup("uuid-1") {
				t.Error("an expired mark is still a duplicate")
			}
			if !dup("uuid-1") {
				t.Error("the mark taken over after expiry does not count")
			}

			var firsts atomic.Int32
			var wg sync.WaitGroup
			for range 50 {
				wg.Go(func() {
					d, err := repo.IsDuplicate(ctx, "concurrent")
					if err != nil {
						t.Error(err)
						return
					}
					if !d {
						firsts.Add(1)
					}
				})
			}
			wg.Wait()
			if firsts.Load() != 1 {
				t.Errorf("%d of 50 concurrent first sights won, want 1", firsts.Load())
			}
		})
	}
}

// TestPostgresKeyRepositoryAdmin: Migrate is idempotent and safe to run
// concurrently; Cleanup deletes expired marks only; SQL prints the schema;
// names are checked.
func TestPostgresKeyRepositoryAdmin(t *testing.T) {
	pool, schema := pgEnv(t)
	ctx := context.Background()
	r := must(idemwm.NewPostgresKeyRepository(pool, idemwm.PostgresKeyRepositoryOptions{Schema: schema, Table: "marks", CleanupBatch: 2}))
	var wg sync.WaitGroup
	for range 3 {
		wg.Go(func() {
			if err := r.Migrate(ctx); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	for _, k := range []string{"a", "b", "c", "d", "e"} {
		if _, err := r.IsDuplicate(ctx, k); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := pool.Exec(ctx, "UPDATE "+r.Table()+" SET expires_at = now() - interval '1 second' WHERE key <> 'ke'::bytea"); err != nil {
		t.Fatal(err)
	}
	n, err := r.Cleanup(ctx)
	if err != nil || n != 4 {
		t.Fatalf("cleanup deleted %d, %v; want 4", n, err)
	}
	if d, err := r.IsDuplicate(ctx, "e"); err != nil || !d {
		t.Fatalf("the live mark is gone: %v, %v", d, err)
	}
	if sql := r.SQL(); !strings.Contains(sql, `"`+schema+`"."marks"`) || !strings.Contains(sql, "bytea PRIMARY KEY") {
		t.Errorf("SQL:\n%s", sql)
	}
	for _, o := range []idemwm.PostgresKeyRepositoryOptions{{Table: "Marks"}, {Schema: "a;b"}, {Window: -1}, {Window: time.Microsecond}, {CleanupBatch: -1}} {
		if _, err := idemwm.NewPostgresKeyRepository(pool, o); err == nil {
			t.Errorf("%+v accepted", o)
		}
	}
	client := testenv.Redis(t)
	for _, o := range []idemwm.RedisKeyRepositoryOptions{{Prefix: "a b"}, {Prefix: "{tag}"}, {Window: -time.Second}} {
		if _, err := idemwm.NewRedisKeyRepository(client, o); err == nil {
			t.Errorf("%+v accepted", o)
		}
	}
}

// TestRedisKeyRepositoryWindow: the mark carries the window as its TTL.
func TestRedisKeyRepositoryWindow(t *testing.T) {
	client := testenv.Redis(t)
	r := must(idemwm.NewRedisKeyRepository(client, idemwm.RedisKeyRepositoryOptions{Prefix: testenv.Name("wmdedup"), Window: 90 * time.Second}))
	ctx := context.Background()
	if _, err := r.IsDuplicate(ctx, "k"); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = client.Del(ctx, r.RedisKey("k")).Err() }()
	ttl, err := client.PTTL(ctx, r.RedisKey("k")).Result()
	if err != nil || ttl <= 0 || ttl > 90*time.Second {
		t.Fatalf("PTTL = %v, %v; want at most the 90s window", ttl, err)
	}
}
