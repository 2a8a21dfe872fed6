package idemkafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemkit/idem/internal/backoff"
)

// generation is this member's share of one consumer-group generation: the
// partitions assigned to it and their commits.
type generation struct {
	c     *Consumer
	gen   *kafkago.Generation
	parts []*partition
	// kick asks the commit loop for a commit now (CommitEvery reached).
	kick chan struct{}
}

func (g *generation) kickCommit() {
	select {
	case g.kick <- struct{}{}:
	default:
	}
}

// runGeneration runs for the length of a generation, started by
// Generation.Start. stop is done when the generation ends: a rebalance, a
// lost coordinator, or Run's context done (Run closes the group). kafka-go
// waits for this function to return before it joins the next generation, so
// no record of this generation is committed through another one: a partition
// moved to another member is never committed by this one.
func (c *Consumer) runGeneration(base, stop context.Context, gen *kafkago.Generation) {
	g := &generation{c: c, gen: gen, kick: make(chan struct{}, 1)}
	starts, ok := g.startPositions(stop)
	if !ok {
		return
	}
	workCtx, cancelWork := context.WithCancel(context.WithoutCancel(base))
	defer cancelWork()

	var (
		wg       sync.WaitGroup
		resolved bool
	)
	for _, s := range starts {
		g.parts = append(g.parts, c.newPartition(workCtx, g, s))
		resolved = resolved || s.commitStart
	}
	if resolved {
		// Record the resolved start positions at once, before a
		// record is done: this commit moves nothing past them.
		g.commit(stop)
	}
	for _, p := range g.parts {
		wg.Go(func() { p.run(stop) })
	}
	g.commitLoop(stop)

	// The generation ended: fetching has stopped. Records running get
	// ShutdownTimeout to finish, then their context is cancelled; records
	// not started are abandoned. Then what is done is committed.
	t := time.AfterFunc(c.opts.ShutdownTimeout, cancelWork)
	g.waitParts(base, &wg)
	t.Stop()
	g.commit(context.WithoutCancel(base))
	c.log.LogAttrs(base, slog.LevelDebug, "idem: generation ended",
		slog.String("group", c.group), slog.Int("generation", int(gen.ID)))
}

// offsetStoreTimeout bounds each OffsetStore call and each resolution of a
// start offset.
const offsetStoreTimeout = 10 * time.Second

// waitParts waits for the partitions' loops to return: at most
// ShutdownTimeout after the handlers' context was cancelled. A handler that
// ignores its context would otherwise hold the generation, and with it the
// member's next join and Run's return, for as long as it runs. The records
// it holds are not done, so they are not committed: the partition's next
// owner runs them again.
func (g *generation) waitParts(base context.Context, wg *sync.WaitGroup) {
	c := g.c
	finished := make(chan struct{})
	go func() { // ends with the last partition loop
		wg.Wait()
		close(finished)
	}()
	t := time.NewTimer(2 * c.opts.ShutdownTimeout)
	defer t.Stop()
	select {
	case <-finished:
	case <-t.C:
		c.log.LogAttrs(base, slog.LevelError, "idem: handlers did not return within ShutdownTimeout of their context's cancellation; the generation ends without them and their records are not committed",
			slog.String("group", c.group), slog.Int("generation", int(g.gen.ID)))
	}
}

type startPosition struct {
	topic       string
	partition   int
	offset      int64
	commitStart bool
}

// startPositions returns where each assigned partition is consumed from: the
// OffsetStore's position when there is one (committed to Kafka at once when
// Kafka's is behind it), else the group's committed offset, else the
// StartOffset resolved to an absolute offset (and committed at once, so that
// a LastOffset start does not skip records produced before the next
// generation). ok is false when stop ended first.
func (g *generation) startPositions(stop context.Context) (_ []startPosition, ok bool) {
	c := g.c
	topics := make([]string, 0, len(g.gen.Assignments))
	for t := range g.gen.Assignments {
		topics = append(topics, t)
	}
	sort.Strings(topics)
	var out []startPosition
	for _, topic := range topics {
		as := g.gen.Assignments[topic]
		if len(as) == 0 {
			continue
		}
		ids := make([]int, len(as))
		for i, a := range as {
			ids[i] = a.ID
		}
		var stored map[int]int64
		if c.opts.Offsets != nil {
			// Each try is bounded: a load stuck on its database (a
			// pool waiting for a connection, a connection that no
			// longer answers) would keep the partitions unfetched for
			// as long as the generation lasts, which in a settled
			// group is for good.
			err := retry(stop, c, "loading stored offsets", func() error {
				lctx, cancel := context.WithTimeout(stop, offsetStoreTimeout)
				defer cancel()
				var err error
				stored, err = c.opts.Offsets.LoadOffsets(lctx, c.group, topic, ids)
				return err
			})
			if err != nil {
				return nil, false
			}
		}
		for _, a := range as {
			s := startPosition{topic: topic, partition: a.ID, offset: a.Offset}
			if off, ok := stored[a.ID]; ok {
				s.offset = off
				// Kafka's committed offset is behind when a commit
				// the OffsetStore saved was refused by Kafka (the
				// generation had ended): bring it up now, so that
				// Kafka's lag is not that of records long done.
				s.commitStart = off > a.Offset
			}
			if s.offset < 0 {
				which := s.offset
				err := retry(stop, c, "resolving the start offset", func() (err error) {
					// Bounded like the load above: a Dialer without
					// a Timeout sets no deadline on the leader lookup.
					rctx, cancel := context.WithTimeout(stop, offsetStoreTimeout)
					defer cancel()
					s.offset, err = c.resolveOffset(rctx, topic, a.ID, which)
					return err
				})
				if err != nil {
					return nil, false
				}
				s.commitStart = true
			}
			out = append(out, s)
		}
	}
	return out, true
}

// retry runs fn until it succeeds or stop is done, with backoff.
func retry(stop context.Context, c *Consumer, what string, fn func() error) error {
	for n := 1; ; n++ {
		err := fn()
		if err == nil {
			return nil
		}
		if stop.Err() != nil {
			return err
		}
		c.log.LogAttrs(stop, slog.LevelWarn, "idem: "+what+" failed; trying again",
			slog.String("group", c.group), slog.Any("error", err))
		if !backoff.Sleep(stop, c.backoff(n, 0)) {
			return err
		}
	}
}

// resolveOffset turns kafkago.FirstOffset or LastOffset into an absolute
// offset by asking the partition's leader.
func (c *Consumer) resolveOffset(ctx context.Context, topic string, partition int, which int64) (int64, error) {
	var errs []error
	for _, b := range c.groupCfg.Brokers {
		conn, err := c.dialer.DialLeader(ctx, "tcp", b, topic, partition)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
		first, last, err := conn.ReadOffsets()
		_ = conn.Close()
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if which == kafkago.LastOffset {
			return last, nil
		}
		return first, nil
	}
	return 0, fmt.Errorf("kafka: offsets of %s/%d: %w", topic, partition, errors.Join(errs...))
}

// commitLoop commits every CommitInterval, or sooner when kicked, until stop
// is done.
func (g *generation) commitLoop(stop context.Context) {
	t := time.NewTicker(g.c.opts.CommitInterval)
	defer t.Stop()
	for {
		select {
		case <-stop.Done():
			return
		case <-t.C:
		case <-g.kick:
		}
		if stop.Err() != nil {
			return // the final commit follows
		}
		g.commit(stop)
	}
}

// commit commits each partition's contiguous-done watermark that moved,
// through this generation (the broker refuses it once the generation is
// over), and to the OffsetStore when there is one.
func (g *generation) commit(ctx context.Context) {
	c := g.c
	type taken struct {
		p   *partition
		off int64
	}
	var ts []taken
	offsets := map[string]map[int]int64{}
	for _, p := range g.parts {
		off, ok := p.tr.take()
		if !ok {
			continue
		}
		ts = append(ts, taken{p, off})
		if offsets[p.topic] == nil {
			offsets[p.topic] = map[int]int64{}
		}
		offsets[p.topic][p.id] = off
	}
	if len(ts) == 0 {
		return
	}
	if h := c.hooks.beforeCommit; h != nil {
		h(offsets)
	}
	kerr := g.gen.CommitOffsets(offsets)
	if kerr != nil {
		c.log.LogAttrs(ctx, slog.LevelWarn, "idem: committing offsets failed; they are committed with the next commit, or the records come back",
			slog.String("group", c.group), slog.Int("generation", int(g.gen.ID)), slog.Any("offsets", offsets), slog.Any("error", kerr))
	}
	ok := kerr == nil
	if c.opts.Offsets != nil {
		// Not cut short by the generation's end: the final commit would
		// only repeat it.
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), offsetStoreTimeout)
		serr := c.opts.Offsets.SaveOffsets(sctx, c.group, offsets)
		cancel()
		if serr != nil {
			c.log.LogAttrs(ctx, slog.LevelWarn, "idem: storing offsets failed",
				slog.String("group", c.group), slog.Any("offsets", offsets), slog.Any("error", serr))
		}
		// Both must have it: a commit Kafka refused is tried again with
		// the next one (and, once the generation is over, the next
		// owner commits the OffsetStore's position to Kafka when the
		// partition is assigned to it).
		ok = ok && serr == nil
	}
	if !ok {
		return
	}
	for _, t := range ts {
		t.p.tr.taken(t.off)
	}
	if h := c.hooks.afterCommit; h != nil {
		h(offsets)
	}
}
