package chaos

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/adapters/kafka/kafkapg"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/pgtable"
)

// kafka/kafkapg/sigkill: three adapters/kafka consumer children in one
// group over six partitions, their positions stored in PostgreSQL with
// kafkapg (the claim, the effect and the partition position in one
// transaction; ConsumerOptions.Offsets loads the positions when a
// partition is assigned). Besides the SIGKILLs, the runner moves every
// partition's leadership and the group's coordinator among three brokers
// every few seconds: what the clients see of a broker going away. The
// stall detector watches the group throughout.

const (
	kafkaOffsetsPartitions = 6
	kafkaOffsetsWorkers    = 3
	kafkaOffsetsBrokers    = 3
)

func init() {
	RegisterChild("kafka-consumer-offsets", kafkaOffsetsChild)
	Register(kafkaOffsetsCell("kafka/kafkapg/sigkill+failover"))
}

// kafkaOffsetsChild is kafkaChild with kafkapg: kafkapg.Transactional
// stores the position with each effect, and the Consumer loads it.
func kafkaOffsetsChild(ctx context.Context) error {
	r, err := newChildRun(ctx)
	if err != nil {
		return err
	}
	defer r.quit()
	stopDump, err := dumpGoroutinesOn(r.cfg.Log)
	if err != nil {
		return err
	}
	defer stopDump()
	pool, err := childPool(r.ctx, r.cfg.PGURL, 4)
	if err != nil {
		return err
	}
	defer pool.Close()
	store, err := pgtable.New(pool, pgtable.Options{Schema: r.cfg.Schema, Logger: childLogger()})
	if err != nil {
		return err
	}
	offsets, err := kafkapg.NewOffsets(pool, kafkapg.OffsetsOptions{Schema: r.cfg.Schema})
	if err != nil {
		return err
	}
	if err := offsets.Migrate(r.ctx); err != nil {
		return err
	}
	ins := effectSQL(r.cfg.Effects)
	inner, err := kafkapg.Transactional(store, offsets, consumer.TxOptions{Scope: r.cfg.Scope},
		func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
			if _, err := tx.Exec(ctx, ins, msg.ID, r.cfg.Name); err != nil {
				return err
			}
			r.kill.at(pointAfterEffect)
			return nil
		})
	if err != nil {
		return err
	}
	h := consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		if msg.Attempt <= 1 {
			r.log.record(msg.ID)
		}
		r.kill.at(pointBeforeTx)
		err := inner.Handle(ctx, msg)
		if err == nil {
			r.kill.at(pointAfterCommit)
		}
		return err
	})
	return runKafkaChild(r, h, offsets)
}

// kafkaOffsetsCell is the kafkapg SIGKILL and failover cell.
func kafkaOffsetsCell(name string) Cell {
	return Cell{
		Name: name,
		Run: func(ctx context.Context, env *Env) (Result, error) {
			n, kills := env.Pick(1000, 20000), env.Pick(8, 40)
			return withBase(ctx, env, name, storePG, n, func(b *cellBase) (Result, error) {
				w, err := newKafkaWorkload(ctx, b, "kafka-consumer-offsets", kafkaOffsetsPartitions, kafkaOffsetsBrokers)
				if err != nil {
					return Result{}, err
				}
				defer w.closer()
				fctx, stopFailover := context.WithCancel(ctx)
				failovers := make(chan int, 1)
				go func() { failovers <- failover(fctx, w.k, 3*time.Second) }()
				res, err := killCell(ctx, b, w, killSpec{
					kills: kills, workers: kafkaOffsetsWorkers, points: consumerPoints,
					named: 8 * time.Second, limit: time.Duration(env.Pick(120, 900)) * time.Second,
				})
				stopFailover()
				res.Restarts += <-failovers
				res.Note += "; leader and coordinator moves counted as restarts"
				return res, err
			})
		},
	}
}

// failover moves every partition's leadership and the coordinators every
// interval until ctx is done, and returns how many times.
func failover(ctx context.Context, k *kafkaEnv, every time.Duration) int {
	n := 0
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return n
		case <-t.C:
		}
		k.cluster.ShufflePartitionLeaders()
		k.cluster.RehashCoordinators()
		n++
	}
}
