package idemamqp

import (
	"context"
	"errors"
	"fmt"
	"regexp"
	"strconv"
	"sync"
	"time"

	amqp091 "github.com/rabbitmq/amqp091-go"
)

// ErrTopologyMissing is the cause of Run's error when
// ConsumerOptions.NoDeclare is set and a queue, an exchange or a queue
// argument the Consumer needs is missing or differs: the error names it.
var ErrTopologyMissing = errors.New("amqp: topology declared elsewhere is missing (NoDeclare)")

// Queue arguments of a retry queue.
const (
	argDeadLetterExchange   = "x-dead-letter-exchange"
	argDeadLetterRoutingKey = "x-dead-letter-routing-key"
	argMessageTTL           = "x-message-ttl"
)

// declare declares the topology; every call is idempotent.
func (c *Consumer) declare(ch *amqp091.Channel) error {
	durable := !c.opts.NotDurable
	if _, err := ch.QueueDeclare(c.queue, durable, false, false, false, c.opts.QueueArgs); err != nil {
		return fmt.Errorf("declare queue %q: %w", c.queue, err)
	}
	for _, b := range c.opts.Bindings {
		if err := ch.QueueBind(c.queue, b.Key, b.Exchange, false, b.Args); err != nil {
			return fmt.Errorf("bind queue %q to exchange %q with key %q: %w", c.queue, b.Exchange, b.Key, err)
		}
	}
	for _, d := range c.delays {
		name := consRetryQueue(c.queue, d)
		args := c.retryArgs()
		args[argMessageTTL] = d.Milliseconds()
		if _, err := ch.QueueDeclare(name, durable, false, false, false, args); err != nil {
			return fmt.Errorf("declare retry queue %q: %w", name, err)
		}
	}
	if err := ch.ExchangeDeclare(c.opts.DeadLetterExchange, amqp091.ExchangeDirect, durable, false, false, false, nil); err != nil {
		return fmt.Errorf("declare dead-letter exchange %q: %w", c.opts.DeadLetterExchange, err)
	}
	if _, err := ch.QueueDeclare(c.opts.DeadLetterQueue, durable, false, false, false, nil); err != nil {
		return fmt.Errorf("declare dead-letter queue %q: %w", c.opts.DeadLetterQueue, err)
	}
	if err := ch.QueueBind(c.opts.DeadLetterQueue, c.queue, c.opts.DeadLetterExchange, false, nil); err != nil {
		return fmt.Errorf("bind dead-letter queue %q: %w", c.opts.DeadLetterQueue, err)
	}
	return nil
}

// retryArgs are the arguments every retry queue needs: its expired
// copies are dead-lettered to the default exchange with the work queue's
// name as routing key, that is, back to the work queue.
func (c *Consumer) retryArgs() amqp091.Table {
	return amqp091.Table{argDeadLetterExchange: "", argDeadLetterRoutingKey: c.queue}
}

// check verifies that the topology Run uses exists when it is declared
// elsewhere (ConsumerOptions.NoDeclare), and declares nothing: the work
// queue, each retry queue with the dead-letter arguments that bring its
// copies back (see checkRetryQueue), and the dead-letter exchange. A
// missing queue or exchange fails with NOT_FOUND, which closes ch and
// makes Run return; the arguments are checked on channels of their own,
// opened on conn.
func (c *Consumer) check(conn *amqp091.Connection, ch *amqp091.Channel) error {
	if _, err := ch.QueueDeclarePassive(c.queue, false, false, false, false, nil); err != nil {
		return fmt.Errorf("%w: work queue %q: %w", ErrTopologyMissing, c.queue, err)
	}
	for _, d := range c.delays {
		name := consRetryQueue(c.queue, d)
		if _, err := ch.QueueDeclarePassive(name, false, false, false, false, nil); err != nil {
			return fmt.Errorf("%w: retry queue %q: %w (%s)", ErrTopologyMissing, name, err, c.retryHint(d))
		}
		if err := c.checkRetryQueue(conn, name, d); err != nil {
			return err
		}
	}
	if err := ch.ExchangeDeclarePassive(c.opts.DeadLetterExchange, amqp091.ExchangeDirect, false, false, false, false, nil); err != nil {
		return fmt.Errorf("%w: dead-letter exchange %q: %w (it must route routing key %q to a queue)", ErrTopologyMissing, c.opts.DeadLetterExchange, err, c.queue)
	}
	return nil
}

func (c *Consumer) retryHint(d time.Duration) string {
	return fmt.Sprintf("declare it with %s \"\" and %s %q, and optionally %s %d",
		argDeadLetterExchange, argDeadLetterRoutingKey, c.queue, argMessageTTL, d.Milliseconds())
}

// inequivalentArg parses the text of the PRECONDITION_FAILED a queue
// declare gets when its flags or arguments differ from the existing
// queue's: the argument, and what the queue has when the declare did not
// send it ("received none but current is the value 'V' of type 'T'").
var (
	inequivalentArg = regexp.MustCompile(`inequivalent arg '([^']+)'`)
	currentValue    = regexp.MustCompile(`received none but current is the value '(.*)' of type '([a-z]+)'$`)
)

// checkRetryQueue verifies that the existing retry queue name carries
// x-dead-letter-exchange "" and x-dead-letter-routing-key <queue>: without
// them every copy sent to it expires into nothing. AMQP 0-9-1 cannot read
// a queue's arguments, but a declare with arguments that differ from the
// queue's fails with PRECONDITION_FAILED naming the first that differs, and
// one that matches changes nothing. So the queue is declared again with the
// two arguments, each attempt on a channel of its own (the failure closes
// it): a difference on one of them is the missing piece; a difference on
// durable or auto_delete, or an argument the queue has and the declare did
// not send (x-message-ttl, x-queue-type, x-max-length...), is taken over
// from the broker's answer and the declare tried again. The queue exists
// (checked passively before), so the declare creates nothing.
func (c *Consumer) checkRetryQueue(conn *amqp091.Connection, name string, d time.Duration) error {
	args := c.retryArgs()
	durable, autoDelete := true, false
	for range 32 {
		ch, err := conn.Channel()
		if err != nil {
			return fmt.Errorf("open a channel to check retry queue %q: %w", name, err)
		}
		_, err = ch.QueueDeclare(name, durable, autoDelete, false, false, args)
		if err == nil {
			_ = ch.Close()
			return nil
		}
		var ae *amqp091.Error
		if !errors.As(err, &ae) || ae.Code != amqp091.PreconditionFailed {
			return fmt.Errorf("check retry queue %q: %w", name, err)
		}
		m := inequivalentArg.FindStringSubmatch(ae.Reason)
		if m == nil {
			return fmt.Errorf("%w: retry queue %q: cannot check its arguments: %w (%s)", ErrTopologyMissing, name, err, c.retryHint(d))
		}
		switch arg := m[1]; arg {
		case "durable":
			durable = !durable
		case "auto_delete":
			autoDelete = !autoDelete
		case argDeadLetterExchange, argDeadLetterRoutingKey:
			return fmt.Errorf("%w: retry queue %q: argument %s: %w (expired copies would be dropped, not brought back to %q; %s)",
				ErrTopologyMissing, name, arg, err, c.queue, c.retryHint(d))
		default:
			v, ok := parseArgValue(currentValue.FindStringSubmatch(ae.Reason))
			if !ok {
				return fmt.Errorf("%w: retry queue %q: cannot check its arguments: %w (%s)", ErrTopologyMissing, name, err, c.retryHint(d))
			}
			args[arg] = v
		}
	}
	return fmt.Errorf("%w: retry queue %q: cannot check its arguments (too many)", ErrTopologyMissing, name)
}

// parseArgValue converts a queue argument's value as the broker prints it
// (m is currentValue's match) to one of the same type class, which is
// what the broker compares.
func parseArgValue(m []string) (any, bool) {
	if m == nil {
		return nil, false
	}
	v, typ := m[1], m[2]
	switch typ {
	case "longstr":
		return v, true
	case "byte", "short", "signedint", "long", "unsignedbyte", "unsignedshort", "unsignedint":
		n, err := strconv.ParseInt(v, 10, 64)
		return n, err == nil
	case "bool":
		b, err := strconv.ParseBool(v)
		return b, err == nil
	case "float", "double":
		f, err := strconv.ParseFloat(v, 64)
		return f, err == nil
	}
	return nil, false
}

// RetryQueues returns the names of the retry queues of a Consumer of queue
// with opts, "<queue>.retry.<ms>ms", one per delay of
// ConsumerOptions.Backoff, shortest first: the queues to declare when
// NoDeclare is set, and those DeleteTopology deletes. It returns an error
// when opts would be refused by NewConsumer.
func RetryQueues(queue string, opts ConsumerOptions) ([]string, error) {
	if queue == "" {
		return nil, errors.New("amqp: RetryQueues: queue is required")
	}
	if err := opts.consSetDefaults(queue); err != nil {
		return nil, err
	}
	ds := opts.retryDelays()
	names := make([]string, len(ds))
	for i, d := range ds {
		names[i] = consRetryQueue(queue, d)
	}
	return names, nil
}

// DeleteTopology deletes, on conn, what a Consumer of queue with opts
// declares: the work queue, its retry queues ("<queue>.retry.<ms>ms", one
// per delay of ConsumerOptions.Backoff), the dead-letter queue
// and the dead-letter exchange (ConsumerOptions.DeadLetterQueue and
// DeadLetterExchange, "<queue>.dlq" and "<queue>.dlx" by default), and so
// their bindings, with every message they hold. Nothing else is touched:
// not the producer's exchanges named in Bindings, nor the retry queues of
// delays opts does not make (pass the Backoff the Consumer ran with).
// What does not exist is skipped. Stop the Consumers of queue first: a
// running one declares it all again when it reconnects.
//
// It is for tests, throw-away queues and retiring a worker; conn stays
// open, and the deletes stop at the first error or when ctx ends.
func DeleteTopology(ctx context.Context, conn *amqp091.Connection, queue string, opts ConsumerOptions) error {
	if conn == nil {
		return errors.New("amqp: DeleteTopology: conn is nil")
	}
	if queue == "" {
		return errors.New("amqp: DeleteTopology: queue is required")
	}
	if err := opts.consSetDefaults(queue); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	ch, err := conn.Channel()
	if err != nil {
		return fmt.Errorf("amqp: DeleteTopology: open a channel: %w", err)
	}
	defer func() { _ = ch.Close() }()
	// A delete waits for the broker's answer; ctx ending closes the
	// channel, which ends the wait.
	stop := context.AfterFunc(ctx, func() { _ = ch.Close() })
	defer stop()
	queues := []string{queue}
	seen := map[string]bool{queue: true}
	for _, d := range opts.retryDelays() {
		if n := consRetryQueue(queue, d); !seen[n] {
			seen[n] = true
			queues = append(queues, n)
		}
	}
	queues = append(queues, opts.DeadLetterQueue)
	for _, q := range queues {
		if _, err := ch.QueueDelete(q, false, false, false); err != nil {
			return deleteErr(ctx, "queue", q, err)
		}
	}
	if err := ch.ExchangeDelete(opts.DeadLetterExchange, false, false); err != nil {
		return deleteErr(ctx, "exchange", opts.DeadLetterExchange, err)
	}
	return nil
}

func deleteErr(ctx context.Context, what, name string, err error) error {
	if ctx.Err() != nil {
		err = ctx.Err()
	}
	return fmt.Errorf("amqp: DeleteTopology: delete %s %q: %w", what, name, err)
}

// channelErr is connect's error when a channel cannot be opened on conn:
// on a connection the caller owns (NewConsumerConn) it says so, and wraps
// ErrConnectionClosed when that connection closed meanwhile.
func (c *Consumer) channelErr(conn *amqp091.Connection, err error) error {
	if !c.shared {
		return fmt.Errorf("open channel: %w", err)
	}
	if conn.IsClosed() {
		return fmt.Errorf("%w: opening a channel on it failed: %w", ErrConnectionClosed, err)
	}
	return fmt.Errorf("open a channel on the connection given to the consumer: %w", err)
}

// returnWatch counts the copies the broker returned as unroutable on a
// session's publishing channel, by exchange and routing key. The Consumer
// publishes its retry and dead-letter copies mandatory: a copy no queue
// takes (a retry queue deleted, a dead-letter exchange without a binding
// for the work queue's name) comes back as basic.return, which RabbitMQ
// sends before the copy's confirm. So a copy whose count moved between
// its publish and its confirm was not routed, or shared its destination
// with one that was not.
type returnWatch struct {
	mu sync.Mutex
	n  map[returnDest]uint64
	// returns and after are registered on the channel in that order:
	// amqp091-go hands a basic.return to each in turn before it reads the
	// next frame (the confirm), and loop counts a return before it takes
	// the return's second copy from after, so the count has moved by the
	// time the confirm is seen.
	returns, after chan amqp091.Return
}

type returnDest struct{ exchange, key string }

func watchReturns(ch *amqp091.Channel) *returnWatch {
	return &returnWatch{
		n:       make(map[returnDest]uint64),
		returns: ch.NotifyReturn(make(chan amqp091.Return)),
		after:   ch.NotifyReturn(make(chan amqp091.Return)),
	}
}

// loop counts the returns until the channel closes.
func (w *returnWatch) loop() {
	returns, after := w.returns, w.after
	for returns != nil || after != nil {
		select {
		case r, ok := <-returns:
			if !ok {
				returns = nil
				continue
			}
			w.mu.Lock()
			w.n[returnDest{r.Exchange, r.RoutingKey}]++
			w.mu.Unlock()
		case _, ok := <-after:
			if !ok {
				after = nil
			}
		}
	}
}

func (w *returnWatch) count(exchange, key string) uint64 {
	if w == nil {
		return 0
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.n[returnDest{exchange, key}]
}

// errUnroutable is the cause of a copy the broker returned. Under
// NoDeclare it comes wrapped in ErrTopologyMissing, and Run returns it;
// otherwise the session is given up, and the reconnect declares the
// topology again.
var errUnroutable = errors.New("no queue took the copy")

// unroutable is publishCopy's error for a copy the broker returned: the
// copy was not stored, so its delivery is not acknowledged. The session
// is killed with it (the delivery comes back from the broker): under
// NoDeclare it makes Run return, otherwise the reconnect declares the
// topology again.
func (c *Consumer) unroutable(s *consSession, exchange, key string) error {
	what := fmt.Sprintf("retry queue %q does not exist", key)
	if exchange != "" {
		what = fmt.Sprintf("dead-letter exchange %q routes routing key %q to no queue (bind a dead-letter queue to it with that key)", exchange, key)
	}
	err := fmt.Errorf("%w: %s", errUnroutable, what)
	if c.opts.NoDeclare {
		err = fmt.Errorf("%w: %w", ErrTopologyMissing, err)
	}
	s.kill(err)
	return err
}
