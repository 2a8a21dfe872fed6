package main

import (
	"context"
	"net/url"
	"testing"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestExample runs the program as docs/outbox.md shows it, on its own schema
// and exchange, so the outbox walk-through stays true.
func TestExample(t *testing.T) {
	pool := testenv.Pool(t, 2)
	u, err := url.Parse(testenv.AMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	testenv.RequireTCP(t, "RabbitMQ", u.Host)
	schema := testenv.Name("idemex_outbox")
	t.Cleanup(func() { _, _ = pool.Exec(context.Background(), `DROP SCHEMA IF EXISTS "`+schema+`" CASCADE`) })
	if err := run(context.Background(), testenv.PostgresURL(), testenv.AMQPURL(), schema, "idem.test."+schema, 6, false); err != nil {
		t.Fatal(err)
	}
}
