package pgoutbox_test

import (
	"context"
	"fmt"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
	"github.com/idemkit/idem/outbox/pgoutbox"
)

// checkingPublisher is a publisher that, for every message it is handed,
// checks in the database that every earlier message of the same key is
// already marked published, and counts the Publish calls running at once.
type checkingPublisher struct {
	pool  *pgxpool.Pool
	ob    *pgoutbox.Outbox
	delay time.Duration

	running, maxRunning atomic.Int32

	mu         sync.Mutex
	got        []outbox.Message
	violations []string
}

func (p *checkingPublisher) Publish(ctx context.Context, msgs []*outbox.Message) error {
	n := p.running.Add(1)
	defer p.running.Add(-1)
	for {
		m := p.maxRunning.Load()
		if n <= m || p.maxRunning.CompareAndSwap(m, n) {
			break
		}
	}
	for _, m := range msgs {
		var earlier int
		err := p.pool.QueryRow(ctx, "SELECT count(*) FROM "+p.ob.Table()+
			" WHERE key = $1 AND state <> 1 AND seq < (SELECT seq FROM "+p.ob.Table()+" WHERE id = $2::uuid)", m.Key, m.ID).Scan(&earlier)
		if err != nil {
			return err
		}
		if earlier > 0 {
			p.mu.Lock()
			p.violations = append(p.violations, fmt.Sprintf("%s (key %s) sent while %d earlier messages of its key were not marked", m.Payload, m.Key, earlier))
			p.mu.Unlock()
		}
	}
	select {
	case <-time.After(p.delay):
	case <-ctx.Done():
		return ctx.Err()
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, m := range msgs {
		p.got = append(p.got, *m)
	}
	return nil
}

// While a full batch is being published the session claims the next one;
// the claim passes over the keys of the batch in flight, so a key's next
// message is still sent only after the previous one was confirmed and
// marked, and one session never has two batches at the broker at once.
func TestClaimAheadKeepsKeyOrder(t *testing.T) {
	t.Parallel()
	pool := testenv.Pool(t, 6)
	ob := newOutbox(t, pool, pgoutbox.Options{})
	const keys, perKey = 40, 8
	var msgs []outbox.Message
	for round := range perKey {
		for k := range keys {
			msgs = append(msgs, msg("t", keyOf(k, keys), fmt.Sprint(round)))
		}
	}
	enqueue(t, pool, ob, msgs...)

	pub := &checkingPublisher{pool: pool, ob: ob, delay: 20 * time.Millisecond}
	r, err := pgoutbox.NewRelay(ob, pub, fastRelay(pgoutbox.RelayOptions{BatchSize: 10, CleanupInterval: -1}))
	if err != nil {
		t.Fatal(err)
	}
	var conns atomic.Int32
	pgoutbox.SetOnConnect(r, func(uint32) { conns.Add(1) })
	start(t, r)
	testenv.Eventually(t, 60*time.Second, "every message published", func() bool { return countState(t, pool, ob, 1) == keys*perKey })

	pub.mu.Lock()
	defer pub.mu.Unlock()
	if len(pub.violations) > 0 {
		t.Errorf("%d messages sent before an earlier one of their key was marked, e.g. %s", len(pub.violations), pub.violations[0])
	}
	if len(pub.got) != keys*perKey {
		t.Errorf("%d messages published, want %d (each once)", len(pub.got), keys*perKey)
	}
	last := map[string]int{}
	for _, m := range pub.got {
		round, err := strconv.Atoi(string(m.Payload))
		if err != nil {
			t.Fatal(err)
		}
		if prev, ok := last[string(m.Key)]; ok && round != prev+1 {
			t.Errorf("key %s: message %d after %d", m.Key, round, prev)
		}
		last[string(m.Key)] = round
	}
	if n := pub.maxRunning.Load(); n != 1 {
		t.Errorf("%d Publish calls ran at once, want 1", n)
	}
	// The batch after a full one was claimed on the session's second
	// connection: the claim-ahead ran.
	if n := conns.Load(); n < 2 {
		t.Errorf("the session opened %d connections, want its second one for the claim ahead", n)
	}
}
