// Package adaptertest is the conformance suite every idem broker adapter
// runs, the broker counterpart of dedup/deduptest. An adapter's own test
// implements Harness for its broker and calls Run:
//
//	func TestConformance(t *testing.T) { adaptertest.Run(t, harness) }
//
// Run checks, as subtests, what every adapter promises under idem's ACK
// rule, each case against an oracle in PostgreSQL: the effects of the
// messages are rows of a table without a unique constraint, written in the
// transaction that claims the message in dedup/pgtable
// (consumer.Transactional), so a message applied twice is a second row
// (GROUP BY id HAVING count(*) > 1) and a message lost is a published id
// without a row. The cases (see Cases):
//
//   - AckRule: a consumer process SIGKILLed before the effect, inside its
//     transaction (the row written, not committed) and after the commit
//     (before the acknowledgement) loses nothing and applies nothing
//     twice; the delivery killed after the commit comes back and is
//     acknowledged as a duplicate.
//   - Duplicate: a message published again after its claim committed is
//     acknowledged without running the handler.
//   - TransientRetry: a transient error is retried and the message applied
//     once; it holds up unrelated messages only as far as the broker's
//     ordering promise says (Capabilities.Ordering).
//   - DeadLetter: a permanent error, a malformed payload, an empty id, an
//     oversized id and a fingerprint mismatch each reach the dead-letter
//     destination once per message, with the reason and an id, and the
//     consumer goes on with the messages after them; a dead letter sent
//     again after a crash carries the same id.
//   - Order: messages of one key (or of the whole destination) are applied
//     in the order they were published, where the broker promises it.
//   - GracefulStop: a consumer stopped while it works leaves nothing lost
//     and nothing applied twice: every delivery it did not settle comes
//     back to the next consumer.
//   - Reconnect: a consumer whose connection is lost reconnects and goes
//     on, losing nothing.
//   - StoreDown: while the dedup store cannot be reached, a message is
//     neither acknowledged nor dead-lettered nor applied; once the store
//     is back, it is applied once.
//
// # What a harness does
//
// A Harness creates an isolated destination (a topic, a queue) with its
// dead-letter destination, publishes messages with an id, key, payload and
// headers, starts a consumer of the adapter that runs the suite's Work, and
// reads the dead-letter destination back as DeadLetter values. The harness,
// not the suite, knows the adapter's dead-letter vocabulary (header names,
// where the id is): it returns the reason, the dead letter's id and its
// attempts, so the suite never depends on one adapter's names.
//
// The crash cases run the consumer in a child process: the test binary
// started again with -test.run set to the test that called Run and an
// environment variable that makes Run start the consumer instead of the
// suite. The Destination crosses the process boundary as JSON, so a
// harness keeps in it (Destination.Params) whatever another process needs
// to reach the broker, and its Start must work in a process that never
// called NewDestination.
//
// # Cases a harness cannot run
//
// A harness that cannot run a case (its broker lives in the test process,
// so a killed process takes it along; it has no connection to cut)
// declares it in Capabilities.Unsupported with the reason: the case is then
// skipped with that reason, under CI too. A case that cannot run for a
// reason not declared there (Consumer.Interrupt returned ErrUnsupported, a
// child process could not start) is skipped locally and fails under CI=true
// or IDEM_REQUIRE_SERVICES=1: a check that did not run never counts as
// passed.
//
// # PostgreSQL
//
// The suite's oracle and claim store live in the PostgreSQL database named
// by IDEM_TEST_POSTGRES_URL (default
// postgres://postgres@127.0.0.1:5432/test), each case in a schema of its
// own, dropped at the end. Without a reachable database the suite is
// skipped, or fails under CI.
package adaptertest
