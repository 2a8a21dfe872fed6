package main

import (
	"context"
	"fmt"
	"strconv"
	"strings"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/outbox"
)

// The brokers the demo runs on.
const (
	brokerKafka = "kafka"
	brokerAMQP  = "amqp"
)

// Session timeouts of the child processes' Kafka consumer group. A SIGKILLed
// member stays in the group until its session times out, and the partitions
// wait that long for the restarted one: kfake accepts a short session
// (kfake.GroupMinSessionTimeout); a real broker's default minimum is 6s
// (group.min.session.timeout.ms).
const (
	kfakeSession     = time.Second
	realKafkaSession = 6 * time.Second
)

// demoBroker is the broker side of a demo run: where the relay publishes
// and where the consumers read.
type demoBroker struct {
	kind     string // brokerKafka or brokerAMQP
	describe string
	pub      outbox.Publisher
	// topic is the outbox messages' Topic: the Kafka topic, or the
	// RabbitMQ exchange.
	topic string

	// Kafka.
	brokers []string
	dlq     string
	session time.Duration // of the child processes' consumer group
	// trimmer, set on the in-process kfake cluster, trims the topic
	// below what the consumer groups committed (demo_trim.go).
	trimmer *logTrimmer

	// RabbitMQ.
	amqpURL string
	queues  map[string]string // pipeline → its queue

	closers []func()
}

// close releases what setupKafka or setupAMQP set up, the last first.
func (b *demoBroker) close() {
	for i := len(b.closers) - 1; i >= 0; i-- {
		b.closers[i]()
	}
	b.closers = nil
}

// setupKafka starts kfake in this process (or uses the brokers of --kafka),
// creates the run's topic and dead-letter topic, and returns the broker
// with a idemkafka.Publisher on the topic.
func setupKafka(ctx context.Context, cfg demoConfig, runID string) (*demoBroker, error) {
	topic, dlq := "payments-"+runID, "payments-"+runID+".dlq"
	b := &demoBroker{kind: brokerKafka, topic: topic, dlq: dlq}
	ok := false
	defer func() {
		if !ok {
			b.close()
		}
	}()
	if cfg.kafkaBrokers == "" {
		cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.GroupMinSessionTimeout(100*time.Millisecond),
			kfake.SeedTopics(int32(cfg.partitions), topic), kfake.SeedTopics(1, dlq),
			kfake.BrokerConfigs(map[string]string{"log.segment.bytes": strconv.Itoa(kfakeSegment)}))
		if err != nil {
			return nil, fmt.Errorf("start kfake: %w", err)
		}
		b.closers = append(b.closers, cluster.Close)
		// kfake listens on localhost TCP ports: the child processes
		// connect to it like to any broker.
		b.brokers = cluster.ListenAddrs()
		b.session = kfakeSession
		b.describe = fmt.Sprintf("in-process Kafka (kfake), topic with %d partitions", cfg.partitions)
	} else {
		b.brokers = strings.Split(cfg.kafkaBrokers, ",")
		b.session = realKafkaSession
		b.describe = fmt.Sprintf("Kafka at %s, topic %s with %d partitions", cfg.kafkaBrokers, topic, cfg.partitions)
	}
	transport := &kafkago.Transport{}
	b.closers = append(b.closers, transport.CloseIdleConnections)
	if cfg.kafkaBrokers == "" {
		client, err := kgo.NewClient(kgo.SeedBrokers(b.brokers...))
		if err != nil {
			return nil, fmt.Errorf("kfake client: %w", err)
		}
		b.closers = append(b.closers, client.Close)
		b.trimmer = &logTrimmer{
			client:     client,
			offsets:    &kafkago.Client{Addr: kafkago.TCP(b.brokers...), Transport: transport, Timeout: 5 * time.Second},
			topic:      topic,
			partitions: cfg.partitions,
			trimmed:    map[int]int64{},
		}
	}
	if cfg.kafkaBrokers != "" {
		if err := createTopics(ctx, b.brokers, transport, cfg.partitions, topic, dlq); err != nil {
			return nil, err
		}
	}
	w := &kafkago.Writer{
		Addr:         kafkago.TCP(b.brokers...),
		Topic:        topic,
		Balancer:     &kafkago.Hash{},
		RequiredAcks: kafkago.RequireAll,
		BatchTimeout: 5 * time.Millisecond,
		BatchSize:    200,
		Transport:    transport,
	}
	b.closers = append(b.closers, func() { _ = w.Close() })
	pub, err := idemkafka.NewPublisher(w, idemkafka.PublisherOptions{})
	if err != nil {
		return nil, err
	}
	b.pub = pub
	ok = true
	return b, nil
}
