package main

import (
	"context"
	"net/url"
	"os"
	"testing"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

func TestWorker(t *testing.T) {
	u, err := url.Parse(testenv.AMQPURL())
	if err != nil {
		t.Fatal(err)
	}
	testenv.RequireTCP(t, "RabbitMQ", u.Host)
	testenv.Redis(t) // skips, or fails under CI=true, when Redis is down
	if err := run(context.Background(), config{
		amqpURL: testenv.AMQPURL(), redisAddr: testenv.RedisAddr(), queue: testenv.Name("idemtest_notify"), n: 50, out: os.Stdout,
	}); err != nil {
		t.Fatal(err)
	}
}
