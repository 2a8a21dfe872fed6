//go:build unix

package chaos

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/childproc"
	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/internal/testkit/netns"
)

// The runner of the partition/ cells (partition_cells.go). Two consumer
// children (partition_child.go), each in a network namespace of its own,
// consume one queue of the shared RabbitMQ. Their connections to RabbitMQ,
// PostgreSQL and Redis cross their namespace's veth pair to forwarders on
// the host end (fault.NewProxyOn), which pass bytes to the shared services
// on 127.0.0.1 and add nothing: a connection whose consumer side fails is
// closed on the server side, and nothing is retried or redialled. A cut is
// an nftables rule inside the namespace that drops the packets to or from
// one forwarder's port (netns.Space.Cut), so the consumer's TCP stack sees
// a real partition: retransmissions, timeouts, half-open connections.
//
// The runner publishes at a steady rate while it cuts one consumer, the
// other or both, in turn short (partShortLo to partShortHi: below the
// redisnx lease and every client timeout) and long (partLongLo to
// partLongHi: above the lease, the handler timeout, the go-redis timeouts
// and both ends' AMQP heartbeat timeouts), each after a gap of normal
// running. After each heal it waits until every healed consumer shows it
// recovered on its own (a first delivery logged and an effect committed
// after the heal; partRecoverLimit at most, else the cell fails); a cell
// with kills also SIGKILLs the cut consumers halfway through some long
// cuts and restarts them at once, still cut off. Then the publishing stops,
// the consumers drain the queue, stop gracefully, and the oracle counts.

const (
	partSlots        = 2
	partShortLo      = 200 * time.Millisecond
	partShortHi      = 1500 * time.Millisecond
	partLongLo       = 7 * time.Second
	partLongHi       = 10 * time.Second
	partGapLo        = time.Second
	partGapHi        = 2 * time.Second
	partRecoverLimit = 60 * time.Second
)

// The services a partition cell can cut.
const (
	partPG    = "postgresql"
	partRedis = "redis"
	partAMQP  = "rabbitmq"
)

// partSpec is one partition cell.
type partSpec struct {
	name  string
	store string            // storePG or storeRedis
	cut   string            // partPG, partRedis or partAMQP
	dirs  []netns.Direction // the directions, in turn (each for a short and a long cut)
	kills bool              // SIGKILL the cut consumers halfway through every other long cut
}

// partForwarders are the forwarders of a cell's services on the namespaces'
// service address, and the children's addresses through them.
type partForwarders struct {
	proxies   map[string]*fault.Proxy // by service
	pgURL     string
	redisAddr string
	amqpURL   string
}

func newPartForwarders(svc string, env *Env) (_ *partForwarders, err error) {
	f := &partForwarders{proxies: map[string]*fault.Proxy{}}
	defer func() {
		if err != nil {
			f.close()
		}
	}()
	listen := net.JoinHostPort(svc, "0")
	via := func(service, target string) (string, error) {
		px, err := fault.NewProxyOn(listen, target)
		if err != nil {
			return "", err
		}
		f.proxies[service] = px
		return px.Addr(), nil
	}
	pg, err := url.Parse(env.PGURL)
	if err != nil {
		return nil, fmt.Errorf("PostgreSQL URL: %w", err)
	}
	if pg.Host, err = via(partPG, withPort(pg.Host, "5432")); err != nil {
		return nil, err
	}
	q := pg.Query()
	q.Set("connect_timeout", "2")
	pg.RawQuery = q.Encode()
	f.pgURL = pg.String()
	if f.redisAddr, err = via(partRedis, withPort(env.RedisAddr, "6379")); err != nil {
		return nil, err
	}
	am, err := url.Parse(env.AMQPURL)
	if err != nil {
		return nil, fmt.Errorf("AMQP URL: %w", err)
	}
	if am.Host, err = via(partAMQP, withPort(am.Host, "5672")); err != nil {
		return nil, err
	}
	f.amqpURL = am.String()
	return f, nil
}

// port is the forwarder port of service.
func (f *partForwarders) port(service string) (uint16, error) {
	_, p, err := srvHostPort(f.proxies[service].Addr())
	return p, err
}

func (f *partForwarders) close() {
	for _, px := range f.proxies {
		_ = px.Close()
	}
}

// withPort adds def to a host without a port.
func withPort(host, def string) string {
	if _, _, err := net.SplitHostPort(host); err == nil {
		return host
	}
	return net.JoinHostPort(strings.Trim(host, "[]"), def)
}

// partRun is one run of a partition cell.
type partRun struct {
	env   *Env
	spec  partSpec
	b     *cellBase
	w     *amqpWorkload
	nw    *netns.Net
	fw    *partForwarders
	port  uint16 // the cut service's forwarder port
	procs [partSlots]*proc
	gen   int

	kills, restarts int
	short, long     int
	targets         map[string]int // cuts by target: s0, s1, both
	dirs            map[string]int
	dropped         int64
	recoveries      []time.Duration
}

// runPartition runs spec's cell.
func runPartition(ctx context.Context, env *Env, spec partSpec) (Result, error) {
	if err := netns.Check(); err != nil {
		return Result{}, fmt.Errorf("%w: %w", ErrSkipped, err)
	}
	if removed, err := netns.CleanStale(ctx); err != nil {
		return Result{}, err
	} else if len(removed) > 0 {
		env.Logf("removed what a run that no longer runs left: %v", removed)
	}
	ctx, cancel := context.WithTimeout(ctx, time.Duration(env.Pick(8, 25))*time.Minute)
	defer cancel()
	return withBase(ctx, env, spec.name, spec.store, 0, func(b *cellBase) (res Result, err error) {
		w, cleanup, err := newAMQPWorkload(b)
		if err != nil {
			return res, err
		}
		defer cleanup()
		nw, err := netns.New(ctx, partSlots)
		if err != nil {
			return res, err
		}
		defer func() { err = errors.Join(err, nw.Close()) }()
		fw, err := newPartForwarders(nw.Service().String(), env)
		if err != nil {
			return res, err
		}
		defer fw.close()
		port, err := fw.port(spec.cut)
		if err != nil {
			return res, err
		}
		pr := &partRun{env: env, spec: spec, b: b, w: w, nw: nw, fw: fw, port: port,
			targets: map[string]int{}, dirs: map[string]int{}}
		defer pr.killAll()
		return pr.run(ctx)
	})
}

func (pr *partRun) run(ctx context.Context) (res Result, err error) {
	env := pr.env
	cuts := env.Pick(6, 24)
	rate := env.Scale.Pick(25, 40) // messages per second, the same at every multiple
	for s := range pr.procs {
		if err := pr.start(s); err != nil {
			return res, err
		}
	}
	prod := &partProducer{w: pr.w, prefix: "m" + pr.b.suffix[:6], rate: rate}
	stop := make(chan struct{})
	prodDone := make(chan error, 1)
	go func() { prodDone <- prod.run(ctx, stop) }()
	stopProducer := func() error {
		close(stop)
		return <-prodDone
	}
	begin := time.Now()
	runErr := pr.schedule(ctx, cuts)
	runErr = errors.Join(runErr, stopProducer())
	pr.b.ids = prod.published()
	env.Logf("%d cuts done in %v, %d messages published; draining", cuts, time.Since(begin).Round(100*time.Millisecond), len(pr.b.ids))
	if runErr == nil {
		runErr = pr.drain(ctx)
		env.Logf("drained after %v", time.Since(begin).Round(100*time.Millisecond))
	}
	res = pr.result()
	if runErr == nil {
		runErr = pr.stopAll()
		env.Logf("consumers stopped after %v", time.Since(begin).Round(100*time.Millisecond))
	}
	if runErr == nil {
		if err := pr.w.settle(ctx); err != nil {
			runErr = fmt.Errorf("settle: %w", err)
		}
	}
	deliveries, distinct, err := countDeliveries(env.TempDir, "deliveries")
	if err != nil && runErr == nil {
		runErr = err
	}
	res.Redeliveries = deliveries - distinct
	outcomes, unmarked, err := partOutcomes(env.TempDir)
	if err != nil && runErr == nil {
		runErr = err
	}
	dups, lost, err := oracleVerdict(ctx, pr.b, runErr)
	if err != nil {
		return res, errors.Join(runErr, err)
	}
	res.Duplicates, res.Lost = dups, lost
	res.Note = pr.note(outcomes)
	if pr.spec.store == storeRedis {
		res.Note = partRedisNote + "; " + res.Note
		if err := pr.leaseBound(ctx, unmarked); err != nil {
			runErr = errors.Join(runErr, err)
		}
	}
	return res, runErr
}

const partRedisNote = "redisnx lease, effect outside it: duplicates expected, bounded per input by the handlers that ran its effect and could not mark its key done"

// leaseBound checks the redisnx cells' bound: a second effect for one input
// needs a handler that ran the effect (or may have: its INSERT failed with
// an unknown result) and could not mark the key done, so each input's extra
// effects are at most its complete_failed, lease_lost and effect_error
// events in the children's outcome logs. No consumer is SIGKILLed in these
// cells, which would be another way.
func (pr *partRun) leaseBound(ctx context.Context, unmarked map[string]int) error {
	rows, err := pr.b.pool.Query(ctx, "SELECT id, count(*), string_agg(worker, '+' ORDER BY at) FROM "+pr.b.oracle.Table()+" GROUP BY id HAVING count(*) > 1 ORDER BY id")
	if err != nil {
		return err
	}
	defer rows.Close()
	var bad []string
	n := 0
	for rows.Next() {
		var id, workers string
		var effects int
		if err := rows.Scan(&id, &effects, &workers); err != nil {
			return err
		}
		if effects-1 > unmarked[id] {
			n++
			if len(bad) < 5 {
				bad = append(bad, fmt.Sprintf("%s: %d effects (by %s), %d handlers that could not mark it done", id, effects, workers, unmarked[id]))
			}
		}
	}
	if err := rows.Err(); err != nil {
		return err
	}
	if n > 0 {
		return fmt.Errorf("%d input(s) with more duplicate effects than the lease window explains: %s", n, strings.Join(bad, "; "))
	}
	return nil
}

// schedule runs the cuts.
func (pr *partRun) schedule(ctx context.Context, cuts int) error {
	env := pr.env
	spaces := pr.nw.Spaces()
	for s, p := range pr.procs {
		if err := pr.waitStarted(ctx, p); err != nil {
			return fmt.Errorf("consumer %d: %w", s, err)
		}
	}
	for i := range cuts {
		if err := pr.wait(ctx, srvBetween(env.Rand, partGapLo, partGapHi)); err != nil {
			return err
		}
		long := i%2 == 1
		d := srvBetween(env.Rand, partShortLo, partShortHi)
		if long {
			d = srvBetween(env.Rand, partLongLo, partLongHi)
			pr.long++
		} else {
			pr.short++
		}
		dir := pr.spec.dirs[(i/2)%len(pr.spec.dirs)]
		var slots []int
		switch k := env.Rand.IntN(3); k {
		case 0, 1:
			slots = []int{k}
			pr.targets[fmt.Sprintf("consumer %d alone", k)]++
		default:
			slots = []int{0, 1}
			pr.targets["both consumers"]++
		}
		pr.dirs[map[netns.Direction]string{netns.Both: "both ways", netns.Out: "out", netns.In: "in"}[dir]]++
		for _, s := range slots {
			if err := spaces[s].Cut(ctx, dir, pr.port); err != nil {
				return err
			}
		}
		kill := pr.spec.kills && long && (i/2)%2 == 1
		env.Logf("cut %d/%d: %s %s of consumers %v for %v%s", i+1, cuts, pr.spec.cut, dir, slots, d.Round(time.Millisecond),
			map[bool]string{true: ", SIGKILLed halfway", false: ""}[kill])
		if kill {
			if err := pr.wait(ctx, d/2); err != nil {
				return err
			}
			for _, s := range slots {
				if err := pr.killRestart(s); err != nil {
					return err
				}
			}
			d -= d / 2
		}
		if err := pr.wait(ctx, d); err != nil {
			return err
		}
		if err := pr.heal(ctx, i, slots); err != nil {
			return err
		}
	}
	return nil
}

// heal heals the slots' namespaces and waits until each consumer shows it
// recovered: a delivery logged and an effect committed after the heal.
func (pr *partRun) heal(ctx context.Context, i int, slots []int) error {
	spaces := pr.nw.Spaces()
	type base struct{ deliveries, effects int }
	bases := make([]base, len(slots))
	for k, s := range slots {
		n, err := spaces[s].Heal(ctx)
		if err != nil {
			return err
		}
		pr.dropped += n
		if bases[k].deliveries, bases[k].effects, err = pr.progress(ctx, s); err != nil {
			return err
		}
	}
	healed := time.Now()
	for k, s := range slots {
		for {
			dl, ef, err := pr.progress(ctx, s)
			if err != nil {
				return err
			}
			if dl > bases[k].deliveries && ef > bases[k].effects {
				pr.recoveries = append(pr.recoveries, time.Since(healed))
				break
			}
			if time.Since(healed) > partRecoverLimit {
				return fmt.Errorf("consumer %d did not recover within %v of the heal of cut %d (%d deliveries and %d effects since)%s",
					s, partRecoverLimit, i+1, dl-bases[k].deliveries, ef-bases[k].effects, pr.procs[s].StderrTail())
			}
			if err := pr.wait(ctx, 100*time.Millisecond); err != nil {
				return err
			}
		}
	}
	return nil
}

// progress is slot s's first deliveries logged and effects committed so
// far, over all its children.
func (pr *partRun) progress(ctx context.Context, s int) (deliveries, effects int, err error) {
	if deliveries, _, err = countDeliveries(pr.env.TempDir, fmt.Sprintf("deliveries-s%d", s)); err != nil {
		return 0, 0, err
	}
	err = pr.b.pool.QueryRow(ctx, "SELECT count(*) FROM "+pr.b.oracle.Table()+" WHERE worker LIKE $1", fmt.Sprintf("s%d.%%", s)).Scan(&effects)
	return deliveries, effects, err
}

// start starts a child in slot s's namespace.
func (pr *partRun) start(s int) error {
	pr.gen++
	cfg := pr.w.config(s)
	cfg.PGURL, cfg.RedisAddr, cfg.AMQPURL = pr.fw.pgURL, pr.fw.redisAddr, pr.fw.amqpURL
	cfg.Name = fmt.Sprintf("s%d.g%d", s, pr.gen)
	cfg.Log = filepath.Join(pr.env.TempDir, fmt.Sprintf("deliveries-s%d-%04d.log", s, pr.gen))
	cfg.Seed = pr.env.Rand.Uint64()
	p, err := startProcIn(pr.env, pr.nw.Spaces()[s], partChildName, cfg)
	if err != nil {
		return fmt.Errorf("start consumer %d: %w", s, err)
	}
	pr.procs[s] = p
	return nil
}

// killRestart SIGKILLs slot s's child and starts another at once.
func (pr *partRun) killRestart(s int) error {
	p := pr.procs[s]
	p.Kill()
	<-p.Exited()
	if !p.DiedOfSIGKILL() {
		return fmt.Errorf("consumer %s exited on its own before its SIGKILL (%w)%s", p.cfg.Name, p.ExitErr(), p.StderrTail())
	}
	pr.kills++
	if err := pr.start(s); err != nil {
		return err
	}
	pr.restarts++
	return nil
}

// wait sleeps d, failing when a child exits meanwhile.
func (pr *partRun) wait(ctx context.Context, d time.Duration) error {
	deadline := time.Now().Add(d)
	for {
		for _, p := range pr.procs {
			select {
			case <-p.Exited():
				return fmt.Errorf("consumer %s exited on its own (%w)%s", p.cfg.Name, p.ExitErr(), p.StderrTail())
			default:
			}
		}
		left := time.Until(deadline)
		if left <= 0 {
			return nil
		}
		if err := sleepCtx(ctx, min(left, 50*time.Millisecond)); err != nil {
			return err
		}
	}
}

// waitStarted waits for p's first delivery.
func (pr *partRun) waitStarted(ctx context.Context, p *proc) error {
	limit := time.After(60 * time.Second)
	for {
		select {
		case <-p.started:
			return nil
		case <-limit:
			return fmt.Errorf("no delivery within 60s of the start%s", p.StderrTail())
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(50 * time.Millisecond):
		}
		if err := pr.wait(ctx, 0); err != nil {
			return err
		}
	}
}

// drain waits until every published message has an effect and the broker
// holds none of the cell's messages.
func (pr *partRun) drain(ctx context.Context) error {
	limit := time.Duration(pr.env.Scale.Pick(120, 300)) * time.Second
	begin := time.Now()
	lastDone, lastDoneAt := -1, time.Now()
	for {
		if err := pr.wait(ctx, 200*time.Millisecond); err != nil {
			return err
		}
		done, err := pr.w.progress(ctx)
		if err != nil {
			return err
		}
		if done != lastDone {
			lastDone, lastDoneAt = done, time.Now()
		}
		ok, err := pr.w.drained(ctx, time.Since(lastDoneAt))
		if err != nil {
			return fmt.Errorf("drained: %w", err)
		}
		if ok {
			return nil
		}
		if time.Since(begin) > limit {
			return fmt.Errorf("drain stalled: %d of %d messages with an effect after %v", done, len(pr.b.ids), limit)
		}
	}
}

// stopAll stops the children gracefully, at once.
func (pr *partRun) stopAll() error {
	errs := make([]error, len(pr.procs))
	var wg sync.WaitGroup
	for i, p := range pr.procs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = p.stop(30 * time.Second)
		}()
	}
	wg.Wait()
	pr.procs = [partSlots]*proc{}
	return errors.Join(errs...)
}

// killAll SIGKILLs the children still running (a failed run).
func (pr *partRun) killAll() {
	for _, p := range pr.procs {
		if p != nil {
			p.Kill()
			<-p.Exited()
		}
	}
}

func (pr *partRun) result() Result {
	return Result{Messages: len(pr.b.ids), Kills: pr.kills, Restarts: pr.restarts}
}

// note describes the partitions for the cell's line.
func (pr *partRun) note(outcomes *srvCounts) string {
	var worst, sum time.Duration
	for _, d := range pr.recoveries {
		worst = max(worst, d)
		sum += d
	}
	mean := time.Duration(0)
	if len(pr.recoveries) > 0 {
		mean = sum / time.Duration(len(pr.recoveries))
	}
	return fmt.Sprintf("%d partitions of %s (%d short of %v-%v, %d long of %v-%v; %s; dropped %s), %d packets dropped, every cut consumer recovered after each heal in %v on average, at most %v; dedup outcomes: %s",
		pr.short+pr.long, pr.spec.cut, pr.short, partShortLo, partShortHi, pr.long, partLongLo, partLongHi,
		countsString(pr.targets), countsString(pr.dirs), pr.dropped, mean.Round(10*time.Millisecond), worst.Round(10*time.Millisecond), outcomes.String())
}

// countsString renders counts as "a 1, b 2", sorted by name.
func countsString(m map[string]int) string {
	var c srvCounts
	for k, v := range m {
		c.add(k, v)
	}
	return c.String()
}

// partOutcomes reads the children's outcome logs: the count of each
// outcome (and effect_error), and for each input the events after which
// its effect may have run without its key being marked done
// (complete_failed, lease_lost, effect_error).
func partOutcomes(dir string) (*srvCounts, map[string]int, error) {
	files, err := filepath.Glob(filepath.Join(dir, "outcomes-*.log"))
	if err != nil {
		return nil, nil, err
	}
	c := &srvCounts{}
	unmarked := map[string]int{}
	for _, name := range files {
		f, err := os.Open(name)
		if err != nil {
			return nil, nil, err
		}
		sc := bufio.NewScanner(f)
		sc.Buffer(make([]byte, 64<<10), 1<<20)
		for sc.Scan() {
			fs := strings.Fields(sc.Text())
			if len(fs) == 0 {
				continue
			}
			c.add(fs[0], 1)
			switch fs[0] {
			case string(consumer.OutcomeCompleteFailed), string(consumer.OutcomeLeaseLost), string(partEffectError):
				if len(fs) > 1 {
					unmarked[fs[1]]++
				}
			}
		}
		_ = f.Close()
		if err := sc.Err(); err != nil {
			return nil, nil, err
		}
	}
	return c, unmarked, nil
}

// startProcIn is startProc with the child in namespace s.
func startProcIn(env *Env, s *netns.Space, child string, cfg childConfig) (*proc, error) {
	js, err := json.Marshal(cfg)
	if err != nil {
		return nil, err
	}
	cmd := s.Command(env.Exe)
	cmd.Env = append(os.Environ(), ChildEnv+"="+child, childConfigEnv+"="+string(js))
	return startCmd(cmd, cfg)
}

// startCmd runs cmd as a child of a cell, with p's ready and started
// channels fed from its stdout.
func startCmd(cmd *exec.Cmd, cfg childConfig) (*proc, error) {
	p := &proc{cfg: cfg, start: time.Now(), ready: make(chan struct{}), started: make(chan struct{})}
	var readyOnce, startedOnce sync.Once
	cp, err := childproc.Start(cmd, 16<<10, func(line string) {
		switch line {
		case childReadyLine:
			readyOnce.Do(func() { close(p.ready) })
		case childStartedLine:
			startedOnce.Do(func() { close(p.started) })
		}
	})
	if err != nil {
		return nil, err
	}
	p.Proc = cp
	return p, nil
}

// partProducer publishes fresh messages at a steady rate until stopped.
type partProducer struct {
	w      *amqpWorkload
	prefix string
	rate   int // per second

	mu  sync.Mutex
	ids []string
}

// run publishes until stop is closed; a batch under way is finished.
func (p *partProducer) run(ctx context.Context, stop <-chan struct{}) error {
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	start := time.Now()
	n := 0
	for {
		select {
		case <-stop:
			return nil
		case <-ctx.Done():
			return ctx.Err()
		case <-tick.C:
		}
		want := int(time.Since(start).Seconds() * float64(p.rate))
		if want <= n {
			continue
		}
		batch := make([]string, 0, want-n)
		for ; n < want; n++ {
			batch = append(batch, p.prefix+"-"+strconv.Itoa(n))
		}
		if _, err := publishAll(ctx, p.w.pub, p.w.q.exchange, batch); err != nil {
			return err
		}
		p.mu.Lock()
		p.ids = append(p.ids, batch...)
		p.mu.Unlock()
	}
}

// published returns the ids whose publishing the broker confirmed.
func (p *partProducer) published() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := append([]string(nil), p.ids...)
	sort.Strings(out)
	return out
}
