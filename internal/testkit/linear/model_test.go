package linear_test

import (
	"testing"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/idemkit/idem/internal/testkit/linear"
)

// op builds one operation of a handmade history; times in milliseconds,
// ret < 0 for an Unknown outcome (returns at the end of the history).
func op(client int, call, ret int64, kind linear.Kind, token string, res linear.Result, outToken string) porcupine.Operation {
	in := linear.Input{Kind: kind, Key: "k", Token: token, Call: call * 1e6, Return: ret * 1e6}
	if ret < 0 {
		in.Return = 1e15
	}
	return porcupine.Operation{ClientId: client, Input: in, Call: in.Call, Output: linear.Output{Result: res, Token: outToken}, Return: in.Return}
}

// TestLeaseModel: handmade histories of one key, each linearizable or not
// under a lease of 100ms and a retention of 100ms.
func TestLeaseModel(t *testing.T) {
	m := linear.LeaseModel(100*time.Millisecond, 100*time.Millisecond, time.Millisecond)
	const (
		C, E, Co, R, Rd = linear.Claim, linear.Extend, linear.Complete, linear.Release, linear.Read
	)
	for _, tc := range []struct {
		name string
		ops  []porcupine.Operation
		ok   bool
	}{
		{"claim, release, claim", []porcupine.Operation{
			op(0, 0, 1, C, "", linear.Granted, "a"),
			op(0, 2, 3, R, "a", linear.OK, ""),
			op(1, 4, 5, C, "", linear.Granted, "b"),
		}, true},
		{"two owners at once", []porcupine.Operation{
			op(0, 0, 1, C, "", linear.Granted, "a"),
			op(1, 2, 3, C, "", linear.Granted, "b"),
		}, false},
		{"a second owner after the lease ran out", []porcupine.Operation{
			op(0, 0, 1, C, "", linear.Granted, "a"),
			op(1, 150, 151, C, "", linear.Granted, "b"),
			op(0, 160, 161, Co, "a", linear.LeaseLost, ""),
		}, true},
		{"a stale owner completes", []porcupine.Operation{
			op(0, 0, 1, C, "", linear.Granted, "a"),
			op(1, 150, 151, C, "", linear.Granted, "b"),
			op(0, 160, 161, Co, "a", linear.OK, ""),
		}, false},
		{"lease lost to a live owner", []porcupine.Operation{
			op(0, 0, 1, C, "", linear.Granted, "a"),
			op(0, 2, 3, Co, "a", linear.LeaseLost, ""),
		}, false},
		{"a release whose reply was lost, then a new owner", []porcupine.Operation{
			op(0, 0, 1, C, "", linear.Granted, "a"),
			op(0, 2, -1, R, "a", linear.Unknown, ""),
			op(1, 10, 11, C, "", linear.Granted, "b"),
		}, true},
		{"done stays done until its retention", []porcupine.Operation{
			op(0, 0, 1, C, "", linear.Granted, "a"),
			op(0, 2, 3, Co, "a", linear.OK, ""),
			op(1, 50, 51, C, "", linear.Granted, "b"),
		}, false},
		{"done runs out", []porcupine.Operation{
			op(0, 0, 1, C, "", linear.Granted, "a"),
			op(0, 2, 3, Co, "a", linear.OK, ""),
			op(1, 50, 51, Rd, "", linear.Done, ""),
			op(1, 120, 121, C, "", linear.Granted, "b"),
		}, true},
		{"an extended lease keeps others out", []porcupine.Operation{
			op(0, 0, 1, C, "", linear.Granted, "a"),
			op(0, 80, 81, E, "a", linear.OK, ""),
			op(1, 150, 151, C, "", linear.Granted, "b"),
		}, false},
		{"a claim that may have granted blocks the key", []porcupine.Operation{
			op(0, 0, -1, C, "", linear.Unknown, ""),
			op(1, 5, 6, C, "", linear.InFlight, ""),
			op(1, 200, 201, C, "", linear.Granted, "b"),
		}, true},
		{"a read sees a key held with no owner", []porcupine.Operation{
			op(1, 5, 6, Rd, "", linear.Held, ""),
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := porcupine.CheckOperations(m, tc.ops); got != tc.ok {
				t.Fatalf("linearizable = %v, want %v", got, tc.ok)
			}
		})
	}
}

// TestTxModel: handmade histories of one key of a TxStore.
func TestTxModel(t *testing.T) {
	m := linear.TxModel()
	p := func(client int, call, ret int64, value string, res linear.Result, out string) porcupine.Operation {
		in := linear.Input{Kind: linear.Process, Key: "k", Value: value, Call: call, Return: ret}
		return porcupine.Operation{ClientId: client, Input: in, Call: call, Output: linear.Output{Result: res, Value: out}, Return: ret}
	}
	for _, tc := range []struct {
		name string
		ops  []porcupine.Operation
		ok   bool
	}{
		{"one commit, then duplicates of it", []porcupine.Operation{
			p(0, 0, 1, "a", linear.OK, "a"), p(1, 2, 3, "b", linear.Duplicate, "a"),
		}, true},
		{"two commits", []porcupine.Operation{
			p(0, 0, 1, "a", linear.OK, "a"), p(1, 2, 3, "b", linear.OK, "b"),
		}, false},
		{"a duplicate with another result", []porcupine.Operation{
			p(0, 0, 1, "a", linear.OK, "a"), p(1, 2, 3, "b", linear.Duplicate, "x"),
		}, false},
		{"a duplicate of an outcome unknown", []porcupine.Operation{
			p(0, 0, 100, "a", linear.Unknown, ""), p(1, 2, 3, "b", linear.Duplicate, "a"),
		}, true},
		{"in flight after the commit", []porcupine.Operation{
			p(0, 0, 1, "a", linear.OK, "a"), p(1, 2, 3, "b", linear.InFlight, ""),
		}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := porcupine.CheckOperations(m, tc.ops); got != tc.ok {
				t.Fatalf("linearizable = %v, want %v", got, tc.ok)
			}
		})
	}
}
