package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
)

// group is a consumer group of one pipeline: a idemkafka.Consumer, or an
// idemamqp.Consumer of the pipeline's queue, that crashes now and then before
// committing and is restarted. With a shared store, the idem group runs in
// child processes instead (demo_proc.go).
type group struct {
	path      string
	name      string
	br        *demoBroker
	logger    *slog.Logger
	ledger    *ledger
	dedup     consumer.Middleware // nil for the naive group
	crashRate float64
	rng       *lockedRand
	plan      *plan
	offsets   *offsetStore
	// crashed holds the payments whose planned crash happened (Kafka in
	// this process).
	crashed map[int]bool
	// child, when set, is the configuration of the child processes that
	// run this group, started from exe. freeze makes the demo stop a
	// child between deliveries before it SIGKILLs it.
	child  *childConfig
	exe    string
	freeze bool

	mu       sync.Mutex
	handled  atomic.Int64 // distinct records handled, of both pipelines
	seen     copySet      // the broker copies handled
	crashes  atomic.Int64
	kills    atomic.Int64 // child processes SIGKILLed
	restarts atomic.Int64 // child processes started after a kill
}

// instance is one run of a group's consumer: one process, in a real
// deployment.
type instance struct {
	dead   atomic.Bool
	cancel context.CancelFunc
}

func (g *group) run(ctx context.Context) error {
	if g.child != nil {
		return g.runChildren(ctx)
	}
	for ctx.Err() == nil {
		inst := &instance{}
		ictx, cancel := context.WithCancel(ctx)
		inst.cancel = cancel
		var err error
		if g.br.kind == brokerAMQP {
			err = g.runAMQPInstance(ictx, inst)
		} else {
			err = g.runInstance(ictx, inst)
		}
		cancel()
		if err != nil {
			return err
		}
	}
	return nil
}

// markHandled counts the broker's copy po as handled by the group.
func (g *group) markHandled(po copyID) {
	g.mu.Lock()
	if g.seen.add(po) {
		g.handled.Add(1)
	}
	g.mu.Unlock()
}

// handler is the group's handler chain in this process: route (skip the
// other pipeline's records, classify this one's deliveries), then the dedup
// claim for the idem group, then the charge on the ledger.
func (g *group) handler() consumer.Handler {
	charge := consumer.HandlerFunc(func(_ context.Context, msg *consumer.Message) error {
		var p paymentBody
		if err := json.Unmarshal(msg.Payload, &p); err != nil {
			return consumer.Permanent(err)
		}
		g.ledger.charge(p.Payment, p.Cents)
		return nil
	})
	classify := func(msg *consumer.Message, p *paymentBody) {
		g.ledger.classify(deliveryID(msg), msg.ID, msg.Headers[headerRequest], p.Payment)
	}
	return consumer.Chain(charge, route(g.path, classify), consumer.Recover(), g.dedup)
}

// route is the outermost middleware of a group: it skips the other
// pipeline's records (both pipelines share the topic) and reports each
// broker delivery of this pipeline's records to delivered before passing it
// on. A retry the consumer decided (Attempt > 1) is not a delivery.
func route(path string, delivered func(msg *consumer.Message, p *paymentBody)) consumer.Middleware {
	return func(next consumer.Handler) consumer.Handler {
		return consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
			if msg.Headers[headerPath] != path {
				return nil
			}
			var p paymentBody
			if err := json.Unmarshal(msg.Payload, &p); err != nil {
				return consumer.Permanent(err)
			}
			if msg.Attempt <= 1 {
				delivered(msg, &p)
			}
			return next.Handle(ctx, msg)
		})
	}
}

// errDead is what a crashed instance answers: the process is gone and
// handles nothing more.
var errDead = errors.New("demo: the consumer crashed")

// crashing wraps the group's handler for an instance in this process, so
// that what it handles and commits follows from the plan alone: the
// instance commits each record's position as soon as the record is
// handled, but after the first delivery of a payment whose plan says it
// crashes, which it handles and never commits; and once crashed it
// handles nothing more. The restarted instance gets that delivery again,
// and no other.
func (g *group) crashing(inst *instance, next consumer.Handler) consumer.Handler {
	return consumer.HandlerFunc(func(ctx context.Context, msg *consumer.Message) error {
		if inst.dead.Load() {
			return errDead
		}
		// A crash stops the consumer, not a handler midway: the
		// handler runs to its end.
		err := next.Handle(context.WithoutCancel(ctx), msg)
		if consumer.Decide(err).Action != consumer.ActionAck {
			return err
		}
		if msg.Headers[headerPath] == g.path {
			var p paymentBody
			if json.Unmarshal(msg.Payload, &p) == nil && g.crashAfter(p.Payment) {
				inst.dead.Store(true)
				g.crashes.Add(1)
				inst.cancel()
				return err
			}
		}
		part, _ := strconv.Atoi(msg.Metadata["kafka.partition"])
		off, _ := strconv.ParseInt(msg.Metadata["kafka.offset"], 10, 64)
		g.offsets.save(part, off+1)
		g.markHandled(deliveryID(msg))
		return err // nil, or a completed duplicate's
	})
}

// crashAfter reports whether the group crashes after handling a delivery
// of payment n: the first one, when the plan says so.
func (g *group) crashAfter(n int) bool {
	if !g.plan.crashes(g.path, n) {
		return false
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.crashed[n] {
		return false
	}
	g.crashed[n] = true
	return true
}

func (g *group) runInstance(ctx context.Context, inst *instance) error {
	c, err := idemkafka.NewConsumer(kafkago.ReaderConfig{
		Brokers:  g.br.brokers,
		GroupID:  g.name,
		Topic:    g.br.topic,
		MinBytes: 1,
		MaxBytes: 10 << 20,
		MaxWait:  50 * time.Millisecond,
	}, g.crashing(inst, g.handler()), idemkafka.ConsumerOptions{
		DeadLetterTopic: g.br.dlq,
		CommitEvery:     500,
		CommitInterval:  500 * time.Millisecond,
		ShutdownTimeout: time.Second,
		Offsets:         &instanceOffsets{store: g.offsets, inst: inst},
		Telemetry: consumer.Telemetry{
			Logger: g.logger,
			OnOutcome: func(_ context.Context, rep consumer.Report) {
				msg, r := rep.Message, rep.Result
				if r.Action == consumer.ActionRetry || inst.dead.Load() {
					return
				}
				g.markHandled(deliveryID(msg))
			},
		},
	})
	if err != nil {
		return err
	}
	return c.Run(ctx)
}

// offsetStore keeps a group's committed positions: the source of truth for
// where a restarted consumer resumes. A fresh topic starts at offset 0.
type offsetStore struct {
	mu         sync.Mutex
	pos        map[int]int64
	partitions int
}

// instanceOffsets is one instance's view of its group's offsetStore: once
// the instance is dead, its commits are lost, as a crashed process's are.
type instanceOffsets struct {
	store *offsetStore
	inst  *instance
}

// save records that a partition's records before off are done.
func (o *offsetStore) save(partition int, off int64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if off > o.pos[partition] {
		o.pos[partition] = off
	}
}

func (o *instanceOffsets) LoadOffsets(_ context.Context, _, _ string, partitions []int) (map[int]int64, error) {
	o.store.mu.Lock()
	defer o.store.mu.Unlock()
	out := make(map[int]int64, len(partitions))
	for _, p := range partitions {
		out[p] = o.store.pos[p]
	}
	return out, nil
}

func (o *instanceOffsets) SaveOffsets(_ context.Context, _ string, offsets map[string]map[int]int64) error {
	if o.inst.dead.Load() {
		return nil // the process is gone: the commit never happens
	}
	o.store.mu.Lock()
	defer o.store.mu.Unlock()
	for _, parts := range offsets {
		for p, off := range parts {
			if off > o.store.pos[p] {
				o.store.pos[p] = off
			}
		}
	}
	return nil
}

// createTopics creates the demo's topics on a real cluster and waits for
// their leaders.
func createTopics(ctx context.Context, brokers []string, transport *kafkago.Transport, partitions int, topic, dlq string) error {
	client := &kafkago.Client{Addr: kafkago.TCP(brokers...), Transport: transport, Timeout: 10 * time.Second}
	res, err := client.CreateTopics(ctx, &kafkago.CreateTopicsRequest{Topics: []kafkago.TopicConfig{
		{Topic: topic, NumPartitions: partitions, ReplicationFactor: 1},
		{Topic: dlq, NumPartitions: 1, ReplicationFactor: 1},
	}})
	if err != nil {
		return fmt.Errorf("kafka at %s: create topics: %w", strings.Join(brokers, ","), err)
	}
	for t, err := range res.Errors {
		if err != nil && !errors.Is(err, kafkago.TopicAlreadyExists) {
			return fmt.Errorf("kafka: create topic %s: %w", t, err)
		}
	}
	for {
		md, err := client.Metadata(ctx, &kafkago.MetadataRequest{Topics: []string{topic, dlq}})
		if err == nil && topicsReady(md) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("kafka: topics have no leaders: %w", ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func topicsReady(md *kafkago.MetadataResponse) bool {
	for _, t := range md.Topics {
		if t.Error != nil || len(t.Partitions) == 0 {
			return false
		}
		for _, p := range t.Partitions {
			if p.Error != nil || p.Leader.Host == "" {
				return false
			}
		}
	}
	return true
}
