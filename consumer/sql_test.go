package consumer_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/sqltable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// sqlEnv is an sqltable store on MariaDB and an effects table without a
// unique constraint, both of the test's own.
type sqlEnv struct {
	db      *sql.DB
	claims  *sqltable.Store
	effects string
}

func newSQLEnv(t *testing.T) *sqlEnv {
	t.Helper()
	db := testenv.MySQL(t, "")
	db.SetMaxOpenConns(40)
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
	return &sqlEnv{db: db, claims: claims, effects: "`" + eff + "`"}
}

func (e *sqlEnv) insert(ctx context.Context, tx *sql.Tx, id string) error {
	_, err := tx.ExecContext(ctx, "INSERT INTO "+e.effects+" (id) VALUES (?)", id)
	return err
}

// counts returns each id's number of effects.
func (e *sqlEnv) counts(t *testing.T) map[string]int {
	t.Helper()
	rows, err := e.db.QueryContext(context.Background(), "SELECT id, COUNT(*) FROM "+e.effects+" GROUP BY id")
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = rows.Close() }()
	out := map[string]int{}
	for rows.Next() {
		var (
			id string
			n  int
		)
		if err := rows.Scan(&id, &n); err != nil {
			t.Fatal(err)
		}
		out[id] = n
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return out
}

// Concurrent deliveries of the same messages through Transactional on
// sqltable over MariaDB: the duplicates wait on the first claim's row and
// acknowledge without running the handler, and each message's effect is
// written once.
func TestSqlTransactionalConcurrentDuplicates(t *testing.T) {
	e := newSQLEnv(t)
	ctx := context.Background()
	var runs atomic.Int64
	h, err := consumer.Transactional(e.claims, consumer.TxOptions{Scope: "test/sql-dups"},
		func(ctx context.Context, tx *sql.Tx, msg *consumer.Message) error {
			runs.Add(1)
			return e.insert(ctx, tx, msg.ID)
		})
	if err != nil {
		t.Fatal(err)
	}
	const messages, copies = 20, 8
	var (
		wg               sync.WaitGroup
		acked, dups, bad atomic.Int64
	)
	for m := range messages {
		for range copies {
			wg.Go(func() {
				msg := &consumer.Message{ID: fmt.Sprintf("m-%02d", m), Payload: []byte(fmt.Sprint(m))}
				for {
					err := h.Handle(ctx, msg)
					switch {
					case err == nil:
						acked.Add(1)
					case errors.Is(err, dedup.ErrDuplicate):
						dups.Add(1)
					case errors.Is(err, sqltable.ErrTransient):
						continue // a deadlock or lock wait: the consumer retries
					default:
						bad.Add(1)
						t.Errorf("%s: %v", msg.ID, err)
					}
					return
				}
			})
		}
	}
	wg.Wait()
	counts := e.counts(t)
	t.Logf("%d deliveries: %d handled, %d duplicates, %d handler runs", messages*copies, acked.Load(), dups.Load(), runs.Load())
	if len(counts) != messages {
		t.Errorf("%d messages have an effect, want %d", len(counts), messages)
	}
	for id, n := range counts {
		if n != 1 {
			t.Errorf("%s: %d effects, want 1", id, n)
		}
	}
	if acked.Load() != messages || dups.Load() != messages*(copies-1) || runs.Load() != messages {
		t.Errorf("%d handled, %d duplicates, %d handler runs; want %d, %d, %d",
			acked.Load(), dups.Load(), runs.Load(), messages, messages*(copies-1), messages)
	}
}

// A handler error rolls back the effect and the claim: the redelivery runs
// the handler again, and its effect is the only one.
func TestSqlTransactionalErrorRollsBack(t *testing.T) {
	e := newSQLEnv(t)
	ctx := context.Background()
	errBoom := errors.New("boom after the write")
	var runs atomic.Int64
	h, err := consumer.Transactional(e.claims, consumer.TxOptions{Scope: "test/sql-error"},
		func(ctx context.Context, tx *sql.Tx, msg *consumer.Message) error {
			if err := e.insert(ctx, tx, msg.ID); err != nil {
				return err
			}
			if runs.Add(1) == 1 {
				return errBoom
			}
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	msg := &consumer.Message{ID: "m-1", Payload: []byte("1")}
	if err := h.Handle(ctx, msg); !errors.Is(err, errBoom) {
		t.Fatalf("first delivery = %v, want the handler's error", err)
	}
	if d := consumer.Decide(errBoom); d.Action != consumer.ActionRetry {
		t.Fatalf("a handler error decides %v, want a retry", d.Action)
	}
	var claimed int
	if err := e.db.QueryRowContext(ctx, "SELECT COUNT(*) FROM "+e.claims.Table()).Scan(&claimed); err != nil {
		t.Fatal(err)
	}
	if claimed != 0 || len(e.counts(t)) != 0 {
		t.Fatalf("%d claims and effects %v after the handler failed; want none", claimed, e.counts(t))
	}
	if err := h.Handle(ctx, msg); err != nil {
		t.Fatalf("redelivery = %v, want the handler to run and commit", err)
	}
	if err := h.Handle(ctx, msg); !errors.Is(err, dedup.ErrDuplicate) {
		t.Fatalf("third delivery = %v, want a duplicate", err)
	}
	if got := e.counts(t); len(got) != 1 || got["m-1"] != 1 || runs.Load() != 2 {
		t.Fatalf("effects %v after %d handler runs; want m-1 once after 2 runs", got, runs.Load())
	}
}
