package linear

import (
	"fmt"
	"time"

	"github.com/anishathalye/porcupine"
)

// Kind is the operation a client called.
type Kind uint8

// The operations of a history.
const (
	Claim Kind = iota
	Extend
	Complete
	Release
	// Read asks for a key's state without changing it.
	Read
	// Process is a dedup.TxStore's Process (TxModel).
	Process
)

func (k Kind) String() string {
	return [...]string{"claim", "extend", "complete", "release", "read", "process"}[k]
}

// Result is what a client saw.
type Result uint8

// The results of an operation.
const (
	// Unknown: the call failed with an error that does not say it had no
	// effect (a lost reply, a timeout, a store error): it may or may not
	// have taken effect, at any time from its call on.
	Unknown Result = iota
	// Granted: a claim got a lease (Output.Token).
	Granted
	// Duplicate: the key is done (Output.Value: the stored result, for
	// Process).
	Duplicate
	// InFlight: another owner holds the key.
	InFlight
	// LeaseLost: the token does not own the key.
	LeaseLost
	// OK: an Extend, Complete or Release that took effect; a Process whose
	// fn ran and committed (Output.Value: its result).
	OK
	// Failed: a Process whose fn returned an error; nothing was committed.
	Failed
	// Absent, Held and Done are the answers of a Read.
	Absent
	Held
	Done
)

func (r Result) String() string {
	return [...]string{"unknown", "granted", "duplicate", "in flight", "lease lost", "ok", "failed", "absent", "held", "done"}[r]
}

// Input is an operation as called. Call and Return are the history's
// times of its call and its return, in nanoseconds from the history's
// start; Return of an Unknown outcome is the end of the history (the call
// may take effect at any time after it was made).
type Input struct {
	Kind  Kind
	Key   string
	Token string // the lease's token (Extend, Complete, Release)
	Value string // the result fn returns (Process)
	Call  int64
	// Return is the time the call returned, or the end of the history for
	// an Unknown outcome.
	Return int64
}

// Output is what the call answered.
type Output struct {
	Result Result
	Token  string // Granted
	Value  string // OK and Duplicate of Process
	Err    string // the error's text, for Unknown
}

// unknownOwner is the token of a lease an Unknown claim may have taken: no
// client holds it.
const unknownOwner = "?"

// leaseState is the state of one key in LeaseModel. A lease or a done mark
// runs out at a time the model knows only within bounds: not before lo,
// surely by hi (in history time).
type leaseState struct {
	owner  string // "" when no lease is live
	lo, hi int64  // the bounds of the lease's end
	done   bool
	dlo    int64 // the bounds of the done mark's end
	dhi    int64
}

// LeaseModel is the sequential specification of a dedup.LeaseStore whose
// leases last lease and whose done marks last ttl, for one key (histories
// are checked key by key):
//
//   - a claim of an absent key grants a lease to a new token and holds the
//     key for lease from the moment it takes effect; a claim of a held key
//     answers in flight, of a done key duplicate. So at most one owner is
//     live at a time, and a lease that ran out lets exactly one new owner
//     in;
//   - Extend, Complete and Release take effect only with the token of the
//     live lease, and answer lease lost otherwise; Extend holds the key for
//     lease from its effect on, Complete makes it done for ttl, Release
//     makes it absent;
//   - a done key stays done until its ttl has run out;
//   - a Read answers the state without changing it;
//   - an Unknown outcome may have taken effect or not (as Jepsen counts an
//     indeterminate operation): the model tries both. A claim that may have
//     granted a lease grants it to a token no client holds.
//
// Time enters through the expiries: an operation takes effect at some
// moment between its call and its return, so a lease granted by a claim
// called at c and returned at r ends between c+lease and r+lease. slack
// widens each bound, for the store's clock (Redis, PostgreSQL) against the
// history's and its rounding to milliseconds. Where a lease may or may not
// have run out when an operation takes effect, the model tries both.
//
// What it does not cover: a store that forgets state (Redis without
// persistence restarted, an eviction, a failover to a replica that had not
// received a write) breaks the model, which counts a lost lease or done
// mark as a violation; fingerprints and stored results are not modelled.
func LeaseModel(lease, ttl, slack time.Duration) porcupine.Model {
	l, t, e := int64(lease), int64(ttl), int64(slack)
	nm := &porcupine.NondeterministicModel{
		Init: func() []any { return []any{leaseState{}} },
		Step: func(state, input, output any) []any {
			in, out := input.(Input), output.(Output)
			var next []any
			for _, s := range expire(state.(leaseState), in) {
				next = append(next, stepLease(s, in, out, l, t, e)...)
			}
			return next
		},
		DescribeOperation: describeOp,
		DescribeState: func(state any) string {
			s := state.(leaseState)
			switch {
			case s.owner != "":
				return fmt.Sprintf("held by %s (ends in [%s, %s])", short(s.owner), ms(s.lo), ms(s.hi))
			case s.done:
				return fmt.Sprintf("done (ends in [%s, %s])", ms(s.dlo), ms(s.dhi))
			}
			return "absent"
		},
	}
	return nm.ToModel()
}

// expire returns the states s may be in when in takes effect: a lease or
// done mark whose end surely came before the call is gone; one whose end
// may fall before the effect may be gone or not.
func expire(s leaseState, in Input) []leaseState {
	switch {
	case s.owner != "" && s.hi < in.Call:
		return []leaseState{{}}
	case s.owner != "" && s.lo <= in.Return:
		return []leaseState{s, {}}
	case s.done && s.dhi < in.Call:
		return []leaseState{{}}
	case s.done && s.dlo <= in.Return:
		return []leaseState{s, {}}
	}
	return []leaseState{s}
}

func stepLease(s leaseState, in Input, out Output, lease, ttl, slack int64) []any {
	held := func(owner string) leaseState {
		return leaseState{owner: owner, lo: in.Call + lease - slack, hi: in.Return + lease + slack}
	}
	done := leaseState{done: true, dlo: in.Call + ttl - slack, dhi: in.Return + ttl + slack}
	absent := s.owner == "" && !s.done
	owns := s.owner != "" && s.owner == in.Token
	one := func(ok bool, to leaseState) []any {
		if ok {
			return []any{to}
		}
		return nil
	}
	switch in.Kind {
	case Claim:
		switch out.Result {
		case Granted:
			return one(absent, held(out.Token))
		case InFlight:
			return one(s.owner != "", s)
		case Duplicate:
			return one(s.done, s)
		case Unknown:
			if absent {
				return []any{s, held(unknownOwner)}
			}
			return []any{s}
		}
	case Extend, Complete, Release:
		to := held(in.Token)
		switch in.Kind {
		case Complete:
			to = done
		case Release:
			to = leaseState{}
		}
		switch out.Result {
		case OK:
			return one(owns, to)
		case LeaseLost:
			return one(!owns, s)
		case Unknown:
			if owns {
				return []any{s, to}
			}
			return []any{s}
		}
	case Read:
		switch out.Result {
		case Absent:
			return one(absent, s)
		case Held:
			return one(s.owner != "", s)
		case Done:
			return one(s.done, s)
		case Unknown:
			return []any{s}
		}
	}
	return nil
}

// txState is the state of one key in TxModel: the result stored by the
// Process that committed, "" before one did.
type txState struct{ stored string }

// TxModel is the sequential specification of a dedup.TxStore (or of
// twolevel in front of one), for one key, with a retention longer than the
// history: the first Process that commits runs fn and stores its result
// (OK); every later one answers duplicate with that result; in flight is
// answered only while no Process has committed; a Process whose fn failed
// commits nothing; an Unknown outcome may have committed its result or
// not. So fn's effect is committed at most once, and a duplicate always
// carries the result of the Process that committed.
func TxModel() porcupine.Model {
	nm := &porcupine.NondeterministicModel{
		Init: func() []any { return []any{txState{}} },
		Step: func(state, input, output any) []any {
			s, in, out := state.(txState), input.(Input), output.(Output)
			switch out.Result {
			case OK:
				if s.stored == "" && out.Value == in.Value {
					return []any{txState{stored: in.Value}}
				}
			case Duplicate:
				if s.stored != "" && out.Value == s.stored {
					return []any{s}
				}
			case InFlight:
				if s.stored == "" {
					return []any{s}
				}
			case Failed:
				return []any{s}
			case Unknown:
				if s.stored == "" {
					return []any{s, txState{stored: in.Value}}
				}
				return []any{s}
			}
			return nil
		},
		DescribeOperation: describeOp,
		DescribeState: func(state any) string {
			if s := state.(txState); s.stored != "" {
				return "committed " + s.stored
			}
			return "not committed"
		},
	}
	return nm.ToModel()
}

func describeOp(input, output any) string {
	in, out := input.(Input), output.(Output)
	s := in.Kind.String()
	if in.Token != "" {
		s += " " + short(in.Token)
	}
	if in.Value != "" {
		s += " " + in.Value
	}
	s += " → " + out.Result.String()
	switch {
	case out.Token != "":
		s += " " + short(out.Token)
	case out.Value != "":
		s += " " + out.Value
	}
	if out.Err != "" {
		s += " (" + out.Err + ")"
	}
	return s
}

// short is the end of a token, which tells tokens apart (memstore's share
// a prefix).
func short(token string) string {
	if len(token) > 8 {
		return "…" + token[len(token)-8:]
	}
	return token
}

func ms(ns int64) string { return fmt.Sprintf("%.1fms", float64(ns)/1e6) }
