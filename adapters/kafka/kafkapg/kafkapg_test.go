package kafkapg_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/adapters/kafka/kafkapg"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m, testenv.LeakOptions()...) }

func TestOffsets(t *testing.T) {
	pool := testenv.Pool(t, 4)
	schema := testenv.Schema(t, pool)
	ctx := context.Background()
	o, err := kafkapg.NewOffsets(pool, kafkapg.OffsetsOptions{Schema: schema, Table: "positions"})
	if err != nil {
		t.Fatal(err)
	}
	for range 2 { // idempotent
		if err := o.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if got, err := o.LoadOffsets(ctx, "g", "t", []int{0, 1}); err != nil || len(got) != 0 {
		t.Fatalf("LoadOffsets on an empty table = %v, %v", got, err)
	}
	if err := o.SaveOffsets(ctx, "g", map[string]map[int]int64{"t": {0: 10, 1: 20}, "u": {0: 5}}); err != nil {
		t.Fatal(err)
	}
	// Never backwards: 1 moves forward, 0 stays.
	if err := o.SaveOffsets(ctx, "g", map[string]map[int]int64{"t": {0: 3, 1: 25}}); err != nil {
		t.Fatal(err)
	}
	got, err := o.LoadOffsets(ctx, "g", "t", []int{0, 1, 2})
	if err != nil || got[0] != 10 || got[1] != 25 || len(got) != 2 {
		t.Fatalf("LoadOffsets = %v, %v; want map[0:10 1:25]", got, err)
	}
	if other, _ := o.LoadOffsets(ctx, "other", "t", []int{0}); len(other) != 0 {
		t.Fatalf("another group sees %v", other)
	}

	// SaveTx commits with the transaction, or not at all.
	pos := idemkafka.Position{Group: "g", Topic: "t", Partition: 0, Offset: 50}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		if err := o.SaveTx(ctx, tx, pos); err != nil {
			return err
		}
		return errors.New("roll back")
	})
	if err == nil || err.Error() != "roll back" {
		t.Fatal(err)
	}
	if got, _ := o.LoadOffsets(ctx, "g", "t", []int{0}); got[0] != 10 {
		t.Fatalf("a rolled-back SaveTx moved the position to %d", got[0])
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return o.SaveTx(ctx, tx, pos) }); err != nil {
		t.Fatal(err)
	}
	if got, _ := o.LoadOffsets(ctx, "g", "t", []int{0}); got[0] != 50 {
		t.Fatalf("position %d after SaveTx, want 50", got[0])
	}
	sql, err := o.SQL()
	if err != nil || !strings.Contains(sql, `"`+schema+`"."positions"`) {
		t.Fatalf("SQL() = %q, %v", sql, err)
	}
}

func TestOffsetsOptions(t *testing.T) {
	pool := testenv.Pool(t, 1)
	for _, opts := range []kafkapg.OffsetsOptions{
		{Table: "Bad"}, {Table: "x; DROP TABLE y"}, {Schema: "1abc"}, {Table: strings.Repeat("t", 51)},
	} {
		if _, err := kafkapg.NewOffsets(pool, opts); err == nil {
			t.Errorf("NewOffsets accepted %+v", opts)
		}
	}
	if _, err := kafkapg.NewOffsets(nil, kafkapg.OffsetsOptions{}); err == nil {
		t.Error("NewOffsets accepted a nil db")
	}
}

func TestBatch(t *testing.T) {
	pool := testenv.Pool(t, 4)
	schema := testenv.Schema(t, pool)
	ctx := context.Background()
	claims, err := pgtable.New(pool, pgtable.Options{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := claims.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	effects := pgx.Identifier{schema, "effects"}.Sanitize()
	if _, err := pool.Exec(ctx, "CREATE TABLE "+effects+" (id text NOT NULL)"); err != nil {
		t.Fatal(err)
	}
	errBoom := errors.New("boom")
	h := func(ctx context.Context, tx pgx.Tx, msg *consumer.Message) error {
		if string(msg.Payload) == "boom" {
			return errBoom
		}
		_, err := tx.Exec(ctx, "INSERT INTO "+effects+" (id) VALUES ($1)", msg.ID)
		return err
	}
	var outcomes []string
	bh, err := kafkapg.Batch(pool, claims, kafkapg.BatchOptions{
		Scope:     "test/batch",
		Telemetry: consumer.Telemetry{OnOutcome: func(_ context.Context, r consumer.Report) { outcomes = append(outcomes, string(r.Outcome)) }},
	}, h)
	if err != nil {
		t.Fatal(err)
	}
	msg := func(id, payload string) *consumer.Message {
		return &consumer.Message{ID: id, Payload: []byte(payload)}
	}
	count := func() (n int) {
		if err := pool.QueryRow(ctx, "SELECT count(*) FROM "+effects).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}

	if err := bh(ctx, []*consumer.Message{msg("a", "1"), msg("b", "2")}); err != nil {
		t.Fatal(err)
	}
	// a again (duplicate), a in the same batch twice, b with other content.
	err = bh(ctx, []*consumer.Message{msg("a", "1"), msg("c", "3"), msg("c", "3"), msg("b", "other")})
	var be *idemkafka.BatchError
	if !errors.As(err, &be) {
		t.Fatalf("batch handler = %v; want a BatchError", err)
	}
	if !errors.Is(be.Errs[0], dedup.ErrDuplicate) || be.Errs[1] != nil || !errors.Is(be.Errs[2], dedup.ErrDuplicate) ||
		!errors.Is(be.Errs[3], dedup.ErrFingerprintMismatch) {
		t.Fatalf("per-message errors %v", be.Errs)
	}
	if n := count(); n != 3 {
		t.Fatalf("%d effects, want 3 (a, b, c)", n)
	}
	// A failing handler rolls back the batch: d's effect and claim too.
	err = bh(ctx, []*consumer.Message{msg("d", "4"), msg("e", "boom")})
	if !errors.Is(err, errBoom) {
		t.Fatalf("batch handler = %v; want errBoom", err)
	}
	if n := count(); n != 3 {
		t.Fatalf("%d effects after a failed batch, want 3", n)
	}
	if err := bh(ctx, []*consumer.Message{msg("d", "4")}); err != nil {
		t.Fatalf("d again after the rollback: %v", err)
	}
	if n := count(); n != 4 {
		t.Fatalf("%d effects, want 4", n)
	}
	want := "completed completed duplicate completed duplicate fingerprint_mismatch completed"
	if got := strings.Join(outcomes, " "); got != want {
		t.Errorf("outcomes %q, want %q", got, want)
	}

	// With offsets but outside a Consumer there is no position to store.
	offsets, err := kafkapg.NewOffsets(pool, kafkapg.OffsetsOptions{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := offsets.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	bo, err := kafkapg.Batch(pool, claims, kafkapg.BatchOptions{Scope: "test/batch", Offsets: offsets}, h)
	if err != nil {
		t.Fatal(err)
	}
	if err := bo(ctx, []*consumer.Message{msg("f", "6")}); consumer.Decide(err).Action != consumer.ActionDeadLetter {
		t.Fatalf("batch handler outside a Consumer = %v; want a permanent error", err)
	}
	if n := count(); n != 4 {
		t.Fatalf("%d effects, want 4: the batch without a position must roll back", n)
	}
}

func TestConstructors(t *testing.T) {
	pool := testenv.Pool(t, 1)
	claims, err := pgtable.New(pool, pgtable.Options{})
	if err != nil {
		t.Fatal(err)
	}
	h := func(context.Context, pgx.Tx, *consumer.Message) error { return nil }
	if _, err := kafkapg.Transactional(claims, nil, consumer.TxOptions{Scope: "s"}, h); err == nil {
		t.Error("Transactional accepted nil offsets")
	}
	if _, err := kafkapg.Batch(pool, claims, kafkapg.BatchOptions{}, h); err == nil {
		t.Error("Batch accepted an empty scope")
	}
	if _, err := kafkapg.Batch(pool, nil, kafkapg.BatchOptions{Scope: "s"}, h); err == nil {
		t.Error("Batch accepted nil claims")
	}
	if _, err := kafkapg.Batch(pool, claims, kafkapg.BatchOptions{Scope: "s"}, nil); err == nil {
		t.Error("Batch accepted a nil handler")
	}
	all := func(context.Context, pgx.Tx, []*consumer.Message) error { return nil }
	if _, err := kafkapg.BatchAll(pool, claims, kafkapg.BatchOptions{}, all); err == nil {
		t.Error("BatchAll accepted an empty scope")
	}
	if _, err := kafkapg.BatchAll(nil, claims, kafkapg.BatchOptions{Scope: "s"}, all); err == nil {
		t.Error("BatchAll accepted a nil db")
	}
	if _, err := kafkapg.BatchAll(pool, nil, kafkapg.BatchOptions{Scope: "s"}, all); err == nil {
		t.Error("BatchAll accepted nil claims")
	}
	if _, err := kafkapg.BatchAll(pool, claims, kafkapg.BatchOptions{Scope: "s"}, nil); err == nil {
		t.Error("BatchAll accepted a nil handler")
	}
}

// TestSaveOffsetsBehind: SaveOffsets of a position the table holds already
// (the Consumer's periodic commit after a batch's transaction stored it)
// neither moves it nor waits for a transaction that holds its row: it
// writes nothing.
func TestSaveOffsetsBehind(t *testing.T) {
	pool := testenv.Pool(t, 4)
	schema := testenv.Schema(t, pool)
	ctx := testenv.Ctx(t)
	o, err := kafkapg.NewOffsets(pool, kafkapg.OffsetsOptions{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if err := o.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	if err := o.SaveOffsets(ctx, "g", map[string]map[int]int64{"t": {0: 100}}); err != nil {
		t.Fatal(err)
	}
	holder, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = holder.Rollback(ctx) }()
	if _, err := holder.Exec(ctx, "SELECT 1 FROM "+o.Table()+" WHERE partition = 0 FOR UPDATE"); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- o.SaveOffsets(ctx, "g", map[string]map[int]int64{"t": {0: 100}}) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-ctx.Done():
		t.Fatal("SaveOffsets of the stored position waited for the transaction holding its row")
	}
	if err := holder.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	if err := o.SaveOffsets(ctx, "g", map[string]map[int]int64{"t": {0: 90, 1: 5}}); err != nil {
		t.Fatal(err)
	}
	got, err := o.LoadOffsets(ctx, "g", "t", []int{0, 1})
	if err != nil || got[0] != 100 || got[1] != 5 {
		t.Fatalf("LoadOffsets = %v, %v; want map[0:100 1:5]", got, err)
	}
}
