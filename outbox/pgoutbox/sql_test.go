package pgoutbox

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The poll relay's SQL floor (test/bench/testdata/relay/claim.sql) sends
// the relay's own statements: its claim, its mark and its delete on
// relay_floor.outbox, their parameters bound from the script's variables.
func TestFloorScriptSendsRelayStatements(t *testing.T) {
	b, err := os.ReadFile(filepath.Join("..", "..", "test", "bench", "testdata", "relay", "claim.sql"))
	if err != nil {
		t.Fatal(err)
	}
	script := string(b)
	s := buildStatements("relay_floor.outbox")
	claimArgs := strings.NewReplacer("$1", ":shards", "$2", ":owned", "$3", ":window", "$4", ":perkey", "$5", ":batch")
	seqs := strings.NewReplacer("$1", ":seqs")
	for name, want := range map[string]string{
		"claim":  claimArgs.Replace(s.claim),
		"mark":   seqs.Replace(s.markPublished),
		"delete": seqs.Replace(s.markDelete),
	} {
		if !strings.Contains(script, strings.TrimSpace(want)) {
			t.Errorf("claim.sql does not send the relay's %s statement:\n%s", name, strings.TrimSpace(want))
		}
	}
}
