// Package idemamqp is idem's RabbitMQ adapter, on amqp091-go.
//
// The outbox publisher (NewPublisher) sends an outbox relay's messages with
// publisher confirms: a message counts as published only when the broker
// confirmed it.
//
// The Consumer (NewConsumer, or NewConsumerConn on a connection the
// service owns) runs an idem handler chain over a queue's deliveries and
// settles each with idem's ACK rule: acknowledged only when the effect
// committed, the message was a completed duplicate, or it was
// dead-lettered. Run declares its topology on every connect: the work
// queue "<queue>", one retry queue "<queue>.retry.<ms>ms" per distinct
// retry delay (its expired copies go back to the work queue), the
// dead-letter exchange "<queue>.dlx" and the dead-letter queue
// "<queue>.dlq" bound to it. With ConsumerOptions.NoDeclare it is declared
// elsewhere, and Run checks it instead. Nothing deletes it when the
// Consumer stops; DeleteTopology does.
//
// Consumer.Ready is closed once Run consumes. Until then the work queue
// may not exist, and a message published to it is unroutable and dropped:
// a producer, a test or a readiness probe started with the worker waits
// for Ready (ExampleNewConsumer, ExampleNewConsumer_transactional).
//
// # Your own loop
//
// A program that keeps its own amqp091-go loop and its own Ack needs only
// NewMessage, which maps a delivery to a consumer.Message (the id from the
// message-id property or a configured header), and consumer.Process, whose
// Result says what to do with the delivery; see the example of NewMessage.
//
// # Dead letters
//
// A dead-lettered message is published, with publisher confirms, to the
// dead-letter exchange with HeaderReason, HeaderError, HeaderAttempt and
// HeaderQueue, and only then acknowledged. A worker that dies between the
// confirm and the ack leaves the message to be delivered, and
// dead-lettered, again: the dead-letter queue can hold a message twice.
// Every dead letter therefore carries a message id that is the same for
// every delivery of the same message: the original message-id, else the
// id taken from ConsumerOptions.IDHeader, else "idem-dl-" and a digest of
// the work queue and the message's exchange, routing key, properties,
// headers and body. A reader of the dead-letter queue deduplicates on that
// id with idem itself: a Consumer of the dead-letter queue (with
// NoDeclare, or its own names) whose chain has consumer.Dedup or
// consumer.Transactional in a scope of its own.
//
// # A message that crashes the worker every time
//
// A handler that kills its process (a panic without consumer.Recover, an
// out-of-memory kill, a segfault in C code) never settles its delivery,
// so the broker delivers it again, with HeaderAttempt unchanged, to the
// next worker, which dies too. On a classic queue nothing counts these
// deliveries and the message circles forever. On a quorum queue
// (ConsumerOptions.QuorumQueue, or one declared elsewhere) the broker
// counts them in x-delivery-count, and the Consumer bounds them
// (ConsumerOptions.MaxDeliveries).
//
// The neighbours of such a message, the deliveries prefetched with it,
// die unsettled with it and are counted with it. The Consumer keeps them
// out of the dead-letter queue: a delivery the broker returned before
// (x-delivery-count above 0) runs alone on its channel, once the
// deliveries before it are settled, and is acknowledged at once (the
// broker confirms the ack before the next delivery starts), not in a
// coalesced ack. So after the first death the neighbours run one at a
// time: each one before the poison message is settled (a completed one
// is acknowledged as a duplicate, its effect is not repeated), the poison
// message kills the worker again, and it is then the first delivery on
// the next worker's channel. Only the first delivery of a channel is
// dead-lettered, with reason redelivery_limit and without running, once
// its x-delivery-count reaches MaxDeliveries; a neighbour that reaches
// the count behind it runs, alone, when its turn comes. A graceful stop
// does not give such a neighbour back (it would then be the next
// channel's first delivery past the bound): a prefetched delivery that
// one more return would bring to MaxDeliveries runs before the channel
// closes, within ShutdownTimeout. With several workers on the queue the poison message may keep reaching workers that
// are already running, never as a first delivery: past twice MaxDeliveries
// it is dead-lettered wherever it comes. The cost is one death per
// delivery of the poison message, MaxDeliveries in all with one worker
// and at most twice that with several, and the throughput of one handler
// while returned deliveries are worked off. With MaxDeliveries -1 (no
// bound) returned deliveries run as any other.
// A message that dies holding a dedup lease (consumer.Dedup over
// redisnx, say) finds its key in flight on the next delivery and waits on
// a fresh copy; the copy carries the count in HeaderReturns, so the bound
// holds across the waits. What this cannot tell apart: several workers crash-looping at once may
// hand a neighbour that waited behind the poison message through
// MaxDeliveries deaths to a freshly started worker as its first
// delivery; it is then dead-lettered with redelivery_limit, and a replay
// from the dead-letter queue is deduplicated as usual.
package idemamqp
