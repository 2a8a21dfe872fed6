package idemamqp

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"

	"github.com/idemkit/idem/consumer"
	"github.com/idemkit/idem/internal/backoff"
	"github.com/idemkit/idem/internal/defaults"
	"github.com/idemkit/idem/outbox"
)

// Errors of the outbox publisher.
var (
	// ErrPublisherClosed is returned by Publish after Close.
	ErrPublisherClosed = errors.New("amqp: publisher closed")
	// ErrUnconfirmed is the cause of a message the broker did not confirm
	// in time, or nacked: its outcome is unknown and the relay sends it
	// again.
	ErrUnconfirmed = errors.New("amqp: publish not confirmed; outcome unknown")
	// ErrReturned is the cause of a mandatory message the broker returned
	// as unroutable (no queue bound for its routing key).
	ErrReturned = errors.New("amqp: message returned unroutable")
	// ErrNoExchange is the cause of a message whose exchange does not
	// exist.
	ErrNoExchange = errors.New("amqp: exchange does not exist")
	// ErrInvalidMessage is the cause of a message that cannot be sent as
	// it is (a routing key or exchange name longer than 255 bytes).
	ErrInvalidMessage = errors.New("amqp: invalid message")
)

// PublisherOptions configure a Publisher. The zero value is usable.
type PublisherOptions struct {
	// Config is passed to amqp091.DialConfig. Defaults to a 10s heartbeat,
	// a 10s dial timeout and the connection name below.
	Config *amqp091.Config
	// ConnectionName is the connection_name client property, shown by
	// the RabbitMQ management UI and rabbitmqctl. Defaults to
	// "idem-outbox-publisher".
	ConnectionName string
	// ConfirmTimeout bounds one Publish call: sending the messages and
	// waiting for their confirms. A message not confirmed by then is
	// reported failed (outcome unknown: the relay sends it again) and the
	// connection is reopened. Defaults to 10s.
	ConfirmTimeout time.Duration
	// AllowUnroutable publishes without the mandatory flag, so a message
	// no queue is bound for is confirmed and dropped by the broker.
	// Defaults to false: messages are mandatory, and a returned one is a
	// failure (ErrReturned) retried by the relay and eventually dead.
	AllowUnroutable bool
	// SkipExchangeCheck skips the passive declare of each exchange the
	// first time it is used. Defaults to false: a message to a missing
	// exchange fails alone (ErrNoExchange) instead of closing the channel
	// under the whole batch.
	SkipExchangeCheck bool
	// ContentType is the content type property of every message. Defaults
	// to none.
	ContentType string
	// ReconnectBackoff spaces the dials after a failed one
	// (ReconnectBackoff.Delay, spread ±20%). Defaults to Initial 100ms,
	// Max 10s, Factor 2.
	ReconnectBackoff consumer.Backoff
	// Logger receives warnings. Defaults to slog.Default().
	Logger *slog.Logger
}

// Publisher is an outbox.Publisher for RabbitMQ. Each message goes to the
// exchange named by its Topic with its Key as routing key, persistent
// (delivery mode 2), with the outbox id as its message-id property, its
// CreatedAt as timestamp and its Headers as headers (string values; the
// W3C traceparent the outbox stored at Enqueue time among them, so the
// Consumer's span continues the producer's trace). It is safe for
// concurrent use: concurrent Publish calls use separate channels of one
// connection.
//
// Publish returns nil only when the broker confirmed every message. A
// message nacked, not confirmed within ConfirmTimeout, returned as
// unroutable, or sent to a missing exchange is reported in an
// *outbox.PublishError (causes ErrUnconfirmed, ErrReturned, ErrNoExchange),
// the others of the batch being confirmed. When the connection is lost
// during the batch, or cannot be opened, Publish returns a plain error: the
// outcome of the whole batch is unknown and the relay sends it again (the
// consumer deduplicates on the message id). When the broker closes the
// channel (a channel exception), the unconfirmed messages are sent again
// one by one so that only the message that causes it fails.
//
// The connection is opened on the first Publish and reopened, after a
// closed connection or channel (watched with NotifyClose), on the next
// Publish, with exponential backoff between failed dials. While the broker
// blocks the connection (a resource alarm), Publish fails at once.
type Publisher struct {
	url  string
	opts PublisherOptions
	cfg  amqp091.Config

	dialing chan struct{} // a one-slot semaphore: one dial at a time

	mu       sync.Mutex
	closed   bool
	conn     *pubConn
	known    map[string]bool // exchanges seen to exist
	nextDial time.Time
	fails    int // failed dials in a row
}

// NewPublisher returns a Publisher for the broker at url (an amqp:// or
// amqps:// URI). It does not connect: the first Publish does.
func NewPublisher(url string, opts PublisherOptions) (*Publisher, error) {
	if _, err := amqp091.ParseURI(url); err != nil {
		return nil, fmt.Errorf("amqp: NewPublisher: %w", err)
	}
	c := defaults.New("amqp: PublisherOptions")
	c.Duration("ConfirmTimeout", &opts.ConfirmTimeout, 10*time.Second)
	var err error
	opts.ReconnectBackoff, err = opts.ReconnectBackoff.WithDefaults(defaultReconnectBackoff)
	c.Wrap("ReconnectBackoff", err)
	if err := c.Err(); err != nil {
		return nil, err
	}
	if opts.ConnectionName == "" {
		opts.ConnectionName = "idem-outbox-publisher"
	}
	if opts.Logger == nil {
		opts.Logger = slog.Default()
	}
	cfg := dialConfig(opts.Config, opts.ConnectionName)
	return &Publisher{
		url:     url,
		opts:    opts,
		cfg:     cfg,
		dialing: make(chan struct{}, 1),
		known:   map[string]bool{},
	}, nil
}

var _ outbox.Publisher = (*Publisher)(nil)

// Close closes the connection. Publish calls in flight fail; later ones
// return ErrPublisherClosed.
func (p *Publisher) Close() error {
	p.mu.Lock()
	p.closed = true
	c := p.conn
	p.conn = nil
	p.mu.Unlock()
	if c == nil {
		return nil
	}
	if err := c.conn.CloseDeadline(time.Now().Add(5 * time.Second)); err != nil && !errors.Is(err, amqp091.ErrClosed) {
		return fmt.Errorf("amqp: close: %w", err)
	}
	return nil
}

// pubConn is one connection and its idle confirm-mode channels.
type pubConn struct {
	conn   *amqp091.Connection
	closes chan *amqp091.Error
	blocks chan amqp091.Blocking

	mu      sync.Mutex
	blocked amqp091.Blocking
	idle    []*pubChannel
}

// pubChannel is a channel in confirm mode with its notifications.
type pubChannel struct {
	ch      *amqp091.Channel
	closes  chan *amqp091.Error
	returns chan amqp091.Return
}

const pubMaxIdle = 8

// connection returns the open connection, dialling one (after the backoff
// of earlier failures) when there is none or it closed.
func (p *Publisher) connection(ctx context.Context) (*pubConn, error) {
	select {
	case p.dialing <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	defer func() { <-p.dialing }()

	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil, ErrPublisherClosed
	}
	c := p.conn
	if c != nil && c.conn.IsClosed() {
		p.conn, c = nil, nil
	}
	wait := time.Until(p.nextDial)
	p.mu.Unlock()
	if c != nil {
		return c, nil
	}
	if wait > 0 {
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil, ctx.Err()
		case <-t.C:
		}
	}
	conn, err := amqp091.DialConfig(p.url, p.cfg)
	p.mu.Lock()
	defer p.mu.Unlock()
	if err != nil {
		p.fails++
		p.nextDial = time.Now().Add(backoff.Spread(p.opts.ReconnectBackoff.Delay(p.fails)))
		return nil, fmt.Errorf("amqp: connect: %w", err)
	}
	p.fails, p.nextDial = 0, time.Time{}
	c = &pubConn{
		conn:   conn,
		closes: conn.NotifyClose(make(chan *amqp091.Error, 1)),
		blocks: conn.NotifyBlocked(make(chan amqp091.Blocking, 16)),
	}
	if p.closed {
		_ = conn.CloseDeadline(time.Now().Add(time.Second))
		return nil, ErrPublisherClosed
	}
	p.conn = c
	return c, nil
}

// drop forgets c and closes it without waiting on a stuck socket for long.
func (p *Publisher) drop(c *pubConn, why string) {
	p.mu.Lock()
	if p.conn == c {
		p.conn = nil
	}
	p.mu.Unlock()
	if !c.conn.IsClosed() {
		p.opts.Logger.Warn("amqp: publisher reopens its connection", "why", why)
		_ = c.conn.CloseDeadline(time.Now().Add(2 * time.Second))
	}
}

// blockedReason returns the reason the broker blocks the connection, or "".
func (c *pubConn) blockedReason() string {
	c.mu.Lock()
	defer c.mu.Unlock()
	for {
		select {
		case b := <-c.blocks:
			c.blocked = b
			continue
		default:
		}
		break
	}
	if c.blocked.Active {
		return c.blocked.Reason
	}
	return ""
}

// channel takes an idle channel or opens one in confirm mode.
func (c *pubConn) channel() (*pubChannel, error) {
	c.mu.Lock()
	for len(c.idle) > 0 {
		pc := c.idle[len(c.idle)-1]
		c.idle = c.idle[:len(c.idle)-1]
		if !pc.ch.IsClosed() {
			c.mu.Unlock()
			return pc, nil
		}
	}
	c.mu.Unlock()
	ch, err := c.conn.Channel()
	if err != nil {
		return nil, err
	}
	if err := ch.Confirm(false); err != nil {
		_ = ch.Close()
		return nil, err
	}
	return &pubChannel{
		ch:     ch,
		closes: ch.NotifyClose(make(chan *amqp091.Error, 1)),
		// Returns are read while the batch's confirms are awaited; the
		// buffer holds those that arrive while the batch is still being
		// sent (the library drops a return it cannot hand over in 5s).
		returns: ch.NotifyReturn(make(chan amqp091.Return, 1024)),
	}, nil
}

// release puts a healthy channel back for the next Publish.
func (c *pubConn) release(pc *pubChannel) {
	if pc.ch.IsClosed() {
		return
	}
	c.mu.Lock()
	if len(c.idle) < pubMaxIdle {
		c.idle = append(c.idle, pc)
		pc = nil
	}
	c.mu.Unlock()
	if pc != nil {
		_ = pc.ch.Close()
	}
}

// closeErr returns why pc closed, if it did.
func (pc *pubChannel) closeErr() error {
	select {
	case e, ok := <-pc.closes:
		if ok && e != nil {
			return e
		}
	default:
	}
	if pc.ch.IsClosed() {
		return amqp091.ErrClosed
	}
	return nil
}

// Publish sends msgs and waits for their confirms; see Publisher.
func (p *Publisher) Publish(ctx context.Context, msgs []*outbox.Message) error {
	if len(msgs) == 0 {
		return nil
	}
	failed := map[int]error{}
	todo := make([]int, 0, len(msgs))
	for i, m := range msgs {
		if err := pubCheck(m); err != nil {
			failed[i] = err
			continue
		}
		todo = append(todo, i)
	}
	if len(todo) > 0 {
		if err := p.publish(ctx, msgs, todo, failed); err != nil {
			return err
		}
	}
	if len(failed) > 0 {
		return &outbox.PublishError{Failed: failed}
	}
	return nil
}

func pubCheck(m *outbox.Message) error {
	switch {
	case len(m.Topic) > 255:
		return fmt.Errorf("%w: exchange name (Topic) is %d bytes, the most is 255", ErrInvalidMessage, len(m.Topic))
	case len(m.Key) > 255:
		return fmt.Errorf("%w: routing key (Key) is %d bytes, the most is 255", ErrInvalidMessage, len(m.Key))
	case len(m.ID) > 255:
		return fmt.Errorf("%w: message id is %d bytes, the most is 255", ErrInvalidMessage, len(m.ID))
	}
	for k := range m.Headers {
		if len(k) > 255 {
			return fmt.Errorf("%w: header name %.20q... is %d bytes, the most is 255", ErrInvalidMessage, k, len(k))
		}
	}
	return nil
}

// publish sends msgs[todo] and records the failures in failed. It returns
// an error when the outcome of the batch is unknown as a whole.
func (p *Publisher) publish(ctx context.Context, msgs []*outbox.Message, todo []int, failed map[int]error) error {
	c, err := p.connection(ctx)
	if err != nil {
		return err
	}
	if reason := c.blockedReason(); reason != "" {
		return fmt.Errorf("amqp: the broker blocks publishing on this connection: %s", reason)
	}
	// One deadline for the whole call. If it passes while a send is stuck
	// on a full socket, closing the connection unblocks it.
	wctx, cancel := context.WithTimeout(ctx, p.opts.ConfirmTimeout)
	defer cancel()
	stopWatch := context.AfterFunc(wctx, func() { p.drop(c, "publish deadline passed") })
	defer stopWatch()

	if !p.opts.SkipExchangeCheck {
		todo, err = p.checkExchanges(wctx, c, msgs, todo, failed)
		if err != nil {
			return err
		}
		if len(todo) == 0 {
			return nil
		}
	}
	pc, err := c.channel()
	if err != nil {
		p.drop(c, "cannot open a channel")
		return fmt.Errorf("amqp: open channel: %w", err)
	}
	res := p.send(wctx, pc, msgs, todo)
	for i, e := range res.failed {
		failed[i] = e
	}
	if len(res.unknown) == 0 && wctx.Err() == nil {
		c.release(pc)
		return nil
	}
	if ctx.Err() != nil {
		return fmt.Errorf("amqp: publish: %w", ctx.Err())
	}
	if wctx.Err() != nil { // the deadline: outcome unknown
		for _, i := range res.unknown {
			failed[i] = fmt.Errorf("%w within %v", ErrUnconfirmed, p.opts.ConfirmTimeout)
		}
		return nil
	}
	// The channel closed under the batch.
	cause := pc.closeErr()
	if c.conn.IsClosed() {
		p.drop(c, "connection closed")
		return fmt.Errorf("amqp: connection closed during publish; every message of the batch is unconfirmed: %w", cause)
	}
	// A channel exception: find the message that causes it by sending the
	// unconfirmed ones one by one.
	p.forgetExchanges()
	p.opts.Logger.Warn("amqp: channel closed during publish; resending the unconfirmed messages one by one",
		"unconfirmed", len(res.unknown), "err", cause)
	return p.isolate(wctx, c, msgs, res.unknown, failed)
}

// isolate sends each message of idx alone, so that a message whose publish
// closes the channel fails alone.
func (p *Publisher) isolate(ctx context.Context, c *pubConn, msgs []*outbox.Message, idx []int, failed map[int]error) error {
	var pc *pubChannel
	for _, i := range idx {
		if pc == nil || pc.ch.IsClosed() {
			var err error
			if pc, err = c.channel(); err != nil {
				p.drop(c, "cannot open a channel")
				return fmt.Errorf("amqp: open channel: %w", err)
			}
		}
		res := p.send(ctx, pc, msgs, []int{i})
		if e, ok := res.failed[i]; ok {
			failed[i] = e
		}
		if len(res.unknown) == 0 {
			continue
		}
		if ctx.Err() != nil {
			failed[i] = fmt.Errorf("%w: %w", ErrUnconfirmed, ctx.Err())
			continue
		}
		if c.conn.IsClosed() {
			p.drop(c, "connection closed")
			return fmt.Errorf("amqp: connection closed during publish: %w", pc.closeErr())
		}
		failed[i] = fmt.Errorf("amqp: the broker closed the channel on this message: %w", pc.closeErr())
	}
	if pc != nil {
		c.release(pc)
	}
	return nil
}

// pubResult is the outcome of send: failed messages, and messages whose
// outcome is unknown because the channel closed or the deadline passed.
type pubResult struct {
	failed  map[int]error
	unknown []int
}

// send publishes msgs[idx] on pc and waits for their confirms, reading the
// returns meanwhile. The broker sends a message's basic.return before its
// basic.ack, and the library hands both over in that order, so when a
// confirm arrives the message's return, if any, is already in pc.returns.
func (p *Publisher) send(ctx context.Context, pc *pubChannel, msgs []*outbox.Message, idx []int) pubResult {
	res := pubResult{failed: map[int]error{}}
	dcs := make([]*amqp091.DeferredConfirmation, 0, len(idx))
	for n, i := range idx {
		m := msgs[i]
		dc, err := pc.ch.PublishWithDeferredConfirmWithContext(ctx, m.Topic, string(m.Key), !p.opts.AllowUnroutable, false, p.publishing(m))
		if err != nil || dc == nil {
			res.unknown = append(res.unknown, idx[n:]...)
			break
		}
		dcs = append(dcs, dc)
	}
	returned := map[string]amqp091.Return{}
	takeReturn := func(r amqp091.Return) { returned[r.MessageId] = r }
	returns := pc.returns
	for _, dc := range dcs {
	wait:
		for {
			select {
			case <-dc.Done():
				break wait
			case r, ok := <-returns:
				if !ok {
					returns = nil
					continue
				}
				takeReturn(r)
			case <-ctx.Done():
				break wait
			}
		}
	}
	for drained := false; !drained && returns != nil; {
		select {
		case r, ok := <-returns:
			if !ok {
				returns = nil
				continue
			}
			takeReturn(r)
		default:
			drained = true
		}
	}
	closed := pc.ch.IsClosed()
	unknown := res.unknown
	res.unknown = nil
	for n, dc := range dcs {
		i := idx[n]
		select {
		case <-dc.Done():
		default: // the deadline passed first
			res.unknown = append(res.unknown, i)
			continue
		}
		switch {
		case dc.Acked():
			if r, ok := returned[msgs[i].ID]; ok {
				res.failed[i] = fmt.Errorf("%w: exchange %q, routing key %q: %d %s", ErrReturned, r.Exchange, r.RoutingKey, r.ReplyCode, r.ReplyText)
			}
		case closed: // the library nacks what is pending when the channel closes
			res.unknown = append(res.unknown, i)
		default:
			res.failed[i] = fmt.Errorf("%w: nacked by the broker", ErrUnconfirmed)
		}
	}
	res.unknown = append(res.unknown, unknown...)
	sort.Ints(res.unknown)
	return res
}

func (p *Publisher) publishing(m *outbox.Message) amqp091.Publishing {
	var h amqp091.Table
	if len(m.Headers) > 0 {
		h = make(amqp091.Table, len(m.Headers))
		for k, v := range m.Headers {
			h[k] = v
		}
	}
	return amqp091.Publishing{
		Headers:      h,
		ContentType:  p.opts.ContentType,
		DeliveryMode: amqp091.Persistent,
		MessageId:    m.ID,
		Timestamp:    m.CreatedAt,
		Body:         m.Payload,
	}
}

// checkExchanges declares, passively, each exchange of msgs[todo] not seen
// before, fails the messages to missing ones and returns the others.
func (p *Publisher) checkExchanges(ctx context.Context, c *pubConn, msgs []*outbox.Message, todo []int, failed map[int]error) ([]int, error) {
	p.mu.Lock()
	var unknown []string
	seen := map[string]bool{}
	for _, i := range todo {
		x := msgs[i].Topic
		if x == "" || p.known[x] || seen[x] {
			continue
		}
		seen[x] = true
		unknown = append(unknown, x)
	}
	p.mu.Unlock()
	if len(unknown) == 0 {
		return todo, nil
	}
	missing := map[string]error{}
	for _, x := range unknown {
		if ctx.Err() != nil {
			return nil, fmt.Errorf("amqp: check exchange %q: %w", x, ctx.Err())
		}
		ch, err := c.conn.Channel()
		if err != nil {
			p.drop(c, "cannot open a channel")
			return nil, fmt.Errorf("amqp: check exchange %q: %w", x, err)
		}
		err = ch.ExchangeDeclarePassive(x, amqp091.ExchangeDirect, false, false, false, false, nil)
		var ae *amqp091.Error
		switch {
		case err == nil:
			_ = ch.Close()
			p.mu.Lock()
			p.known[x] = true
			p.mu.Unlock()
		case errors.As(err, &ae) && ae.Code == amqp091.NotFound && !c.conn.IsClosed():
			missing[x] = fmt.Errorf("%w: %q: %s", ErrNoExchange, x, ae.Reason)
		default:
			_ = ch.Close()
			if c.conn.IsClosed() {
				p.drop(c, "connection closed")
			}
			return nil, fmt.Errorf("amqp: check exchange %q: %w", x, err)
		}
	}
	if len(missing) == 0 {
		return todo, nil
	}
	kept := todo[:0:0]
	for _, i := range todo {
		if err, ok := missing[msgs[i].Topic]; ok {
			failed[i] = err
			continue
		}
		kept = append(kept, i)
	}
	return kept, nil
}

func (p *Publisher) forgetExchanges() {
	p.mu.Lock()
	clear(p.known)
	p.mu.Unlock()
}

// dialConfig returns a copy of base (or a zero Config) with the defaults the
// publisher and the consumer share: a 10s heartbeat, a dialer with a 10s
// timeout, and name as the connection name unless base sets one. base's
// Properties table is copied, never changed.
func dialConfig(base *amqp091.Config, name string) amqp091.Config {
	var cfg amqp091.Config
	if base != nil {
		cfg = *base
	}
	if cfg.Heartbeat == 0 {
		cfg.Heartbeat = 10 * time.Second
	}
	if cfg.Dial == nil {
		cfg.Dial = amqp091.DefaultDial(10 * time.Second)
	}
	props := amqp091.NewConnectionProperties()
	for k, v := range cfg.Properties {
		props[k] = v
	}
	if _, ok := props["connection_name"]; !ok {
		props.SetClientConnectionName(name)
	}
	cfg.Properties = props
	return cfg
}
