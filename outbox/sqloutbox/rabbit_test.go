package sqloutbox_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	idemamqp "github.com/idemkit/idem/adapters/amqp"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/testkit/outboxtest"
	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/sqloutbox"
)

func newAMQPPublisher(t testing.TB, rawURL string) *idemamqp.Publisher {
	t.Helper()
	p, err := idemamqp.NewPublisher(rawURL, idemamqp.PublisherOptions{
		Logger: quiet(), ReconnectBackoff: consumer.Backoff{Initial: 20 * time.Millisecond, Max: 200 * time.Millisecond},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	return p
}

// Two MariaDB relays publish to RabbitMQ through adapters/amqp's publisher
// (publisher confirms): every message arrives with its outbox id as its
// AMQP message-id, each key's messages in order.
func TestMariaDBRelaysToRabbitMQ(t *testing.T) {
	t.Parallel()
	db := mariaDB(t)
	ob := newOutbox(t, db, sqloutbox.MySQL, sqloutbox.Options{})
	rb := outboxtest.NewRabbit(t, "", false)
	col := rb.Collect(t, nil)
	for range 2 {
		r, err := sqloutbox.NewRelay(ob, newAMQPPublisher(t, rb.URL), fastRelay(sqloutbox.RelayOptions{
			Sessions: 2, BatchSize: 50, CleanupInterval: -1,
		}))
		if err != nil {
			t.Fatal(err)
		}
		start(t, r)
	}
	const keys, perKey = 20, 25
	want := map[string]string{}
	for n := range perKey {
		var ms []outbox.Message
		for k := range keys {
			key := fmt.Sprintf("k%02d", k)
			ms = append(ms, msg(rb.Exchange, key, fmt.Sprintf("%s/%d", key, n)))
		}
		for i, id := range enqueue(t, db, ob, ms...) {
			want[id] = string(ms[i].Payload)
		}
	}
	testenv.Eventually(t, 60*time.Second, "every message delivered", func() bool { return col.Distinct() >= len(want) })
	var payloads []string
	for _, a := range col.Snapshot() {
		p, ok := want[a.ID]
		if !ok {
			t.Fatalf("delivery with message-id %q, not an outbox id", a.ID)
		}
		if string(a.Body) != p || !strings.HasPrefix(p, a.Key+"/") {
			t.Fatalf("message %s arrived as %q with routing key %q, want %q", a.ID, a.Body, a.Key, p)
		}
		payloads = append(payloads, p)
	}
	if bad := orderViolations(payloads); len(bad) > 0 {
		t.Fatalf("per-key order violated: %v", bad)
	}
	testenv.Eventually(t, 30*time.Second, "every row marked published", func() bool { return countState(t, db, ob, 1) == len(want) })
}
