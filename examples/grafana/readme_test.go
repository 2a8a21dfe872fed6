package grafana_test

import (
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// TestReadmeLinksResolve: every relative link of this README names a file
// that exists and, with a #fragment, a heading of that Markdown file.
func TestReadmeLinksResolve(t *testing.T) {
	b, err := os.ReadFile("README.md")
	if err != nil {
		t.Fatal(err)
	}
	links := regexp.MustCompile(`\]\(([^)\s]+)\)`).FindAllStringSubmatch(string(b), -1)
	if len(links) == 0 {
		t.Fatal("the README has no link")
	}
	for _, l := range links {
		target := l[1]
		if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
			continue
		}
		path, fragment, _ := strings.Cut(target, "#")
		if path == "" {
			path = "README.md"
		}
		doc, err := os.ReadFile(filepath.FromSlash(path))
		if err != nil {
			t.Errorf("link %s: %v", target, err)
			continue
		}
		if fragment != "" && !hasAnchor(string(doc), fragment) {
			t.Errorf("link %s: %s has no heading with the anchor #%s", target, path, fragment)
		}
	}
}

// hasAnchor reports whether the Markdown doc has a heading whose GitHub
// anchor is fragment: lowercased, spaces to hyphens, punctuation other than
// hyphens and underscores dropped.
func hasAnchor(doc, fragment string) bool {
	for _, line := range strings.Split(doc, "\n") {
		if !strings.HasPrefix(line, "#") {
			continue
		}
		title := strings.TrimSpace(strings.TrimLeft(line, "#"))
		var a strings.Builder
		for _, r := range strings.ToLower(title) {
			switch {
			case r == ' ':
				a.WriteRune('-')
			case r == '-' || r == '_' || r >= 'a' && r <= 'z' || r >= '0' && r <= '9':
				a.WriteRune(r)
			}
		}
		if a.String() == fragment {
			return true
		}
	}
	return false
}
