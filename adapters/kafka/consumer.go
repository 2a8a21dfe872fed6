package idemkafka

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/backoff"
	"github.com/idemkit/idem/internal/telemetry"
)

// Consumer runs a handler over the partitions a Kafka consumer group assigns
// to it, and commits each partition's offset only past records whose every
// predecessor is done. See the package documentation.
type Consumer struct {
	group    string
	topics   []string
	groupCfg kafkago.ConsumerGroupConfig
	partCfg  kafkago.ReaderConfig // a partition Reader's config, Topic and Partition unset
	dialer   *kafkago.Dialer

	h  consumer.Handler
	bh BatchHandler

	opts     ConsumerOptions
	msgOpts  MessageOptions
	log      *slog.Logger
	tel      *telemetry.Adapter
	dlq      *kafkago.Writer
	dlqTopic string
	// dlqTransport is set when the Consumer made dlq (and closes it).
	dlqTransport *kafkago.Transport

	started atomic.Bool
	closers sync.WaitGroup
	hooks   hooks
}

// hooks are test seams; nil outside tests.
type hooks struct {
	// afterEffect runs when the handler acknowledged a record, before the
	// record is marked done.
	afterEffect func(msg *consumer.Message)
	// beforeCommit and afterCommit run around each offset commit.
	beforeCommit, afterCommit func(offsets map[string]map[int]int64)
	// queued runs when a fetched record was handed to the workers
	// (several workers, or a BatchHandler).
	queued func(km *kafkago.Message)
}

// NewConsumer returns a Consumer that runs h on every record of the topics
// of cfg, as a member of the consumer group cfg.GroupID.
//
// cfg is the kafka-go ReaderConfig a kafka-go user already has: Brokers,
// GroupID, Topic or GroupTopics, Dialer, the group settings (balancers,
// heartbeat, session and rebalance timeouts, StartOffset) and the fetch
// settings (MinBytes, MaxBytes, MaxWait, QueueCapacity, IsolationLevel) are
// used as kafka-go documents them, except that MaxWait defaults to 1s instead
// of 10s: a partition Reader's Close waits for the fetch in flight. GroupID is
// required; Partition and CommitInterval must be left zero (the group
// assigns partitions, ConsumerOptions.CommitEvery and CommitInterval set the commit
// policy).
//
// h is any consumer.Handler: a chain of idem middleware
// (consumer.Dedup, consumer.Transactional, Retry, Recover, Timeout,
// DeadLetter) around the business handler. The Consumer acts on
// consumer.Process's Result: see the package documentation.
func NewConsumer(cfg kafkago.ReaderConfig, h consumer.Handler, opts ConsumerOptions) (*Consumer, error) {
	if h == nil {
		return nil, errors.New("kafka: NewConsumer: handler is nil")
	}
	c, err := newConsumer(cfg, opts)
	if err != nil {
		return nil, err
	}
	c.h = h
	return c, nil
}

// NewBatchConsumer is NewConsumer for a BatchHandler: each partition's
// records are handed over in batches of up to ConsumerOptions.BatchSize, in offset
// order. ConsumerOptions.Workers must be 1.
func NewBatchConsumer(cfg kafkago.ReaderConfig, h BatchHandler, opts ConsumerOptions) (*Consumer, error) {
	if h == nil {
		return nil, errors.New("kafka: NewBatchConsumer: handler is nil")
	}
	if opts.Workers > 1 {
		return nil, fmt.Errorf("kafka: NewBatchConsumer: ConsumerOptions.Workers is %d; batches keep offset order, use 1 (the default)", opts.Workers)
	}
	c, err := newConsumer(cfg, opts)
	if err != nil {
		return nil, err
	}
	c.bh = h
	return c, nil
}

func newConsumer(cfg kafkago.ReaderConfig, opts ConsumerOptions) (*Consumer, error) {
	switch {
	case cfg.GroupID == "":
		return nil, errors.New("kafka: ReaderConfig.GroupID is required: the Consumer is a member of a consumer group and commits through it")
	case len(cfg.Brokers) == 0:
		return nil, errors.New("kafka: ReaderConfig.Brokers is empty")
	case cfg.Partition != 0:
		return nil, errors.New("kafka: ReaderConfig.Partition must be zero: the group assigns partitions")
	case cfg.CommitInterval != 0:
		return nil, errors.New("kafka: ReaderConfig.CommitInterval must be zero: set ConsumerOptions.CommitEvery and ConsumerOptions.CommitInterval instead")
	case cfg.Topic != "" && len(cfg.GroupTopics) > 0:
		return nil, errors.New("kafka: set ReaderConfig.Topic or ReaderConfig.GroupTopics, not both")
	case cfg.Topic == "" && len(cfg.GroupTopics) == 0:
		return nil, errors.New("kafka: ReaderConfig.Topic (or GroupTopics) is required")
	}
	topics := cfg.GroupTopics
	if cfg.Topic != "" {
		topics = []string{cfg.Topic}
	}
	c := &Consumer{group: cfg.GroupID, topics: append([]string(nil), topics...), dialer: cfg.Dialer}
	if c.dialer == nil {
		c.dialer = kafkago.DefaultDialer
	}
	c.groupCfg = kafkago.ConsumerGroupConfig{
		ID:                     cfg.GroupID,
		Brokers:                cfg.Brokers,
		Dialer:                 cfg.Dialer,
		Topics:                 c.topics,
		GroupBalancers:         cfg.GroupBalancers,
		HeartbeatInterval:      cfg.HeartbeatInterval,
		PartitionWatchInterval: cfg.PartitionWatchInterval,
		WatchPartitionChanges:  cfg.WatchPartitionChanges,
		SessionTimeout:         cfg.SessionTimeout,
		RebalanceTimeout:       cfg.RebalanceTimeout,
		JoinGroupBackoff:       cfg.JoinGroupBackoff,
		RetentionTime:          cfg.RetentionTime,
		StartOffset:            cfg.StartOffset,
		Logger:                 cfg.Logger,
		ErrorLogger:            cfg.ErrorLogger,
	}
	if err := c.groupCfg.Validate(); err != nil {
		return nil, fmt.Errorf("kafka: ReaderConfig: %w", err)
	}
	maxWait := cfg.MaxWait
	if maxWait == 0 {
		maxWait = time.Second
	}
	c.partCfg = kafkago.ReaderConfig{
		Brokers:          cfg.Brokers,
		Dialer:           cfg.Dialer,
		QueueCapacity:    cfg.QueueCapacity,
		MinBytes:         cfg.MinBytes,
		MaxBytes:         cfg.MaxBytes,
		MaxWait:          maxWait,
		ReadBatchTimeout: cfg.ReadBatchTimeout,
		ReadLagInterval:  -1,
		ReadBackoffMin:   cfg.ReadBackoffMin,
		ReadBackoffMax:   cfg.ReadBackoffMax,
		Logger:           cfg.Logger,
		ErrorLogger:      cfg.ErrorLogger,
		IsolationLevel:   cfg.IsolationLevel,
		MaxAttempts:      cfg.MaxAttempts,
	}
	check := c.partCfg
	check.Topic = c.topics[0]
	if err := check.Validate(); err != nil {
		return nil, fmt.Errorf("kafka: ReaderConfig: %w", err)
	}
	// kafka-go's defaults, which NewReader would panic on.
	bmin, bmax := cmp.Or(check.ReadBackoffMin, 100*time.Millisecond), cmp.Or(check.ReadBackoffMax, time.Second)
	if bmax < bmin {
		return nil, fmt.Errorf("kafka: ReaderConfig: ReadBackoffMax %v is smaller than ReadBackoffMin %v", bmax, bmin)
	}

	if err := opts.setDefaults(c.groupCfg.SessionTimeout, c.groupCfg.RebalanceTimeout); err != nil {
		return nil, err
	}
	c.opts = opts
	c.msgOpts = opts.messageOptions(c.group)
	c.log = opts.Logger
	c.tel = telemetry.NewAdapter(opts.MeterProvider, opts.TracerProvider, system)
	if err := c.setDeadLetter(cfg); err != nil {
		return nil, err
	}
	return c, nil
}

func (c *Consumer) setDeadLetter(cfg kafkago.ReaderConfig) error {
	o := c.opts
	if w := o.DeadLetterWriter; w != nil {
		if err := checkWriter("ConsumerOptions.DeadLetterWriter", w); err != nil {
			return err
		}
		switch {
		case w.Topic != "" && o.DeadLetterTopic != "" && w.Topic != o.DeadLetterTopic:
			return fmt.Errorf("kafka: ConsumerOptions.DeadLetterTopic is %q but DeadLetterWriter.Topic is %q; set one of them", o.DeadLetterTopic, w.Topic)
		case w.Topic != "":
			c.dlqTopic = w.Topic
		case o.DeadLetterTopic == "":
			return errNoDeadLetterTopic
		default:
			c.dlqTopic = o.DeadLetterTopic
		}
		c.dlq = w
		return nil
	}
	if o.DeadLetterTopic == "" {
		return errNoDeadLetterTopic
	}
	for _, t := range c.topics {
		if t == o.DeadLetterTopic {
			return fmt.Errorf("kafka: ConsumerOptions.DeadLetterTopic %q is a topic the Consumer reads", t)
		}
	}
	d := c.dialer
	c.dlqTransport = &kafkago.Transport{
		Dial:     d.DialFunc,
		ClientID: d.ClientID,
		TLS:      d.TLS,
		SASL:     d.SASLMechanism,
	}
	c.dlqTopic = o.DeadLetterTopic
	c.dlq = &kafkago.Writer{
		Addr:         kafkago.TCP(cfg.Brokers...),
		Topic:        o.DeadLetterTopic,
		Balancer:     &kafkago.Hash{},
		RequiredAcks: kafkago.RequireAll,
		BatchSize:    1, // one record is a full batch: no BatchTimeout wait
		Transport:    c.dlqTransport,
	}
	return nil
}

// Run checks that the dead-letter topic exists, joins the group and
// consumes until ctx is done, then stops fetching, gives the handlers
// running ShutdownTimeout to finish, commits what is done and leaves the
// group. It returns nil after such a stop; it keeps retrying when the
// brokers are unreachable (kafka-go backs off between attempts to join). It
// returns an error wrapping ErrDeadLetterTopicMissing, before consuming
// anything, when the brokers answer that the dead-letter topic does not
// exist. Run may be called once.
func (c *Consumer) Run(ctx context.Context) error {
	if !c.started.CompareAndSwap(false, true) {
		return errors.New("kafka: Consumer.Run called twice; make a new Consumer")
	}
	defer c.closeDeadLetter()
	if err := c.checkDeadLetterTopic(ctx); err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return err
	}
	cg, err := kafkago.NewConsumerGroup(c.groupCfg)
	if err != nil {
		return fmt.Errorf("kafka: consumer group: %w", err)
	}
	for {
		gen, err := cg.Next(ctx)
		if err != nil {
			if ctx.Err() != nil || errors.Is(err, kafkago.ErrGroupClosed) {
				break
			}
			level := slog.LevelWarn
			if errors.Is(err, kafkago.RebalanceInProgress) {
				level = slog.LevelDebug // another member joined meanwhile
			}
			c.log.LogAttrs(ctx, level, "idem: joining the consumer group failed; kafka-go tries again",
				slog.String("group", c.group), slog.Any("error", err))
			continue
		}
		c.log.LogAttrs(ctx, slog.LevelDebug, "idem: new generation",
			slog.String("group", c.group), slog.Int("generation", int(gen.ID)), slog.String("member", gen.MemberID),
			slog.Any("assignments", gen.Assignments))
		gen.Start(func(gctx context.Context) { c.runGeneration(ctx, gctx, gen) })
	}
	// Close ends the generation, waits for runGeneration (which drains and
	// commits) and leaves the group.
	_ = cg.Close()
	c.closers.Wait()
	return nil
}

func (c *Consumer) closeDeadLetter() {
	c.closers.Wait()
	if c.dlqTransport != nil {
		_ = c.dlq.Close()
		c.dlqTransport.CloseIdleConnections()
	}
}

// closeInBackground closes r without waiting for it.
func (c *Consumer) closeInBackground(r io.Closer) {
	c.closers.Go(func() { _ = r.Close() })
}

func (c *Consumer) report(ctx context.Context, msg *consumer.Message, r consumer.Result) {
	if c.opts.OnOutcome != nil {
		c.opts.OnOutcome(ctx, consumer.Report{Outcome: r.Outcome(), Message: msg, Result: r, Err: r.Err})
	}
}

// backoff returns the wait before retry n (n >= 1): Backoff.Delay(n) with
// jitter over its upper half; at least hint, capped by Backoff.Max.
func (c *Consumer) backoff(n int, hint time.Duration) time.Duration {
	d := backoff.Upper(c.opts.Backoff.Delay(n))
	if hint > d {
		d = min(hint, c.opts.Backoff.Max)
	}
	return d
}
