package main

import (
	"context"
	"maps"
	"time"

	kafkago "github.com/segmentio/kafka-go"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"
)

// The in-process kfake cluster keeps every record produced, in memory: a
// run of a million payments would hold them all. The demo trims the
// payments topic as a broker's retention would, but only below what every
// consumer group committed, so that the broker holds the consumers' lag and
// not the stream.

// kfakeSegment is the size of kfake's log segments: a trim frees whole
// segments only, so a partition holds at most one segment beyond its lag.
const kfakeSegment = 256 << 10

// trimInterval is how often the demo trims the payments topic.
const trimInterval = 250 * time.Millisecond

// logTrimmer moves the log start offset of each partition of the payments
// topic up to the smallest offset the demo's consumer groups committed.
type logTrimmer struct {
	client     *kgo.Client
	offsets    *kafkago.Client // reads the child processes' commits
	topic      string
	partitions int
	groups     []*group
	// trimmed is each partition's log start offset the trimmer set.
	trimmed map[int]int64
}

// run trims every trimInterval until ctx ends. A trim that fails is tried
// again at the next tick: trimming is housekeeping, the run goes on
// without it.
func (t *logTrimmer) run(ctx context.Context) {
	tick := time.NewTicker(trimInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-tick.C:
		}
		t.trim(ctx)
	}
}

// trim deletes the records below the smallest committed offset of each
// partition over every group: the records every group is done with. A
// restarted consumer resumes from its group's committed offset, never
// below, so it never asks for a deleted record.
func (t *logTrimmer) trim(ctx context.Context) {
	floor := map[int]int64{}
	for p := range t.partitions {
		floor[p] = -1
	}
	for _, g := range t.groups {
		committed, ok := t.committed(ctx, g)
		if !ok {
			return
		}
		for p, low := range floor {
			off, ok := committed[p]
			if !ok || off <= 0 {
				off = 0 // nothing committed: the group reads from 0
			}
			if low < 0 || off < low {
				floor[p] = off
			}
		}
	}
	req := kmsg.NewPtrDeleteRecordsRequest()
	req.TimeoutMillis = 5000
	rt := kmsg.NewDeleteRecordsRequestTopic()
	rt.Topic = t.topic
	for p, off := range floor {
		if off > t.trimmed[p] {
			rp := kmsg.NewDeleteRecordsRequestTopicPartition()
			rp.Partition, rp.Offset = int32(p), off
			rt.Partitions = append(rt.Partitions, rp)
		}
	}
	if len(rt.Partitions) == 0 {
		return
	}
	req.Topics = append(req.Topics, rt)
	resp, err := req.RequestWith(ctx, t.client)
	if err != nil {
		return
	}
	for _, st := range resp.Topics {
		for _, sp := range st.Partitions {
			if sp.ErrorCode == 0 {
				t.trimmed[int(sp.Partition)] = sp.LowWatermark
			}
		}
	}
}

// committed returns the offsets group g committed, by partition: the
// demo's offset store for a group in this process, the group's commits on
// the broker for the child processes.
func (t *logTrimmer) committed(ctx context.Context, g *group) (map[int]int64, bool) {
	if g.child == nil {
		g.offsets.mu.Lock()
		defer g.offsets.mu.Unlock()
		return maps.Clone(g.offsets.pos), true
	}
	parts := make([]int, t.partitions)
	for p := range parts {
		parts[p] = p
	}
	resp, err := t.offsets.OffsetFetch(ctx, &kafkago.OffsetFetchRequest{GroupID: g.name, Topics: map[string][]int{t.topic: parts}})
	if err != nil || resp.Error != nil {
		return nil, false
	}
	out := map[int]int64{}
	for _, p := range resp.Topics[t.topic] {
		if p.Error != nil {
			return nil, false
		}
		out[p.Partition] = p.CommittedOffset
	}
	return out, true
}
