package main

import (
	"context"
	"flag"
	"html"
	"io"
	"net/http"
	"net/http/cookiejar"
	"net/http/httptest"
	"net/url"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// startConsole serves the console's handler, configured by args as "idem
// console" takes them, on a loopback httptest server.
func startConsole(t *testing.T, args ...string) *httptest.Server {
	t.Helper()
	fs := flag.NewFlagSet("console", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	var cfg consoleConfig
	cfg.register(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	if err := cfg.check(); err != nil {
		t.Fatal(err)
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	src, err := openConsoleSources(context.Background(), &cfg, set)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(src.close)
	h, err := newConsole(&cfg, src)
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv
}

// consoleClient is an HTTP client with a cookie jar, as a browser keeps.
func consoleClient(t *testing.T) *http.Client {
	t.Helper()
	jar, err := cookiejar.New(nil)
	if err != nil {
		t.Fatal(err)
	}
	return &http.Client{Jar: jar, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
}

// do sends a request and returns its status and body.
func do(t *testing.T, c *http.Client, method, u string, form url.Values, header map[string]string) (int, http.Header, string) {
	t.Helper()
	var body io.Reader
	if form != nil {
		body = strings.NewReader(form.Encode())
	}
	req, err := http.NewRequest(method, u, body)
	if err != nil {
		t.Fatal(err)
	}
	if form != nil {
		req.Header.Set("Content-Type", "application/x-www-form-urlencoded")
	}
	for k, v := range header {
		if k == "Host" {
			req.Host = v
			continue
		}
		req.Header.Set(k, v)
	}
	res, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = res.Body.Close() }()
	b, err := io.ReadAll(res.Body)
	if err != nil {
		t.Fatal(err)
	}
	return res.StatusCode, res.Header, string(b)
}

var csrfField = regexp.MustCompile(`name="csrf" value="([0-9a-f]+)"`)

// TestConsoleSecurity: a console with a token refuses every request
// without it (401), takes it as a Bearer header or from the cookie its
// login form sets (HttpOnly, SameSite=Strict), and refuses a POST from
// another origin or without a valid CSRF token (403); a console without a
// token answers only to a loopback Host; "idem console" refuses to listen
// on a non-loopback address without a token.
func TestConsoleSecurity(t *testing.T) {
	const token = "console-token-0123456789"
	srv := startConsole(t, "--token", token, "--listen", "0.0.0.0:0")
	c := consoleClient(t)
	bearer := map[string]string{"Authorization": "Bearer " + token}

	status, h, body := do(t, c, "GET", srv.URL+"/outbox", nil, nil)
	if status != http.StatusUnauthorized || !strings.Contains(body, `name="token"`) {
		t.Fatalf("GET without the token: %d, want 401 and the login form:\n%s", status, body)
	}
	for name, want := range map[string]string{"X-Frame-Options": "DENY", "Cache-Control": "no-store", "X-Content-Type-Options": "nosniff"} {
		if got := h.Get(name); got != want {
			t.Errorf("%s: %q, want %q", name, got, want)
		}
	}
	if csp := h.Get("Content-Security-Policy"); !strings.Contains(csp, "default-src 'none'") || !strings.Contains(csp, "frame-ancestors 'none'") {
		t.Errorf("Content-Security-Policy: %q", csp)
	}
	if status, _, _ := do(t, c, "GET", srv.URL+"/outbox", nil, map[string]string{"Authorization": "Bearer wrong-token-0123456789"}); status != http.StatusUnauthorized {
		t.Errorf("GET with a wrong token: %d, want 401", status)
	}
	same := map[string]string{"Origin": srv.URL}
	if status, _, _ := do(t, c, "POST", srv.URL+"/outbox/requeue", url.Values{"id": {"x"}}, same); status != http.StatusUnauthorized {
		t.Errorf("POST without the token: %d, want 401", status)
	}

	status, _, body = do(t, c, "GET", srv.URL+"/outbox", nil, bearer)
	if status != http.StatusOK || !strings.Contains(body, "No outbox is configured") {
		t.Fatalf("GET with the Bearer token: %d\n%s", status, body)
	}
	// The login form: a wrong token is refused, the right one sets the
	// session cookie.
	if status, _, _ := do(t, c, "POST", srv.URL+"/login", url.Values{"token": {"nope"}, "next": {"/dedup"}}, same); status != http.StatusUnauthorized {
		t.Errorf("login with a wrong token: %d, want 401", status)
	}
	status, h, _ = do(t, c, "POST", srv.URL+"/login", url.Values{"token": {token}, "next": {"https://evil.example/"}}, same)
	if status != http.StatusSeeOther || h.Get("Location") != "/" {
		t.Errorf("login: %d to %q, want 303 to / (never to another site)", status, h.Get("Location"))
	}
	for _, next := range []string{"//evil.example/", "/\\evil.example/", "/\\/evil.example/", "javascript:alert(1)", "\\\\evil.example"} {
		if status, h, _ := do(t, c, "POST", srv.URL+"/login", url.Values{"token": {token}, "next": {next}}, same); status != http.StatusSeeOther || h.Get("Location") != "/" {
			t.Errorf("login with next %q: %d to %q, want 303 to / (never to another site)", next, status, h.Get("Location"))
		}
	}
	ck := h.Get("Set-Cookie")
	if !strings.Contains(ck, consoleSessionCookie+"=") || !strings.Contains(ck, "HttpOnly") || !strings.Contains(ck, "SameSite=Strict") || strings.Contains(ck, token) {
		t.Errorf("session cookie: %q, want HttpOnly, SameSite=Strict, without the token", ck)
	}
	status, _, body = do(t, c, "GET", srv.URL+"/dedup", nil, nil)
	if status != http.StatusOK {
		t.Fatalf("GET with the session cookie: %d", status)
	}
	m := csrfField.FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("no CSRF token on the page (its log-out form):\n%s", body)
	}
	csrf := m[1]

	// An action: refused from another origin, without an origin, or
	// without a valid CSRF token; let through with both.
	for _, tc := range []struct {
		name   string
		header map[string]string
		form   url.Values
		want   int
	}{
		{"another origin", map[string]string{"Origin": "http://evil.example"}, url.Values{"csrf": {csrf}, "id": {"x"}}, http.StatusForbidden},
		{"origin null", map[string]string{"Origin": "null"}, url.Values{"csrf": {csrf}, "id": {"x"}}, http.StatusForbidden},
		{"no origin or referer", nil, url.Values{"csrf": {csrf}, "id": {"x"}}, http.StatusForbidden},
		{"another site's referer", map[string]string{"Referer": "http://evil.example/page"}, url.Values{"csrf": {csrf}, "id": {"x"}}, http.StatusForbidden},
		{"cross-site fetch", map[string]string{"Origin": srv.URL, "Sec-Fetch-Site": "cross-site"}, url.Values{"csrf": {csrf}, "id": {"x"}}, http.StatusForbidden},
		{"no CSRF token", same, url.Values{"id": {"x"}}, http.StatusForbidden},
		{"a forged CSRF token", same, url.Values{"csrf": {strings.Repeat("0", 64)}, "id": {"x"}}, http.StatusForbidden},
		// Through the checks: the outbox is not configured.
		{"same origin with the CSRF token", same, url.Values{"csrf": {csrf}, "id": {"x"}}, http.StatusNotFound},
		{"own referer with the CSRF token", map[string]string{"Referer": srv.URL + "/outbox"}, url.Values{"csrf": {csrf}, "id": {"x"}}, http.StatusNotFound},
	} {
		if status, _, body := do(t, c, "POST", srv.URL+"/outbox/requeue", tc.form, tc.header); status != tc.want {
			t.Errorf("POST, %s: %d, want %d\n%s", tc.name, status, tc.want, body)
		}
	}
	// The CSRF token is bound to the browser's nonce: another browser
	// (another cookie jar), logged in, cannot use it.
	other := consoleClient(t)
	if status, _, _ := do(t, other, "POST", srv.URL+"/outbox/requeue", url.Values{"csrf": {csrf}, "id": {"x"}}, map[string]string{"Origin": srv.URL, "Authorization": "Bearer " + token}); status != http.StatusForbidden {
		t.Errorf("POST with another browser's CSRF token: %d, want 403", status)
	}

	// Without a token the console answers only to loopback names.
	local := startConsole(t)
	if status, _, _ := do(t, consoleClient(t), "GET", local.URL+"/", nil, nil); status != http.StatusOK {
		t.Errorf("GET of a console without a token: %d, want 200", status)
	}
	if status, _, _ := do(t, consoleClient(t), "GET", local.URL+"/", nil, map[string]string{"Host": "attacker.example"}); status != http.StatusMisdirectedRequest {
		t.Errorf("GET with a foreign Host (DNS rebinding): %d, want 421", status)
	}

	code, _, errOut := runCmd(context.Background(), t, "console", "--listen", "0.0.0.0:0")
	if code != 2 || !strings.Contains(errOut, "--token") {
		t.Errorf("idem console --listen 0.0.0.0:0 without a token: exit %d, want 2 with a word on --token\n%s", code, errOut)
	}
}

// TestConsoleWatermillDiscard: the console lists the poison queue of a
// Watermill router on watermill-sql by reason, and a discard of one letter
// (its form's POST, then the confirmation's) deletes that letter only.
func TestConsoleWatermillDiscard(t *testing.T) {
	r := newWMRig(t)
	r.publish(t, r.poison, r.letter("wm-a", "bad-a"), r.letter("wm-b", "bad-b"))
	srv := startConsole(t, "--watermill-sql", r.poison, "--postgres", testenv.PostgresURL(), "--schema", r.schema)
	c := consoleClient(t)
	status, _, body := do(t, c, "GET", srv.URL+"/deadletters?dest=watermill-sql", nil, nil)
	if status != http.StatusOK || !strings.Contains(body, "2 dead letters") || !strings.Contains(body, "cannot parse bad-a") {
		t.Fatalf("dead-letter page: %d\n%s", status, body)
	}
	m := csrfField.FindStringSubmatch(body)
	if m == nil {
		t.Fatalf("no CSRF token on the page:\n%s", body)
	}
	form := url.Values{"csrf": {m[1]}, "dest": {"watermill-sql"}, "action": {"discard"}, "id": {"wm-a"}}
	origin := map[string]string{"Origin": srv.URL}
	status, _, body = do(t, c, "POST", srv.URL+"/deadletters/act", form, origin)
	if status != http.StatusOK || !strings.Contains(body, "would discard 1") {
		t.Fatalf("discard, first POST: %d, want the confirmation of a dry run\n%s", status, body)
	}
	if n := r.letters(t); n != 2 {
		t.Fatalf("%d letters before the confirmation, want 2", n)
	}
	form.Set("confirm", "yes")
	status, _, body = do(t, c, "POST", srv.URL+"/deadletters/act", form, origin)
	if status != http.StatusOK || !strings.Contains(body, ": 1 discarded") {
		t.Fatalf("discard, confirmed: %d\n%s", status, body)
	}
	if rows := r.rows(t, r.poison); len(rows) != 1 || rows["wm-b"] != 1 {
		t.Errorf("letters after the discard: %v, want wm-b only", rows)
	}

	// The confirmation acts on the letters the dry run showed: a letter
	// of the same reason parked in between is left alone.
	form = url.Values{"csrf": {m[1]}, "dest": {"watermill-sql"}, "action": {"discard"}, "reason": {"permanent"}}
	status, _, body = do(t, c, "POST", srv.URL+"/deadletters/act", form, origin)
	if status != http.StatusOK || !strings.Contains(body, "would discard 1") {
		t.Fatalf("discard by reason, first POST: %d, want the confirmation of a dry run of wm-b\n%s", status, body)
	}
	confirm := url.Values{}
	for _, f := range hiddenField.FindAllStringSubmatch(body, -1) {
		confirm.Add(f[1], html.UnescapeString(f[2]))
	}
	r.publish(t, r.poison, r.letter("wm-c", "bad-c"))
	status, _, body = do(t, c, "POST", srv.URL+"/deadletters/act", confirm, origin)
	if status != http.StatusOK || !strings.Contains(body, ": 1 discarded") {
		t.Fatalf("discard by reason, confirmed with %v: %d\n%s", confirm, status, body)
	}
	if rows := r.rows(t, r.poison); len(rows) != 1 || rows["wm-c"] != 1 {
		t.Errorf("letters after the confirmed discard: %v, want wm-c only (parked after the dry run)", rows)
	}
}

// hiddenField is a hidden input of a page's form.
var hiddenField = regexp.MustCompile(`<input type="hidden" name="([a-z]+)" value="([^"]*)">`)

// A login lasts consoleSessionTTL: a session cookie older than that, or
// whose time was changed, is refused like no cookie.
func TestConsoleSessionExpires(t *testing.T) {
	const token = "0123456789abcdef-token"
	c, err := newConsole(&consoleConfig{token: token}, &consoleSources{})
	if err != nil {
		t.Fatal(err)
	}
	with := func(value string) bool {
		r := httptest.NewRequest(http.MethodGet, "/", nil)
		r.AddCookie(&http.Cookie{Name: consoleSessionCookie, Value: value})
		return c.authorized(r)
	}
	if !with(c.session()) {
		t.Fatal("a fresh session is refused")
	}
	old := strconv.FormatInt(time.Now().Add(-consoleSessionTTL-time.Minute).Unix(), 10)
	if with(old + "." + c.mac("session", token, old)) {
		t.Error("a session older than its TTL is accepted")
	}
	fresh := strconv.FormatInt(time.Now().Unix(), 10)
	if with(fresh + "." + c.mac("session", token, old)) {
		t.Error("a session whose time was moved forward is accepted")
	}
	if with(c.mac("session", token)) {
		t.Error("a session without its time is accepted")
	}
}
