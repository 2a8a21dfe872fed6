package main

import (
	"context"
	"flag"
	"io"
	"strings"

	"github.com/idemkit/idem/dedup"
)

// "idem demo --console": once the demo has run and printed its table, the
// console serves what the run made until SIGINT: the Kafka dead-letter
// topic (on kfake too), and with --postgres the outbox and the pgtable
// store, with --redis the redisnx store. memstore has no Inspect: its
// marks are not browsable.

// registerDemoConsole adds --console and --console-listen to the demo's
// flags.
func registerDemoConsole(fs *flag.FlagSet) (on *bool, cfg *consoleConfig) {
	cfg = &consoleConfig{scan: 1000, limit: 100, token: envDefault("IDEM_CONSOLE_TOKEN", "")}
	on = fs.Bool("console", false, "once the run is done, serve \"idem console\" on its store, outbox and topics until SIGINT (the exit status is the run's)")
	fs.StringVar(&cfg.listen, "console-listen", defaultConsoleListen, "with --console: the address the console listens on (one that is not a loopback address needs IDEM_CONSOLE_TOKEN)")
	return on, cfg
}

// demoConsole returns the hook the demo calls when its run is done: it
// prints the run's table and serves the console until ctx ends.
func demoConsole(ctx context.Context, cfg *consoleConfig, stdout io.Writer) func(*demoResult, *consoleSources) error {
	return func(res *demoResult, src *consoleSources) error {
		res.print(stdout)
		res.printed = true
		return serveConsole(ctx, cfg, src, stdout)
	}
}

// demoSources are the console's sources on a demo run's broker and store.
func demoSources(br *demoBroker, pgd *pgDemo, schema string, store dedup.LeaseStore, storeWhere string) *consoleSources {
	src := &consoleSources{}
	if pgd != nil {
		src.pool, src.outbox, src.schema, src.outboxTable = pgd.pool, pgd.ob, schema, pgOutboxTable
		pool, table := pgd.pool, pgd.store.Table()
		src.stores = append(src.stores, &consoleStore{Name: "pgtable", Where: "pgtable " + table, inspector: pgd.store,
			counts: func(ctx context.Context) (*dedupCounts, error) { return pgDedupCounts(ctx, pool, table) }})
		src.addOutboxDLQ()
	}
	switch in, ok := store.(inspector); {
	case ok:
		src.stores = append(src.stores, &consoleStore{Name: "redisnx", Where: storeWhere, inspector: in})
	case pgd == nil:
		src.storeNote = "The demo's dedup marks are in memstore, which keeps them in the demo's memory and cannot be inspected: run the demo with --postgres or --redis to look its keys up here."
	}
	if br.kind == brokerKafka {
		f := dlqFlags{kafka: strings.Join(br.brokers, ","), topic: br.dlq, group: "idem-deadletter", idHeader: "idem-message-id"}
		src.dlqs = append(src.dlqs, &consoleDLQ{turn: make(chan struct{}, 1), Name: "kafka", Label: "Kafka topic \"" + br.dlq + "\"",
			open: func(ctx context.Context) (dlqBackend, error) { return openKafkaDLQ(ctx, &f) }})
	}
	return src
}
