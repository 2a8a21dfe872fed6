package idemwatermill

import (
	"context"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemkit/idem/dedup"
	"github.com/idemkit/idem/internal/leasekeep"
	"github.com/idemkit/idem/internal/telemetry"
)

// call is one message's lease, from the claim to Complete or Release: the
// one allocation the middleware makes per message it runs the handler for.
// It holds everything that must outlive the claim's stack frame: the
// message's delivery (telemetry) and the lease flow (leasekeep.Run: the
// handler's context, the heartbeat, Complete and Release, which run with
// the message context's values but not its cancellation, so that a handler
// that finishes its work while the router stops still gets its key
// completed, bounded by FinishTimeout).
type call struct {
	leasekeep.Run
	dl  delivery
	cfg *config

	parent   context.Context // the message's context, with the consumer span
	msg      *message.Message
	key      dedup.Key
	returned bool // the handler returned (did not panic)
	// out and herr are what the handler returned. They are kept here, not
	// passed to settle, to keep the frame under the handler small.
	out  []*message.Message
	herr error

	tel       *telemetry.Dedup
	timed     bool      // the duration histograms record
	recording bool      // parent holds a recording span
	hstart    time.Time // the handler's start, when timed
	endHandle spanEnd   // ends the idem.handle span
}

// tracer is the tracer of the idem.complete span, nil when the message is
// not traced.
func (lc *call) tracer() trace.Tracer {
	if !lc.recording {
		return nil
	}
	return lc.tel.Tracer
}
