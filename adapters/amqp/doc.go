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
// queue "<queue>", one retry queue "<queue>.retry.<ms>ms" per delay of
// ConsumerOptions.Backoff (its expired copies go back to the work queue), the
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
// dead-letter exchange with the dead-letter headers every adapter sets
// (consumer.HeaderReason, HeaderError, HeaderAttempts, HeaderSource and
// HeaderID), HeaderAttempt, HeaderExchange and HeaderRoutingKey, and only
// then acknowledged. A worker that dies between the confirm and the ack
// leaves the message to be delivered, and dead-lettered, again: the
// dead-letter queue can hold a message twice. Every dead letter therefore
// carries a message id, also in consumer.HeaderID, that is the same for
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
// die unsettled with it, and the broker counts them as it counts the
// message. The Consumer keeps them out of the dead-letter queue by never
// leaving a neighbour unsettled while a returned delivery runs: a delivery
// the broker returned before (x-delivery-count above 0) makes the Consumer
// hold the deliveries that come after it, let those before it finish, and
// cancel its consumer once its prefetch window is full (or nothing came for
// a moment: with the window full, the broker has no delivery in flight that
// the cancel could lose). Then it runs the held deliveries that were never
// returned, puts the returned ones back (published again to the work queue
// with their count in HeaderReturns, then acknowledged: not requeued, which
// would count one more return), runs the returned delivery alone, and
// consumes again with a prefetch window of one while returned deliveries
// keep coming, each running alone; the first delivery that was never
// returned ends that, and the window is Prefetch again.
//
// So a crash while a returned delivery runs returns, and counts, that
// delivery only, and a returned delivery whose count reaches MaxDeliveries
// is dead-lettered with reason redelivery_limit, without running, wherever
// it comes. What else counts a return against a message: a crash of a
// worker running, next to it, a message never returned before (the first
// crash of each message that kills workers), a connection lost, a graceful
// stop that requeues it before it was ever returned, a copy that could not
// be published. A neighbour can so be dead-lettered only if MaxDeliveries
// such returns meet it, for example as many different crashing messages
// running for the first time beside it; keep MaxDeliveries above the number
// of such messages expected at once. The cost of a crash loop is one death
// per delivery of the crashing message, MaxDeliveries in all, one copy
// published per returned delivery that has to wait, and the throughput of
// one handler while returned deliveries are worked off. With MaxDeliveries
// -1 (no bound) returned deliveries run as any other.
//
// A message that dies holding a dedup lease (consumer.Dedup over
// redisnx, say) finds its key in flight on the next delivery and waits on
// a fresh copy; the copy carries the count in HeaderReturns, so the bound
// holds across the waits.
package idemamqp
