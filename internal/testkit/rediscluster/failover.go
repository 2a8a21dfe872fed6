//go:build unix

package rediscluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"

	"github.com/redis/go-redis/v9"
)

// FailOver replaces the master at addr by one of its replicas without
// losing a write the master acknowledged, and returns the promoted
// replica's address:
//
//  1. CLIENT PAUSE WRITE on the master: its writes (and scripts) wait,
//     reads go on;
//  2. wait until every replica has the master's replication offset;
//  3. SIGKILL the master; the clients of the paused writes see their
//     connections close, the writes never ran;
//  4. wait until a live node names a replica as the master of the shard's
//     slots (the cluster's own failover, after its node timeout);
//  5. start the killed node again empty (data and cluster config removed,
//     so it cannot come back claiming the slots it had), make every node
//     forget its old identity, and join it to the cluster as a replica of
//     the promoted master; wait until every node sees all the nodes
//     again, the replica's full sync is done and every node names it a
//     replica, so the shard can be failed over once more.
//
// The whole takes a few seconds: the node timeout, the replica's election,
// and the empty node's full sync.
//
// Redis replicates asynchronously: a master killed without step 2 may take
// its last acknowledged writes with it. FailOver keeps that window out, so
// what a client sees across it is the store's doing, not the replication's.
func (c *Cluster) FailOver(ctx context.Context, addr string) (promoted string, err error) {
	n, ok := c.nodes[addr]
	if !ok {
		return "", fmt.Errorf("rediscluster: no node %s", addr)
	}
	shards, err := c.Shards(ctx)
	if err != nil {
		return "", err
	}
	slot := -1
	for _, s := range shards {
		if s.Master == addr && len(s.Slots) > 0 {
			slot = int(s.Slots[0].Start)
		}
	}
	if slot < 0 {
		return "", fmt.Errorf("rediscluster: %s is not the master of a shard", addr)
	}
	oldID, err := c.command(ctx, addr, "CLUSTER", "MYID")
	if err != nil {
		return "", fmt.Errorf("rediscluster: CLUSTER MYID on %s: %w", addr, err)
	}
	if _, err := c.command(ctx, addr, "CLIENT", "PAUSE", "60000", "WRITE"); err != nil {
		return "", fmt.Errorf("rediscluster: CLIENT PAUSE on %s: %w", addr, err)
	}
	if err := c.WaitInSync(ctx, addr); err != nil {
		_, _ = c.command(context.WithoutCancel(ctx), addr, "CLIENT", "UNPAUSE")
		return "", fmt.Errorf("rediscluster: before failing %s over: %w", addr, err)
	}
	if err := n.Kill(); err != nil {
		return "", err
	}
	if promoted, err = c.WaitMaster(ctx, slot, addr); err != nil {
		return "", err
	}
	if err := c.rejoin(ctx, addr, oldID, promoted); err != nil {
		return promoted, fmt.Errorf("rediscluster: rejoin %s as a replica of %s: %w", addr, promoted, err)
	}
	// Not waitReady: its check that replicas have their master's
	// offset seldom holds while clients write.
	for {
		err := c.whole(ctx, slot, addr, promoted)
		if err == nil {
			return promoted, nil
		}
		if perr := pause(ctx); perr != nil {
			return promoted, fmt.Errorf("rediscluster: after failing %s over: %w (%w)", addr, err, perr)
		}
	}
}

// whole reports an error unless every running node sees the cluster as
// ok with all its nodes, master lists replica as online (its full sync
// done), and every node names replica a replica in slot's shard.
func (c *Cluster) whole(ctx context.Context, slot int, replica, master string) error {
	for _, a := range c.addrs {
		info, err := c.command(ctx, a, "CLUSTER", "INFO")
		if err != nil {
			return err
		}
		if !strings.Contains(info, "cluster_state:ok") ||
			!strings.Contains(info, fmt.Sprintf("cluster_known_nodes:%d\r", len(c.addrs))) {
			return fmt.Errorf("%s: %s", a, info)
		}
	}
	host, port, err := net.SplitHostPort(replica)
	if err != nil {
		return err
	}
	info, err := c.command(ctx, master, "INFO", "replication")
	if err != nil {
		return err
	}
	if !strings.Contains(info, "ip="+host+",port="+port+",state=online") {
		return fmt.Errorf("%s is not an online replica of %s: %s", replica, master, info)
	}
	seen, err := c.seenAsReplica(ctx, slot, replica)
	if err == nil && !seen {
		err = fmt.Errorf("not every node names %s a replica", replica)
	}
	return err
}

// seenAsReplica reports whether every running node names replica as an
// online replica in the shard of slot (CLUSTER SHARDS on each).
func (c *Cluster) seenAsReplica(ctx context.Context, slot int, replica string) (bool, error) {
	for _, a := range c.addrs {
		if !c.nodes[a].Running() {
			continue
		}
		n := redis.NewClient(&redis.Options{Addr: a, MaxRetries: -1})
		shards, err := n.ClusterShards(ctx).Result()
		_ = n.Close()
		if err != nil {
			return false, fmt.Errorf("CLUSTER SHARDS on %s: %w", a, err)
		}
		seen := false
		for _, rs := range shards {
			if !(Shard{Slots: rs.Slots}).Owns(slot) {
				continue
			}
			for _, node := range rs.Nodes {
				if fmt.Sprintf("%s:%d", node.IP, node.Port) == replica && node.Role == "replica" && node.Health == "online" {
					seen = true
				}
			}
		}
		if !seen {
			return false, nil
		}
	}
	return true, nil
}

// rejoin starts the killed node at addr again empty and makes it a
// replica of master; the other nodes forget oldID, its identity before.
func (c *Cluster) rejoin(ctx context.Context, addr, oldID, master string) error {
	n := c.nodes[addr]
	for _, f := range []string{"nodes.conf", "dump.rdb", "appendonlydir"} {
		if err := os.RemoveAll(filepath.Join(n.Dir(), f)); err != nil {
			return err
		}
	}
	if err := n.Restart(ctx); err != nil {
		return err
	}
	for _, other := range c.addrs {
		if other == addr || !c.nodes[other].Running() {
			continue
		}
		if _, err := c.command(ctx, other, "CLUSTER", "FORGET", oldID); err != nil && !strings.Contains(err.Error(), "Unknown node") {
			return fmt.Errorf("CLUSTER FORGET on %s: %w", other, err)
		}
	}
	host, port, err := net.SplitHostPort(master)
	if err != nil {
		return err
	}
	bus, err := c.busPort(ctx, master)
	if err != nil {
		return err
	}
	if _, err := c.command(ctx, addr, "CLUSTER", "MEET", host, port, bus); err != nil {
		return fmt.Errorf("CLUSTER MEET: %w", err)
	}
	// Without this the master waits 5s (Redis's default) for more
	// replicas before it starts the new one's full sync.
	if err := c.ConfigSet(ctx, master, "repl-diskless-sync-delay", "0"); err != nil {
		return err
	}
	masterID, err := c.command(ctx, master, "CLUSTER", "MYID")
	if err != nil {
		return fmt.Errorf("CLUSTER MYID on %s: %w", master, err)
	}
	// The node learns of the master by gossip after the MEET: until
	// then CLUSTER REPLICATE answers that the node is unknown.
	for {
		_, err := c.command(ctx, addr, "CLUSTER", "REPLICATE", masterID)
		if err == nil {
			return nil
		}
		if perr := pause(ctx); perr != nil {
			return errors.Join(err, perr)
		}
	}
}

// busPort returns the cluster bus port of the node at addr (the @port of
// its own line in CLUSTER NODES).
func (c *Cluster) busPort(ctx context.Context, addr string) (string, error) {
	nodes, err := c.command(ctx, addr, "CLUSTER", "NODES")
	if err != nil {
		return "", fmt.Errorf("CLUSTER NODES on %s: %w", addr, err)
	}
	for _, line := range strings.Split(nodes, "\n") {
		f := strings.Fields(line)
		if len(f) < 3 || !strings.Contains(f[2], "myself") {
			continue
		}
		_, rest, ok := strings.Cut(f[1], "@")
		if !ok {
			break
		}
		bus, _, _ := strings.Cut(rest, ",")
		return bus, nil
	}
	return "", fmt.Errorf("no bus port in CLUSTER NODES of %s: %s", addr, nodes)
}
