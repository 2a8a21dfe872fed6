package main

import (
	"context"
	"net/url"
	"os"
	"strings"
	"testing"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestWorker runs the example with -redis as a URL and as host:port, and
// checks that it leaves no Redis keys behind.
func TestWorker(t *testing.T) {
	u, err := url.Parse(testenv.AMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	testenv.RequireTCP(t, "RabbitMQ", u.Host)
	rdb := testenv.Redis(t) // skips, or fails under CI=true, when Redis is down
	for _, addr := range []string{"redis://" + testenv.RedisAddr() + "/0", testenv.RedisAddr()} {
		queue := testenv.Name("idemtest_notify")
		if err := run(context.Background(), config{
			amqpURL: testenv.AMQPURL(), redisURL: addr, queue: queue, n: 50, out: os.Stdout,
		}); err != nil {
			t.Fatalf("-redis %s: %v", addr, err)
		}
		keys, err := rdb.Keys(context.Background(), "*"+queue+"*").Result()
		if err != nil {
			t.Fatal(err)
		}
		if len(keys) > 0 {
			t.Errorf("-redis %s: %d keys left behind, such as %s", addr, len(keys), keys[0])
		}
	}
}

func TestWorkerRedisUnreachable(t *testing.T) {
	err := run(context.Background(), config{
		amqpURL: testenv.AMQPURL(), redisURL: testenv.DeadAddr(t), queue: testenv.Name("idemtest_notify"), n: 1, out: os.Stdout,
	})
	if err == nil || !strings.Contains(err.Error(), "is unreachable") {
		t.Errorf("run with an unreachable Redis: %v, want an error saying it is unreachable", err)
	}
}
