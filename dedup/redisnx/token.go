package redisnx

import (
	"context"
	"errors"
	"fmt"
	"net"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/dedup"
)

// cmdable is what token scripts are sent through: the client or a
// pipeline.
type cmdable interface {
	Process(ctx context.Context, cmd redis.Cmder) error
}

// owned runs one of the token scripts and maps its reply.
func (s *Store) owned(ctx context.Context, op string, sc *tokenScript, l *dedup.Lease, args ...any) error {
	if l == nil {
		return fmt.Errorf("redisnx: %s: nil lease: %w", op, dedup.ErrLeaseLost)
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("redisnx: %s %s: %w", op, l.Key, err)
	}
	call := &scriptCall{script: sc, key: s.RedisKey(l.Key), args: args}
	nd, err := s.nodeOf(ctx, call.key)
	if err != nil {
		return fmt.Errorf("redisnx: %s %s: %w", op, l.Key, err)
	}
	err = nd.ops.do(ctx, []nodeOp{{call: call}})
	var n int64
	if err == nil {
		n, err = call.cmd.Int64()
	}
	if err != nil {
		if sc.once && mayHaveRun(err) {
			return fmt.Errorf("redisnx: %s %s: %w: %w", op, l.Key, dedup.ErrOutcomeUnknown, err)
		}
		return fmt.Errorf("redisnx: %s %s: %w", op, l.Key, err)
	}
	if n != 1 {
		return fmt.Errorf("redisnx: %s %s: %w", op, l.Key, dedup.ErrLeaseLost)
	}
	return nil
}

// Extend implements dedup.LeaseStore: the lease runs for Options.Lease from
// now.
func (s *Store) Extend(ctx context.Context, l *dedup.Lease) error {
	if l == nil {
		return s.owned(ctx, "extend", s.extend, l)
	}
	return s.owned(ctx, "extend", s.extend, l, l.Token, s.leaseArg)
}

// Complete implements dedup.LeaseStore: the key is done, holds result, and
// is remembered for Options.TTL.
func (s *Store) Complete(ctx context.Context, l *dedup.Lease, result []byte) error {
	if l == nil {
		return s.owned(ctx, "complete", s.complete, l)
	}
	if result == nil {
		result = []byte{}
	}
	return s.owned(ctx, "complete", s.complete, l, l.Token, result, s.ttlArg)
}

// Release implements dedup.LeaseStore: the key is deleted so a redelivery
// runs again. A completed key is never released.
func (s *Store) Release(ctx context.Context, l *dedup.Lease) error {
	if l == nil {
		return s.owned(ctx, "release", s.release, l)
	}
	return s.owned(ctx, "release", s.release, l, l.Token)
}

// scriptCall is one run of a token script (extend, complete, release) on
// its way to Redis and back.
type scriptCall struct {
	script *tokenScript
	key    string
	args   []any
	cmd    *redis.Cmd
}

// issue sends the call through c (queues it, on a pipeline): EVALSHA, or
// with full EVAL and the script's source. The command of a script marked
// once goes as a onceCmd.
func (c *scriptCall) issue(ctx context.Context, to cmdable, full bool) {
	args := make([]any, 0, 4+len(c.args))
	if full {
		args = append(args, "eval", c.script.src)
	} else {
		args = append(args, "evalsha", c.script.sha)
	}
	args = append(args, 1, c.key)
	args = append(args, c.args...)
	c.cmd = redis.NewCmd(ctx, args...)
	if c.script.once {
		_ = to.Process(ctx, onceCmd{c.cmd})
		return
	}
	_ = to.Process(ctx, c.cmd)
}

// onceCmd is a command go-redis sends at most once. go-redis sends a
// command again after an error that broke its connection (up to
// Options.MaxRetries times; a pipeline as a whole, and on a cluster up to
// MaxRedirects times), although the first send may have run it and only
// its reply was lost. A command whose NoRetry answers true is never sent
// again, nor is a pipeline that holds one; redirections (MOVED, ASK),
// which Redis answers without running the command, are still followed.
type onceCmd struct{ *redis.Cmd }

// NoRetry implements redis.Cmder.
func (onceCmd) NoRetry() bool { return true }

// mayHaveRun reports whether a call that failed with err may have run on
// Redis: err is no reply from Redis (which answers a call it ran, or
// refused), and not one that says the call never left the client.
func mayHaveRun(err error) bool {
	return !isReplyError(err) && !unsent(err)
}

// unsent reports whether err says the command never left the client: the
// caller gave up while it waited for its batch (errUnsent), no connection
// could be had (a dial that failed, the pool's timeout), or the client is
// closed.
func unsent(err error) bool {
	var op *net.OpError
	return errors.Is(err, errUnsent) || errors.Is(err, redis.ErrClosed) || errors.Is(err, redis.ErrPoolTimeout) ||
		errors.As(err, &op) && op.Op == "dial"
}

// runScripts runs calls with EVALSHA: alone, or in one pipeline. A call
// answered NOSCRIPT (a restarted server, SCRIPT FLUSH, a new cluster node)
// has had no effect: it is sent again with EVAL, the whole script, which
// also caches it on that server (no SCRIPT LOAD, which on a cluster would
// need every shard). It returns an error only when Redis could not be
// reached; an error Redis returns for one call stays in its cmd. With sent,
// the calls went out already (see runOps): it starts from their replies.
func (s *Store) runScripts(ctx context.Context, calls []*scriptCall, sent bool) error {
	send := func(todo []*scriptCall, full bool) {
		// A Redis Cluster client routes a lone command through its
		// COMMAND table, which it fetches once from any node, perhaps one
		// that is down or frozen; a pipeline routes by slot alone.
		if len(todo) == 1 && s.cluster == nil {
			todo[0].issue(ctx, s.client, full)
			return
		}
		_, _ = s.client.Pipelined(ctx, func(p redis.Pipeliner) error {
			for _, c := range todo {
				c.issue(ctx, p, full)
			}
			return nil
		})
	}
	todo := calls
	for _, full := range []bool{false, true} {
		if full || !sent {
			send(todo, full)
		}
		var again []*scriptCall
		for _, c := range todo {
			err := c.cmd.Err()
			switch {
			case err == nil || errors.Is(err, redis.Nil):
			case !isReplyError(err):
				return err
			case isNoScript(err):
				again = append(again, c)
			}
		}
		if len(again) == 0 {
			return nil
		}
		todo = again
	}
	return nil
}
