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
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/dedup/redisnx"
	"github.com/idemkit/idem/dedup/twolevel"
)

// Redis answers hot duplicates in front of PostgreSQL, whose claim in the
// business transaction stays the final word. The first delivery is decided
// by the database; the redelivery is answered by the Redis mark alone. When
// Redis loses the mark (a restart without persistence, an eviction), the
// database still catches the duplicate and writes the mark back. The
// idem.twolevel.answers counter tells which level answered each call.
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

	// In an application the MeterProvider exports to Prometheus or OTLP;
	// here a reader with delta temporality tells the level that answered
	// since the last read.
	reader := sdkmetric.NewManualReader(sdkmetric.WithTemporalitySelector(
		func(sdkmetric.InstrumentKind) metricdata.Temporality { return metricdata.DeltaTemporality }))
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer func() { _ = mp.Shutdown(context.Background()) }()
	store, err := twolevel.New(cache, db, twolevel.Options{MeterProvider: mp})
	if err != nil {
		fmt.Println(err)
		return
	}
	answered := func() string {
		var rm metricdata.ResourceMetrics
		if err := reader.Collect(ctx, &rm); err != nil {
			return err.Error()
		}
		for _, sm := range rm.ScopeMetrics {
			for _, m := range sm.Metrics {
				sum, ok := m.Data.(metricdata.Sum[int64])
				if m.Name != "idem.twolevel.answers" || !ok {
					continue
				}
				for _, p := range sum.DataPoints {
					if v, _ := p.Attributes.Value(attribute.Key("idem.source")); p.Value > 0 {
						return v.AsString()
					}
				}
			}
		}
		return "no answer"
	}

	key := dedup.NewKey("billing-consumer/charge", "order-A-1", []byte(`{"order":"A-1","amount":100}`))
	defer rdb.Del(context.Background(), cache.RedisKey(key))
	charge := func(ctx context.Context, tx pgx.Tx) ([]byte, error) {
		// Business writes go here, in tx.
		return []byte("charged ch_42"), nil
	}
	deliver := func(delivery int) {
		result, err := store.Process(ctx, key, charge)
		source := answered()
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
