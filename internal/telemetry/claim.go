package telemetry

import (
	"errors"

	"github.com/idemkit/idem/dedup"
)

// ClaimOutcome is the idem.claims outcome of a claim that returned err
// (ClaimFirst for nil).
func ClaimOutcome(err error) string {
	switch {
	case err == nil:
		return ClaimFirst
	case errors.Is(err, dedup.ErrDuplicate):
		return ClaimDuplicate
	case errors.Is(err, dedup.ErrInFlight):
		return ClaimInFlight
	case errors.Is(err, dedup.ErrFingerprintMismatch):
		return ClaimFingerprintMismatch
	case errors.Is(err, dedup.ErrInvalidKey):
		return ClaimInvalidKey
	}
	return ClaimError
}

// SpanErr is the error a claim span records for a claim that returned err:
// none for a duplicate or a key in flight, which are answers, not failures.
func SpanErr(err error) error {
	if errors.Is(err, dedup.ErrDuplicate) || errors.Is(err, dedup.ErrInFlight) {
		return nil
	}
	return err
}
