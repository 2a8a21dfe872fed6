package telemetry_test

import (
	"os"
	"strings"
	"testing"

	"github.com/idemkit/idem/internal/telemetry"
)

// README's "Operating idem" section lists every metric idem declares.
func TestReadmeListsEveryMetric(t *testing.T) {
	b, err := os.ReadFile("../../README.md")
	if err != nil {
		t.Fatal(err)
	}
	readme := string(b)
	start := strings.Index(readme, "## Operating idem")
	if start < 0 {
		t.Fatal(`README has no "## Operating idem" section`)
	}
	section := readme[start:]
	if end := strings.Index(section[3:], "\n## "); end >= 0 {
		section = section[:end+3]
	}
	for _, m := range telemetry.Metrics {
		if !strings.Contains(section, "`"+m+"`") {
			t.Errorf("README's Operating idem section does not list %s", m)
		}
	}
}

func TestStoreName(t *testing.T) {
	type local struct{}
	if got := telemetry.StoreName(&local{}); got != "telemetry_test" {
		t.Errorf("StoreName(local) = %q", got)
	}
	if got := telemetry.StoreName(nil); got != "custom" {
		t.Errorf("StoreName(nil) = %q", got)
	}
}
