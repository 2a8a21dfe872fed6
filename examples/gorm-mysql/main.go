// Command gorm-mysql is a consumer whose business write goes through GORM
// on MariaDB or MySQL and commits in one transaction with idem's claim
// (dedup/sqltable, MySQL dialect). Every message is delivered twice, one
// first delivery fails after its write and is redelivered: each order must be
// written exactly once. See README.md.
package main

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"regexp"
	"sync"
	"sync/atomic"
	"time"

	_ "github.com/go-sql-driver/mysql"
	"gorm.io/driver/mysql"
	"gorm.io/gorm"
	"gorm.io/gorm/logger"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup/sqltable"
)

func main() {
	if err := run(context.Background(), os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "gorm-mysql:", err)
		os.Exit(1)
	}
}

// Order is the business row GORM writes. order_id has no unique index on
// purpose: the table is the oracle, a duplicate effect would show as two rows.
type Order struct {
	ID       uint64 `gorm:"primaryKey"`
	OrderID  string `gorm:"size:64;index"`
	Amount   int64
	Received time.Time
}

// inTx returns a *gorm.DB whose statements run in tx, the transaction
// sqltable began and holds the claim in. GORM runs every statement of a
// *gorm.DB on its Statement.ConnPool, an interface *sql.Tx implements; its
// own DB.Begin puts the *sql.Tx it began there. The session is new (NewDB)
// and has its own Statement (Context set), so gdb itself is untouched.
func inTx(ctx context.Context, gdb *gorm.DB, tx *sql.Tx) *gorm.DB {
	s := gdb.Session(&gorm.Session{NewDB: true, Context: ctx, SkipDefaultTransaction: true})
	s.Statement.ConnPool = tx
	return s
}

var namePattern = regexp.MustCompile(`^[a-z_][a-z0-9_]{0,40}$`)

func run(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("gorm-mysql", flag.ContinueOnError)
	fs.SetOutput(out)
	printf := func(format string, a ...any) { _, _ = fmt.Fprintf(out, format, a...) }
	dsn := fs.String("mysql", envOr("IDEM_EXAMPLE_MYSQL_DSN", "root@tcp(127.0.0.1:3306)/test?parseTime=true"),
		"go-sql-driver/mysql DSN (env IDEM_EXAMPLE_MYSQL_DSN)")
	n := fs.Int("orders", 20, "number of orders; each is delivered twice")
	workers := fs.Int("workers", 4, "deliveries handled at once")
	prefix := fs.String("prefix", "", "table name prefix (default idem_example_gorm_<random>)")
	keep := fs.Bool("keep", false, "keep the tables at the end")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *n < 2 || *workers < 1 {
		return errors.New("-orders must be at least 2 and -workers at least 1")
	}
	if *prefix == "" {
		*prefix = fmt.Sprintf("idem_example_gorm_%06x", rand.Uint32()&0xffffff)
	}
	if !namePattern.MatchString(*prefix) {
		return fmt.Errorf("-prefix %q: use lowercase letters, digits and _ (at most 41)", *prefix)
	}
	ordersTable, eventsTable := *prefix+"_orders", *prefix+"_processed"

	db, err := sql.Open("mysql", *dsn)
	if err != nil {
		return err
	}
	defer func() { _ = db.Close() }()
	pingCtx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := db.PingContext(pingCtx); err != nil {
		return fmt.Errorf("MySQL/MariaDB at %s is unreachable: %w (start it with `make up`, or pass -mysql)", *dsn, err)
	}

	// One *gorm.DB on the application's *sql.DB (GORM's "existing database
	// connection"), opened once; each transaction gets a session of it.
	gdb, err := gorm.Open(mysql.New(mysql.Config{Conn: db}), &gorm.Config{
		SkipDefaultTransaction: true,
		Logger:                 logger.Discard,
	})
	if err != nil {
		return err
	}
	if err := gdb.Table(ordersTable).AutoMigrate(&Order{}); err != nil {
		return err
	}
	store, err := sqltable.New(db, sqltable.MySQL, sqltable.Options{Table: eventsTable})
	if err != nil {
		return err
	}
	if err := store.Migrate(ctx); err != nil {
		return err
	}
	if !*keep {
		defer func() {
			_, _ = db.ExecContext(context.WithoutCancel(ctx), "DROP TABLE IF EXISTS `"+ordersTable+"`, `"+eventsTable+"`, `"+eventsTable+"_migrations`")
		}()
	}
	printf("tables %s (GORM) and %s (idem claims) on %s\n", ordersTable, eventsTable, redact(*dsn))

	// The order whose first delivery fails after GORM wrote it: its
	// transaction rolls back, the claim with it, and the redelivery writes
	// it once.
	failing := fmt.Sprintf("order-%03d", *n/2)
	var failedOnce atomic.Bool

	handler, err := consumer.Transactional(store, consumer.TxOptions{Scope: "billing.orders"},
		func(ctx context.Context, tx *sql.Tx, msg *consumer.Message) error {
			order := Order{OrderID: msg.ID, Amount: int64(len(msg.Payload)) * 100, Received: time.Now().UTC()}
			if err := inTx(ctx, gdb, tx).Table(ordersTable).Create(&order).Error; err != nil {
				return err
			}
			if msg.ID == failing && failedOnce.CompareAndSwap(false, true) {
				return errors.New("payment service timed out (after the order row was written)")
			}
			return nil
		})
	if err != nil {
		return err
	}

	// The message source: every order delivered twice, in shuffled order,
	// by several workers at once, as a broker redelivers after a lost ACK.
	// A delivery that is not acknowledged goes back on the queue.
	queue := make(chan *consumer.Message, 4**n)
	var deliveries []*consumer.Message
	for i := 1; i <= *n; i++ {
		id := fmt.Sprintf("order-%03d", i)
		for range 2 {
			deliveries = append(deliveries, &consumer.Message{ID: id, Payload: []byte(`{"order":"` + id + `"}`)})
		}
	}
	rand.Shuffle(len(deliveries), func(i, j int) { deliveries[i], deliveries[j] = deliveries[j], deliveries[i] })
	for _, m := range deliveries {
		queue <- m
	}
	var applied, dropped, redelivered, pending atomic.Int64
	pending.Store(int64(len(deliveries)))
	runCtx, stop := context.WithTimeout(ctx, 2*time.Minute)
	defer stop()
	var wg sync.WaitGroup
	var firstErr error
	var errOnce sync.Once
	for range *workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for pending.Load() > 0 {
				var m *consumer.Message
				select {
				case m = <-queue:
				case <-runCtx.Done():
					errOnce.Do(func() { firstErr = fmt.Errorf("deliveries still pending: %w", runCtx.Err()) })
					return
				case <-time.After(50 * time.Millisecond):
					continue
				}
				r := consumer.Process(runCtx, handler, m)
				switch {
				case r.Action == consumer.ActionAck && r.Duplicate:
					dropped.Add(1)
					pending.Add(-1)
				case r.Action == consumer.ActionAck:
					applied.Add(1)
					pending.Add(-1)
				case r.Action == consumer.ActionRetry:
					printf("%s: %v: not acknowledged, delivered again\n", m.ID, r.Err)
					redelivered.Add(1)
					queue <- m
				default:
					errOnce.Do(func() { firstErr = fmt.Errorf("%s: %s: %w", m.ID, r.Reason, r.Err) })
					pending.Add(-1)
				}
			}
		}()
	}
	wg.Wait()
	if firstErr != nil {
		return firstErr
	}

	// The oracle: orders written more than once, and orders never written.
	var dupRows []struct {
		OrderID string
		N       int
	}
	if err := gdb.WithContext(ctx).Table(ordersTable).Select("order_id, count(*) AS n").
		Group("order_id").Having("count(*) > 1").Scan(&dupRows).Error; err != nil {
		return err
	}
	var distinct int64
	if err := gdb.WithContext(ctx).Table(ordersTable).Distinct("order_id").Count(&distinct).Error; err != nil {
		return err
	}
	printf("%d deliveries of %d orders: %d applied, %d duplicates dropped, %d redelivered after a rollback\n",
		len(deliveries), *n, applied.Load(), dropped.Load(), redelivered.Load())
	if len(dupRows) > 0 {
		return fmt.Errorf("duplicate effect: %d orders written more than once, such as %s (%d rows)", len(dupRows), dupRows[0].OrderID, dupRows[0].N)
	}
	if distinct != int64(*n) {
		return fmt.Errorf("lost effect: %d of %d orders written", distinct, *n)
	}
	printf("every order written exactly once (%d of %d)\n", distinct, *n)
	return nil
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// redact hides a DSN's password.
func redact(dsn string) string {
	return regexp.MustCompile(`^([^:@/]*):[^@]*@`).ReplaceAllString(dsn, "$1:***@")
}
