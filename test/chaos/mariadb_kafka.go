package chaos

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/sqltable"
)

// kafka/sqltable-mariadb/sigkill: the Kafka consumer SIGKILL cell of
// kafka/pgtable with the claim in dedup/sqltable on the shared MariaDB and
// the effect an INSERT into a MariaDB table (no unique constraint) in the
// claim's transaction. The children are SIGKILLed at random and at the named
// points (before the transaction, after the effect before the commit, after
// the commit before the offset commit) and restarted at once. Promise:
// 0 duplicate effects, 0 lost, over every record (each was acknowledged:
// the run ends only once the group committed every partition to its end).

// myKafkaWorkload is the kafka/pgtable workload (kfake topic, group,
// offsets) with children that claim in sqltable and count progress in the
// MariaDB oracle.
type myKafkaWorkload struct {
	*kafkaWorkload
	o     *myOracle
	dsn   string // the children's DSN, default database the oracle's
	scope string
}

func (w *myKafkaWorkload) child() string { return "kafka-sqltable-consumer" }

func (w *myKafkaWorkload) config(int) childConfig {
	return childConfig{
		Store: storeMySQL, MySQLDSN: w.dsn, Schema: w.o.database, Effects: w.o.table, Scope: w.scope,
		Brokers: w.k.brokers, Topic: w.topic, Group: w.group,
	}
}

func (w *myKafkaWorkload) progress(ctx context.Context) (int, error) { return w.o.distinct(ctx) }

// sqlHandler is brokerHandler for sqltable on MariaDB: the effect under
// consumer.Transactional (in the claim's transaction), the kill points
// around it and the deliveries log in front.
func sqlHandler(r *childRun, db *sql.DB) (consumer.Handler, error) {
	cfg := r.cfg
	store, err := sqltable.New(db, sqltable.MySQL, sqltable.Options{Schema: cfg.Schema, Logger: childLogger()})
	if err != nil {
		return nil, err
	}
	ins := "INSERT INTO " + cfg.Effects + " (id, worker) VALUES (?, ?)"
	inner, err := consumer.Transactional(store, consumer.TxOptions{Scope: cfg.Scope},
		func(ctx context.Context, tx *sql.Tx, msg *consumer.Message) error {
			if _, err := tx.ExecContext(ctx, ins, msg.ID, cfg.Name); err != nil {
				return err
			}
			r.kill.at(pointAfterEffect)
			return nil
		})
	if err != nil {
		return nil, err
	}
	return consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		if msg.Attempt <= 1 { // a broker delivery, not an in-process retry
			r.log.record(msg.ID)
		}
		r.kill.at(pointBeforeTx)
		err := inner.Handle(ctx, msg)
		if err == nil {
			r.kill.at(pointAfterCommit)
		}
		return err
	}), nil
}

// kafkaSQLChild is the kafka-sqltable-consumer child: an adapters/kafka
// Consumer with sqlHandler.
func kafkaSQLChild(ctx context.Context) error {
	r, err := newChildRun(ctx)
	if err != nil {
		return err
	}
	defer r.quit()
	db, err := myOpen(r.ctx, r.cfg.MySQLDSN, 4)
	if err != nil {
		return err
	}
	defer func() { _ = db.Close() }()
	h, err := sqlHandler(r, db)
	if err != nil {
		return err
	}
	c, err := idemkafka.NewConsumer(kafkaReaderConfig(r.cfg.Brokers, r.cfg.Group, r.cfg.Topic, kafkaSession), h, idemkafka.ConsumerOptions{
		CommitEvery:     50,
		CommitInterval:  100 * time.Millisecond,
		Backoff:         consumer.Backoff{Initial: 50 * time.Millisecond, Max: time.Second},
		DeadLetterTopic: r.cfg.Topic + "_dlq",
		Telemetry: consumer.Telemetry{
			Logger: childLogger(),
		},
	})
	if err != nil {
		return err
	}
	r.ready()
	return r.done(c.Run(r.ctx))
}

// kafkaSQLCell is the Kafka consumer SIGKILL cell on sqltable and MariaDB.
func kafkaSQLCell(name string) Cell {
	return Cell{
		Name: name,
		Run: func(ctx context.Context, env *Env) (res Result, err error) {
			n, kills := env.Pick(1000, 20000), env.Pick(8, 40)
			root, err := myDSN(mySharedDSN(), "")
			if err != nil {
				return res, err
			}
			admin, err := myOpen(ctx, root, 4)
			if err != nil {
				return res, err
			}
			defer func() { _ = admin.Close() }()
			o, err := newMyOracle(ctx, admin, name, env.Seed)
			if err != nil {
				return res, err
			}
			defer func() {
				dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
				defer cancel()
				err = errors.Join(err, o.drop(dctx))
			}()
			if err := myMigrate(ctx, admin, o.database); err != nil {
				return res, err
			}
			dsn, err := myDSN(mySharedDSN(), o.database)
			if err != nil {
				return res, err
			}
			b := &cellBase{env: env, name: name, store: storeMySQL, scope: "chaos/" + name, suffix: randSuffix()}
			b.ids = makeIDs("m"+b.suffix[:6], n)
			kw, err := newKafkaWorkload(ctx, b, "kafka-sqltable-consumer", kafkaPartitions, 1)
			if err != nil {
				return res, err
			}
			defer kw.closer()
			w := &myKafkaWorkload{kafkaWorkload: kw, o: o, dsn: dsn, scope: b.scope}
			st, runErr := runKills(ctx, env, w, killSpec{
				ids: b.ids, kills: kills, workers: 2, points: consumerPoints,
				named: 8 * time.Second, limit: time.Duration(env.Pick(90, 600)) * time.Second,
			})
			res = Result{Messages: n, Kills: st.kills, Restarts: st.restarts, Note: "sqltable on MariaDB; " + st.note()}
			deliveries, distinct, cerr := countDeliveries(env.TempDir, "deliveries")
			if cerr != nil && runErr == nil {
				runErr = cerr
			}
			res.Redeliveries = deliveries - distinct
			must := b.ids
			if runErr != nil {
				must = nil // only a finished run had every input acknowledged
			}
			if err := myCheck(context.WithoutCancel(ctx), o, must, &res); err != nil {
				return res, errors.Join(runErr, err)
			}
			if runErr == nil {
				env.Logf("%d inputs, %d deliveries, %d kills in %v", n, deliveries, st.kills, st.elapsed.Round(100*time.Millisecond))
			}
			return res, runErr
		},
	}
}

// myMigrate applies sqltable's migrations in database, through db.
func myMigrate(ctx context.Context, db *sql.DB, database string) error {
	st, err := sqltable.New(db, sqltable.MySQL, sqltable.Options{Schema: database, Logger: quietLogger()})
	if err != nil {
		return err
	}
	if err := st.Migrate(ctx); err != nil {
		return fmt.Errorf("sqltable migrate: %w", err)
	}
	return nil
}
