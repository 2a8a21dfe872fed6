package consumer_test

import (
	"context"
	"errors"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/dedup"
)

// fakeTx collects writes; they reach the store only on commit.
type fakeTx struct{ writes []string }

// txStore is a dedup.TxStore in memory: one transaction at a time, claims
// and writes committed together.
type txStore struct {
	mu        sync.Mutex
	done      map[dedup.Key]txRow
	committed []string
	down      bool
	// stolen: another writer takes the key while fn runs, as a claim that
	// does not wait for the transaction can on pgtable; the transaction
	// then rolls back and the verdict is on the other writer's row.
	stolen bool
}

type txRow struct {
	fp     dedup.Fingerprint
	result []byte
}

func newTxStore() *txStore { return &txStore{done: make(map[dedup.Key]txRow)} }

func (s *txStore) Process(ctx context.Context, key dedup.Key, fn dedup.TxFunc[*fakeTx]) ([]byte, error) {
	if err := key.Validate(); err != nil {
		return nil, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.down {
		return nil, errors.New("txstore: connection refused")
	}
	id := dedup.Key{Scope: key.Scope, ID: key.ID}
	if row, ok := s.done[id]; ok {
		if !key.Fingerprint.Matches(row.fp) {
			return nil, &dedup.ClaimError{Err: dedup.ErrFingerprintMismatch, Key: key}
		}
		return nil, &dedup.ClaimError{Err: dedup.ErrDuplicate, Key: key, Result: row.result}
	}
	tx := &fakeTx{}
	res, err := fn(ctx, tx) // a panic unlocks and commits nothing
	if err != nil {
		return nil, err
	}
	if s.stolen {
		s.done[id] = txRow{fp: key.Fingerprint, result: []byte("theirs")}
		return nil, &dedup.ClaimError{Err: dedup.ErrDuplicate, Key: key, Result: []byte("theirs")}
	}
	s.done[id] = txRow{fp: key.Fingerprint, result: res}
	s.committed = append(s.committed, tx.writes...)
	return res, nil
}

func (s *txStore) writes() map[string]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	c := make(map[string]int)
	for _, w := range s.committed {
		c[w]++
	}
	return c
}

func TestTransactional(t *testing.T) {
	store := newTxStore()
	fail := true
	var outcomes []consumer.Outcome
	var mu sync.Mutex
	h, err := consumer.Transactional[*fakeTx](store, consumer.TxOptions{
		Scope: "billing/ledger",
		Telemetry: consumer.Telemetry{OnOutcome: func(_ context.Context, r consumer.Report) {
			o := r.Outcome
			mu.Lock()
			outcomes = append(outcomes, o)
			mu.Unlock()
		}},
	}, func(ctx context.Context, tx *fakeTx, m *consumer.Message) error {
		tx.writes = append(tx.writes, "debit "+m.ID)
		if fail {
			return errBoom
		}
		consumer.SetResult(ctx, []byte("entry-"+m.ID))
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()

	r := consumer.Process(ctx, h, msg("m1", "p"))
	wantResult(t, r, consumer.ActionRetry, consumer.OutcomeTransient)
	if r.Err != errBoom || len(store.writes()) != 0 {
		t.Fatalf("err %v writes %v; want the handler's error and nothing committed", r.Err, store.writes())
	}

	fail = false
	var wg sync.WaitGroup
	results := make([]consumer.Result, 50)
	for i := range results {
		wg.Go(func() { results[i] = consumer.Process(ctx, h, msg("m1", "p")) })
	}
	wg.Wait()
	firsts, dups := 0, 0
	for _, r := range results {
		switch {
		case r.Action == consumer.ActionAck && !r.Duplicate:
			firsts++
		case r.Action == consumer.ActionAck && r.Duplicate:
			dups++
			if res, ok := dedup.StoredResult(r.Err); !ok || string(res) != "entry-m1" {
				t.Errorf("duplicate result %q, want entry-m1", res)
			}
		default:
			t.Errorf("unexpected result %+v", r)
		}
	}
	if firsts != 1 || dups != len(results)-1 || store.writes()["debit m1"] != 1 {
		t.Fatalf("firsts=%d dups=%d writes=%v; want one commit", firsts, dups, store.writes())
	}
	mu.Lock()
	if outcomes[0] != consumer.OutcomeReleased || len(slices.DeleteFunc(slices.Clone(outcomes), func(o consumer.Outcome) bool { return o != consumer.OutcomeCompleted })) != 1 {
		t.Errorf("outcomes %v", outcomes)
	}
	mu.Unlock()

	wantResult(t, consumer.Process(ctx, h, msg("m1", "other")), consumer.ActionDeadLetter, consumer.OutcomeFingerprintMismatch)
	wantResult(t, consumer.Process(ctx, h, msg("", "p")), consumer.ActionDeadLetter, consumer.OutcomeInvalidKey)
	wantResult(t, consumer.Process(ctx, h, msg("a\x01", "p")), consumer.ActionDeadLetter, consumer.OutcomeInvalidKey)

	store.mu.Lock()
	store.down = true
	store.mu.Unlock()
	wantResult(t, consumer.Process(ctx, h, msg("m2", "p")), consumer.ActionRetry, consumer.OutcomeTransient)
	if store.writes()["debit m2"] != 0 {
		t.Fatal("handler committed while the store was down")
	}
}

func TestTransactionalPanic(t *testing.T) {
	store := newTxStore()
	h, err := consumer.Transactional[*fakeTx](store, consumer.TxOptions{Scope: "s"}, func(ctx context.Context, tx *fakeTx, m *consumer.Message) error {
		tx.writes = append(tx.writes, "w")
		panic("poison")
	})
	if err != nil {
		t.Fatal(err)
	}
	wantResult(t, consumer.Process(t.Context(), consumer.Chain(h, consumer.Recover()), msg("m1", "p")), consumer.ActionDeadLetter, consumer.OutcomePanic)
	if len(store.writes()) != 0 {
		t.Fatal("a panicking handler's writes were committed")
	}
}

func TestTransactionalErrors(t *testing.T) {
	h := func(context.Context, *fakeTx, *consumer.Message) error { return nil }
	for name, c := range map[string]struct {
		store dedup.TxStore[*fakeTx]
		opts  consumer.TxOptions
		h     consumer.TxHandler[*fakeTx]
		want  string
	}{
		"nil store":   {nil, consumer.TxOptions{Scope: "s"}, h, "store"},
		"nil handler": {newTxStore(), consumer.TxOptions{Scope: "s"}, nil, "handler"},
		"no scope":    {newTxStore(), consumer.TxOptions{}, h, "Scope"},
		"bad scope":   {newTxStore(), consumer.TxOptions{Scope: "\x7f"}, h, "Scope"},
	} {
		t.Run(name, func(t *testing.T) {
			got, err := consumer.Transactional(c.store, c.opts, c.h)
			if err == nil || got != nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Transactional = %v, want an error naming %s", err, c.want)
			}
		})
	}
}

// A handler that ran, but whose transaction lost the key to a writer that
// did not wait for it, is a duplicate: acknowledged, nothing of it
// committed, reported with the duplicate outcome (not complete_failed).
func TestTransactionalLosesTheKey(t *testing.T) {
	store := newTxStore()
	store.stolen = true
	var outcomes []consumer.Outcome
	ran := 0
	h, err := consumer.Transactional[*fakeTx](store, consumer.TxOptions{
		Scope:     "billing/ledger",
		Telemetry: consumer.Telemetry{OnOutcome: func(_ context.Context, r consumer.Report) { outcomes = append(outcomes, r.Outcome) }},
	}, func(_ context.Context, tx *fakeTx, m *consumer.Message) error {
		ran++
		tx.writes = append(tx.writes, "debit "+m.ID)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	r := consumer.Process(t.Context(), h, msg("m1", "p"))
	if r.Action != consumer.ActionAck || !r.Duplicate {
		t.Fatalf("result %+v, want an acknowledged duplicate", r)
	}
	if res, ok := dedup.StoredResult(r.Err); !ok || string(res) != "theirs" {
		t.Fatalf("stored result %q, want the winner's", res)
	}
	if ran != 1 || len(store.writes()) != 0 {
		t.Fatalf("ran %d, writes %v; want one run and nothing committed", ran, store.writes())
	}
	if len(outcomes) != 1 || outcomes[0] != consumer.OutcomeDuplicate {
		t.Fatalf("outcomes %v, want [duplicate]", outcomes)
	}
}
