// Package idemnats is idem's NATS JetStream adapter, on nats.go and its
// jetstream package.
//
// The outbox publisher (NewPublisher) sends an outbox relay's messages
// with the outbox row id as Nats-Msg-Id and counts a message as published
// only when its PubAck came back. JetStream drops a message whose
// Nats-Msg-Id it stored within the stream's duplicate window (2 minutes
// by default), so a relay that publishes again after a crash does not
// store a second copy; past the window it does, and the consumer's idem
// claim drops it.
//
// The Consumer (NewConsumer) runs an idem handler chain over a durable
// pull consumer of a stream and settles each delivery by idem's ACK rule:
// acknowledged (AckSync) only when the effect committed, the message was
// a completed duplicate, or it was dead-lettered. Run creates the durable
// consumer (ConsumerOptions.Config) and the dead-letter stream if needed;
// with ConsumerOptions.NoDeclare they are declared elsewhere and Run
// checks them. Consumer.Ready is closed once Run pulls. The message id is
// the Nats-Msg-Id header, or ConsumerOptions.IDFunc's for a message
// without one.
//
// # Your own loop
//
// A program that keeps its own JetStream loop and its own Ack needs only
// NewMessage, which maps a jetstream.Msg to a consumer.Message, and
// consumer.Process, whose Result says what to do with the message; see the
// example of NewMessage.
//
// # Retries and long handlers
//
// A transient failure naks the message with ConsumerOptions.Backoff's
// delay for its delivery count (NakWithDelay); the
// failure on the MaxAttempts-th delivery dead-letters it instead, with
// reason retries_exhausted. Every message pulled and not yet settled gets
// InProgress every third of the durable consumer's AckWait, so a handler
// may run longer than AckWait without JetStream handing its message to
// another worker.
//
// # Dead letters
//
// A dead-lettered message is published to ConsumerOptions.DeadLetterSubject
// ("<stream>.dlq" by default, stored by a stream of its own, "<stream>-dlq"
// unless one exists) with the headers HeaderReason, HeaderError,
// HeaderAttempts, HeaderSubject, HeaderStream, HeaderSequence,
// HeaderConsumer, HeaderMessageID and HeaderID, and only once its PubAck
// came back is the delivery terminated (Term). A worker that dies between
// the two leaves the message to be delivered, and dead-lettered, again;
// the copy's Nats-Msg-Id is HeaderID, "<stream>/<durable>/<sequence>",
// the same for every delivery of the message, so the dead-letter stream
// drops the second copy within its duplicate window. A copy that cannot
// be published leaves the message nacked, to come back; nothing is
// dead-lettered while the Consumer stops.
//
// # A message that crashes the worker every time
//
// A handler that kills its process (a panic without consumer.Recover, an
// out-of-memory kill) never settles its delivery. JetStream delivers the
// message again once AckWait expired, and counts the delivery
// (NumDelivered); the Consumer dead-letters a message delivered more than
// ConsumerOptions.MaxDeliveries times with reason redelivery_limit,
// without running it. The durable consumer's own MaxDeliver must stay
// above MaxDeliveries (Run creates it with -1, no bound), or JetStream
// would stop delivering the message before that.
//
// JetStream counts a delivery for every message the dead process had
// pulled, not only the one that killed it. So that a crash loop does not
// dead-letter the messages pulled with the crashing one, a returned
// delivery (delivered before, and not nacked by this process) runs with
// no other delivery of the process unsettled: the Consumer starts by
// pulling one message at a time, pulls one at a time again after a pull
// brought a returned delivery, and holds returned deliveries that came
// with others (alive, with InProgress) until the others settled, then runs
// them one after another. A crash while a returned delivery runs alone
// counts against it, and against held deliveries still waiting, only. An
// innocent message is charged for the first crash of each crashing message
// it was pulled with and, at most, for one crash while it was held; keep
// MaxDeliveries well above twice the number of crashing messages expected
// at once. A smaller Prefetch makes fewer messages share a crash.
package idemnats
