package idemkafka

import (
	"context"
	"errors"
	"log/slog"
	"strconv"
	"sync"

	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/backoff"
)

// item is one fetched record on its way through a partition.
type item struct {
	km  kafkago.Message
	seq uint64
	// msg and idErr are set when the record is mapped (mapped).
	msg   *consumer.Message
	idErr error
}

// partition consumes one assigned partition for the length of a generation:
// a fetch loop that runs each record itself (one worker, consumer.Handler),
// or feeds ConsumerOptions.Workers workers (several workers, or a BatchHandler); and
// a commit tracker.
type partition struct {
	c     *Consumer
	g     *generation
	topic string
	id    int
	tr    *tracker
	rd    *kafkago.Reader
	// ready holds records a worker may start: in offset order with one
	// worker; with several, at most one record per key at a time (keys).
	ready chan *item
	// sem bounds the records fetched but not finished (MaxInFlight); ready
	// has that capacity, so a send on it never blocks.
	sem  chan struct{}
	keys *keyScheduler
	// partStr is the partition number in decimal, for Message.Metadata.
	partStr string
	// workCtx is the handlers' context: it outlives the generation by
	// ShutdownTimeout.
	workCtx context.Context
}

func (c *Consumer) newPartition(workCtx context.Context, g *generation, s startPosition) *partition {
	cfg := c.partCfg
	cfg.Topic = s.topic
	cfg.Partition = s.partition
	p := &partition{
		c:       c,
		g:       g,
		topic:   s.topic,
		id:      s.partition,
		tr:      newTracker(s.offset, s.commitStart),
		rd:      kafkago.NewReader(cfg),
		partStr: strconv.Itoa(s.partition),
		workCtx: workCtx,
	}
	if c.opts.Workers > 1 || c.bh != nil {
		p.ready = make(chan *item, c.opts.MaxInFlight)
		p.sem = make(chan struct{}, c.opts.MaxInFlight)
	}
	if c.opts.Workers > 1 {
		p.keys = &keyScheduler{ready: p.ready, busy: map[string][]*item{}}
	}
	// A partition Reader starts fetching on the first FetchMessage; the
	// offset is absolute here, so SetOffset cannot fail but on a closed
	// Reader.
	_ = p.rd.SetOffset(s.offset)
	return p
}

// run fetches until stop is done, then lets the workers finish the records
// they are running and abandons the others. The Reader is closed in the
// background: closing waits for a fetch in flight (up to MaxWait).
func (p *partition) run(stop context.Context) {
	defer p.c.closeInBackground(p.rd)
	if p.keys == nil && p.c.bh == nil {
		// One record at a time: the fetch loop runs each record itself
		// (the Reader prefetches), no hand-over to a worker.
		p.fetchAndRun(stop)
		return
	}
	var wg sync.WaitGroup
	for range p.c.opts.Workers {
		wg.Go(func() { p.work(stop) })
	}
	p.fetch(stop)
	wg.Wait()
}

// fetchNext fetches the next record, retrying failed fetches with backoff.
// ok is false once stop is done.
func (p *partition) fetchNext(stop context.Context, km *kafkago.Message) (ok bool) {
	for fails := 0; ; {
		var err error
		*km, err = p.rd.FetchMessage(stop)
		if err == nil {
			return stop.Err() == nil
		}
		if stop.Err() != nil {
			return false
		}
		fails++
		p.c.log.LogAttrs(stop, slog.LevelWarn, "idem: fetching failed; the reader reconnects",
			slog.String("topic", p.topic), slog.Int("partition", p.id), slog.Any("error", err))
		if !backoff.Sleep(stop, p.c.backoff(fails, 0)) {
			return false
		}
	}
}

// fetchAndRun fetches and runs records one after another until stop is done.
func (p *partition) fetchAndRun(stop context.Context) {
	rn := p.newRunner()
	it := &item{}
	for p.fetchNext(stop, &it.km) {
		it.seq = p.tr.add(it.km.Offset)
		it.msg, it.idErr = nil, nil
		p.runOne(stop, rn, it, 1)
	}
}

// fetch feeds the workers until stop is done.
func (p *partition) fetch(stop context.Context) {
	for {
		select {
		case p.sem <- struct{}{}:
		case <-stop.Done():
			return
		}
		it := &item{}
		if !p.fetchNext(stop, &it.km) {
			return
		}
		it.seq = p.tr.add(it.km.Offset)
		if p.keys != nil {
			p.keys.push(it)
		} else {
			p.ready <- it
		}
		if h := p.c.hooks.queued; h != nil {
			h(&it.km)
		}
	}
}

// work runs records from ready until stop is done. A record not started by
// then is abandoned: it is not done, so it is not committed and comes back.
func (p *partition) work(stop context.Context) {
	rn := p.newRunner()
	for {
		select {
		case <-stop.Done():
			return
		case it := <-p.ready:
			if stop.Err() != nil {
				return
			}
			if p.c.bh != nil {
				p.runBatch(stop, rn, it)
				continue
			}
			p.runOne(stop, rn, it, 1)
			if p.keys != nil {
				p.keys.finish(it)
			}
			<-p.sem
		}
	}
}

// runBatch gathers the records already waiting behind first, up to
// BatchSize, and runs them as one batch.
func (p *partition) runBatch(stop context.Context, rn *runner, first *item) {
	batch := []*item{first}
gather:
	for len(batch) < p.c.opts.BatchSize {
		select {
		case it := <-p.ready:
			batch = append(batch, it)
		default:
			break gather
		}
	}
	p.handleBatch(stop, rn, batch)
	for range batch {
		<-p.sem
	}
}

// runOne runs one record until it is done (acknowledged or dead-lettered) or
// abandoned (stop done while it waits for a retry or a dead-letter write).
// Each run has its consumer span (see ConsumerOptions.TracerProvider) and verdict.
func (p *partition) runOne(stop context.Context, rn *runner, it *item, attempt int) {
	msg, idErr := p.mapped(it)
	ctx := rn.single(it)
	for ; ; attempt++ {
		hctx, at := p.startAttempt(ctx, it)
		msg.Attempt = attempt
		var r consumer.Result
		if idErr != nil {
			r = consumer.Result{Action: consumer.ActionDeadLetter, Reason: consumer.OutcomeInvalidKey, Err: idErr}
		} else {
			r = p.process(hctx, msg)
		}
		if p.settle(stop, hctx, at, it, attempt, r) {
			return
		}
	}
}

// runner is one worker's reusable handler context: PositionAfter finds the
// records of the current call in it.
type runner struct {
	hd  handling
	one [1]*item
	ctx context.Context
}

func (p *partition) newRunner() *runner {
	r := &runner{hd: handling{p: p}}
	r.ctx = context.WithValue(p.workCtx, handlingKey{}, &r.hd)
	return r
}

// single returns the context for a call on it alone.
func (r *runner) single(it *item) context.Context {
	r.one[0] = it
	r.hd.items = r.one[:]
	return r.ctx
}

// batch returns the context for a call on items.
func (r *runner) batch(items []*item) context.Context {
	r.hd.items = items
	return r.ctx
}

// mapped returns the record's consumer.Message, mapping it on first use.
func (p *partition) mapped(it *item) (*consumer.Message, error) {
	if it.msg == nil {
		it.msg, it.idErr = p.message(&it.km)
	}
	return it.msg, it.idErr
}

// process runs the handler on one message: the consumer.Handler, or the
// BatchHandler with a batch of one.
func (p *partition) process(ctx context.Context, msg *consumer.Message) consumer.Result {
	if p.c.h != nil {
		return consumer.Process(ctx, p.c.h, msg)
	}
	err := p.c.bh(ctx, []*consumer.Message{msg})
	var be *BatchError
	if errors.As(err, &be) {
		err = be.Errs[0]
	}
	return consumer.DecideContext(ctx, err)
}

// settle acts on a result and records the verdict (at; ctx is the run's
// context, for logs). It returns true when the record is finished (done, or
// abandoned because stop is done) and false when it must run again. A
// record is reported (OnOutcome) once it is done: acknowledged, or parked
// in the dead-letter topic, and marked for commit. A retry and an
// abandoned record are not reported: the record runs again, here or at the
// partition's next owner, and is reported when that run settles it.
func (p *partition) settle(stop, ctx context.Context, at attemptTel, it *item, attempt int, r consumer.Result) bool {
	switch r.Action {
	case consumer.ActionAck:
		if h := p.c.hooks.afterEffect; h != nil {
			h(it.msg)
		}
		p.markDone(it)
		p.c.verdict(ctx, it.km.Topic, at, r, false)
		p.c.report(ctx, it.msg, r)
		return true
	case consumer.ActionDeadLetter:
		parked := p.deadLetter(stop, ctx, it, attempt, r)
		if parked {
			p.markDone(it)
		}
		p.c.verdict(ctx, it.km.Topic, at, r, parked)
		if parked {
			p.c.report(ctx, it.msg, r)
		}
		return true
	}
	p.c.verdict(ctx, it.km.Topic, at, r, false)
	if attempt == 1 || attempt%10 == 0 {
		p.c.log.LogAttrs(ctx, slog.LevelWarn, "idem: handler asked to retry; the partition retries the record in place",
			slog.String("topic", it.km.Topic), slog.Int("partition", it.km.Partition), slog.Int64("offset", it.km.Offset),
			slog.String("message_id_hash", dedup.HashKey("", it.msg.ID)), slog.String("reason", string(r.Reason)), slog.Int("attempt", attempt), slog.Any("error", r.Err))
	}
	return !backoff.Sleep(stop, p.c.backoff(attempt, r.RetryAfter))
}

func (p *partition) markDone(it *item) {
	if n := p.tr.done(it.seq); n >= p.c.opts.CommitEvery {
		p.g.kickCommit()
	}
}

// handleBatch runs a batch through the BatchHandler; see BatchHandler for
// the outcomes. Records without a valid id never reach it. They are
// dead-lettered after the batch, one at a time in offset order together with
// the records the batch leaves to run alone, and only while stop is not
// done: every record of the batch before a dead-lettered one is then done,
// so a rebalance that cancels the batch does not leave a dead-lettered
// record behind the committed offset, to be dead-lettered again by the next
// owner.
func (p *partition) handleBatch(stop context.Context, rn *runner, batch []*item) {
	valid := make([]*item, 0, len(batch))
	for _, it := range batch {
		if _, err := p.mapped(it); err == nil {
			valid = append(valid, it)
		}
	}
	if stop.Err() != nil {
		return
	}
	// alone holds the valid records to run one at a time after the batch:
	// every one when there is no batch (one valid record, or none).
	alone := map[*item]bool{}
	attempt := 1
	if len(valid) > 1 {
		for _, it := range p.runBatchHandler(stop, rn, valid) {
			alone[it] = true
		}
		attempt = 2 // the batch was their first run
	} else {
		for _, it := range valid {
			alone[it] = true
		}
	}
	for _, it := range batch {
		if stop.Err() != nil {
			return
		}
		switch {
		case it.idErr != nil:
			p.runOne(stop, rn, it, 1) // dead-letters it
		case alone[it]:
			p.runOne(stop, rn, it, attempt)
		}
	}
}

// runBatchHandler hands valid (two records or more) to the BatchHandler,
// settles the records it reports done or poison, and returns those it leaves
// to run one at a time: the ones to retry, or every one when nothing
// committed.
func (p *partition) runBatchHandler(stop context.Context, rn *runner, valid []*item) (again []*item) {
	ctx, bt := p.startBatch(rn.batch(valid), valid)
	// The records' verdicts are timed from the batch's start; the batch
	// span is ended once, below.
	at := attemptTel{start: bt.start, end: noEnd}
	msgs := make([]*consumer.Message, len(valid))
	for i, it := range valid {
		it.msg.Attempt = 1
		msgs[i] = it.msg
	}
	err := p.c.bh(ctx, msgs)
	var be *BatchError
	switch {
	case err == nil:
		bt.end(resultAck, nil)
		for _, it := range valid {
			r := consumer.Result{Action: consumer.ActionAck}
			p.settle(stop, ctx, at, it, 1, r)
		}
		return nil
	case errors.As(err, &be):
		bt.end("", nil)
		for i, it := range valid {
			r := consumer.DecideContext(ctx, be.Errs[i])
			if r.Action == consumer.ActionRetry {
				p.c.verdict(ctx, it.km.Topic, at, r, false)
				again = append(again, it)
				continue
			}
			p.settle(stop, ctx, at, it, 1, r)
		}
		return again
	}
	// Nothing committed: each record's run ends in a retry. One at a time,
	// a poison message is isolated.
	bt.end(resultRetry, err)
	for _, it := range valid {
		p.c.verdict(ctx, it.km.Topic, at, consumer.Result{Action: consumer.ActionRetry, Err: err}, false)
	}
	p.c.log.LogAttrs(p.workCtx, slog.LevelDebug, "idem: batch failed; handling its records one at a time",
		slog.String("topic", p.topic), slog.Int("partition", p.id), slog.Int("records", len(valid)), slog.Any("error", err))
	return valid
}

// keyScheduler lets several workers run a partition's records while records
// with the same key run one at a time, in offset order.
type keyScheduler struct {
	ready chan<- *item
	mu    sync.Mutex
	// busy maps a key with a record running (or ready) to the records
	// waiting behind it.
	busy map[string][]*item
}

func (s *keyScheduler) push(it *item) {
	k := string(it.km.Key)
	s.mu.Lock()
	if q, ok := s.busy[k]; ok {
		s.busy[k] = append(q, it)
		s.mu.Unlock()
		return
	}
	s.busy[k] = nil
	s.mu.Unlock()
	s.ready <- it
}

// finish is called once it is finished; the next record of its key becomes
// ready.
func (s *keyScheduler) finish(it *item) {
	k := string(it.km.Key)
	s.mu.Lock()
	q := s.busy[k]
	if len(q) == 0 {
		delete(s.busy, k)
		s.mu.Unlock()
		return
	}
	next := q[0]
	q[0] = nil
	s.busy[k] = q[1:]
	s.mu.Unlock()
	s.ready <- next
}
