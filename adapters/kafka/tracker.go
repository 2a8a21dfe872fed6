package idemkafka

import "sync"

// tracker is one partition's commit tracker. It records the offsets fetched,
// in fetch order, and which of them are done; the offset it hands out for
// commit is the contiguous-done watermark: the offset of the oldest record
// not done yet, or the offset after the last record fetched when every one
// is done. It never moves past unfinished work, whatever order records finish
// in.
//
// Records are identified by a sequence number from add, so done is O(1); the
// done prefix is dropped as soon as it forms.
type tracker struct {
	mu sync.Mutex
	// buf[head:] are the records not yet dropped, oldest first; buf[head]
	// is never done (the done prefix is dropped at once).
	buf  []trackEntry
	head int
	// first is the sequence number of buf[head]; next is the sequence
	// number of the next record added.
	first, next uint64
	// end is the offset after the last record added (the start position
	// before any).
	end int64
	// committed is the last offset handed out for commit.
	committed int64
	// sinceTaken counts records dropped since the last take.
	sinceTaken int
}

type trackEntry struct {
	offset int64
	done   bool
}

// newTracker returns a tracker for a partition consumed from start. When
// commitStart is set, start itself is offered for commit before any record is
// done (a start resolved from FirstOffset or LastOffset, which must be
// recorded before the group moves on).
func newTracker(start int64, commitStart bool) *tracker {
	t := &tracker{end: start, committed: start}
	if commitStart {
		t.committed = start - 1
	}
	return t
}

// add records a fetched offset and returns its sequence number. Offsets must
// be added in increasing order.
func (t *tracker) add(offset int64) uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.head > 64 && t.head*2 >= len(t.buf) {
		n := copy(t.buf, t.buf[t.head:])
		t.buf = t.buf[:n]
		t.head = 0
	}
	t.buf = append(t.buf, trackEntry{offset: offset})
	t.end = offset + 1
	seq := t.next
	t.next++
	return seq
}

// done marks a record done and returns how many records were dropped since
// the last take.
func (t *tracker) done(seq uint64) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.buf[t.head+int(seq-t.first)].done = true
	for t.head < len(t.buf) && t.buf[t.head].done {
		t.head++
		t.first++
		t.sinceTaken++
	}
	if t.head == len(t.buf) {
		t.buf = t.buf[:0]
		t.head = 0
	}
	return t.sinceTaken
}

func (t *tracker) watermarkLocked() int64 {
	if t.head < len(t.buf) {
		return t.buf[t.head].offset
	}
	return t.end
}

// watermark returns the contiguous-done watermark.
func (t *tracker) watermark() int64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.watermarkLocked()
}

// take returns the watermark when it moved past the last offset taken, and
// records it as taken.
func (t *tracker) take() (int64, bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	w := t.watermarkLocked()
	if w <= t.committed {
		return 0, false
	}
	t.sinceTaken = 0
	return w, true
}

// taken records that offset was committed.
func (t *tracker) taken(offset int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.committed = max(t.committed, offset)
}

// nextAssuming returns the watermark the partition would have if the records
// with the given sequence numbers (sorted ascending) were done as well.
func (t *tracker) nextAssuming(seqs []uint64) int64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	j := 0
	for i := t.head; i < len(t.buf); i++ {
		seq := t.first + uint64(i-t.head)
		for j < len(seqs) && seqs[j] < seq {
			j++
		}
		if t.buf[i].done || (j < len(seqs) && seqs[j] == seq) {
			continue
		}
		return t.buf[i].offset
	}
	return t.end
}
