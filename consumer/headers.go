package consumer

// Headers of a dead letter. Every adapter sets them on what it parks: the
// Kafka Consumer as record headers, the RabbitMQ Consumer as message
// headers, the Watermill middleware as metadata fields. A tool that reads
// dead letters (a DLQ browser, a replay) reads the same names whatever the
// broker. Headers an adapter adds for its own broker start with
// HeaderPrefix too: Kafka's partition, offset and group, RabbitMQ's
// exchange and routing key.
const (
	// HeaderPrefix starts every dead-letter header. An adapter that parks
	// a message again (a dead letter consumed and dead-lettered once more)
	// replaces the headers with this prefix that the message carries.
	HeaderPrefix = "idem-dlq-"
	// HeaderReason is why the message was dead-lettered: an Outcome such
	// as "permanent", "panic", "fingerprint_mismatch", "invalid_key" or
	// "retries_exhausted", or one of an adapter's own (RabbitMQ's
	// "redelivery_limit" and "wait_limit").
	HeaderReason = "idem-dlq-reason"
	// HeaderError is the text of the error that dead-lettered it, cut to a
	// bound the adapter documents.
	HeaderError = "idem-dlq-error"
	// HeaderAttempts is how many times the handler ran on the message
	// before it was dead-lettered, as a decimal number.
	HeaderAttempts = "idem-dlq-attempts"
	// HeaderSource is where the message was consumed from: the Kafka
	// topic, the RabbitMQ work queue, the Watermill topic.
	HeaderSource = "idem-dlq-source"
	// HeaderID is the dead letter's own message id, the same each time the
	// same delivery is dead-lettered: a consumer of the dead letters
	// deduplicates with idem on it, so that a dead letter parked twice (a
	// crash after parking it and before the acknowledgement) is handled
	// once.
	HeaderID = "idem-dlq-id"
)
