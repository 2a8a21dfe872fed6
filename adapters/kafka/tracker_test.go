package idemkafka

import (
	"math/rand/v2"
	"testing"
)

func TestTrackerContiguousWatermark(t *testing.T) {
	tr := newTracker(10, false)
	if _, ok := tr.take(); ok {
		t.Fatal("nothing done, yet take offered an offset")
	}
	var seqs []uint64
	for o := int64(10); o < 20; o++ {
		seqs = append(seqs, tr.add(o))
	}
	// 11..19 done, 10 not: the watermark stays at 10.
	for _, s := range seqs[1:] {
		tr.done(s)
	}
	if w := tr.watermark(); w != 10 {
		t.Fatalf("watermark %d, want 10 while offset 10 is unfinished", w)
	}
	if _, ok := tr.take(); ok {
		t.Fatal("take offered an offset past unfinished work")
	}
	if n := tr.done(seqs[0]); n != 10 {
		t.Fatalf("done dropped %d, want 10", n)
	}
	off, ok := tr.take()
	if !ok || off != 20 {
		t.Fatalf("take = %d, %v; want 20, true", off, ok)
	}
	tr.taken(off)
	if _, ok := tr.take(); ok {
		t.Fatal("take offered the committed offset again")
	}
}

func TestTrackerGapsAndCommitStart(t *testing.T) {
	tr := newTracker(0, true)
	off, ok := tr.take()
	if !ok || off != 0 {
		t.Fatalf("commitStart: take = %d, %v; want 0, true", off, ok)
	}
	tr.taken(off)
	// Compacted topic: offsets 3, 7, 8.
	a, b, c := tr.add(3), tr.add(7), tr.add(8)
	tr.done(b)
	if w := tr.watermark(); w != 3 {
		t.Fatalf("watermark %d, want 3", w)
	}
	tr.done(a)
	if w := tr.watermark(); w != 8 {
		t.Fatalf("watermark %d, want 8", w)
	}
	if got := tr.nextAssuming([]uint64{c}); got != 9 {
		t.Fatalf("nextAssuming(8) = %d, want 9", got)
	}
	tr.done(c)
	if w := tr.watermark(); w != 9 {
		t.Fatalf("watermark %d, want 9", w)
	}
}

func TestTrackerNextAssuming(t *testing.T) {
	tr := newTracker(0, false)
	var s []uint64
	for o := range int64(6) {
		s = append(s, tr.add(o))
	}
	tr.done(s[1])
	tr.done(s[3])
	for _, tc := range []struct {
		assume []uint64
		want   int64
	}{
		{nil, 0},
		{[]uint64{s[0]}, 2},
		{[]uint64{s[0], s[2]}, 4},
		{[]uint64{s[0], s[2], s[4], s[5]}, 6},
		{[]uint64{s[2], s[4]}, 0},
	} {
		if got := tr.nextAssuming(tc.assume); got != tc.want {
			t.Errorf("nextAssuming(%v) = %d, want %d", tc.assume, got, tc.want)
		}
	}
}

// TestTrackerRandomOrder checks against a brute-force model that the
// watermark is always the first unfinished offset, whatever the order of
// completion, through the buffer's compaction.
func TestTrackerRandomOrder(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	tr := newTracker(0, false)
	done := map[int64]bool{}
	var pending []struct {
		off int64
		seq uint64
	}
	next, end := int64(0), int64(0)
	for step := 0; step < 20000; step++ {
		if len(pending) < 50 && (len(pending) == 0 || r.IntN(2) == 0) {
			gap := int64(1 + r.IntN(2))
			pending = append(pending, struct {
				off int64
				seq uint64
			}{next, tr.add(next)})
			end = next + 1
			next += gap
			continue
		}
		i := r.IntN(len(pending))
		tr.done(pending[i].seq)
		done[pending[i].off] = true
		pending = append(pending[:i], pending[i+1:]...)
		want := end
		for _, p := range pending {
			want = min(want, p.off)
		}
		if got := tr.watermark(); got != want {
			t.Fatalf("step %d: watermark %d, want %d", step, got, want)
		}
	}
}
