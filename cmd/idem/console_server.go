package main

import (
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"embed"
	"encoding/hex"
	"fmt"
	"html/template"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// The console's pages are html/template templates embedded in the binary:
// layout.html around each page. They work as plain HTML forms, with no
// script.
//
//go:embed console
var consoleFS embed.FS

// The cookies the console sets: the session of a logged-in browser (a MAC
// of the token, never the token) and the nonce its CSRF tokens are bound
// to.
const (
	consoleSessionCookie = "idem_console_session"
	consoleCSRFCookie    = "idem_console_csrf"
	consoleCSRFField     = "csrf"
)

// consoleCSP allows the console's own stylesheet and forms, and nothing
// else: no script, no frame, no form posting elsewhere.
const consoleCSP = "default-src 'none'; style-src 'self'; img-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"

// console is the console's HTTP handler.
type console struct {
	cfg    *consoleConfig
	src    *consoleSources
	secret []byte // per process: the key of the session and CSRF MACs
	pages  map[string]*template.Template
	mux    *http.ServeMux
}

func newConsole(cfg *consoleConfig, src *consoleSources) (*console, error) {
	c := &console{cfg: cfg, src: src, secret: make([]byte, 32), pages: map[string]*template.Template{}, mux: http.NewServeMux()}
	if _, err := rand.Read(c.secret); err != nil {
		return nil, err
	}
	names, err := fs.Glob(consoleFS, "console/*.html")
	if err != nil {
		return nil, err
	}
	for _, n := range names {
		name := strings.TrimSuffix(strings.TrimPrefix(n, "console/"), ".html")
		if name == "layout" {
			continue
		}
		t, err := template.New(name).Funcs(consoleFuncs).ParseFS(consoleFS, "console/layout.html", n)
		if err != nil {
			return nil, fmt.Errorf("console template %s: %w", n, err)
		}
		c.pages[name] = t
	}
	c.routes()
	return c, nil
}

// ServeHTTP checks every request before its page sees it: the Host (a
// console without a token answers only to a loopback name, against DNS
// rebinding), the token, and for a POST the origin and the CSRF token.
func (c *console) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	h := w.Header()
	h.Set("Content-Security-Policy", consoleCSP)
	h.Set("X-Frame-Options", "DENY")
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "same-origin")
	h.Set("Cache-Control", "no-store")
	if c.cfg.token == "" && !loopbackRequestHost(r.Host) {
		http.Error(w, "this console answers only to a loopback host name (127.0.0.1, localhost): give it --token to serve other names", http.StatusMisdirectedRequest)
		return
	}
	if r.Method == http.MethodPost {
		r.Body = http.MaxBytesReader(w, r.Body, 1<<20)
		if !sameOrigin(r) {
			http.Error(w, "cross-site request refused: the console acts only on forms of its own pages", http.StatusForbidden)
			return
		}
	}
	if r.URL.Path == "/login" {
		c.login(w, r)
		return
	}
	if r.URL.Path == "/console.css" {
		c.mux.ServeHTTP(w, r)
		return
	}
	if !c.authorized(r) {
		c.renderStatus(w, r, http.StatusUnauthorized, "login", "Log in", loginData{Next: r.URL.RequestURI()})
		return
	}
	if r.Method == http.MethodPost && !c.validCSRF(r) {
		http.Error(w, "missing or invalid CSRF token: reload the page and submit its form again", http.StatusForbidden)
		return
	}
	c.mux.ServeHTTP(w, r)
}

// mac is the hex HMAC-SHA256 of the process secret over parts.
func (c *console) mac(parts ...string) string {
	m := hmac.New(sha256.New, c.secret)
	for _, p := range parts {
		m.Write([]byte(p))
		m.Write([]byte{0})
	}
	return hex.EncodeToString(m.Sum(nil))
}

func equalStrings(a, b string) bool {
	return len(a) == len(b) && subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1
}

// authorized reports whether r carries the token: none is needed without
// one; else a Bearer header or the session cookie the login set.
func (c *console) authorized(r *http.Request) bool {
	if c.cfg.token == "" {
		return true
	}
	if b, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok && equalStrings(b, c.cfg.token) {
		return true
	}
	ck, err := r.Cookie(consoleSessionCookie)
	if err != nil {
		return false
	}
	issued, mac, ok := strings.Cut(ck.Value, ".")
	if !ok || !equalStrings(mac, c.mac("session", c.cfg.token, issued)) {
		return false
	}
	at, err := strconv.ParseInt(issued, 10, 64)
	return err == nil && time.Since(time.Unix(at, 0)) < consoleSessionTTL
}

// consoleSessionTTL is how long a login lasts. The session cookie holds
// the time of the login and a MAC of it and the token, so a copied cookie
// is refused once this has passed, whatever its browser does.
const consoleSessionTTL = 12 * time.Hour

// session returns a session cookie's value for a login now.
func (c *console) session() string {
	issued := strconv.FormatInt(time.Now().Unix(), 10)
	return issued + "." + c.mac("session", c.cfg.token, issued)
}

type loginData struct {
	Next   string
	Failed bool
}

// login shows the login form (GET) or checks the token it posts and sets
// the session cookie.
func (c *console) login(w http.ResponseWriter, r *http.Request) {
	next := localPath(r.FormValue("next"))
	if c.cfg.token == "" {
		http.Redirect(w, r, next, http.StatusSeeOther)
		return
	}
	if r.Method != http.MethodPost {
		c.render(w, r, "login", "Log in", loginData{Next: next})
		return
	}
	if !equalStrings(r.PostFormValue("token"), c.cfg.token) {
		c.renderStatus(w, r, http.StatusUnauthorized, "login", "Log in", loginData{Next: next, Failed: true})
		return
	}
	http.SetCookie(w, &http.Cookie{Name: consoleSessionCookie, Value: c.session(), Path: "/",
		HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil, MaxAge: int(consoleSessionTTL.Seconds())})
	http.Redirect(w, r, next, http.StatusSeeOther)
}

// localPath returns next when it is a path on this console, else "/": a
// login never sends the browser to another site. Browsers read a
// backslash as a slash, so "/\\evil.example" would leave the site too.
func localPath(next string) string {
	u, err := url.Parse(next)
	if next == "" || err != nil || u.Host != "" || u.Scheme != "" || !strings.HasPrefix(next, "/") ||
		strings.HasPrefix(next, "//") || strings.ContainsAny(next, "\\\r\n\t") {
		return "/"
	}
	return next
}

// csrfToken returns the CSRF token of r's browser, setting the nonce
// cookie it is bound to when the browser has none.
func (c *console) csrfToken(w http.ResponseWriter, r *http.Request) string {
	nonce := ""
	if ck, err := r.Cookie(consoleCSRFCookie); err == nil && len(ck.Value) == 32 {
		nonce = ck.Value
	} else {
		var b [16]byte
		_, _ = rand.Read(b[:])
		nonce = hex.EncodeToString(b[:])
		http.SetCookie(w, &http.Cookie{Name: consoleCSRFCookie, Value: nonce, Path: "/",
			HttpOnly: true, SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil})
		// The request renders with the nonce it just got.
		r.AddCookie(&http.Cookie{Name: consoleCSRFCookie, Value: nonce})
	}
	return c.mac("csrf", nonce)
}

// validCSRF checks the form's CSRF token against the browser's nonce.
func (c *console) validCSRF(r *http.Request) bool {
	ck, err := r.Cookie(consoleCSRFCookie)
	if err != nil || ck.Value == "" {
		return false
	}
	return equalStrings(r.PostFormValue(consoleCSRFField), c.mac("csrf", ck.Value))
}

// sameOrigin reports whether a POST comes from a page of this console: its
// Origin (or, when a browser sends none, its Referer) names this host, and
// the browser does not call it cross-site.
func sameOrigin(r *http.Request) bool {
	if s := r.Header.Get("Sec-Fetch-Site"); s != "" && s != "same-origin" && s != "none" {
		return false
	}
	from := r.Header.Get("Origin")
	if from == "" {
		from = r.Header.Get("Referer")
	}
	if from == "" {
		return false
	}
	u, err := url.Parse(from)
	return err == nil && (u.Scheme == "http" || u.Scheme == "https") && u.Host == r.Host
}

// loopbackRequestHost reports whether a request's Host names a loopback
// address or localhost.
func loopbackRequestHost(hostport string) bool {
	host, _, err := net.SplitHostPort(hostport)
	if err != nil {
		host = hostport
	}
	return loopbackHost(strings.Trim(host, "[]"))
}
