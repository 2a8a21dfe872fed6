package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/chromedp/cdproto/network"
	"github.com/chromedp/chromedp"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// chromiumPath finds the Chromium the browser tests drive: IDEM_CHROMIUM,
// else Debian's /usr/bin/chromium (scripts/services.sh installs it), else
// chromium or chromium-browser on the PATH.
func chromiumPath() string {
	if p := os.Getenv("IDEM_CHROMIUM"); p != "" {
		return p
	}
	if _, err := os.Stat("/usr/bin/chromium"); err == nil {
		return "/usr/bin/chromium"
	}
	for _, n := range []string{"chromium", "chromium-browser"} {
		if p, err := exec.LookPath(n); err == nil {
			return p
		}
	}
	return ""
}

// browser is a headless Chromium tab, with a fresh profile, for one test.
type browser struct {
	t   *testing.T
	ctx context.Context
}

// newBrowser starts headless Chromium. Without one the test skips, or
// fails under CI=true.
func newBrowser(t *testing.T) *browser {
	t.Helper()
	path := chromiumPath()
	if path == "" {
		testenv.Unavailable(t, "Chromium is not installed: the console's browser tests drive headless Chromium (apt-get install chromium, or scripts/services.sh up; IDEM_CHROMIUM names another binary)")
		return nil
	}
	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(),
		chromedp.ExecPath(path),
		chromedp.Flag("headless", true),
		chromedp.NoSandbox,
		chromedp.DisableGPU,
		chromedp.Flag("disable-quic", true),
		chromedp.NoFirstRun,
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("disable-sync", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1200, 800),
	)
	ctx, cancel := chromedp.NewContext(alloc)
	t.Cleanup(func() {
		cancel()
		cancelAlloc()
	})
	// The first call starts the browser, with the context's lifetime.
	if err := chromedp.Do(ctx, chromedp.EmulateViewport(1200, 800)); err != nil {
		t.Fatalf("start Chromium (%s): %v", path, err)
	}
	return &browser{t: t, ctx: ctx}
}

// limit bounds one step: a page that never comes fails the test instead of
// hanging it.
func (b *browser) limit() (context.Context, context.CancelFunc) {
	return context.WithTimeout(b.ctx, 60*time.Second)
}

// do runs steps.
func (b *browser) do(steps ...chromedp.Action[chromedp.Void]) {
	b.t.Helper()
	ctx, cancel := b.limit()
	defer cancel()
	if err := chromedp.Do(ctx, steps...); err != nil {
		b.t.Fatal(err)
	}
}

// load runs steps that load a page and returns its response.
func (b *browser) load(steps ...chromedp.Action[chromedp.Void]) *network.Response {
	b.t.Helper()
	ctx, cancel := b.limit()
	defer cancel()
	res, err := chromedp.RunResponse(ctx, steps...)
	if err != nil {
		b.t.Fatal(err)
	}
	return res
}

// open loads u and fails unless it answers 200.
func (b *browser) open(u string) {
	b.t.Helper()
	if res := b.load(chromedp.Navigate(u)); res.Status != 200 {
		b.t.Fatalf("GET %s: %d", u, res.Status)
	}
}

// submit clicks the button sel, which submits a form, and fails unless the
// page it loads answers 200.
func (b *browser) submit(sel string) {
	b.t.Helper()
	if res := b.load(chromedp.Click(chromedp.CSS(sel))); res.Status != 200 {
		b.t.Fatalf("submit %s: %d %s\n%s", sel, res.Status, res.URL, b.text("body"))
	}
}

// text returns the text of the element sel.
func (b *browser) text(sel string) string {
	b.t.Helper()
	ctx, cancel := b.limit()
	defer cancel()
	s, err := chromedp.Run(ctx, chromedp.Text(chromedp.CSS(sel)))
	if err != nil {
		b.t.Fatalf("text of %s: %v", sel, err)
	}
	return strings.TrimSpace(s)
}

// screenshot takes a full-page PNG of the page and, when
// IDEM_CONSOLE_SCREENSHOTS names a directory, writes it there as
// console-<name>.png.
func (b *browser) screenshot(name string) {
	b.t.Helper()
	ctx, cancel := b.limit()
	defer cancel()
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		b.t.Fatalf("screenshot %s: %v", name, err)
	}
	if len(png) < 8 || string(png[1:4]) != "PNG" {
		b.t.Fatalf("screenshot %s: not a PNG", name)
	}
	if dir := os.Getenv("IDEM_CONSOLE_SCREENSHOTS"); dir != "" {
		if err := os.WriteFile(filepath.Join(dir, "console-"+name+".png"), png, 0o644); err != nil {
			b.t.Fatal(err)
		}
	}
}

// chromedpClick clicks the element sel.
func chromedpClick(sel string) chromedp.Action[chromedp.Void] {
	return chromedp.Click(chromedp.CSS(sel))
}
