package linear

import (
	"errors"
	"sync"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/idemkit/idem/dedup"
)

// History records the operations of concurrent clients, with call and
// return times from one clock (the monotonic clock, from the history's
// start). Safe for concurrent use.
type History struct {
	start time.Time
	mu    sync.Mutex
	ops   []porcupine.Operation
}

// NewHistory starts an empty history; its clock starts now.
func NewHistory() *History { return &History{start: time.Now()} }

// Now is the history's time, for an operation's call or return.
func (h *History) Now() int64 { return int64(time.Since(h.start)) }

// Add records one operation of client: in with its Call set, the output it
// got, and the time it returned.
func (h *History) Add(client int, in Input, out Output, ret int64) {
	in.Return = ret
	h.mu.Lock()
	h.ops = append(h.ops, porcupine.Operation{ClientId: client, Input: in, Call: in.Call, Output: out, Return: ret})
	h.mu.Unlock()
}

// Operations returns the history: an Unknown outcome's return moved to
// after every other operation's (it may take effect at any later time).
func (h *History) Operations() []porcupine.Operation {
	h.mu.Lock()
	defer h.mu.Unlock()
	var end int64
	for _, op := range h.ops {
		end = max(end, op.Return)
	}
	end++
	out := make([]porcupine.Operation, len(h.ops))
	for i, op := range h.ops {
		if op.Output.(Output).Result == Unknown {
			in := op.Input.(Input)
			in.Return = end
			op.Input, op.Return = in, end
		}
		out[i] = op
	}
	return out
}

// Counts returns how many operations of each kind got each result, as
// "claim granted" → n.
func (h *History) Counts() map[string]int {
	h.mu.Lock()
	defer h.mu.Unlock()
	c := map[string]int{}
	for _, op := range h.ops {
		c[op.Input.(Input).Kind.String()+" "+op.Output.(Output).Result.String()]++
	}
	return c
}

// ClaimOutput classifies a Claim's answer.
func ClaimOutput(l *dedup.Lease, err error) Output {
	switch {
	case err == nil && l != nil:
		return Output{Result: Granted, Token: l.Token}
	case errors.Is(err, dedup.ErrDuplicate):
		return Output{Result: Duplicate}
	case errors.Is(err, dedup.ErrInFlight):
		return Output{Result: InFlight}
	}
	return unknown(err)
}

// LeaseOutput classifies the answer of an Extend, Complete or Release.
func LeaseOutput(err error) Output {
	switch {
	case err == nil:
		return Output{Result: OK}
	case errors.Is(err, dedup.ErrLeaseLost):
		return Output{Result: LeaseLost}
	}
	return unknown(err)
}

func unknown(err error) Output {
	if err == nil {
		err = errors.New("no lease and no error")
	}
	return Output{Result: Unknown, Err: err.Error()}
}
