package idemnats

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/idemkit/idem/internal/backoff"
)

// setup declares or checks the durable consumer and the dead-letter
// stream, trying again while the server cannot be reached. It returns the
// consumer and its AckWait.
func (c *Consumer) setup(ctx context.Context) (jetstream.Consumer, time.Duration, error) {
	for n := 1; ; n++ {
		cons, ackWait, err := c.setupOnce(ctx)
		if err == nil || fatalSetup(err) {
			return cons, ackWait, err
		}
		if c.js.Conn().IsClosed() {
			return nil, 0, fmt.Errorf("%w: %w", ErrConnectionClosed, err)
		}
		c.opts.Logger.LogAttrs(ctx, slog.LevelWarn, "nats: consumer cannot set up; retrying",
			slog.String("stream", c.stream), slog.String("durable", c.durable), slog.Int("try", n), slog.Any("err", err))
		if !backoff.Sleep(ctx, backoff.Spread(min(100*time.Millisecond<<min(n, 7), 10*time.Second))) {
			return nil, 0, ctx.Err()
		}
	}
}

// errSetup marks a setup error that trying again will not fix.
type errSetup struct{ err error }

func (e *errSetup) Error() string { return e.err.Error() }
func (e *errSetup) Unwrap() error { return e.err }

func fatalSetup(err error) bool {
	var es *errSetup
	var api *jetstream.APIError
	return errors.As(err, &es) || (errors.As(err, &api) && api.Code >= 400 && api.Code < 500 && api.Code != 408)
}

func (c *Consumer) setupOnce(ctx context.Context) (jetstream.Consumer, time.Duration, error) {
	ctx, cancel := context.WithTimeout(ctx, c.opts.PublishTimeout)
	defer cancel()
	if _, err := c.js.Stream(ctx, c.stream); err != nil {
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			return nil, 0, &errSetup{fmt.Errorf("stream %q does not exist; it is the producer's: create it first: %w", c.stream, err)}
		}
		return nil, 0, err
	}
	if err := c.deadLetterStream(ctx); err != nil {
		return nil, 0, err
	}
	var cons jetstream.Consumer
	var err error
	if c.opts.NoDeclare {
		cons, err = c.js.Consumer(ctx, c.stream, c.durable)
		if errors.Is(err, jetstream.ErrConsumerNotFound) {
			return nil, 0, &errSetup{fmt.Errorf("durable consumer %q does not exist on stream %q (NoDeclare is set): %w", c.durable, c.stream, err)}
		}
	} else {
		cons, err = c.js.CreateOrUpdateConsumer(ctx, c.stream, c.opts.Config)
	}
	if err != nil {
		return nil, 0, err
	}
	info := cons.CachedInfo()
	switch {
	case info.Config.AckPolicy != jetstream.AckExplicitPolicy:
		return nil, 0, &errSetup{fmt.Errorf("durable consumer %q has AckPolicy %v; the Consumer needs jetstream.AckExplicitPolicy", c.durable, info.Config.AckPolicy)}
	case info.Config.Durable == "":
		return nil, 0, &errSetup{fmt.Errorf("consumer %q is not durable", c.durable)}
	case info.Config.DeliverSubject != "":
		return nil, 0, &errSetup{fmt.Errorf("consumer %q is a push consumer; the Consumer pulls", c.durable)}
	}
	if err := checkMaxDeliver(info.Config.MaxDeliver, c.opts.MaxDeliveries); err != nil {
		return nil, 0, &errSetup{err}
	}
	ackWait := info.Config.AckWait
	if ackWait <= 0 {
		ackWait = 30 * time.Second
	}
	return cons, ackWait, nil
}

// deadLetterStream finds the stream that stores the dead-letter subject,
// or creates one.
func (c *Consumer) deadLetterStream(ctx context.Context) error {
	name, err := c.js.StreamNameBySubject(ctx, c.opts.DeadLetterSubject)
	switch {
	case err == nil && name == c.stream:
		return &errSetup{fmt.Errorf("%w: the work stream %q itself stores the dead-letter subject %q; name a subject outside its subjects in ConsumerOptions.DeadLetterSubject", ErrDeadLetterStream, c.stream, c.opts.DeadLetterSubject)}
	case err == nil:
		return nil
	case !errors.Is(err, jetstream.ErrStreamNotFound):
		return err
	case c.opts.NoDeclare:
		return &errSetup{fmt.Errorf("%w: no stream stores the dead-letter subject %q (NoDeclare is set): create one, or name a stored subject in ConsumerOptions.DeadLetterSubject", ErrDeadLetterStream, c.opts.DeadLetterSubject)}
	}
	_, err = c.js.CreateStream(ctx, jetstream.StreamConfig{
		Name:     c.opts.DeadLetterStream,
		Subjects: []string{c.opts.DeadLetterSubject},
		Storage:  jetstream.FileStorage,
	})
	if errors.Is(err, jetstream.ErrStreamNameAlreadyInUse) {
		return &errSetup{fmt.Errorf("%w: a stream named %q exists but does not store %q: add the subject to it or set ConsumerOptions.DeadLetterStream: %w", ErrDeadLetterStream, c.opts.DeadLetterStream, c.opts.DeadLetterSubject, err)}
	}
	return err
}
