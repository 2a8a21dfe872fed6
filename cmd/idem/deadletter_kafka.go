package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"

	kafkago "github.com/segmentio/kafka-go"

	idemkafka "github.com/idemkit/idem/adapters/kafka"
	"github.com/idemkit/idem/consumer"
)

// The Kafka dead-letter topic. A topic cannot delete a record, so what
// replay and discard remove is recorded in a consumer group of the tool's
// own (--group): per partition, the committed offset is the first record
// not removed, and the commit's metadata lists the offsets removed past it
// (a selection by reason or id leaves holes). Reading starts at the
// committed offset and skips the listed ones. The metadata is bounded
// (brokers refuse more than offset.metadata.max.bytes, 4 KiB by default):
// when it is full, the run stops and asks for the earlier letters to be
// dealt with first.

// kafkaProgressPrefix starts the commit metadata the tool writes.
const kafkaProgressPrefix = "idem-deadletter/1:"

// maxKafkaProgress bounds the commit metadata, below the brokers' default
// limit of 4096 bytes.
const maxKafkaProgress = 3500

// kafkaCommitEvery is how many removals the tool records in one commit;
// close commits the rest. A run killed between two commits replays up to
// this many letters again on its next run, which their message ids make
// harmless.
const kafkaCommitEvery = 100

// kafkaProgress is what was removed from one partition: every offset below
// next, and the offsets in done.
type kafkaProgress struct {
	next  int64
	done  map[int64]bool
	dirty bool
}

// mark records off as removed and moves next past the offsets done.
func (p *kafkaProgress) mark(off int64) {
	p.done[off] = true
	for p.done[p.next] {
		delete(p.done, p.next)
		p.next++
	}
	p.dirty = true
}

// metadata encodes the offsets done past next as ranges: "a-b,c".
func (p *kafkaProgress) metadata() string {
	offs := make([]int64, 0, len(p.done))
	for o := range p.done {
		offs = append(offs, o)
	}
	slices.Sort(offs)
	var b strings.Builder
	b.WriteString(kafkaProgressPrefix)
	for i := 0; i < len(offs); {
		j := i
		for j+1 < len(offs) && offs[j+1] == offs[j]+1 {
			j++
		}
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.FormatInt(offs[i], 10))
		if j > i {
			b.WriteString("-" + strconv.FormatInt(offs[j], 10))
		}
		i = j + 1
	}
	return b.String()
}

// parseKafkaProgress reads what metadata recorded past next. Metadata the
// tool did not write records nothing: those letters are read again.
func parseKafkaProgress(next int64, metadata string) *kafkaProgress {
	p := &kafkaProgress{next: next, done: map[int64]bool{}}
	rest, ok := strings.CutPrefix(metadata, kafkaProgressPrefix)
	if !ok || rest == "" {
		return p
	}
	for r := range strings.SplitSeq(rest, ",") {
		lo, hi, isRange := strings.Cut(r, "-")
		a, err1 := strconv.ParseInt(lo, 10, 64)
		b := a
		var err2 error
		if isRange {
			b, err2 = strconv.ParseInt(hi, 10, 64)
		}
		if err1 != nil || err2 != nil || b < a || b-a > 1<<20 {
			return &kafkaProgress{next: next, done: map[int64]bool{}}
		}
		for o := a; o <= b; o++ {
			if o >= next {
				p.done[o] = true
			}
		}
	}
	return p
}

type kafkaDLQ struct {
	topic, group, idHeader string
	transport              *kafkago.Transport
	client                 *kafkago.Client
	parts                  []int
	end                    map[int]int64 // each partition's end offset when the command started
	progress               map[int]*kafkaProgress
	marks                  int // removals not committed yet

	// The reading position: partition index, next offset to read, and
	// the records of the last fetch not handed out yet.
	pi     int
	cursor int64
	buf    []*deadLetter
}

func openKafkaDLQ(ctx context.Context, f *dlqFlags) (dlqBackend, error) {
	tr := &kafkago.Transport{}
	k := &kafkaDLQ{
		topic: f.topic, group: f.group, idHeader: f.idHeader, transport: tr,
		client: &kafkago.Client{Addr: kafkago.TCP(strings.Split(f.kafka, ",")...), Transport: tr, Timeout: 10 * time.Second},
		end:    map[int]int64{}, progress: map[int]*kafkaProgress{},
	}
	if err := k.start(ctx); err != nil {
		tr.CloseIdleConnections()
		return nil, fmt.Errorf("%s: %w", k.describe(), err)
	}
	return k, nil
}

func (k *kafkaDLQ) describe() string { return fmt.Sprintf("kafka topic %q", k.topic) }

// start reads the topic's partitions, their offsets and the tool group's
// progress.
func (k *kafkaDLQ) start(ctx context.Context) error {
	md, err := k.client.Metadata(ctx, &kafkago.MetadataRequest{Topics: []string{k.topic}})
	if err != nil {
		return fmt.Errorf("the brokers are unreachable: %w", err)
	}
	for _, t := range md.Topics {
		if t.Name != k.topic {
			continue
		}
		if t.Error != nil {
			return t.Error
		}
		for _, p := range t.Partitions {
			k.parts = append(k.parts, p.ID)
		}
	}
	if len(k.parts) == 0 {
		return errors.New("the topic has no partitions (does it exist?)")
	}
	slices.Sort(k.parts)
	reqs := make([]kafkago.OffsetRequest, 0, 2*len(k.parts))
	for _, p := range k.parts {
		reqs = append(reqs, kafkago.FirstOffsetOf(p), kafkago.LastOffsetOf(p))
	}
	lo, err := k.client.ListOffsets(ctx, &kafkago.ListOffsetsRequest{Topics: map[string][]kafkago.OffsetRequest{k.topic: reqs}})
	if err != nil {
		return fmt.Errorf("list offsets: %w", err)
	}
	first := map[int]int64{}
	for _, po := range lo.Topics[k.topic] {
		if po.Error != nil {
			return fmt.Errorf("offsets of partition %d: %w", po.Partition, po.Error)
		}
		first[po.Partition], k.end[po.Partition] = po.FirstOffset, po.LastOffset
	}
	of, err := k.client.OffsetFetch(ctx, &kafkago.OffsetFetchRequest{GroupID: k.group, Topics: map[string][]int{k.topic: k.parts}})
	if err == nil {
		err = of.Error
	}
	committed := map[int]kafkago.OffsetFetchPartition{}
	switch {
	case errors.Is(err, kafkago.GroupIdNotFound):
		of = &kafkago.OffsetFetchResponse{} // nothing committed yet
	case err != nil:
		return fmt.Errorf("committed offsets of group %q: %w", k.group, err)
	}
	for _, p := range of.Topics[k.topic] {
		if p.Error != nil {
			return fmt.Errorf("committed offset of group %q, partition %d: %w", k.group, p.Partition, p.Error)
		}
		committed[p.Partition] = p
	}
	for _, p := range k.parts {
		next, meta := first[p], ""
		if c, ok := committed[p]; ok && c.CommittedOffset >= 0 {
			meta = c.Metadata
			next = max(next, c.CommittedOffset)
		}
		k.progress[p] = parseKafkaProgress(next, meta)
	}
	k.cursor = k.progress[k.parts[0]].next
	return nil
}

func (k *kafkaDLQ) next(ctx context.Context) (*deadLetter, error) {
	for {
		if len(k.buf) > 0 {
			d := k.buf[0]
			k.buf = k.buf[1:]
			return d, nil
		}
		if k.pi >= len(k.parts) {
			return nil, nil
		}
		p := k.parts[k.pi]
		if k.cursor >= k.end[p] {
			k.pi++
			if k.pi < len(k.parts) {
				k.cursor = k.progress[k.parts[k.pi]].next
			}
			continue
		}
		if err := k.fetch(ctx, p); err != nil {
			return nil, err
		}
	}
}

// fetch reads records of partition p from the cursor, up to the end offset
// the command started with, into buf.
func (k *kafkaDLQ) fetch(ctx context.Context, p int) error {
	res, err := k.client.Fetch(ctx, &kafkago.FetchRequest{
		Topic: k.topic, Partition: p, Offset: k.cursor,
		MinBytes: 1, MaxBytes: 4 << 20, MaxWait: time.Second,
	})
	if err == nil {
		err = res.Error
	}
	if err != nil {
		return fmt.Errorf("fetch partition %d at offset %d: %w", p, k.cursor, err)
	}
	start := k.cursor
	for res.Records != nil {
		rec, err := res.Records.ReadRecord()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("read partition %d at offset %d: %w", p, k.cursor, err)
		}
		if rec.Offset < k.cursor || rec.Offset >= k.end[p] {
			continue // the start of a batch before the cursor, or past the end
		}
		k.cursor = rec.Offset + 1
		if k.progress[p].done[rec.Offset] {
			continue
		}
		d, err := k.letter(p, rec)
		if err != nil {
			return err
		}
		k.buf = append(k.buf, d)
	}
	if k.cursor == start {
		// Nothing at the cursor: offsets a compaction or a transaction
		// marker left out. Move on to the partition's end offset when
		// the broker says nothing lies before it.
		if res.HighWatermark <= k.cursor {
			k.cursor = k.end[p]
		} else {
			k.cursor++
		}
	}
	return nil
}

func readBytes(b kafkago.Bytes) ([]byte, error) {
	if b == nil {
		return nil, nil
	}
	defer func() { _ = b.Close() }()
	return kafkago.ReadAll(b)
}

// kafkaRef is a letter's place and what its replay publishes.
type kafkaRef struct {
	partition int
	offset    int64
	key       []byte
	headers   []kafkago.Header
}

func (k *kafkaDLQ) letter(p int, rec *kafkago.Record) (*deadLetter, error) {
	key, err := readBytes(rec.Key)
	if err != nil {
		return nil, err
	}
	value, err := readBytes(rec.Value)
	if err != nil {
		return nil, err
	}
	d := &deadLetter{pos: fmt.Sprintf("%d@%d", p, rec.Offset), at: rec.Time, key: key, payload: value}
	ref := &kafkaRef{partition: p, offset: rec.Offset, key: key}
	for _, h := range rec.Headers {
		v := string(h.Value)
		ref.headers = append(ref.headers, kafkago.Header{Key: h.Key, Value: slices.Clone(h.Value)})
		d.headers = append(d.headers, header{h.Key, printableHeader(h.Value)})
		switch h.Key {
		case consumer.HeaderID:
			d.id = v
		case consumer.HeaderReason:
			d.reason = v
		case consumer.HeaderError:
			d.errText = v
		case consumer.HeaderAttempts:
			d.attempts = v
		case consumer.HeaderSource:
			d.source = v
		case k.idHeader:
			d.msgID = v
		}
	}
	if d.msgID == "" {
		// The replay carries the dead letter's id, the original record's
		// "topic/partition/offset": the id a consumer with
		// ConsumerOptions.OffsetID gave it.
		d.msgID = d.id
	}
	d.ref = ref
	return d, nil
}

// printableHeader is a header value as text when it is printable.
func printableHeader(v []byte) string {
	s := printable(v)
	if strings.HasPrefix(s, `"`) {
		return string(v)
	}
	return s
}

// replayRecord is what the replay of d publishes: its key, value and
// headers without the dead-letter headers, and the message id in the id
// header when it had none.
func (k *kafkaDLQ) replayRecord(d *deadLetter) (kafkago.Record, int, string) {
	ref := d.ref.(*kafkaRef)
	var (
		hs        []kafkago.Header
		partition = -1
		hasID     bool
	)
	for _, h := range ref.headers {
		switch {
		case h.Key == idemkafka.HeaderPartition:
			if n, err := strconv.Atoi(string(h.Value)); err == nil && n >= 0 {
				partition = n
			}
		case strings.HasPrefix(h.Key, consumer.HeaderPrefix):
		default:
			hasID = hasID || h.Key == k.idHeader
			hs = append(hs, h)
		}
	}
	if !hasID && d.msgID != "" {
		hs = append(hs, kafkago.Header{Key: k.idHeader, Value: []byte(d.msgID)})
	}
	rec := kafkago.Record{Time: time.Now(), Key: kafkago.NewBytes(ref.key), Value: kafkago.NewBytes(d.payload), Headers: hs}
	if d.source == "" {
		return rec, -1, "it has no " + consumer.HeaderSource + " header: where it came from is not known"
	}
	if partition < 0 {
		return rec, -1, "it has no valid " + idemkafka.HeaderPartition + " header"
	}
	return rec, partition, ""
}

func (k *kafkaDLQ) replay(ctx context.Context, d *deadLetter) (string, error) {
	rec, partition, skip := k.replayRecord(d)
	if skip != "" {
		return skip, nil
	}
	if err := k.canMark(d); err != nil {
		return "", err
	}
	res, err := k.client.Produce(ctx, &kafkago.ProduceRequest{
		Topic: d.source, Partition: partition, RequiredAcks: kafkago.RequireAll,
		Records: kafkago.NewRecordReader(rec),
	})
	if err == nil {
		err = res.Error
	}
	if err == nil {
		for _, e := range res.RecordErrors {
			err = e
		}
	}
	if err != nil {
		return "", fmt.Errorf("publish to %s/%d: %w", d.source, partition, err)
	}
	return "", k.mark(ctx, d)
}

func (k *kafkaDLQ) discard(ctx context.Context, d *deadLetter) error {
	if err := k.canMark(d); err != nil {
		return err
	}
	return k.mark(ctx, d)
}

// canMark checks that the progress record has room for d's removal.
func (k *kafkaDLQ) canMark(d *deadLetter) error {
	ref := d.ref.(*kafkaRef)
	p := k.progress[ref.partition]
	trial := &kafkaProgress{next: p.next, done: map[int64]bool{}}
	for o := range p.done {
		trial.done[o] = true
	}
	trial.mark(ref.offset)
	if len(trial.metadata()) > maxKafkaProgress {
		return fmt.Errorf("the progress record of partition %d is full (%d letters removed past offset %d, which is not): replay or discard the letters before them first",
			ref.partition, len(p.done), p.next)
	}
	return nil
}

func (k *kafkaDLQ) mark(ctx context.Context, d *deadLetter) error {
	ref := d.ref.(*kafkaRef)
	k.progress[ref.partition].mark(ref.offset)
	k.marks++
	if k.marks >= kafkaCommitEvery {
		return k.commit(ctx)
	}
	return nil
}

// commit commits the progress of every partition that changed, as a
// simple commit (generation -1, no member): the tool's group has no
// members.
func (k *kafkaDLQ) commit(ctx context.Context) error {
	var cs []kafkago.OffsetCommit
	for _, p := range k.parts {
		if pr := k.progress[p]; pr.dirty {
			cs = append(cs, kafkago.OffsetCommit{Partition: p, Offset: pr.next, Metadata: pr.metadata()})
		}
	}
	if len(cs) == 0 {
		return nil
	}
	res, err := k.client.OffsetCommit(ctx, &kafkago.OffsetCommitRequest{
		GroupID: k.group, GenerationID: -1, Topics: map[string][]kafkago.OffsetCommit{k.topic: cs},
	})
	if err == nil {
		for _, p := range res.Topics[k.topic] {
			err = errors.Join(err, p.Error)
		}
	}
	if err != nil {
		return fmt.Errorf("commit the progress in group %q: %w", k.group, err)
	}
	for _, c := range cs {
		k.progress[c.Partition].dirty = false
	}
	k.marks = 0
	return nil
}

func (k *kafkaDLQ) close(ctx context.Context) error {
	defer k.transport.CloseIdleConnections()
	return k.commit(ctx)
}
