package main

import (
	"math"
	"strconv"
	"strings"
	"sync"

	"github.com/idemkit/idem/consumer"
)

// maxPayments bounds --payments: the demo keeps a few counters per payment
// and per delivery, and a run of a million takes minutes.
const maxPayments = 1_000_000

func isRate(f float64) bool { return f >= 0 && f <= 1 && !math.IsNaN(f) }

// payment is one logical payment a client submits: one idempotency key,
// one or more requests.
type payment struct {
	n           int
	key         string
	customer    string
	cents       int64
	doubleClick bool
	loseFirst   bool
	// crash says whether the naive [0] and the idem [1] consumer crash
	// after handling this payment's first delivery.
	crash [2]bool
}

// ledger is one pipeline's effect sink and counters. Everything is guarded
// by mu. It keeps a few bytes per payment and a bit per broker copy, not the
// deliveries themselves: a run of maxPayments fits in a few megabytes.
type ledger struct {
	mu sync.Mutex
	// accepted are the payments the API answered with success.
	accepted paymentSet
	// charges counts the charges applied per payment (the effect sink),
	// amounts is the amount of each, both indexed by payment number.
	charges []uint32
	amounts []int32
	// deliveries of this pipeline's records, by cause.
	deliveries int
	causes     map[string]int
	// classification state of the consumer group: the broker copies
	// delivered, and per payment the request of its first delivery
	// (reasons[firstReason[n]-1]; 0: none yet) and the message ids
	// delivered (see seenID).
	seenCopy    copySet
	firstReason []uint8
	reasons     []string
	firstID     []uint64
	moreIDs     map[paymentID]struct{}
	// replayed counts API answers replayed by the idem middleware.
	replayed int
	crashes  int
}

// paymentID is one of a payment's message ids, hashed (idHash).
type paymentID struct {
	payment int32
	id      uint64
}

// idHash is a 64-bit FNV-1a hash of a message id, never 0. Ids are compared
// only among the few of one payment, where a collision has a chance of one
// in 2^64.
func idHash(id string) uint64 {
	h := uint64(14695981039346656037)
	for i := range len(id) {
		h = (h ^ uint64(id[i])) * 1099511628211
	}
	return h | 1
}

func newLedger(payments int) *ledger {
	return &ledger{
		accepted:    newPaymentSet(payments),
		charges:     make([]uint32, payments),
		amounts:     make([]int32, payments),
		causes:      map[string]int{},
		seenCopy:    copySet{},
		firstReason: make([]uint8, payments),
		firstID:     make([]uint64, payments),
		moreIDs:     map[paymentID]struct{}{},
	}
}

// valid reports whether n is a payment number of the run.
func (l *ledger) valid(n int) bool { return n >= 0 && n < len(l.charges) }

func (l *ledger) accept(n int) {
	l.mu.Lock()
	if l.valid(n) {
		l.accepted.add(n)
	}
	l.mu.Unlock()
}

func (l *ledger) charge(n int, cents int64) {
	l.mu.Lock()
	if l.valid(n) {
		l.charges[n]++
		l.amounts[n] = int32(min(cents, math.MaxInt32))
	}
	l.mu.Unlock()
}

// copyID names the broker's copy of a message: its partition and offset on
// Kafka; on RabbitMQ, which has no offsets, the publish sequence number the
// demo's publisher stamps on each copy it sends (headerPublish), with
// partition -1. A second delivery of the same copy is the broker delivering
// it again; another copy with the same message id is a re-publish.
type copyID struct {
	partition int
	offset    int64
}

// deliveryID returns the copy msg is.
func deliveryID(msg *consumer.Message) copyID {
	if seq := msg.Headers[headerPublish]; seq != "" {
		n, _ := strconv.ParseInt(seq, 10, 64)
		return copyID{partition: -1, offset: n}
	}
	p, _ := strconv.Atoi(msg.Metadata["kafka.partition"])
	o, _ := strconv.ParseInt(msg.Metadata["kafka.offset"], 10, 64)
	return copyID{partition: p, offset: o}
}

// String is the copy as the child processes report it: partition/offset.
func (c copyID) String() string {
	return strconv.Itoa(c.partition) + "/" + strconv.FormatInt(c.offset, 10)
}

// parseCopyID reads a copyID's String.
func parseCopyID(s string) (copyID, bool) {
	ps, os, ok := strings.Cut(s, "/")
	p, err1 := strconv.Atoi(ps)
	o, err2 := strconv.ParseInt(os, 10, 64)
	return copyID{partition: p, offset: o}, ok && err1 == nil && err2 == nil
}

// copySet is a set of broker copies: a bitset of offsets per partition. The
// offsets of a partition (and the publish sequence numbers) are dense from
// 0, so a copy costs a bit.
type copySet map[int]*bitset

// add adds c and reports whether it was new.
func (s copySet) add(c copyID) bool {
	if c.offset < 0 {
		return false
	}
	b := s[c.partition]
	if b == nil {
		b = new(bitset)
		s[c.partition] = b
	}
	return b.add(int(c.offset))
}

// bitset is a set of non-negative integers that are dense from 0: a bit
// each. It grows as numbers are added.
type bitset []uint64

// add adds n and reports whether it was new.
func (s *bitset) add(n int) bool {
	w, b := n/64, uint64(1)<<(n%64)
	if w >= len(*s) {
		*s = append(*s, make([]uint64, w+1-len(*s))...)
	}
	if (*s)[w]&b != 0 {
		return false
	}
	(*s)[w] |= b
	return true
}

// has reports whether n is in the set.
func (s bitset) has(n int) bool {
	w := n / 64
	return w < len(s) && s[w]&(uint64(1)<<(n%64)) != 0
}

// seenID reports whether message id h of payment n was delivered, and
// records it.
func (l *ledger) seenID(n int, h uint64) bool {
	switch l.firstID[n] {
	case 0:
		l.firstID[n] = h
		return false
	case h:
		return true
	}
	k := paymentID{payment: int32(n), id: h}
	if _, ok := l.moreIDs[k]; ok {
		return true
	}
	l.moreIDs[k] = struct{}{}
	return false
}

// reason returns the code of request in firstReason, adding it to reasons.
func (l *ledger) reason(request string) uint8 {
	for i, r := range l.reasons {
		if r == request {
			return uint8(i + 1)
		}
	}
	l.reasons = append(l.reasons, request)
	return uint8(len(l.reasons))
}

// classify records a delivery of this pipeline's record, the broker's copy
// po of message id with the demo-request header request, and returns why it
// is a duplicate (causeFirst when it is not).
func (l *ledger) classify(po copyID, id, request string, n int) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.valid(n) {
		return causeFirst
	}
	cause := causeFirst
	redelivered := !l.seenCopy.add(po)
	republished := l.seenID(n, idHash(id))
	switch first := l.firstReason[n]; {
	case redelivered:
		cause = causeRedelivery
	case republished:
		cause = causeRepublish
	case first != 0:
		// Another request of the same payment: a double click or a retry.
		// When the double click's second request was published first,
		// this one says "original": the duplicate is still the click's.
		cause = request
		if cause == causeFirst || cause == "" {
			cause = l.reasons[first-1]
		}
	default:
		l.firstReason[n] = l.reason(request)
	}
	l.deliveries++
	if cause != causeFirst {
		l.causes[cause]++
	}
	return cause
}

// deliveryCount returns the deliveries classified so far.
func (l *ledger) deliveryCount() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.deliveries
}

func (l *ledger) duplicates() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	d := 0
	for _, c := range l.causes {
		d += c
	}
	return d
}

func (l *ledger) effects() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	e := 0
	for _, c := range l.charges {
		e += int(c)
	}
	return e
}

// extra is the number of charges beyond one per payment.
func (l *ledger) extra() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	e := 0
	for _, c := range l.charges {
		if c > 1 {
			e += int(c) - 1
		}
	}
	return e
}

func (l *ledger) extraCents() int64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	var e int64
	for n, c := range l.charges {
		if c > 1 {
			e += int64(c-1) * int64(l.amounts[n])
		}
	}
	return e
}

// lost is the number of accepted payments never charged.
func (l *ledger) lost() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	lost := 0
	for n, c := range l.charges {
		if c == 0 && l.accepted.has(n) {
			lost++
		}
	}
	return lost
}

// paymentSet is a set of a run's payment numbers, with its size.
type paymentSet struct {
	bits bitset
	n    int
}

func newPaymentSet(payments int) paymentSet {
	return paymentSet{bits: make(bitset, (payments+63)/64)}
}

// add adds payment n.
func (s *paymentSet) add(n int) {
	if s.bits.add(n) {
		s.n++
	}
}

// has reports whether payment n is in the set.
func (s *paymentSet) has(n int) bool { return s.bits.has(n) }

// len returns the number of payments in the set.
func (s *paymentSet) len() int { return s.n }
