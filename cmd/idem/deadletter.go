package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"
	"time"
)

const deadletterSynopsis = `deadletter list|show|replay|discard (--kafka BROKERS --topic T | --amqp URL --queue Q | --nats URL --stream S | --watermill-sql TOPIC --postgres URL | --outbox --postgres URL) [flags]

The dead letters of a consumer or a relay, read where they were parked:

  --kafka, --topic    the Kafka Consumer's dead-letter topic
                      (ConsumerOptions.DeadLetterTopic)
  --amqp, --queue     the RabbitMQ Consumer's dead-letter queue ("<queue>.dlq")
  --nats, --stream    the NATS Consumer's dead-letter stream ("<stream>-dlq")
  --watermill-sql    the poison topic of a Watermill router on watermill-sql:
                      the table "watermill_<topic>" (--postgres, --schema)
  --outbox            the dead rows of the outbox table (--postgres, --schema,
                      --outbox-table), as "idem outbox dead" lists them

  list             dead letters grouped by reason and source: count, first and
                   last seen, a sample of the error; then one line each
                   (at most --limit; --reason filters)
  show ID          one dead letter with its headers and payload (ID: the dead
                   letter's id, its message id, or its position as list prints
                   it); exits 4 when none matches
  replay           publish the selected dead letters again to where they came
                   from (the source header: the topic and partition, the work
                   queue, the subject, the Watermill topic; the outbox relay
                   for dead rows), keeping
                   their message id, and remove each once the broker
                   confirmed its publish
  discard          remove the selected dead letters without publishing them

replay and discard act on a selection: --reason R, --id ID (both
repeatable; together, a letter must match both) or --all, at most --limit
letters. Every command reads at most --scan letters. --dry-run prints what
would be done and changes nothing. A summary line ends every replay and
discard; the exit status is 1 when a selected letter could not be acted
on.

A replayed message keeps its id, so a consumer whose claim already holds
it (the message was applied before it was dead-lettered, or a replay ran
twice) drops it as a duplicate: an interrupted replay can be run again.
Kafka cannot delete a record: the tool records its progress as the
committed offset of a consumer group of its own (--group) on the
dead-letter topic, with the offsets done past it in the commit's metadata,
and never reads those again. RabbitMQ's letters are taken from the queue
and the ones not removed are returned to it when the command ends (list
and --dry-run too: the broker marks them redelivered).`

// deadLetter is one dead letter as the command shows and selects it.
type deadLetter struct {
	// pos is where it is in the dead-letter destination: a Kafka
	// partition and offset, a stream or table sequence, RabbitMQ's order
	// of reading.
	pos string
	// id is the dead letter's id (consumer.HeaderID; the outbox row id);
	// msgID the message id its replay carries.
	id, msgID string
	reason    string
	errText   string
	attempts  string
	// source is where it was consumed from: the topic, the work queue,
	// the subject.
	source  string
	at      time.Time // when it was parked, when the broker says
	key     []byte
	headers []header
	payload []byte
	ref     any // the backend's handle
}

type header struct{ name, value string }

// dlqBackend is one broker's dead-letter destination.
type dlqBackend interface {
	// describe names the destination.
	describe() string
	// next returns the next dead letter not yet removed, or nil after the
	// last one the destination held when the command started.
	next(ctx context.Context) (*deadLetter, error)
	// replay publishes d again to its source, keeping its message id, and
	// removes it once the broker confirmed the publish. A letter it
	// cannot replay it leaves in place and says why in skip.
	replay(ctx context.Context, d *deadLetter) (skip string, err error)
	// discard removes d.
	discard(ctx context.Context, d *deadLetter) error
	// close records the progress made (Kafka) and leaves every letter
	// read and not removed where it was (RabbitMQ returns them to the
	// queue). It runs once, after an error or an interruption too.
	close(ctx context.Context) error
}

// multiFlag is a flag that may be given several times.
type multiFlag []string

func (m *multiFlag) String() string     { return strings.Join(*m, ",") }
func (m *multiFlag) Set(v string) error { *m = append(*m, v); return nil }

// selection is which dead letters replay and discard act on.
type selection struct {
	reasons, ids []string
	all          bool
}

func (s *selection) match(d *deadLetter) bool {
	if len(s.reasons) > 0 && !slices.Contains(s.reasons, d.reason) {
		return false
	}
	return len(s.ids) == 0 || slices.ContainsFunc(s.ids, d.matchesID)
}

// matchesID reports whether id names d: its id, its message id or its
// position.
func (d *deadLetter) matchesID(id string) bool {
	return id != "" && (id == d.id || id == d.msgID || id == d.pos)
}

// dlqFlags name the dead-letter destination.
type dlqFlags struct {
	pg                            pgFlags
	outbox                        bool
	watermill                     string // the poison topic
	kafka, topic, group, idHeader string
	amqp, queue                   string
	nats, stream                  string
}

func runDeadletter(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := newFlagSet("deadletter", deadletterSynopsis, stderr)
	var f dlqFlags
	f.pg.register(fs, withOutbox)
	fs.BoolVar(&f.outbox, "outbox", false, "the dead rows of the outbox table (--postgres)")
	fs.StringVar(&f.watermill, "watermill-sql", "", "the poison topic of a Watermill router on watermill-sql (with --postgres)")
	fs.StringVar(&f.kafka, "kafka", envDefault("IDEM_KAFKA_BROKERS", ""), "comma-separated Kafka brokers (or IDEM_KAFKA_BROKERS)")
	fs.StringVar(&f.topic, "topic", "", "with --kafka: the dead-letter topic")
	fs.StringVar(&f.group, "group", "idem-deadletter", "with --kafka: the consumer group whose committed offsets record what replay and discard removed")
	fs.StringVar(&f.idHeader, "id-header", "idem-message-id", "with --kafka: the header that carries the message id (ConsumerOptions.IDHeader)")
	fs.StringVar(&f.amqp, "amqp", envDefault("IDEM_AMQP_URL", ""), "RabbitMQ URL (or IDEM_AMQP_URL)")
	fs.StringVar(&f.queue, "queue", "", "with --amqp: the dead-letter queue (\"<queue>.dlq\")")
	fs.StringVar(&f.nats, "nats", envDefault("IDEM_NATS_URL", ""), "NATS URL (or IDEM_NATS_URL)")
	fs.StringVar(&f.stream, "stream", "", "with --nats: the dead-letter stream (\"<stream>-dlq\")")
	var sel selection
	fs.Var((*multiFlag)(&sel.reasons), "reason", "select the dead letters of this reason (repeatable)")
	fs.Var((*multiFlag)(&sel.ids), "id", "select the dead letter of this id, message id or position (repeatable)")
	fs.BoolVar(&sel.all, "all", false, "replay or discard: select every dead letter")
	limit := fs.Int("limit", 100, "most dead letters list prints, and replay or discard acts on")
	scan := fs.Int("scan", 10000, "most dead letters a command reads to find the selection")
	dryRun := fs.Bool("dry-run", false, "replay or discard: print what would be done, change nothing")

	action, args := splitAction(args)
	var pre []string
	if action != "" {
		for len(args) > 0 && !strings.HasPrefix(args[0], "-") {
			pre, args = append(pre, args[0]), args[1:]
		}
	}
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	operands := slices.Concat(pre, fs.Args())
	if action == "" && len(operands) > 0 {
		action, operands = operands[0], operands[1:]
	}
	switch action {
	case "list", "replay", "discard":
		if len(operands) > 0 {
			return usageError(fs, "unexpected argument %q", operands[0])
		}
	case "show":
		if len(operands) > 1 {
			return usageError(fs, "show takes one id")
		}
		sel.ids = append(sel.ids, operands...)
		if len(sel.ids) != 1 {
			return usageError(fs, "show needs one id: idem deadletter show ID")
		}
	case "":
		return usageError(fs, "missing action: list, show, replay or discard")
	default:
		return usageError(fs, "unknown action %q: want list, show, replay or discard", action)
	}
	switch {
	case *limit < 1 || *scan < 1:
		return usageError(fs, "--limit and --scan must be at least 1")
	case (action == "replay" || action == "discard") && !sel.all && len(sel.reasons) == 0 && len(sel.ids) == 0:
		return usageError(fs, "%s needs a selection: --reason, --id or --all", action)
	case sel.all && (len(sel.reasons) > 0 || len(sel.ids) > 0):
		return usageError(fs, "--all selects every dead letter: leave out --reason and --id")
	case *dryRun && action != "replay" && action != "discard":
		return usageError(fs, "--dry-run is for replay and discard")
	}
	set := map[string]bool{}
	fs.Visit(func(fl *flag.Flag) { set[fl.Name] = true })
	b, err := f.open(ctx, fs, set)
	if err != nil {
		return err
	}
	// The backend's close runs even when ctx ends: it records progress.
	closeCtx := func() (context.Context, context.CancelFunc) {
		return context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	}
	var runErr error
	switch action {
	case "list":
		runErr = dlqList(ctx, b, &sel, *limit, *scan, stdout)
	case "show":
		runErr = dlqShow(ctx, b, sel.ids[0], *scan, stdout)
	default:
		runErr = dlqAct(ctx, b, action, &sel, *limit, *scan, *dryRun, stdout)
	}
	cctx, cancel := closeCtx()
	defer cancel()
	if err := b.close(cctx); err != nil {
		runErr = errors.Join(runErr, fmt.Errorf("%s: %w", b.describe(), err))
	}
	return runErr
}

// open connects to the destination the flags name: the one given on the
// command line, or, when none is, the one the environment names.
func (f *dlqFlags) open(ctx context.Context, fs *flag.FlagSet, set map[string]bool) (dlqBackend, error) {
	kinds := []string{}
	for _, k := range []string{"kafka", "amqp", "nats", "outbox", "watermill-sql"} {
		if set[k] && (k != "outbox" || f.outbox) {
			kinds = append(kinds, k)
		}
	}
	if len(kinds) == 0 {
		for k, v := range map[string]string{"kafka": f.kafka, "amqp": f.amqp, "nats": f.nats} {
			if v != "" {
				kinds = append(kinds, k)
			}
		}
	}
	if len(kinds) != 1 {
		return nil, usageError(fs, "name one dead-letter destination: --kafka with --topic, --amqp with --queue, --nats with --stream, --watermill-sql, or --outbox")
	}
	need := func(flag, v string) error {
		if v == "" {
			return usageError(fs, "--%s needs --%s", kinds[0], flag)
		}
		return nil
	}
	switch kinds[0] {
	case "kafka":
		if err := need("topic", f.topic); err != nil {
			return nil, err
		}
		return openKafkaDLQ(ctx, f)
	case "amqp":
		if err := need("queue", f.queue); err != nil {
			return nil, err
		}
		return openAMQPDLQ(ctx, f)
	case "nats":
		if err := need("stream", f.stream); err != nil {
			return nil, err
		}
		return openNATSDLQ(ctx, f)
	case "watermill-sql":
		if f.watermill == "" {
			return nil, usageError(fs, "--watermill-sql needs the poison topic")
		}
		return openWatermillDLQ(ctx, f)
	}
	return openOutboxDLQ(ctx, f)
}

// letterGroup is the dead letters of one reason and source.
type letterGroup struct {
	Reason, Source string
	Count          int
	First, Last    time.Time
	Sample         string // the error of one of them
}

// letterScan is what collectLetters found.
type letterScan struct {
	letters []*deadLetter
	// groups are by reason and source, the largest first.
	groups []*letterGroup
	// more is set when the scan stopped at limit or scan.
	more bool
}

// collectLetters reads the dead letters sel matches, at most limit of
// them found among at most scan read, and groups them by reason and
// source.
func collectLetters(ctx context.Context, b dlqBackend, sel *selection, limit, scan int) (*letterScan, error) {
	groups := map[[2]string]*letterGroup{}
	res := &letterScan{}
	for read := 0; ; read++ {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if read == scan {
			res.more = true
			break
		}
		d, err := b.next(ctx)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", b.describe(), err)
		}
		if d == nil {
			break
		}
		if !sel.match(d) {
			continue
		}
		if len(res.letters) == limit {
			res.more = true
			break
		}
		res.letters = append(res.letters, d)
		g := groups[[2]string{d.reason, d.source}]
		if g == nil {
			g = &letterGroup{Reason: d.reason, Source: d.source, Sample: d.errText}
			groups[[2]string{d.reason, d.source}] = g
		}
		g.Count++
		if !d.at.IsZero() {
			if g.First.IsZero() || d.at.Before(g.First) {
				g.First = d.at
			}
			if d.at.After(g.Last) {
				g.Last = d.at
			}
		}
		if g.Sample == "" {
			g.Sample = d.errText
		}
	}
	for _, g := range groups {
		res.groups = append(res.groups, g)
	}
	sort.Slice(res.groups, func(i, j int) bool {
		a, b := res.groups[i], res.groups[j]
		if a.Count != b.Count {
			return a.Count > b.Count
		}
		return a.Reason+"\x00"+a.Source < b.Reason+"\x00"+b.Source
	})
	return res, nil
}

// dlqList prints the dead letters grouped by reason and source, then one
// line each: at most limit of them, found among at most scan read.
func dlqList(ctx context.Context, b dlqBackend, sel *selection, limit, scan int, w io.Writer) error {
	res, err := collectLetters(ctx, b, sel, limit, scan)
	if err != nil {
		return err
	}
	letters := res.letters
	fprintf(w, "%s: %d dead letters", b.describe(), len(letters))
	switch {
	case res.more && len(letters) == limit:
		fprintf(w, " (the first %d: more follow, raise --limit)", limit)
	case res.more:
		fprintf(w, " among the first %d read (more may follow: raise --scan)", scan)
	}
	fprintln(w)
	if len(letters) == 0 {
		return nil
	}
	rw, sw := len("REASON"), len("SOURCE")
	for _, g := range res.groups {
		rw, sw = max(rw, len(orDash(g.Reason))), max(sw, len(orDash(g.Source)))
	}
	fprintf(w, "\n%-*s  %-*s  %6s  %-20s  %-20s  %s\n", rw, "REASON", sw, "SOURCE", "COUNT", "FIRST SEEN", "LAST SEEN", "ERROR (A SAMPLE)")
	for _, g := range res.groups {
		fprintf(w, "%-*s  %-*s  %6d  %-20s  %-20s  %s\n", rw, orDash(g.Reason), sw, orDash(g.Source), g.Count,
			timeText(g.First), timeText(g.Last), cut(g.Sample, 100))
	}
	fprintln(w)
	for _, d := range letters {
		fprintln(w, d.line())
	}
	return nil
}

// findLetter returns the first dead letter that id names among at most
// scan read, or nil when none does.
func findLetter(ctx context.Context, b dlqBackend, id string, scan int) (*deadLetter, error) {
	for range scan {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		d, err := b.next(ctx)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", b.describe(), err)
		}
		if d == nil {
			break
		}
		if d.matchesID(id) {
			return d, nil
		}
	}
	return nil, nil
}

// dlqShow prints the first dead letter that id names.
func dlqShow(ctx context.Context, b dlqBackend, id string, scan int, w io.Writer) error {
	d, err := findLetter(ctx, b, id, scan)
	if err != nil {
		return err
	}
	if d != nil {
		row := func(name, format string, args ...any) {
			fprintf(w, "%-12s "+format+"\n", append([]any{name}, args...)...)
		}
		row("in", "%s", b.describe())
		row("position", "%s", d.pos)
		row("id", "%s", orDash(d.id))
		row("message id", "%s", orDash(d.msgID))
		row("reason", "%s", orDash(d.reason))
		row("source", "%s", orDash(d.source))
		row("attempts", "%s", orDash(d.attempts))
		row("parked at", "%s", timeText(d.at))
		row("error", "%s", orDash(d.errText))
		if d.key != nil {
			row("key", "%s", printable(d.key))
		}
		fprintln(w, "headers")
		for _, h := range d.headers {
			fprintf(w, "  %s: %s\n", h.name, h.value)
		}
		row("payload", "%d bytes: %s", len(d.payload), printable(d.payload))
		return nil
	}
	fprintf(w, "%s: no dead letter %q among the first %d read (--scan)\n", b.describe(), id, scan)
	return errAbsent
}

// dlqAct replays or discards the selected dead letters.
func dlqAct(ctx context.Context, b dlqBackend, action string, sel *selection, limit, scan int, dry bool, w io.Writer) error {
	var (
		read, acted, copies, left, skipped int
		runErr                             error
	)
	// The ids replayed in this run: a second letter of the same id is a
	// copy (a message dead-lettered twice) whose message is published
	// already, and is removed without another publish.
	replayed := map[string]bool{}
	verb := map[string]string{"replay": "replayed", "discard": "discarded"}[action]
	if dry {
		verb = "would " + action
	}
	for acted+copies < limit && read < scan {
		if runErr = ctx.Err(); runErr != nil {
			break
		}
		d, err := b.next(ctx)
		if err != nil {
			runErr = fmt.Errorf("%s: %w", b.describe(), err)
			break
		}
		if d == nil {
			break
		}
		read++
		if !sel.match(d) {
			left++
			continue
		}
		if action == "replay" && d.id != "" && replayed[d.id] {
			if !dry {
				if err := b.discard(ctx, d); err != nil {
					runErr = fmt.Errorf("remove copy %s: %w", d.pos, err)
					break
				}
			}
			copies++
			what := "removed"
			if dry {
				what = "would remove"
			}
			fprintf(w, "%-16s %s (a copy of a letter replayed above)\n", what, d.line())
			continue
		}
		switch {
		case dry:
		case action == "discard":
			if err := b.discard(ctx, d); err != nil {
				runErr = fmt.Errorf("discard %s: %w", d.pos, err)
			}
		default:
			skip, err := b.replay(ctx, d)
			if err != nil {
				runErr = fmt.Errorf("replay %s: %w", d.pos, err)
			} else if skip != "" {
				skipped++
				fprintf(w, "%-16s %s: %s\n", "not replayed", d.line(), skip)
				continue
			}
		}
		if runErr != nil {
			break
		}
		if action == "replay" && d.id != "" {
			replayed[d.id] = true
		}
		acted++
		fprintf(w, "%-16s %s\n", verb, d.line())
	}
	var sum strings.Builder
	fmt.Fprintf(&sum, "deadletter %s", action)
	switch {
	case dry && action == "replay":
		fmt.Fprintf(&sum, " (dry run, nothing changed): would replay %d, would remove %d copies", acted, copies)
	case dry:
		fmt.Fprintf(&sum, " (dry run, nothing changed): would discard %d", acted)
	case action == "replay":
		fmt.Fprintf(&sum, ": %d replayed, %d copies removed, %d not replayed", acted, copies, skipped)
	default:
		fmt.Fprintf(&sum, ": %d discarded", acted)
	}
	fmt.Fprintf(&sum, ", %d not selected; %d read from %s", left, read, b.describe())
	switch {
	case runErr != nil:
		sum.WriteString("; stopped by the error below")
	case acted+copies == limit:
		sum.WriteString("; --limit reached, more may follow")
	case read == scan:
		sum.WriteString("; --scan reached, more may follow")
	}
	fprintln(w, sum.String())
	if runErr == nil && skipped > 0 {
		return errFailed
	}
	return runErr
}

// line is the letter on one line.
func (d *deadLetter) line() string {
	var b strings.Builder
	b.WriteString(d.pos)
	if d.id != "" {
		b.WriteString("  id=" + d.id)
	}
	if d.msgID != "" && d.msgID != d.id {
		b.WriteString("  message-id=" + d.msgID)
	}
	b.WriteString("  reason=" + orDash(d.reason) + "  source=" + orDash(d.source))
	if d.attempts != "" {
		b.WriteString("  attempts=" + d.attempts)
	}
	if !d.at.IsZero() {
		b.WriteString("  at=" + timeText(d.at))
	}
	return b.String()
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func timeText(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	return t.UTC().Format(time.RFC3339)
}

// cut quotes s, cut to n bytes on a rune boundary.
func cut(s string, n int) string {
	if s == "" {
		return "-"
	}
	if len(s) > n {
		for n > 0 && !utf8RuneStart(s[n]) {
			n--
		}
		return fmt.Sprintf("%q...", s[:n])
	}
	return fmt.Sprintf("%q", s)
}

func utf8RuneStart(b byte) bool { return b&0xC0 != 0x80 }
