package txflow

import (
	"context"
	"fmt"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/leasekeep"
	"github.com/idemkit/idem/internal/telemetry"
)

// Tx is the transaction ProcessBatch commits or rolls back.
type Tx interface {
	Commit(ctx context.Context) error
	Rollback(ctx context.Context) error
}

// BatchSteps are the caller's parts of ProcessBatch.
type BatchSteps[T Tx] struct {
	// Who prefixes the errors of the commit, such as "kafkapg".
	Who string
	// Begin opens the transaction and claims every key in it (with one
	// statement, sent with BEGIN where it can be), and returns one verdict
	// per key: nil for a key claimed first, else the claim error. When it
	// returns an error, no transaction is open.
	Begin func(ctx context.Context, keys []dedup.Key) (T, []error, error)
	// Work acts on the verdicts in tx: it calls run(h, js...) for each run
	// of the handler, with the indexes js of the keys that run handles
	// (one key, or several handled by one call), and writes whatever else
	// commits with the batch. An error rolls everything back.
	Work func(ctx context.Context, tx T, verdicts []error, run func(h func(ctx context.Context) error, js ...int) error) error
}

// attrBatchCount is the claim span's number of keys.
const attrBatchCount = attribute.Key("messaging.batch.message_count")

// ProcessBatch is the transaction flow for several keys claimed with one
// statement: begin and claim every key in the transaction, run the work,
// commit. It records the telemetry on tel as Process does: idem.claims by
// verdict with the claim's duration (BEGIN included), the claim span
// (under a recording span, with the number of keys), an idem.handle span
// (with the key's hash for a run that handles one key, the number of keys
// for a run that handles several) and one handler duration for each
// handler run, by how the batch ended (completed, released,
// complete_failed), and the commit span. It returns nil once the batch
// committed; the transaction is rolled back otherwise, also when a handler
// panics (the panic goes on).
func ProcessBatch[T Tx](ctx context.Context, tel *telemetry.Dedup, keys []dedup.Key, s BatchSteps[T]) (err error) {
	// Span attributes are built only under a recording span (the key
	// hashes cost a SHA-256 each).
	tracing := telemetry.Recording(ctx)
	tx, verdicts, err := claimBatch(ctx, tel, tracing, keys, s.Begin)
	if err != nil {
		return err
	}
	committed := false
	// ran holds the time each handler run took; they are recorded with
	// how the batch ended.
	ran := make([]time.Duration, 0, len(keys))
	handled := telemetry.HandledReleased
	defer func() {
		if !committed {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			_ = tx.Rollback(rctx)
			cancel()
		}
		for _, d := range ran {
			tel.Handled(ctx, handled, d)
		}
	}()
	run := func(h func(ctx context.Context) error, js ...int) error {
		hctx, endHandle := ctx, func(error, ...attribute.KeyValue) {}
		if tracing {
			attr := attrBatchCount.Int(len(js))
			if len(js) == 1 {
				attr = telemetry.AttrKeyHash.String(keys[js[0]].Hash())
			}
			hctx, endHandle = telemetry.StartSpan(ctx, tel.Tracer, "idem.handle", attr)
		}
		start := time.Now()
		herr := callEnding(hctx, h, endHandle)
		ran = append(ran, time.Since(start))
		return herr
	}
	if err := s.Work(ctx, tx, verdicts, run); err != nil {
		return err
	}
	cmStart := time.Now()
	if err := tx.Commit(ctx); err != nil {
		telemetry.RecordSpan(ctx, tel.Tracer, "idem.commit", cmStart, time.Now(), err)
		handled = telemetry.HandledCompleteFailed
		return fmt.Errorf("%s: commit: %w", s.Who, err)
	}
	telemetry.RecordSpan(ctx, tel.Tracer, "idem.commit", cmStart, time.Now(), nil)
	committed = true
	handled = telemetry.HandledCompleted
	return nil
}

// claimBatch runs begin, the batch claim, under its span and counts its
// verdicts.
func claimBatch[T Tx](ctx context.Context, tel *telemetry.Dedup, tracing bool, keys []dedup.Key,
	begin func(context.Context, []dedup.Key) (T, []error, error)) (T, []error, error) {
	start := time.Now()
	cctx, endClaim := ctx, func(error, ...attribute.KeyValue) {}
	if tracing {
		cctx, endClaim = telemetry.StartSpan(ctx, tel.Tracer, "idem.claim",
			telemetry.AttrScope.String(tel.Scope()), telemetry.AttrStore.String(tel.Store()), attrBatchCount.Int(len(keys)))
	}
	tx, verdicts, err := begin(cctx, keys)
	took := time.Since(start)
	endClaim(err)
	if err != nil {
		tel.ClaimedN(ctx, telemetry.ClaimError, len(keys), took)
		return tx, nil, err
	}
	recordClaims(ctx, tel, verdicts, took)
	return tx, verdicts, nil
}

// recordClaims counts the verdicts of one batch claim that took took.
func recordClaims(ctx context.Context, tel *telemetry.Dedup, verdicts []error, took time.Duration) {
	names := [...]string{telemetry.ClaimFirst, telemetry.ClaimDuplicate, telemetry.ClaimFingerprintMismatch,
		telemetry.ClaimInvalidKey, telemetry.ClaimInFlight, telemetry.ClaimError}
	var n [len(names)]int
	for _, v := range verdicts {
		o := telemetry.ClaimOutcome(v)
		for i, name := range names {
			if name == o {
				n[i]++
				break
			}
		}
	}
	for i, name := range names {
		tel.ClaimedN(ctx, name, n[i], took)
	}
}

// callEnding runs h and ends its span, also when h panics (the panic goes
// on, and the batch's transaction rolls back).
func callEnding(ctx context.Context, h func(context.Context) error, end func(error, ...attribute.KeyValue)) error {
	ended := false
	defer func() {
		if !ended {
			end(leasekeep.ErrPanicked)
		}
	}()
	err := h(ctx)
	ended = true
	end(err)
	return err
}
