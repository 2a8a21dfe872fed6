// Package bench is idem's benchmark harness: `make bench` (test/bench/cmd/bench)
// measures each path users run in production side by side with the
// baseline they would write without idem, with the same business write and
// the same parallelism, on the brokers and databases in their own processes
// (a kfake broker started as a child process for Kafka, the local RabbitMQ,
// PostgreSQL and Redis). Each row runs a warm-up of both sides, then rounds
// that alternate which side goes first; it reports the median rate of each
// side and their ratio. The database paths also get their SQL floor: the
// statements each side sends, replayed by pgbench (testdata/*.sql) with no Go
// in the way. The Redis paths get a third side in the same rounds, their
// commands by hand: the baseline's work plus the Redis commands idem sends
// for the path, sent with the bare go-redis client (hand.go).
//
// A run prints figures and never asserts them. Everything it creates (a
// PostgreSQL schema, Redis keys, RabbitMQ queues and exchanges, Kafka
// topics) is removed at the end.
package bench
