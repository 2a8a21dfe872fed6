package twolevel_test

import (
	"cmp"
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/dedup/twolevel"
)

// Redis answers hot duplicates in front of PostgreSQL, whose claim in the
// business transaction stays the final word. The first delivery is decided
// by the database; the redelivery is answered by the Redis mark alone. When
// Redis loses the mark (a restart without persistence, an eviction), the
// database still catches the duplicate and writes the mark back.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	cfg, err := pgxpool.ParseConfig(cmp.Or(os.Getenv("IDEM_TEST_POSTGRES_URL"), "postgres://postgres@127.0.0.1:5432/test?sslmode=disable"))
	if err != nil {
		fmt.Println(err)
		return
	}
	cfg.ConnConfig.ConnectTimeout = 5 * time.Second
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer pool.Close()
	rdb := redis.NewClient(&redis.Options{
		Addr:        cmp.Or(os.Getenv("IDEM_TEST_REDIS_ADDR"), "127.0.0.1:6379"),
		DialTimeout: 5 * time.Second,
	})
	defer rdb.Close()

	// A fresh schema and key prefix per run.
	suffix := strings.ToLower(rand.Text())
	schema := "idem_example_" + suffix
	defer func() {
		_, _ = pool.Exec(context.Background(), "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
	}()
	db, err := pgtable.New(pool, pgtable.Options{Schema: schema})
	if err != nil {
		fmt.Println(err)
		return
	}
	if err := db.Migrate(ctx); err != nil {
		fmt.Println(err)
		return
	}
	cache, err := redisnx.New(rdb, redisnx.Options{Prefix: "idem-example-" + suffix, TTL: time.Hour})
	if err != nil {
		fmt.Println(err)
		return
	}

	var source twolevel.Source
	store, err := twolevel.New(cache, db, twolevel.Options{
		Stats: func(s twolevel.Source) { source = s }, // feed a metric here
	})
	if err != nil {
		fmt.Println(err)
		return
	}

	key := dedup.NewKey("billing-consumer/charge", "order-A-1", []byte(`{"order":"A-1","amount":100}`))
	defer rdb.Del(context.Background(), cache.RedisKey(key))
	charge := func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		// Business writes go here, in tx.
		return []byte("charged ch_42"), nil
	}
	deliver := func(delivery int) {
		result, err := store.Process(ctx, key, charge)
		if stored, dup := dedup.StoredResult(err); dup {
			fmt.Printf("delivery %d: duplicate %q (%s)\n", delivery, stored, source)
			return
		}
		if err != nil {
			fmt.Printf("delivery %d: %v (%s)\n", delivery, err, source)
			return
		}
		fmt.Printf("delivery %d: processed %q (%s)\n", delivery, result, source)
	}

	deliver(1)
	deliver(2)
	// Redis forgets the mark.
	if err := rdb.Del(ctx, cache.RedisKey(key)).Err(); err != nil {
		fmt.Println(err)
		return
	}
	deliver(3)
	deliver(4)
	// Output:
	// delivery 1: processed "charged ch_42" (db_first)
	// delivery 2: duplicate "charged ch_42" (cache_duplicate)
	// delivery 3: duplicate "charged ch_42" (db_duplicate)
	// delivery 4: duplicate "charged ch_42" (cache_duplicate)
}
