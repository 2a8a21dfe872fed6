package kafkapg_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/adapters/kafka/kafkapg"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/pgbouncer"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// BatchAll through PgBouncer in transaction mode: four workers deliver
// overlapping batches of 60 ids at once (every id in three batches), and
// every third handler call fails after its write. A failed batch is delivered
// again. The oracle finds every id's effect once.
func TestPgBouncerBatchAll(t *testing.T) {
	direct := testenv.Pool(t, 2)
	pool := pgbouncer.New(t, pgbouncer.Options{}).Pool(t, 8)
	schema := testenv.Schema(t, direct)
	ctx := context.Background()
	claims, err := pgtable.New(pool, pgtable.Options{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := claims.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	e := &allEnv{pool: pool, schema: schema, claims: claims, effects: pgx.Identifier{schema, "effects"}.Sanitize()}
	if _, err := direct.Exec(ctx, "CREATE TABLE "+e.effects+" (id text NOT NULL, payload bytea)"); err != nil {
		t.Fatal(err)
	}
	errCrash := errors.New("crash after the write")
	var calls atomic.Int64
	bh, err := kafkapg.BatchAll(pool, claims, kafkapg.BatchOptions{Scope: "test/pgbouncer"},
		func(ctx context.Context, tx pgx.Tx, msgs []*consumer.Message) error {
			if err := e.insertAll(ctx, tx, msgs); err != nil {
				return err
			}
			if calls.Add(1)%3 == 1 {
				return errCrash
			}
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	const ids, size = 60, 15
	var batches [][]*consumer.Message
	for range 3 {
		perm := rand.Perm(ids)
		for i := 0; i < ids; i += size {
			var b []*consumer.Message
			for _, j := range perm[i : i+size] {
				b = append(b, &consumer.Message{ID: fmt.Sprintf("m-%02d", j), Payload: []byte("v")})
			}
			batches = append(batches, b)
		}
	}
	queue := make(chan []*consumer.Message, len(batches))
	for _, b := range batches {
		queue <- b
	}
	close(queue)
	var (
		mu      sync.Mutex
		acked   []string
		crashes int
		wg      sync.WaitGroup
	)
	for range 4 {
		wg.Go(func() {
			for b := range queue {
				for {
					err := bh(ctx, b)
					var be *idemkafka.BatchError
					switch {
					case err == nil:
						mu.Lock()
						acked = append(acked, idsOf(b)...)
						mu.Unlock()
					case errors.As(err, &be):
						mu.Lock()
						for i, m := range b {
							if be.Errs[i] != nil && !errors.Is(be.Errs[i], dedup.ErrDuplicate) {
								t.Errorf("message %s: %v", m.ID, be.Errs[i])
							}
							acked = append(acked, m.ID)
						}
						mu.Unlock()
					case errors.Is(err, errCrash):
						mu.Lock()
						crashes++
						mu.Unlock()
						continue // delivered again
					default:
						t.Errorf("batch handler: %v", err)
					}
					break
				}
			}
		})
	}
	wg.Wait()
	if crashes == 0 {
		t.Fatal("no batch failed after its write: the redelivery did not happen")
	}
	if len(acked) != 3*ids {
		t.Fatalf("%d acknowledged, want %d", len(acked), 3*ids)
	}
	e.oracle(t, acked)
	t.Logf("oracle: %d ids in %d batches, %d failed batches delivered again, 0 applied twice, 0 lost", ids, len(batches), crashes)
}
