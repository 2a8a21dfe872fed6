package main

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// migratedSchema returns a pool of maxConns connections, a fresh schema
// that `idem migrate up` has migrated, and the flags that point the
// command at it.
func migratedSchema(t *testing.T, maxConns int32) (*pgxpool.Pool, string, []string) {
	t.Helper()
	pool := testenv.Pool(t, maxConns)
	schema := testenv.Schema(t, pool)
	pg := []string{"--postgres", testenv.PostgresURL(), "--schema", schema}
	if code, _, errOut := runCmd(context.Background(), t, append([]string{"migrate", "up"}, pg...)...); code != 0 {
		t.Fatalf("migrate up: %s", errOut)
	}
	return pool, schema, pg
}

func TestAdmin(t *testing.T) {
	pool, schema, pg := migratedSchema(t, 4)
	ctx := context.Background()
	ob, err := pgoutbox.New(pool, pgoutbox.Options{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		ids, err = ob.Enqueue(ctx, tx, outbox.Message{Topic: "t", Payload: []byte("a")}, outbox.Message{Topic: "t", Payload: []byte("b")})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "UPDATE "+ob.Table()+" SET state = 2, dead_at = now(), last_error = 'boom', attempts = 10 WHERE id = $1", ids[0]); err != nil {
		t.Fatal(err)
	}
	check := func(want string, args ...string) {
		t.Helper()
		code, out, errOut := runCmd(ctx, t, append(args, pg...)...)
		if code != 0 || !strings.Contains(out, want) {
			t.Errorf("%v: exit %d, stdout %q, stderr %q; want %q", args, code, out, errOut, want)
		}
	}
	check("1 pending", "outbox", "stats")
	check("0 published (kept for retention), 1 dead", "outbox", "stats")
	check(ids[0]+"  topic=t attempts=10", "outbox", "dead")
	check(`error="boom"`, "outbox", "dead")
	check("requeued 1 of 1 messages", "outbox", "requeue", ids[0])
	check("2 pending", "outbox", "stats")

	store, err := pgtable.New(pool, pgtable.Options{Schema: schema, KeepKeys: true})
	if err != nil {
		t.Fatal(err)
	}
	check("empty", "dedup", "stats")
	if _, err := store.Process(ctx, dedup.NewKey("billing/charge", "p1", nil), func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil }); err != nil {
		t.Fatal(err)
	}
	check("billing/charge", "dedup", "stats")
	digestOnly, err := pgtable.New(pool, pgtable.Options{Schema: schema})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := digestOnly.Process(ctx, dedup.NewKey("billing/refund", "p1", nil), func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil }); err != nil {
		t.Fatal(err)
	}
	check("(scope not kept)", "dedup", "stats")
	check("deleted 0 expired rows", "dedup", "cleanup")
}

// TestDedupStats checks what `dedup stats` counts: done keys and leases
// in flight that still hold their key, and apart from them the rows whose
// time ran out (a lease nobody completed, a done key past its retention).
func TestDedupStats(t *testing.T) {
	pool, schema, pg := migratedSchema(t, 4)
	ctx := context.Background()
	store, err := pgtable.New(pool, pgtable.Options{Schema: schema, KeepKeys: true})
	if err != nil {
		t.Fatal(err)
	}
	const scope = "billing/charge"
	done := func(id string) {
		t.Helper()
		if _, err := store.Process(ctx, dedup.NewKey(scope, id, nil), func(context.Context, pgx.Tx) ([]byte, error) { return nil, nil }); err != nil {
			t.Fatal(err)
		}
	}
	lease := func(id string) {
		t.Helper()
		if _, err := store.Lease().Claim(ctx, dedup.NewKey(scope, id, nil)); err != nil {
			t.Fatal(err)
		}
	}
	done("p1")
	done("p2")
	lease("p3")
	lease("p4")
	done("p5")
	// p4's lease ran out and p5 is past its retention.
	if _, err := pool.Exec(ctx, "UPDATE "+store.Table()+" SET expires_at = now() - interval '1 minute' WHERE id IN ('p4', 'p5')"); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := runCmd(ctx, t, append([]string{"dedup", "stats"}, pg...)...)
	if code != 0 {
		t.Fatalf("dedup stats: exit %d, stderr %q", code, errOut)
	}
	fields := strings.Fields(out)
	want := []string{scope, "2", "done", "1", "in", "flight", "2", "expired", "next", "expiry"}
	if len(fields) != len(want)+1 || !slices.Equal(fields[:len(want)], want) {
		t.Fatalf("dedup stats: %q; want %q and the next expiry", out, strings.Join(want, " "))
	}
	if _, err := time.Parse(time.RFC3339, fields[len(want)]); err != nil {
		t.Errorf("next expiry %q: %v", fields[len(want)], err)
	}

	// Only expired rows left: no next expiry.
	if _, err := pool.Exec(ctx, "UPDATE "+store.Table()+" SET expires_at = now() - interval '1 minute'"); err != nil {
		t.Fatal(err)
	}
	_, out, _ = runCmd(ctx, t, append([]string{"dedup", "stats"}, pg...)...)
	if got, want := strings.Join(strings.Fields(out), " "), scope+" 0 done 0 in flight 5 expired next expiry none"; got != want {
		t.Errorf("dedup stats: %q; want %q", got, want)
	}
}

func TestOutboxRequeueMalformedID(t *testing.T) {
	_, _, pg := migratedSchema(t, 2)
	ctx := context.Background()
	code, out, errOut := runCmd(ctx, t, append([]string{"outbox", "requeue", "not-a-uuid"}, pg...)...)
	if code != 2 || !strings.Contains(errOut, `"not-a-uuid" is not a message id`) || strings.Contains(errOut, "SQLSTATE") {
		t.Errorf("requeue not-a-uuid: exit %d, stdout %q, stderr %q; want exit 2 and a message naming the id", code, out, errOut)
	}
}

// TestSubcommandFlags checks that each command's help lists only the flags
// that apply to it.
func TestSubcommandFlags(t *testing.T) {
	for _, tc := range []struct {
		cmd       string
		want, not []string
	}{
		{"dedup", []string{"-dedup-table"}, []string{"-outbox-table"}},
		{"outbox", []string{"-outbox-table", "-limit"}, []string{"-dedup-table"}},
		{"relay", []string{"-outbox-table"}, []string{"-dedup-table"}},
		{"migrate", []string{"-dedup-table", "-outbox-table"}, nil},
	} {
		code, _, errOut := runCmd(context.Background(), t, tc.cmd, "-help")
		if code != 0 {
			t.Errorf("%s -help: exit %d", tc.cmd, code)
		}
		for _, f := range tc.want {
			if !strings.Contains(errOut, "  "+f+" ") {
				t.Errorf("%s -help does not list %s:\n%s", tc.cmd, f, errOut)
			}
		}
		for _, f := range tc.not {
			if strings.Contains(errOut, f) {
				t.Errorf("%s -help lists %s, which does not apply:\n%s", tc.cmd, f, errOut)
			}
		}
	}
}
