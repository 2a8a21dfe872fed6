package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"strings"
	"testing"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// TestReadme runs every `go run ./examples/gorm-mysql` command of README.md
// with its flags, pointed at the test database and at tables of its own
// (-mysql, -prefix and -keep added last), and checks what it printed and
// what it wrote: every order once, every second delivery dropped.
func TestReadme(t *testing.T) {
	db := testenv.MySQL(t, "") // skips, or fails under CI=true, when MariaDB is down
	dsn := testenv.MySQLDSN()
	if !strings.Contains(dsn, "parseTime=") {
		dsn += map[bool]string{true: "&", false: "?"}[strings.Contains(dsn, "?")] + "parseTime=true"
	}
	cmds := readmeCommands(t, "README.md", "go run ./examples/gorm-mysql")
	if len(cmds) < 2 {
		t.Fatalf("README.md shows %d commands running the example, want 2 (local and -mysql)", len(cmds))
	}
	for i, args := range cmds {
		t.Run(fmt.Sprint(i), func(t *testing.T) {
			prefix := testenv.Name("idemtest_gorm")
			t.Cleanup(func() {
				_, _ = db.Exec("DROP TABLE IF EXISTS `" + prefix + "_orders`, `" + prefix + "_processed`, `" + prefix + "_processed_migrations`")
			})
			var out bytes.Buffer
			err := run(context.Background(), append(args, "-mysql", dsn, "-prefix", prefix, "-keep"), &out)
			t.Logf("output:\n%s", out.String())
			if err != nil {
				t.Fatal(err)
			}
			n := intFlag(t, args, "-orders", 20)
			// A deadlock or lock timeout under load is retried too, so the
			// redelivery count is at least the one failure the example makes.
			want := fmt.Sprintf("%d deliveries of %d orders: %d applied, %d duplicates dropped, ", 2*n, n, n, n)
			if !strings.Contains(out.String(), want) {
				t.Errorf("output lacks %q", want)
			}
			failing := fmt.Sprintf("order-%03d: payment service timed out (after the order row was written): not acknowledged, delivered again", n/2)
			if !strings.Contains(out.String(), failing) {
				t.Errorf("output lacks %q", failing)
			}
			if want := fmt.Sprintf("every order written exactly once (%d of %d)", n, n); !strings.Contains(out.String(), want) {
				t.Errorf("output lacks %q", want)
			}
			// The oracle, read on its own: rows per order id.
			var orders, rows, claims int
			if err := db.QueryRow("SELECT COUNT(DISTINCT order_id), COUNT(*) FROM `"+prefix+"_orders`").Scan(&orders, &rows); err != nil {
				t.Fatal(err)
			}
			if err := db.QueryRow("SELECT COUNT(*) FROM `" + prefix + "_processed`").Scan(&claims); err != nil {
				t.Fatal(err)
			}
			if orders != n || rows != n || claims != n {
				t.Errorf("%d orders in %d rows with %d claims, want %d of each", orders, rows, claims, n)
			}
		})
	}
}

// TestUnreachable checks that a database that cannot be reached is an error
// that says so.
func TestUnreachable(t *testing.T) {
	err := run(context.Background(), []string{"-mysql", "root@tcp(" + testenv.DeadAddr(t) + ")/test"}, &bytes.Buffer{})
	if err == nil || !strings.Contains(err.Error(), "is unreachable") {
		t.Errorf("run against a closed port: %v, want an error saying it is unreachable", err)
	}
}

// readmeCommands returns the arguments of each line of file that starts
// with prefix, split as a POSIX shell would split single-quoted words.
func readmeCommands(t *testing.T, file, prefix string) [][]string {
	t.Helper()
	b, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var cmds [][]string
	for line := range strings.Lines(string(b)) {
		line = strings.TrimSpace(line)
		if rest, ok := strings.CutPrefix(line, prefix); ok {
			cmds = append(cmds, shellWords(t, rest))
		}
	}
	return cmds
}

func shellWords(t *testing.T, s string) []string {
	t.Helper()
	var words []string
	var w strings.Builder
	inWord, quoted := false, false
	for _, r := range s {
		switch {
		case quoted && r == '\'':
			quoted = false
		case quoted:
			w.WriteRune(r)
		case r == '\'':
			quoted, inWord = true, true
		case r == ' ' || r == '\t':
			if inWord {
				words = append(words, w.String())
				w.Reset()
				inWord = false
			}
		default:
			w.WriteRune(r)
			inWord = true
		}
	}
	if quoted {
		t.Fatalf("unterminated quote in %q", s)
	}
	if inWord {
		words = append(words, w.String())
	}
	return words
}

func intFlag(t *testing.T, args []string, name string, def int) int {
	t.Helper()
	for i, a := range args {
		if a == name && i+1 < len(args) {
			var v int
			if _, err := fmt.Sscan(args[i+1], &v); err != nil {
				t.Fatalf("%s %s: %v", name, args[i+1], err)
			}
			return v
		}
	}
	return def
}
