//go:build unix

// Package rediscluster starts a throwaway Redis Cluster for tests: masters
// with replicas, each a redis-server process (internal/testkit/fault) on free ports
// on 127.0.0.1, in temporary directories, joined by `redis-cli --cluster
// create`. The cluster is stopped and its directories removed when the test
// ends. Nothing in the library imports this package.
//
// When redis-server or redis-cli is missing the test is skipped, or fails
// under CI=true (internal/testkit/testenv). The binaries are $IDEM_REDIS_SERVER
// (else redis-server on $PATH) and $IDEM_REDIS_CLI (else redis-cli on
// $PATH).
//
// Start is for tests; New, with Close, for other callers such as the chaos
// matrix.
//
// The nodes run with cluster-require-full-coverage no, so a shard whose
// master is down stops only its own slots, as a production cluster that
// must keep its healthy shards serving should.
package rediscluster

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/internal/testkit/fault"
	"github.com/idemkit/idem/internal/testkit/testenv"
)

// Options configure a cluster. The zero value is usable.
type Options struct {
	// Masters is the number of shards. Defaults to 3 (the minimum that
	// redis-cli accepts).
	Masters int
	// Replicas is the number of replicas of each master. Defaults to 1.
	Replicas int
	// NodeTimeout is cluster-node-timeout: how long a node may be
	// unreachable before it is failed over. Defaults to 1s.
	NodeTimeout time.Duration
	// Args are extra redis-server arguments for every node.
	Args []string
	// StartTimeout bounds the start of the whole cluster. Defaults to 60s.
	StartTimeout time.Duration
}

// Cluster is a running Redis Cluster.
type Cluster struct {
	nodes map[string]*fault.Redis // by address
	addrs []string

	mu     sync.Mutex
	paused map[string]*os.Process // by address
}

// Shard is one master with its replicas and its slots.
type Shard struct {
	Master   string
	Replicas []string
	Slots    []redis.SlotRange
}

// Owns reports whether slot is one of the shard's slots.
func (s Shard) Owns(slot int) bool {
	for _, r := range s.Slots {
		if int64(slot) >= r.Start && int64(slot) <= r.End {
			return true
		}
	}
	return false
}

// Start starts a cluster and stops it when t ends. It skips t (fails under
// CI=true) when a binary is missing, and fails t when the cluster does not
// come up.
func Start(t testing.TB, opts Options) *Cluster {
	t.Helper()
	for _, b := range []string{binary("IDEM_REDIS_SERVER", "redis-server"), binary("IDEM_REDIS_CLI", "redis-cli")} {
		if _, err := exec.LookPath(b); err != nil {
			testenv.Unavailable(t, fmt.Sprintf("a Redis Cluster test needs %s: %v (install Redis 7, or set IDEM_REDIS_SERVER and IDEM_REDIS_CLI)", b, err))
		}
	}
	c, err := New(context.Background(), opts)
	if err != nil {
		t.Fatalf("rediscluster: %v", err)
	}
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// New starts a cluster, for a caller that is not a test (the chaos
// matrix); the caller must Close it. It returns an error when a binary is
// missing or the cluster does not come up within opts.StartTimeout (or
// before ctx ends); nothing is left running then.
func New(ctx context.Context, opts Options) (*Cluster, error) {
	if opts.Masters == 0 {
		opts.Masters = 3
	}
	if opts.Replicas == 0 {
		opts.Replicas = 1
	}
	if opts.NodeTimeout == 0 {
		opts.NodeTimeout = time.Second
	}
	if opts.StartTimeout == 0 {
		opts.StartTimeout = time.Minute
	}
	server := binary("IDEM_REDIS_SERVER", "redis-server")
	cli := binary("IDEM_REDIS_CLI", "redis-cli")
	for _, b := range []string{server, cli} {
		if _, err := exec.LookPath(b); err != nil {
			return nil, fmt.Errorf("rediscluster: %s: %w (install Redis 7, or set IDEM_REDIS_SERVER and IDEM_REDIS_CLI)", b, err)
		}
	}
	ctx, cancel := context.WithTimeout(ctx, opts.StartTimeout)
	defer cancel()

	c := &Cluster{nodes: map[string]*fault.Redis{}, paused: map[string]*os.Process{}}
	fail := func(err error) (*Cluster, error) {
		_ = c.Close()
		return nil, err
	}
	for range opts.Masters * (1 + opts.Replicas) {
		bus, err := fault.FreePort()
		if err != nil {
			return fail(err)
		}
		args := append([]string{
			"--cluster-enabled", "yes",
			"--cluster-config-file", "nodes.conf",
			"--cluster-node-timeout", strconv.FormatInt(opts.NodeTimeout.Milliseconds(), 10),
			"--cluster-port", strconv.Itoa(bus),
			"--cluster-require-full-coverage", "no",
		}, opts.Args...)
		n, err := fault.StartRedis(ctx, fault.RedisOptions{Binary: server, Args: args})
		if err != nil {
			return fail(fmt.Errorf("rediscluster: start a node: %w", err))
		}
		c.nodes[n.Addr()] = n
		c.addrs = append(c.addrs, n.Addr())
	}
	create := append([]string{"--cluster", "create"}, c.addrs...)
	create = append(create, "--cluster-replicas", strconv.Itoa(opts.Replicas), "--cluster-yes")
	if out, err := exec.CommandContext(ctx, cli, create...).CombinedOutput(); err != nil {
		return fail(fmt.Errorf("rediscluster: redis-cli --cluster create: %w\n%s", err, out))
	}
	if err := c.waitReady(ctx, opts.Masters); err != nil {
		return fail(fmt.Errorf("rediscluster: %w", err))
	}
	return c, nil
}

// Close resumes the paused nodes, stops every node and removes their
// directories.
func (c *Cluster) Close() error {
	c.mu.Lock()
	paused := slices.Collect(maps.Keys(c.paused))
	c.mu.Unlock()
	for _, addr := range paused {
		_ = c.Resume(context.Background(), addr)
	}
	var errs []error
	for _, n := range c.nodes {
		errs = append(errs, n.Close())
	}
	return errors.Join(errs...)
}

func binary(env, def string) string {
	if b := os.Getenv(env); b != "" {
		return b
	}
	return def
}

// waitReady waits until every node sees the cluster as ok, masters shards
// cover all slots, and every replica is online and has caught up.
func (c *Cluster) waitReady(ctx context.Context, masters int) error {
	var last error
	for {
		last = c.ready(ctx, masters)
		if last == nil {
			return nil
		}
		if err := pause(ctx); err != nil {
			return fmt.Errorf("not ready: %w (%w)", last, err)
		}
	}
}

func (c *Cluster) ready(ctx context.Context, masters int) error {
	for _, addr := range c.addrs {
		info, err := c.command(ctx, addr, "CLUSTER", "INFO")
		if err != nil {
			return err
		}
		if !strings.Contains(info, "cluster_state:ok") ||
			!strings.Contains(info, fmt.Sprintf("cluster_known_nodes:%d\r", len(c.addrs))) {
			return fmt.Errorf("%s: %s", addr, info)
		}
	}
	shards, err := c.Shards(ctx)
	if err != nil {
		return err
	}
	if len(shards) != masters {
		return fmt.Errorf("%d shards, want %d", len(shards), masters)
	}
	for _, s := range shards {
		if err := c.InSync(ctx, s.Master); err != nil {
			return err
		}
	}
	return nil
}

// pause waits a moment between two polls of the cluster's state.
func pause(ctx context.Context) error {
	t := time.NewTimer(50 * time.Millisecond)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// command sends one command to the node at addr.
func (c *Cluster) command(ctx context.Context, addr string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return fault.RedisCommand(ctx, addr, args...)
}

// Addrs returns the address of every node, masters and replicas.
func (c *Cluster) Addrs() []string { return slices.Clone(c.addrs) }

// Client returns a cluster client on the cluster, closed when t ends. The
// nodes' addresses are filled into opts.
func (c *Cluster) Client(t testing.TB, opts redis.ClusterOptions) *redis.ClusterClient {
	t.Helper()
	opts.Addrs = c.Addrs()
	cc := redis.NewClusterClient(&opts)
	t.Cleanup(func() { _ = cc.Close() })
	return cc
}

// live returns the address of a node that is running.
func (c *Cluster) live() (string, error) {
	for _, addr := range c.addrs {
		if c.nodes[addr].Running() {
			return addr, nil
		}
	}
	return "", errors.New("no node is running")
}

// Shards returns the shards as a running node sees them (CLUSTER SHARDS):
// the masters that own slots, with their replicas.
func (c *Cluster) Shards(ctx context.Context) ([]Shard, error) {
	addr, err := c.live()
	if err != nil {
		return nil, err
	}
	n := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
	defer func() { _ = n.Close() }()
	raw, err := n.ClusterShards(ctx).Result()
	if err != nil {
		return nil, fmt.Errorf("CLUSTER SHARDS on %s: %w", addr, err)
	}
	var out []Shard
	for _, rs := range raw {
		if len(rs.Slots) == 0 {
			continue
		}
		s := Shard{Slots: rs.Slots}
		for _, node := range rs.Nodes {
			a := fmt.Sprintf("%s:%d", node.IP, node.Port)
			switch {
			case node.Role == "master" && node.Health == "online":
				s.Master = a
			case node.Role == "replica":
				s.Replicas = append(s.Replicas, a)
			}
		}
		out = append(out, s)
	}
	return out, nil
}

// WaitAgreed waits until every running node names master as the owner of
// slot (CLUSTER SLOTS on each node). A failover spreads by gossip: a node
// may still name the old master for a while after another names the new
// one, and a client that asks that node sees the old topology.
func (c *Cluster) WaitAgreed(ctx context.Context, slot int, master string) error {
	for {
		agreed, err := c.agreed(ctx, slot, master)
		if err == nil && agreed {
			return nil
		}
		if perr := pause(ctx); perr != nil {
			return fmt.Errorf("rediscluster: the nodes do not all name %s as the master of slot %d (last error: %w): %w", master, slot, err, perr)
		}
	}
}

// agreed reports whether every running node names master as the owner of
// slot (CLUSTER SHARDS on each).
func (c *Cluster) agreed(ctx context.Context, slot int, master string) (bool, error) {
	for _, addr := range c.addrs {
		if !c.nodes[addr].Running() {
			continue
		}
		n := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1})
		shards, err := n.ClusterShards(ctx).Result()
		_ = n.Close()
		if err != nil {
			return false, fmt.Errorf("CLUSTER SHARDS on %s: %w", addr, err)
		}
		owner := ""
		for _, rs := range shards {
			if !(Shard{Slots: rs.Slots}).Owns(slot) {
				continue
			}
			for _, node := range rs.Nodes {
				if node.Role == "master" && node.Health == "online" {
					owner = fmt.Sprintf("%s:%d", node.IP, node.Port)
				}
			}
		}
		if owner != master {
			return false, nil
		}
	}
	return true, nil
}

// InSync reports an error unless every replica of the master at addr is
// online and has the master's replication offset (INFO replication on the
// master): no write the master acknowledged is missing on its replicas.
// (Redis replicates asynchronously; a master killed before its replicas
// caught up loses its last writes.)
func (c *Cluster) InSync(ctx context.Context, master string) error {
	info, err := c.command(ctx, master, "INFO", "replication")
	if err != nil {
		return fmt.Errorf("INFO replication on %s: %w", master, err)
	}
	var offset string
	var replicas []string
	for _, line := range strings.Split(info, "\r\n") {
		switch k, v, _ := strings.Cut(line, ":"); {
		case k == "master_repl_offset":
			offset = v
		case strings.HasPrefix(k, "slave") && strings.Contains(v, "offset="):
			replicas = append(replicas, v)
		}
	}
	if len(replicas) == 0 {
		return fmt.Errorf("master %s has no replica: %s", master, info)
	}
	for _, r := range replicas {
		if !strings.Contains(r, "state=online") || !strings.Contains(r+",", ",offset="+offset+",") {
			return fmt.Errorf("master %s at offset %s, replica %s", master, offset, r)
		}
	}
	return nil
}

// WaitInSync waits until InSync(master) reports no error.
func (c *Cluster) WaitInSync(ctx context.Context, master string) error {
	for {
		err := c.InSync(ctx, master)
		if err == nil {
			return nil
		}
		if perr := pause(ctx); perr != nil {
			return fmt.Errorf("replicas not in sync: %w (%w)", err, perr)
		}
	}
}

// Kill SIGKILLs the node at addr.
func (c *Cluster) Kill(addr string) error {
	n, ok := c.nodes[addr]
	if !ok {
		return fmt.Errorf("rediscluster: no node %s", addr)
	}
	return n.Kill()
}

// Pause stops the node at addr with SIGSTOP: it keeps its connections but
// answers nothing, like a frozen host, until Resume.
func (c *Cluster) Pause(ctx context.Context, addr string) error {
	p, err := c.process(ctx, addr)
	if err != nil {
		return err
	}
	return fault.Pause(p)
}

// Resume continues a node stopped by Pause.
func (c *Cluster) Resume(ctx context.Context, addr string) error {
	c.mu.Lock()
	p := c.paused[addr]
	delete(c.paused, addr)
	c.mu.Unlock()
	if p == nil {
		return fmt.Errorf("rediscluster: %s is not paused", addr)
	}
	return fault.Resume(p)
}

// process finds the node's process (INFO server's process_id) and records
// it as paused, so that Resume and the cleanup find it without asking the
// stopped node.
func (c *Cluster) process(ctx context.Context, addr string) (*os.Process, error) {
	info, err := c.command(ctx, addr, "INFO", "server")
	if err != nil {
		return nil, fmt.Errorf("rediscluster: INFO server on %s: %w", addr, err)
	}
	for _, line := range strings.Split(info, "\r\n") {
		if v, ok := strings.CutPrefix(line, "process_id:"); ok {
			pid, err := strconv.Atoi(v)
			if err != nil {
				return nil, fmt.Errorf("rediscluster: process_id %q", v)
			}
			p, err := os.FindProcess(pid)
			if err != nil {
				return nil, err
			}
			c.mu.Lock()
			c.paused[addr] = p
			c.mu.Unlock()
			return p, nil
		}
	}
	return nil, fmt.Errorf("rediscluster: no process_id in INFO server of %s", addr)
}

// ConfigSet runs CONFIG SET on the node at addr.
func (c *Cluster) ConfigSet(ctx context.Context, addr, param, value string) error {
	_, err := c.command(ctx, addr, "CONFIG", "SET", param, value)
	return err
}

// WaitMaster waits until a running node reports a master other than old
// for slot, and returns that master's address: after old was killed, its
// replica's promotion.
func (c *Cluster) WaitMaster(ctx context.Context, slot int, old string) (string, error) {
	for {
		shards, err := c.Shards(ctx)
		if err == nil {
			for _, s := range shards {
				if s.Owns(slot) && s.Master != "" && s.Master != old {
					return s.Master, nil
				}
			}
		}
		if perr := pause(ctx); perr != nil {
			return "", fmt.Errorf("rediscluster: slot %d still without a new master: %w", slot, perr)
		}
	}
}
