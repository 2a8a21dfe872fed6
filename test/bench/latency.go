package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	amqp091 "github.com/rabbitmq/amqp091-go"
	kafkago "github.com/segmentio/kafka-go"

	"github.com/idemkit/idem/internal/testkit/testenv"
	"github.com/idemkit/idem/outbox"
)

// The latency rows: transactions of one message each are committed at a
// fixed rate by latencyProducers goroutines, for a few seconds, while a
// relay runs; the latency of a message is from its Commit returning to
// the broker's confirm of its publish reaching the relay (the publisher
// returned). The baseline is the dual write a user writes without an
// outbox: the same transactions, each followed by a publish of its message
// with the bare client, waiting for the confirm, timed the same way. It is
// the floor of commit-to-confirm on the broker, not a safe alternative: a
// crash between the commit and the publish loses the message.

// latencyProducers is how many goroutines commit the transactions.
const latencyProducers = 16

// latencyRates are the offered rates, in messages per second.
var latencyRates = []int{1000, 5000}

// latencyStats is one run at one rate.
type latencyStats struct {
	offered  int
	achieved float64       // the commits per second reached
	p50, p99 time.Duration // commit to confirm
	max      time.Duration
	drain    time.Duration // from the last commit to the last confirm
	// cpu is the share of the machine's cores that were busy (any
	// process) from the first commit to the last confirm; -1 where
	// /proc/stat cannot be read.
	cpu float64
}

// latencyCase is one relay to one broker, or the baseline to one broker
// (relay is nil).
type latencyCase struct {
	relay  *relayKind
	peer   bool // Watermill's forwarder
	target relayTarget
}

func (c latencyCase) path() string {
	if c.peer {
		return "latency: " + peerName + " to " + c.target.name
	}
	if c.relay == nil {
		return "latency: dual write (commit, then publish with the bare client) to " + c.target.name
	}
	return "latency: " + c.relay.name + " to " + c.target.name
}

// latencyCases are the rows, baseline first for each broker.
func latencyCases() []latencyCase {
	var out []latencyCase
	for _, t := range []relayTarget{rabbitTarget, kafkaTarget} {
		out = append(out, latencyCase{target: t}, latencyCase{relay: &pollRelay, target: t},
			latencyCase{relay: &pollRelayNoNotify, target: t}, latencyCase{relay: &walRelay, target: t},
			latencyCase{peer: true, target: t})
	}
	return out
}

// latencyResult is a measured latency row: its runs per rate.
type latencyResult struct {
	latencyCase
	runs map[int][]latencyStats // by offered rate, one per round
	err  error
}

// measureLatency runs every case at every rate, e.cfg.Rounds times, the
// cases of a broker taking turns within each round.
func measureLatency(ctx context.Context, e *env, only func(string) bool) []latencyResult {
	var results []latencyResult
	for _, c := range latencyCases() {
		if only(c.path()) {
			results = append(results, latencyResult{latencyCase: c, runs: map[int][]latencyStats{}})
		}
	}
	for round := range e.cfg.Rounds {
		for _, rate := range latencyRates {
			for i := range results {
				r := &results[i]
				if r.err != nil {
					continue
				}
				s, err := latencyRun(ctx, e, r.latencyCase, rate)
				if err != nil {
					r.err = err
					e.logf("%s at %d msg/s: not measured: %v", r.path(), rate, err)
					continue
				}
				r.runs[rate] = append(r.runs[rate], s)
				e.logf("%s at %d msg/s: round %d/%d: p50 %s p99 %s max %s, %.0f commits/s, drain %s, CPU %s busy (load %s)",
					r.path(), rate, round+1, e.cfg.Rounds, ms(s.p50), ms(s.p99), ms(s.max), s.achieved, ms(s.drain), percent(s.cpu), loadavg())
			}
		}
	}
	return results
}

// latencyRun runs one case at rate for the run's duration.
func latencyRun(ctx context.Context, e *env, c latencyCase, offered int) (latencyStats, error) {
	topic, reset, err := c.target.dest(ctx, e)
	if err != nil {
		return latencyStats{}, err
	}
	defer reset()
	d := e.size.duration / 2
	switch {
	case c.peer:
		return peerLatency(ctx, e, c.target, topic, offered, d)
	case c.relay == nil:
		return dualWrite(ctx, e, c.target, topic, offered, d)
	default:
		return relayLatency(ctx, e, *c.relay, c.target, topic, offered, d)
	}
}

// cpuSample is the machine's CPU time so far, from /proc/stat, in clock
// ticks: busy (user, nice, system, irq, softirq, steal) and in all. The
// zero sample is one that could not be read.
type cpuSample struct{ busy, total uint64 }

func readCPU() cpuSample {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return cpuSample{}
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 9 || f[0] != "cpu" {
		return cpuSample{}
	}
	var s cpuSample
	for i, v := range f[1:9] { // user nice system idle iowait irq softirq steal
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return cpuSample{}
		}
		s.total += n
		if i != 3 && i != 4 {
			s.busy += n
		}
	}
	return s
}

// busySince is the share of the CPU time since the sample from that was
// busy, or -1 when either sample could not be read.
func busySince(from cpuSample) float64 {
	to := readCPU()
	if from.total == 0 || to.total <= from.total || to.busy < from.busy {
		return -1
	}
	return min(float64(to.busy-from.busy)/float64(to.total-from.total), 1)
}

// stamps records when each message was committed and confirmed.
type stamps struct {
	mu        sync.Mutex
	committed map[string]time.Time
	confirmed map[string]time.Time
	want      int // confirmations to wait for; 0 until the producers are done
	all       chan struct{}
	cpu       cpuSample // the machine's CPU time when the producers started
}

func newStamps() *stamps {
	return &stamps{committed: map[string]time.Time{}, confirmed: map[string]time.Time{}, all: make(chan struct{})}
}

func (s *stamps) commit(id string, at time.Time) {
	s.mu.Lock()
	s.committed[id] = at
	s.mu.Unlock()
}

func (s *stamps) confirm(id string, at time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.confirmed[id]; !ok {
		s.confirmed[id] = at
	}
	s.check()
}

// done says that the producers committed everything.
func (s *stamps) done() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.want = len(s.committed)
	s.check()
}

func (s *stamps) check() {
	if s.want > 0 && len(s.confirmed) >= s.want {
		select {
		case <-s.all:
		default:
			close(s.all)
		}
	}
}

// stats computes the run's figures.
func (s *stamps) stats(rate int, began, ended time.Time) (latencyStats, error) {
	cpu := busySince(s.cpu)
	s.mu.Lock()
	defer s.mu.Unlock()
	st := latencyStats{offered: rate, achieved: float64(len(s.committed)) / ended.Sub(began).Seconds(), cpu: cpu}
	lat := make([]time.Duration, 0, len(s.committed))
	var lastCommit, lastConfirm time.Time
	for id, c := range s.committed {
		f, ok := s.confirmed[id]
		if !ok {
			return st, fmt.Errorf("message %s committed and never confirmed", id)
		}
		lat = append(lat, f.Sub(c))
		if c.After(lastCommit) {
			lastCommit = c
		}
		if f.After(lastConfirm) {
			lastConfirm = f
		}
	}
	if len(lat) == 0 {
		return st, errors.New("no message committed")
	}
	slices.Sort(lat)
	st.p50, st.p99, st.max = lat[len(lat)/2], lat[len(lat)*99/100], lat[len(lat)-1]
	st.drain = max(lastConfirm.Sub(lastCommit), 0)
	return st, nil
}

// produce runs the producers at rate for d: each commits a transaction
// (through tx) on its turn, skipping the turns it is late for. It returns
// when they are done, with the time they started and ended. It notes in s
// the machine's CPU time at the start.
func produce(ctx context.Context, s *stamps, rate int, d time.Duration, tx func(ctx context.Context, i int) error) (began, ended time.Time, err error) {
	per := time.Duration(latencyProducers) * time.Second / time.Duration(rate)
	s.cpu = readCPU()
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
	)
	start := time.Now()
	stop := start.Add(d)
	for p := range latencyProducers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Spread the producers' turns over one period.
			next := start.Add(per * time.Duration(p) / latencyProducers)
			for i := p; ; i += latencyProducers {
				if wait := time.Until(next); wait > 0 {
					time.Sleep(wait)
				}
				if time.Now().After(stop) || ctx.Err() != nil {
					return
				}
				if err := tx(ctx, i); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
					return
				}
				for next = next.Add(per); time.Until(next) < -per; next = next.Add(per) {
				}
			}
		}()
	}
	wg.Wait()
	return start, time.Now(), errors.Join(errs...)
}

// relayLatency runs relay publishing to target while the producers
// enqueue one message per transaction.
func relayLatency(ctx context.Context, e *env, relay relayKind, target relayTarget, topic string, rate int, d time.Duration) (latencyStats, error) {
	ob, err := relay.open(ctx, e)
	if err != nil {
		return latencyStats{}, err
	}
	defer ob.closeAfter(ctx)
	p, closePub, err := target.publisher(ctx, e)
	if err != nil {
		return latencyStats{}, err
	}
	defer closePub()
	s := newStamps()
	r, err := ob.newRelay(&stamping{Publisher: p, s: s})
	if err != nil {
		return latencyStats{}, err
	}
	rctx, cancel := context.WithCancel(ctx)
	errc, stopped := runUntil(rctx, r.Run)
	defer func() { cancel(); <-stopped }()
	enqueue := func(ctx context.Context, i int) (string, error) {
		var ids []string
		err := pgx.BeginFunc(ctx, ob.pool, func(tx pgx.Tx) error {
			var err error
			ids, err = ob.enqueue(ctx, tx, outbox.Message{Topic: topic, Key: fmt.Append(nil, "key-", i%1000), Payload: payload})
			return err
		})
		if err != nil {
			return "", err
		}
		return ids[0], nil
	}
	return timedRun(ctx, s, errc, enqueue, rate, d, "relay")
}

// runUntil runs run(ctx) on a goroutine of its own. Its error arrives on
// errc (buffered: it never blocks), and stopped closes once it returned,
// so that a measurement waits for its relay before the next one starts.
func runUntil(ctx context.Context, run func(context.Context) error) (errc <-chan error, stopped <-chan struct{}) {
	ec, done := make(chan error, 1), make(chan struct{})
	go func() {
		defer close(done)
		ec <- run(ctx)
	}()
	return ec, done
}

// timedRun measures a running relay (the one whose Run returns on errc,
// confirming into s): one message through before the clock starts (the
// relay's session or stream is up), then the producers at rate for d,
// each committing a transaction that enqueues one message, then the wait
// until every message was confirmed.
func timedRun(ctx context.Context, s *stamps, errc <-chan error, enqueue func(ctx context.Context, i int) (string, error), rate int, d time.Duration, what string) (latencyStats, error) {
	first, err := enqueue(ctx, 0)
	if err != nil {
		return latencyStats{}, err
	}
	deadline := time.After(time.Minute)
	for {
		s.mu.Lock()
		_, ok := s.confirmed[first]
		s.mu.Unlock()
		if ok {
			break
		}
		select {
		case err := <-errc:
			return latencyStats{}, fmt.Errorf("%s stopped: %w", what, err)
		case <-deadline:
			return latencyStats{}, fmt.Errorf("the %s did not publish its first message within a minute", what)
		case <-time.After(5 * time.Millisecond):
		}
	}
	s.mu.Lock()
	clear(s.confirmed)
	s.mu.Unlock()
	began, ended, err := produce(ctx, s, rate, d, func(ctx context.Context, i int) error {
		id, err := enqueue(ctx, i)
		if err == nil {
			s.commit(id, time.Now())
		}
		return err
	})
	if err != nil {
		return latencyStats{}, err
	}
	s.done()
	select {
	case <-s.all:
	case err := <-errc:
		return latencyStats{}, fmt.Errorf("%s stopped: %w", what, err)
	case <-time.After(5 * time.Minute):
		return latencyStats{}, fmt.Errorf("the %s did not publish every message within 5 minutes", what)
	}
	return s.stats(rate, began, ended)
}

// stamping is a publisher that records when each message was confirmed.
type stamping struct {
	outbox.Publisher
	s *stamps
}

func (p *stamping) Publish(ctx context.Context, msgs []*outbox.Message) error {
	err := p.Publisher.Publish(ctx, msgs)
	now := time.Now()
	var pe *outbox.PublishError
	if err != nil && !errors.As(err, &pe) {
		return err
	}
	for i, m := range msgs {
		if pe == nil || pe.Failed[i] == nil {
			p.s.confirm(m.ID, now)
		}
	}
	return err
}

// dualWrite is the baseline: each producer commits a business row, then
// publishes the message with the bare client and waits for the confirm.
func dualWrite(ctx context.Context, e *env, target relayTarget, topic string, rate int, d time.Duration) (latencyStats, error) {
	table, err := e.table(ctx, testenv.Name("orders"), "id text PRIMARY KEY, payload bytea")
	if err != nil {
		return latencyStats{}, err
	}
	send, closeSend, err := target.sender(ctx, e, topic)
	if err != nil {
		return latencyStats{}, err
	}
	defer closeSend()
	s := newStamps()
	began, ended, err := produce(ctx, s, rate, d, func(ctx context.Context, i int) error {
		id := e.id("m")
		if _, err := e.pool.Exec(ctx, "INSERT INTO "+table+" (id, payload) VALUES ($1, $2)", id, payload); err != nil {
			return err
		}
		s.commit(id, time.Now())
		if err := send(ctx, id, fmt.Append(nil, "key-", i%1000)); err != nil {
			return err
		}
		s.confirm(id, time.Now())
		return nil
	})
	if err != nil {
		return latencyStats{}, err
	}
	s.done()
	return s.stats(rate, began, ended)
}

// amqpSender publishes one message per call on one of latencyProducers
// channels in confirm mode, and waits for its confirm.
func amqpSender(ctx context.Context, e *env, exchange string) (func(ctx context.Context, id string, key []byte) error, func(), error) {
	conn, err := amqp091.Dial(e.amqpURL)
	if err != nil {
		return nil, nil, err
	}
	pool := make(chan *amqp091.Channel, latencyProducers)
	for range latencyProducers {
		ch, err := conn.Channel()
		if err == nil {
			err = ch.Confirm(false)
		}
		if err != nil {
			_ = conn.Close()
			return nil, nil, err
		}
		pool <- ch
	}
	send := func(ctx context.Context, id string, key []byte) error {
		ch := <-pool
		defer func() { pool <- ch }()
		dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, exchange, string(key), true, false, amqp091.Publishing{
			DeliveryMode: amqp091.Persistent, MessageId: id, Timestamp: time.Now(), Body: payload})
		if err != nil {
			return err
		}
		ok, err := dc.WaitContext(ctx)
		if err == nil && !ok {
			err = errors.New("the broker nacked the publish")
		}
		return err
	}
	return send, func() { _ = conn.Close() }, nil
}

// kafkaSender writes one message per call through a shared Writer.
func kafkaSender(_ context.Context, e *env, topic string) (func(ctx context.Context, id string, key []byte) error, func(), error) {
	k, err := e.broker()
	if err != nil {
		return nil, nil, err
	}
	w := k.writer()
	send := func(ctx context.Context, id string, key []byte) error {
		return w.WriteMessages(ctx, kafkago.Message{Topic: topic, Key: key, Value: payload,
			Headers: []kafkago.Header{{Key: outbox.HeaderMessageID, Value: []byte(id)}}})
	}
	return send, func() { _ = w.Close() }, nil
}

// percent prints a share as a percentage, or "–" for a negative one (not
// measured).
func percent(f float64) string {
	if f < 0 {
		return "–"
	}
	return fmt.Sprintf("%.0f%%", 100*f)
}

func ms(d time.Duration) string { return fmt.Sprintf("%.1f ms", float64(d.Microseconds())/1000) }

// printLatency prints the latency table: per row and rate, the medians of
// the rounds.
func printLatency(w io.Writer, results []latencyResult) {
	if len(results) == 0 {
		return
	}
	p := func(format string, args ...any) { _, _ = fmt.Fprintf(w, format, args...) }
	p("\nCommit to confirmed publish, %d producers committing one message per transaction at the offered rate (medians of the rounds):\n\n", latencyProducers)
	p("| path | offered | committed | p50 | p99 | max | last commit to last confirm | CPU busy |\n|---|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, r := range results {
		for _, offered := range latencyRates {
			runs := r.runs[offered]
			if len(runs) == 0 {
				p("| %s | %s msg/s | not measured | – | – | – | – | – |\n", r.path(), thousands(int64(offered)))
				continue
			}
			med := func(f func(latencyStats) time.Duration) string {
				xs := make([]float64, len(runs))
				for i, s := range runs {
					xs[i] = float64(f(s))
				}
				return ms(time.Duration(median(xs)))
			}
			ach, cpu := make([]float64, len(runs)), []float64{}
			for i, s := range runs {
				ach[i] = s.achieved
				if s.cpu >= 0 {
					cpu = append(cpu, s.cpu)
				}
			}
			busy := -1.0 // not measured
			if len(cpu) > 0 {
				busy = median(cpu)
			}
			p("| %s | %s msg/s | %s | %s | %s | %s | %s | %s |\n", r.path(), thousands(int64(offered)), rate(median(ach), "msg/s"),
				med(func(s latencyStats) time.Duration { return s.p50 }), med(func(s latencyStats) time.Duration { return s.p99 }),
				med(func(s latencyStats) time.Duration { return s.max }), med(func(s latencyStats) time.Duration { return s.drain }), percent(busy))
		}
	}
	for _, r := range results {
		if r.err != nil {
			p("\nnot measured: %s: %v\n", r.path(), r.err)
		}
	}
}
