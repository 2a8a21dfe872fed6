package main

import (
	"strings"
	"testing"
)

// TestKafkaProgress: the progress of a partition moves its committed offset
// over every offset removed in a row, keeps the ones removed past a hole in
// the commit's metadata as ranges, and reads back what it wrote; metadata
// the tool did not write records nothing.
func TestKafkaProgress(t *testing.T) {
	p := parseKafkaProgress(10, "")
	for _, o := range []int64{12, 13, 14, 17, 10, 20} {
		p.mark(o)
	}
	if p.next != 11 {
		t.Fatalf("next %d, want 11 (10 removed, 11 not)", p.next)
	}
	meta := p.metadata()
	if want := kafkaProgressPrefix + "12-14,17,20"; meta != want {
		t.Fatalf("metadata %q, want %q", meta, want)
	}
	back := parseKafkaProgress(11, meta)
	for _, o := range []int64{12, 13, 14, 17, 20} {
		if !back.done[o] {
			t.Errorf("offset %d not read back from %q", o, meta)
		}
	}
	if len(back.done) != 5 {
		t.Errorf("read back %d offsets, want 5", len(back.done))
	}
	back.mark(11)
	if back.next != 15 || len(back.done) != 2 {
		t.Errorf("after 11: next %d, %d past it; want 15 and 2", back.next, len(back.done))
	}
	// A committed offset past some of the listed ones drops them.
	if q := parseKafkaProgress(15, meta); len(q.done) != 2 || !q.done[17] || !q.done[20] {
		t.Errorf("metadata below the committed offset: %v", q.done)
	}
	for _, foreign := range []string{"", "something else", kafkaProgressPrefix + "x", kafkaProgressPrefix + "9-3", kafkaProgressPrefix + "1-99999999"} {
		if q := parseKafkaProgress(0, foreign); len(q.done) != 0 {
			t.Errorf("metadata %q read as %v", foreign, q.done)
		}
	}
}

// TestKafkaProgressBound: the tool refuses a removal whose record would
// pass the bound of the commit metadata, before publishing anything.
func TestKafkaProgressBound(t *testing.T) {
	k := &kafkaDLQ{progress: map[int]*kafkaProgress{0: parseKafkaProgress(0, "")}}
	var o int64 = 1
	for ; ; o += 2 { // every other offset: no two in a row
		d := &deadLetter{ref: &kafkaRef{partition: 0, offset: o}}
		if err := k.canMark(d); err != nil {
			if !strings.Contains(err.Error(), "progress record of partition 0 is full") {
				t.Fatalf("canMark: %v", err)
			}
			break
		}
		k.progress[0].mark(o)
	}
	if n := len(k.progress[0].metadata()); n > maxKafkaProgress {
		t.Errorf("metadata of %d bytes, bound %d", n, maxKafkaProgress)
	}
	if o < 500 {
		t.Errorf("full after %d offsets", o/2)
	}
}
