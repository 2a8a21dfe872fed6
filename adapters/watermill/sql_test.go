package idemwatermill_test

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"testing"

	wm "github.com/ThreeDotsLabs/watermill"
	"github.com/ThreeDotsLabs/watermill/message"

	"github.com/idemkit/idem/adapters/watermill"
	"github.com/idemkit/idem/dedup/sqltable"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox/sqloutbox"
)

// TestTransactionalMariaDB: Transactional on the database/sql store over
// MariaDB, with the outbox on database/sql. Each order is delivered twice;
// its charge (through Tx[*sql.Tx]) and its receipt (written to the outbox
// in the same transaction) exist once, and a first attempt that failed
// after writing left nothing behind.
func TestTransactionalMariaDB(t *testing.T) {
	t.Parallel()
	db := testenv.MySQL(t, "")
	ctx := testenv.Ctx(t)
	table, charges, obTable := testenv.Name("wk"), testenv.Name("charges"), testenv.Name("ob")
	t.Cleanup(func() {
		_, _ = db.ExecContext(context.Background(), "DROP TABLE IF EXISTS `"+table+"`, `"+table+"_migrations`, `"+charges+"`, `"+obTable+"`, `"+obTable+"_keys`, `"+obTable+"_migrations`")
	})
	if _, err := db.ExecContext(ctx, "CREATE TABLE `"+charges+"` (order_id VARCHAR(64) NOT NULL) ENGINE=InnoDB"); err != nil {
		t.Fatal(err)
	}
	store, err := sqltable.New(db, sqltable.MySQL, sqltable.Options{Table: table})
	if err != nil {
		t.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	ob, err := sqloutbox.New(db, sqloutbox.MySQL, sqloutbox.Options{Table: obTable})
	if err != nil {
		t.Fatal(err)
	}
	if err := ob.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	mw, err := idemwatermill.Transactional(store, idemwatermill.Options{Scope: "charge", Outbox: ob})
	if err != nil {
		t.Fatal(err)
	}
	ps := newGoChannel(t)
	r := newRouter(t)
	r.AddMiddleware(mw)
	topic := testenv.Name("orders")
	failed := false
	r.AddHandler("charge", topic, ps, "receipts", &recordingPublisher{}, func(msg *message.Message) ([]*message.Message, error) {
		tx := idemwatermill.Tx[*sql.Tx](msg.Context())
		if tx == nil {
			return nil, fmt.Errorf("no transaction in the message's context")
		}
		if _, err := tx.ExecContext(msg.Context(), "INSERT INTO `"+charges+"` (order_id) VALUES (?)", string(msg.Payload)); err != nil {
			return nil, err
		}
		receipt := message.NewMessage(wm.NewUUID(), []byte("receipt for "+string(msg.Payload)))
		if !failed { // the first attempt fails after its writes
			failed = true
			return []*message.Message{receipt}, errGateway
		}
		return []*message.Message{receipt}, nil
	})
	startRouter(t, r)
	const orders = 5
	for i := range orders {
		msg := message.NewMessage(wm.NewUUID(), fmt.Appendf(nil, "order-%d", i))
		for range 2 {
			if err := ps.Publish(topic, msg.Copy()); err != nil {
				t.Fatal(err)
			}
		}
	}
	var n, distinct int
	if err := db.QueryRowContext(ctx, "SELECT COUNT(*), COUNT(DISTINCT order_id) FROM `"+charges+"`").Scan(&n, &distinct); err != nil {
		t.Fatal(err)
	}
	if n != orders || distinct != orders {
		t.Errorf("charges: %d rows for %d orders, want %d, each once", n, distinct, orders)
	}
	var receipts int
	if err := db.QueryRowContext(ctx, "SELECT COUNT(*) FROM `"+obTable+"` WHERE payload LIKE 'receipt for order-%'").Scan(&receipts); err != nil {
		t.Fatal(err)
	}
	if receipts != orders {
		t.Errorf("outbox holds %d receipts, want %d (one per order; the failed attempt's rolled back)", receipts, orders)
	}
}

// TestTransactionalRefusesAnOutboxOfAnotherTransaction: an outbox that
// writes in another transaction type than the store's is refused at
// construction, naming both.
func TestTransactionalRefusesAnOutboxOfAnotherTransaction(t *testing.T) {
	t.Parallel()
	db := testenv.MySQL(t, "")
	ob, err := sqloutbox.New(db, sqloutbox.MySQL, sqloutbox.Options{})
	if err != nil {
		t.Fatal(err)
	}
	_, err = idemwatermill.Transactional(noTxStore{}, idemwatermill.Options{Outbox: ob})
	if err == nil || !strings.Contains(err.Error(), "sqloutbox.Outbox") || !strings.Contains(err.Error(), "pgx.Tx") {
		t.Fatalf("Transactional with a *sqloutbox.Outbox on a pgx store = %v, want an error naming both", err)
	}
}
