// Package kafkatest gives idem's tests a Kafka to talk to: an in-process
// kfake cluster, or the real brokers named in IDEM_TEST_KAFKA_BROKERS. It is
// its own package so that only the tests that need Kafka link kafka-go and
// kfake.
package kafkatest

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// BrokersEnv names real Kafka brokers, comma-separated.
const BrokersEnv = "IDEM_TEST_KAFKA_BROKERS"

// Env is the Kafka of one test.
type Env struct {
	Brokers []string
	// Real is true when Brokers come from BrokersEnv.
	Real bool
	// Transport and Client talk to Brokers; the Transport's idle
	// connections are closed when the test ends.
	Transport *kafkago.Transport
	Client    *kafkago.Client
}

// New returns the test's Kafka: a kfake cluster closed when the test ends,
// unless BrokersEnv names real brokers (then they must accept connections:
// the test is skipped, or failed under CI=true, otherwise).
func New(t testing.TB) *Env {
	t.Helper()
	e := &Env{}
	if b := os.Getenv(BrokersEnv); b != "" {
		e.Brokers = strings.Split(b, ",")
		e.Real = true
		testenv.RequireTCP(t, "Kafka ("+BrokersEnv+")", e.Brokers[0])
	} else {
		c, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.GroupMinSessionTimeout(100*time.Millisecond))
		if err != nil {
			t.Fatalf("kfake: %v", err)
		}
		t.Cleanup(c.Close)
		e.Brokers = c.ListenAddrs()
	}
	e.Transport = &kafkago.Transport{}
	t.Cleanup(e.Transport.CloseIdleConnections)
	e.Client = &kafkago.Client{Addr: kafkago.TCP(e.Brokers...), Transport: e.Transport, Timeout: 10 * time.Second}
	return e
}

// Topic creates a fresh topic named after prefix and waits until every
// partition has a leader (a real broker elects them asynchronously).
func (e *Env) Topic(t testing.TB, prefix string, partitions int) string {
	t.Helper()
	name := testenv.Name(prefix)
	e.CreateTopic(t, name, partitions)
	return name
}

// CreateTopic creates the topic name and waits until every partition has a
// leader.
func (e *Env) CreateTopic(t testing.TB, name string, partitions int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := e.Client.CreateTopics(ctx, &kafkago.CreateTopicsRequest{
		Topics: []kafkago.TopicConfig{{Topic: name, NumPartitions: partitions, ReplicationFactor: 1}},
	})
	if err == nil {
		err = res.Errors[name]
	}
	if err != nil {
		t.Fatalf("create topic %s: %v", name, err)
	}
	for {
		md, err := e.Client.Metadata(ctx, &kafkago.MetadataRequest{Topics: []string{name}})
		if err == nil && len(md.Topics) == 1 && md.Topics[0].Error == nil && len(md.Topics[0].Partitions) == partitions {
			ok := true
			for _, p := range md.Topics[0].Partitions {
				ok = ok && p.Error == nil && p.Leader.Host != ""
			}
			if ok {
				return
			}
		}
		if ctx.Err() != nil {
			t.Fatalf("topic %s has no leaders: %v", name, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
