//go:build unix

package chaos

import (
	"context"

	"github.com/idemkit/idem/internal/testkit/netns"
)

// The partition/ cells: real network partitions between a consumer and one
// of its services (partition_run.go says how they are made and healed).
//
//   - partition/pgtable/both, partition/pgtable/oneway: PostgreSQL is cut,
//     every packet or one direction at a time (out: the consumer's
//     statements never arrive; in: they arrive and run, a COMMIT included,
//     and the replies are lost). The claim and the effect share one
//     transaction. Promise: 0 duplicate effects, 0 lost. The both-ways
//     cell also SIGKILLs the cut consumers halfway through every other
//     long cut and restarts them still cut off.
//   - partition/redisnx/both, partition/redisnx/oneway: Redis is cut. The
//     claim is a redisnx lease and the effect an autocommit INSERT in
//     PostgreSQL outside it, so a handler whose Complete is cut off, or
//     whose lease ran out while its heartbeats were, leaves the effect to
//     be run again: duplicates are expected (ExpectDuplicates) and bounded
//     by the handlers that reported they could not mark their key done; a
//     duplicate beyond that fails the cell, as does any lost message.
//   - partition/amqp-pgtable: RabbitMQ is cut (both ways, out, in, in
//     turn), with the claim and effect in pgtable. A long cut outlasts the
//     heartbeat on both ends: RabbitMQ closes the connection and requeues
//     the unacknowledged deliveries, whose effects may have committed, and
//     the consumer redials after the heal. The cut consumers are also
//     SIGKILLed halfway through every other long cut. Promise: 0 duplicate
//     effects, 0 lost.
func registerPartition() {
	RegisterChild(partChildName, partitionChild)
	both := []netns.Direction{netns.Both}
	oneway := []netns.Direction{netns.Out, netns.In}
	for _, spec := range []partSpec{
		{name: "partition/pgtable/both", store: storePG, cut: partPG, dirs: both, kills: true},
		{name: "partition/pgtable/oneway", store: storePG, cut: partPG, dirs: oneway},
		{name: "partition/redisnx/both", store: storeRedis, cut: partRedis, dirs: both},
		{name: "partition/redisnx/oneway", store: storeRedis, cut: partRedis, dirs: oneway},
		{name: "partition/amqp-pgtable", store: storePG, cut: partAMQP, dirs: []netns.Direction{netns.Both, netns.Out, netns.In}, kills: true},
	} {
		Register(Cell{
			Name:             spec.name,
			ExpectDuplicates: spec.store == storeRedis,
			Run: func(ctx context.Context, env *Env) (Result, error) {
				return runPartition(ctx, env, spec)
			},
		})
	}
}
