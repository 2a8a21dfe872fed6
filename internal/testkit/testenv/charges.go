package testenv

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Charges is the oracle of the double-payment scenarios (test/scenarios, the HTTP
// ones in adapters/httpidem): a charges table with no unique constraint, so
// a duplicate effect shows up as a second row of its payment.
type Charges struct {
	Pool  *pgxpool.Pool
	Table string // the sanitized, schema-qualified name
}

// NewCharges creates the charges table in schema.
func NewCharges(t testing.TB, pool *pgxpool.Pool, schema string) *Charges {
	t.Helper()
	o := &Charges{Pool: pool, Table: pgx.Identifier{schema, "charges"}.Sanitize()}
	if _, err := pool.Exec(context.Background(), "CREATE TABLE "+o.Table+
		" (payment_id text NOT NULL, receipt text NOT NULL, amount bigint NOT NULL, at timestamptz DEFAULT clock_timestamp())"); err != nil {
		t.Fatal(err)
	}
	return o
}

// Insert is the statement that charges a payment: $1 the payment id, $2 the
// receipt, $3 the amount.
func (o *Charges) Insert() string {
	return "INSERT INTO " + o.Table + " (payment_id, receipt, amount) VALUES ($1, $2, $3)"
}

// Count is the number of charges.
func (o *Charges) Count(t testing.TB) int {
	t.Helper()
	var n int
	if err := o.Pool.QueryRow(context.Background(), "SELECT count(*) FROM "+o.Table).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// Tally counts, for the payments in want, the extra charges, the payments
// never charged, the charges of payments not in want, and the answers in
// seen (receipts callers got, by payment) that carry another receipt than
// their payment's charge.
func (o *Charges) Tally(t testing.TB, want []string, seen map[string][]string) (extra, lost, unexpected, wrongReceipt int) {
	t.Helper()
	rows, err := o.Pool.Query(context.Background(), "SELECT payment_id, count(*), min(receipt) FROM "+o.Table+" GROUP BY payment_id")
	if err != nil {
		t.Fatal(err)
	}
	type agg struct {
		n       int64
		receipt string
	}
	got := map[string]agg{}
	var id, rc string
	var n int64
	if _, err := pgx.ForEachRow(rows, []any{&id, &n, &rc}, func() error { got[id] = agg{n, rc}; return nil }); err != nil {
		t.Fatal(err)
	}
	for _, p := range want {
		a, ok := got[p]
		switch {
		case !ok:
			lost++
		case a.n > 1:
			extra += int(a.n - 1)
		}
		for _, r := range seen[p] {
			if r != a.receipt {
				wrongReceipt++
			}
		}
		delete(got, p)
	}
	return extra, lost, len(got), wrongReceipt
}

// Check fails the test unless every payment in want was charged exactly
// once, nothing else was charged, and every answer in seen carries its
// payment's receipt.
func (o *Charges) Check(t testing.TB, want []string, seen map[string][]string) {
	t.Helper()
	extra, lost, unexpected, wrong := o.Tally(t, want, seen)
	if extra != 0 || lost != 0 || unexpected != 0 || wrong != 0 {
		t.Fatalf("oracle: %d payments, %d extra charges, %d lost, %d unexpected, %d answers with another receipt",
			len(want), extra, lost, unexpected, wrong)
	}
	t.Logf("oracle: %d payments, 0 extra charges, 0 lost, every answer carries its charge's receipt", len(want))
}

// Receipt returns a new random receipt number.
func Receipt() string {
	var b [6]byte
	_, _ = rand.Read(b[:])
	return "rcpt_" + hex.EncodeToString(b[:])
}
