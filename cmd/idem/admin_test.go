package main

import (
	"context"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/dedup/pgtable"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

func TestAdmin(t *testing.T) {
	pool := testenv.Pool(t, 4)
	schema := testenv.Schema(t, pool)
	ctx := context.Background()
	pg := []string{"--postgres", testenv.PostgresURL(), "--schema", schema}
	if code, _, errOut := runCmd(ctx, t, append([]string{"migrate", "up"}, pg...)...); code != 0 {
		t.Fatalf("migrate up: %s", errOut)
	}
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

func TestOutboxRequeueMalformedID(t *testing.T) {
	pool := testenv.Pool(t, 2)
	schema := testenv.Schema(t, pool)
	ctx := context.Background()
	pg := []string{"--postgres", testenv.PostgresURL(), "--schema", schema}
	if code, _, errOut := runCmd(ctx, t, append([]string{"migrate", "up"}, pg...)...); code != 0 {
		t.Fatalf("migrate up: %s", errOut)
	}
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
