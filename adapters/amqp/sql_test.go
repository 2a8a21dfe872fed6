package idemamqp

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/sqltable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// Every message published twice with the same message-id, consumed by
// Consumers with consumer.Transactional on sqltable over MariaDB: the
// copies run concurrently (two Consumers, four workers each), the second
// waits on the first's claim and is acknowledged as a duplicate, and each
// id has its effect exactly once in MariaDB.
func TestSqlConsumerTransactionalOnMariaDB(t *testing.T) {
	t.Parallel()
	url := testenv.AMQPURL()
	q := consQueue(t, url, consTestDelays)
	db := testenv.MySQL(t, "")
	db.SetMaxOpenConns(20)
	ctx := context.Background()
	table, eff := testenv.Name("pe"), testenv.Name("eff")
	t.Cleanup(func() {
		_, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS `"+table+"`, `"+table+"_migrations`, `"+eff+"`")
	})
	claims, err := sqltable.New(db, sqltable.MySQL, sqltable.Options{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := claims.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := db.ExecContext(ctx, "CREATE TABLE `"+eff+"` (id VARCHAR(64) NOT NULL) ENGINE = InnoDB"); err != nil {
		t.Fatal(err)
	}
	h, err := consumer.Transactional(claims, consumer.TxOptions{Scope: "test/amqp-sql"},
		func(ctx context.Context, tx *sql.Tx, msg *consumer.Message) error {
			_, err := tx.ExecContext(ctx, "INSERT INTO `"+eff+"` (id) VALUES (?)", msg.ID)
			return err
		})
	if err != nil {
		t.Fatal(err)
	}
	var cs []*Consumer
	for range 2 {
		c, err := NewConsumer(url, q, h, consOpts(ConsumerOptions{Concurrency: 4}))
		if err != nil {
			t.Fatal(err)
		}
		cs = append(cs, c)
	}
	stops := []func(){consStart(t, cs[0]), consStart(t, cs[1])}

	const n = 100
	msgs := consMsgs("sql", n)
	// Each message right after itself, so that the two copies are handled
	// at the same time by different workers.
	pubs := msgs[:0:0]
	for _, m := range msgs {
		pubs = append(pubs, m, m)
	}
	consPublish(t, url, q, pubs...)
	dups := func() (d, acked int64) {
		for _, c := range cs {
			st := c.Stats()
			d += st.Duplicates
			acked += st.Acked
		}
		return d, acked
	}
	testenv.Eventually(t, 60*time.Second, "every copy to be acknowledged", func() bool {
		_, a := dups()
		return a >= 2*n
	})
	for _, stop := range stops {
		stop()
	}
	d, a := dups()
	var rows, distinct, twiceApplied int
	if err := db.QueryRowContext(ctx, "SELECT COUNT(*), COUNT(DISTINCT id) FROM `"+eff+"`").Scan(&rows, &distinct); err != nil {
		t.Fatal(err)
	}
	if err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM (SELECT id FROM `"+eff+"` GROUP BY id HAVING COUNT(*) > 1) d").Scan(&twiceApplied); err != nil {
		t.Fatal(err)
	}
	t.Logf("%d publishes of %d ids: %d acknowledged, %d of them as duplicates; %d effect rows", 2*n, n, a, d, rows)
	if twiceApplied != 0 || distinct != n || rows != n {
		t.Fatalf("%d ids applied more than once, %d of %d applied, %d effect rows", twiceApplied, distinct, n, rows)
	}
	if a != 2*n || d != n {
		t.Errorf("%d acknowledged, %d of them as duplicates; want %d, %d", a, d, 2*n, n)
	}
	if left := consDepth(t, url, q); left != 0 {
		t.Errorf("%d messages left in the queue", left)
	}
}
