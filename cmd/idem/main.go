// Command idem is idem's command line: an embedded demo that shows the
// problem idem solves and the fix, and the operator's tools for the dedup
// stores, the outbox relay and the dead letters.
//
// Usage:
//
//	idem demo       [flags]                      a payments pipeline, naive against idem (no server needed)
//	idem migrate    up|status|sql                the pgtable and pgoutbox migrations
//	idem relay      [flags]                      the outbox relay as a long-running process
//	idem outbox     stats|dead|requeue           the outbox table: backlog, dead messages, requeue
//	idem dedup      stats|cleanup                the dedup table: rows per scope, delete expired rows
//	idem dedup      show                         one key of pgtable, sqltable or redisnx
//	idem deadletter list|show|replay|discard     dead letters of Kafka, RabbitMQ, NATS, Watermill and the outbox
//	idem console    [flags]                      all of the above in a web console
//
// Run "idem <command> -help" for a command's flags. Flags may also come from
// the environment: IDEM_POSTGRES_URL, IDEM_REDIS_URL, IDEM_KAFKA_BROKERS,
// IDEM_AMQP_URL and IDEM_NATS_URL set the defaults of --postgres, --redis,
// --kafka, --amqp and --nats.
//
// # idem dedup show
//
// Finds one key, by --scope and --id or by its stored --digest, in pgtable
// (--postgres), sqltable (--driver mysql|sqlite|postgres with --dsn) or
// redisnx (--redis, --prefix), through the store's Inspect method, and
// prints its state (in flight, done, expired or absent), when it expires,
// its fingerprint, its stored result, and its scope and id when the store
// keeps them. It exits 0 when the store holds the key and 4 when it does
// not.
//
// # idem deadletter
//
// Reads the dead letters where the adapters parked them: a Kafka
// dead-letter topic (--kafka, --topic), a RabbitMQ dead-letter queue
// (--amqp, --queue), a NATS dead-letter stream (--nats, --stream), the
// poison queue of a Watermill router on watermill-sql (--watermill-sql
// TOPIC) or the outbox's dead rows (--outbox). "list" groups them by reason and source,
// "show" prints one with its headers and payload, "replay" publishes a
// selection (--reason, --id or --all, at most --limit) again to where it
// came from with its message id, removing each letter once the publish was
// confirmed, and "discard" removes a selection; --dry-run changes nothing.
// A consumer's claim drops a replay of a message it applied already, so an
// interrupted replay is run again without harm. On Kafka, which cannot
// delete a record, what was removed is the committed offsets (and commit
// metadata) of the tool's own consumer group, --group.
//
// # idem console
//
// Serves a web console (html/template pages embedded in the binary, plain
// HTML forms) on --listen, 127.0.0.1:7070 by default: the outbox's backlog
// (bounded counts), its oldest pending message and its dead rows with a
// requeue action; the WAL relay's replication slot (lag, retained WAL);
// the dedup stores' rows by state and a key lookup that shows the key's
// dedup.KeyState; the dead letters grouped by reason, one with its headers
// and payload, and the replay or discard of a selection. Sources take the
// flags and environment of the commands above. A --listen address that is
// not a loopback address needs --token (IDEM_CONSOLE_TOKEN), which every
// request must then carry (a login form's HttpOnly cookie, or
// "Authorization: Bearer"); every action is a POST with a CSRF token and
// an Origin check, confirmed on a second page.
//
// # idem demo
//
// With no flags it needs no server: an in-process Kafka cluster (kfake) and
// the in-memory dedup store (memstore). Clients submit payments with
// idempotency keys to two in-process HTTP APIs, a naive one and one behind
// the httpidem middleware, double-clicking some and retrying others after a
// lost response; both APIs publish into the same Kafka topic through a relay
// that crashes between publish and mark now and then (it publishes the batch
// again); two consumer groups read the topic, a naive one and one with the
// idem dedup claim, and crash before committing their offsets and restart.
// Effects are counted in each consumer's effect sink. --console serves
// "idem console" on the demo's store, outbox and topics once it has run,
// until SIGINT. --amqp URL runs the
// same pipeline over RabbitMQ instead of Kafka. With a shared store
// (--postgres or --redis) the idem consumers run as child processes of the
// demo, which SIGKILLs them at random (--crash-rate, --seed) and restarts
// them; without one, crashes are simulated in the process. The demo prints
// a table and a last line of the form
//
//	demo: 10000 payments, 2345 duplicate deliveries, naive 2345 extra, idem 0 extra, 0 lost
//
// and exits 0 only when idem applied no extra effect and lost no payment.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
)

const usage = `idem makes at-least-once delivery safe.

Usage:
  idem demo    [flags]            run the payments demo: naive against idem (no server needed)
  idem migrate up|status|sql      apply, show or print the pgtable and pgoutbox migrations
  idem relay   [flags]            run the outbox relay until SIGINT or SIGTERM
  idem outbox  stats|dead|requeue look into the outbox table; requeue dead messages
  idem dedup   stats|cleanup      look into the dedup table; delete expired rows
  idem dedup   show               one key of a dedup store: state, expiry, fingerprint, result
  idem deadletter list|show|replay|discard
                                  browse dead letters by reason; replay or discard them
  idem console [flags]            a web console for all of the above (127.0.0.1 by default)

Run "idem <command> -help" for the flags of a command.
`

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// errUsage reports bad usage; the message has been printed already.
var errUsage = errors.New("usage")

// run runs the command in args and returns the exit status: 0 on success,
// 1 on failure, 2 on bad usage, 3 when "idem migrate status" finds a
// migration pending, 4 when "idem dedup show" finds the key not held or
// "idem deadletter show" finds no such letter.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 {
		fprint(stderr, usage)
		return 2
	}
	var err error
	switch cmd, rest := args[0], args[1:]; cmd {
	case "demo":
		err = runDemo(ctx, rest, stdout, stderr)
	case "migrate":
		err = runMigrate(ctx, rest, stdout, stderr)
	case "relay":
		err = runRelay(ctx, rest, stdout, stderr)
	case "outbox":
		err = runOutbox(ctx, rest, stdout, stderr)
	case "dedup":
		err = runDedup(ctx, rest, stdout, stderr)
	case "deadletter":
		err = runDeadletter(ctx, rest, stdout, stderr)
	case "console":
		err = runConsole(ctx, rest, stdout, stderr)
	case "help", "-h", "-help", "--help":
		fprint(stdout, usage)
		return 0
	default:
		fprintf(stderr, "idem: unknown command %q\n\n%s", cmd, usage)
		return 2
	}
	switch {
	case err == nil:
		return 0
	case errors.Is(err, flag.ErrHelp):
		return 0
	case errors.Is(err, errUsage):
		return 2
	case errors.Is(err, errFailed):
		return 1
	case errors.Is(err, errPending):
		return exitPending
	case errors.Is(err, errAbsent):
		return exitAbsent
	default:
		// One line, whatever the error: pgconn's list one line per address.
		msg := strings.Join(strings.Fields(strings.ReplaceAll(strings.ReplaceAll(err.Error(), ":\n", ": "), "\n", "; ")), " ")
		fprintf(stderr, "idem %s: %s\n", args[0], msg)
		return 1
	}
}

// errPending reports that "idem migrate status" found migrations not
// applied; the status has been printed already. The command exits with
// exitPending.
var errPending = errors.New("migrations pending")

// exitPending is the exit status of "idem migrate status" when a migration
// is pending: distinct from a failure (1) and bad usage (2).
const exitPending = 3

// errFailed reports a failure whose explanation has been printed already.
var errFailed = errors.New("failed")

// newFlagSet returns a flag set that reports errors on stderr and returns
// them instead of exiting.
func newFlagSet(name, synopsis string, stderr io.Writer) *flag.FlagSet {
	fs := flag.NewFlagSet("idem "+name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fprintf(stderr, "Usage: idem %s\n\nFlags:\n", synopsis)
		fs.PrintDefaults()
	}
	return fs
}

// parseFlags parses args. A parse error is printed as one line that names
// the command, with a pointer to its flags ("idem demo: flag provided but
// not defined: -bogus" / "Run 'idem demo -h' for its flags."), and returned
// as errUsage; -h and -help print the usage and return flag.ErrHelp.
func parseFlags(fs *flag.FlagSet, args []string) error {
	out, usage := fs.Output(), fs.Usage
	// The flag package prints a bare error and the whole usage on a
	// parse error; this function prints its own.
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	err := fs.Parse(args)
	fs.SetOutput(out)
	fs.Usage = usage
	switch {
	case err == nil:
		return nil
	case errors.Is(err, flag.ErrHelp):
		fs.Usage()
		return err
	}
	fprintf(out, "%s: %v\nRun '%s -h' for its flags.\n", fs.Name(), err, fs.Name())
	return errUsage
}

// usageError prints msg and the flag set's usage, and returns errUsage.
func usageError(fs *flag.FlagSet, format string, args ...any) error {
	fprintf(fs.Output(), "%s: %s\n", fs.Name(), fmt.Sprintf(format, args...))
	fs.Usage()
	return errUsage
}

// envDefault returns the environment variable name, or def when it is unset.
func envDefault(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// fprintf, fprintln and fprint write to the command's output; a failed write
// to stdout or stderr is not worth reporting anywhere.
func fprintf(w io.Writer, format string, args ...any) { _, _ = fmt.Fprintf(w, format, args...) }
func fprintln(w io.Writer, args ...any)               { _, _ = fmt.Fprintln(w, args...) }
func fprint(w io.Writer, args ...any)                 { _, _ = fmt.Fprint(w, args...) }
