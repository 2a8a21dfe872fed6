package chaos

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/outbox"
)

// relay/kafka/sigkill: outbox -> Kafka (kfake in the runner) through
// adapters/kafka's Publisher in the relay children; an adapters/kafka
// Consumer in the runner.

// kafkaSink is the Kafka side of a relay cell.
type kafkaSink struct {
	k      *kafkaEnv
	topicN string
	group  string
	cancel context.CancelFunc
	done   chan error
}

func newKafkaSink(ctx context.Context, b *cellBase) (*kafkaSink, func(), error) {
	k, err := newKafkaEnv()
	if err != nil {
		return nil, nil, err
	}
	s := &kafkaSink{k: k, topicN: "chaos_" + b.suffix, group: "chaos_g_" + b.suffix}
	fail := func(err error) (*kafkaSink, func(), error) {
		k.close()
		return nil, nil, err
	}
	if err := k.createTopic(ctx, s.topicN, kafkaPartitions); err != nil {
		return fail(err)
	}
	if err := k.createTopic(ctx, s.topicN+"_dlq", 1); err != nil {
		return fail(err)
	}
	h, closeLog, err := relayHandler(b, filepath.Join(b.env.TempDir, "deliveries-consumer.log"), 0)
	if err != nil {
		return fail(err)
	}
	c, err := idemkafka.NewConsumer(kafkaReaderConfig(k.brokers, s.group, s.topicN, 10*time.Second), h, idemkafka.ConsumerOptions{
		CommitEvery: 50, CommitInterval: 100 * time.Millisecond, DeadLetterTopic: s.topicN + "_dlq",
		Telemetry: consumer.Telemetry{
			Logger: quietLogger(),
		},
	})
	if err != nil {
		closeLog()
		return fail(err)
	}
	cctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	s.cancel, s.done = cancel, make(chan error, 1)
	go func() { s.done <- c.Run(cctx) }()
	return s, func() {
		_ = s.stop()
		closeLog()
		k.close()
	}, nil
}

// stop stops the consumer (once) and returns Run's error.
func (s *kafkaSink) stop() error {
	if s.cancel == nil {
		return nil
	}
	s.cancel()
	s.cancel = nil
	select {
	case err := <-s.done:
		return err
	case <-time.After(60 * time.Second):
		return errors.New("the Kafka consumer did not stop within 60s")
	}
}

func (s *kafkaSink) configure(c *childConfig) { c.Brokers, c.Topic = s.k.brokers, s.topicN }

func (s *kafkaSink) topic() string { return s.topicN }

func (s *kafkaSink) caughtUp(ctx context.Context, _ time.Duration) (bool, error) {
	return s.k.caughtUp(ctx, s.group, s.topicN, kafkaPartitions)
}

func (s *kafkaSink) settle(ctx context.Context) error {
	if err := s.stop(); err != nil {
		return fmt.Errorf("consumer: %w", err)
	}
	ok, err := s.k.caughtUp(ctx, s.group, s.topicN, kafkaPartitions)
	if err != nil {
		return err
	}
	if !ok {
		return errors.New("the consumer's committed offsets are behind the ends after it stopped")
	}
	return s.k.empty(ctx, s.topicN+"_dlq", 1)
}

// relayKafkaPublisher is the relay child's publisher: adapters/kafka's on a
// synchronous Writer that waits for every in-sync replica.
func relayKafkaPublisher(cfg childConfig) (outbox.Publisher, func(), error) {
	tr := &kafkago.Transport{}
	w := &kafkago.Writer{
		Addr:         kafkago.TCP(cfg.Brokers...),
		Balancer:     &kafkago.Hash{},
		RequiredAcks: kafkago.RequireAll,
		BatchSize:    100,
		BatchTimeout: 2 * time.Millisecond,
		WriteTimeout: 10 * time.Second,
		Transport:    tr,
	}
	p, err := idemkafka.NewPublisher(w, idemkafka.PublisherOptions{})
	if err != nil {
		return nil, nil, err
	}
	return p, func() { _ = w.Close(); tr.CloseIdleConnections() }, nil
}

// relayKafkaCell is relay/kafka/sigkill.
func relayKafkaCell(name string) Cell {
	return Cell{
		Name: name,
		Run: func(ctx context.Context, env *Env) (Result, error) {
			n, kills := env.Pick(1000, 20000), env.Pick(8, 40)
			return withBase(ctx, env, name, storePG, n, func(b *cellBase) (Result, error) {
				sink, cleanup, err := newKafkaSink(ctx, b)
				if err != nil {
					return Result{}, err
				}
				defer cleanup()
				return relayKillCell(ctx, b, sink, kills)
			})
		},
	}
}
