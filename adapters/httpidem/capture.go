package httpidem

import (
	"errors"
	"fmt"
	"net/http"
	"strconv"
)

// ErrResponseTooLarge is returned by the ResponseWriter the handler gets when
// the response grows past Options.MaxResponseBytes. See Options for what
// happens to such a response.
var ErrResponseTooLarge = errors.New("httpidem: response larger than Options.MaxResponseBytes")

// capture is the ResponseWriter the handler writes to: it buffers the whole
// response, so that nothing reaches the client before the response is
// stored (lease stores) or committed with the handler's writes
// (transactional stores). It supports neither Flush nor Hijack, on purpose.
type capture struct {
	header   http.Header
	sent     http.Header // the header as it was at WriteHeader
	status   int
	body     []byte
	max      int
	tooLarge bool
}

func newCapture(maxBytes int) *capture {
	return &capture{header: make(http.Header), max: maxBytes}
}

func (c *capture) Header() http.Header { return c.header }

func (c *capture) WriteHeader(code int) {
	if code < 100 || code > 999 {
		panic(fmt.Sprintf("invalid WriteHeader code %v", code))
	}
	if c.status != 0 || code < 200 {
		return // superfluous, or informational (not buffered)
	}
	c.status = code
	c.sent = c.header.Clone()
}

func (c *capture) Write(p []byte) (int, error) {
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	if c.tooLarge {
		return 0, ErrResponseTooLarge
	}
	if len(c.body)+len(p) > c.max {
		c.tooLarge = true
		c.body = nil
		return 0, ErrResponseTooLarge
	}
	c.body = append(c.body, p...)
	return len(p), nil
}

func (c *capture) WriteString(s string) (int, error) {
	if c.status == 0 {
		c.WriteHeader(http.StatusOK)
	}
	if c.tooLarge {
		return 0, ErrResponseTooLarge
	}
	if len(c.body)+len(s) > c.max {
		c.tooLarge = true
		c.body = nil
		return 0, ErrResponseTooLarge
	}
	c.body = append(c.body, s...)
	return len(s), nil
}

// final returns the status and header of the response as the client gets
// it: a handler that wrote nothing answered 200 with its current header.
func (c *capture) final() (int, http.Header) {
	if c.status == 0 {
		return http.StatusOK, c.header
	}
	return c.status, c.sent
}

// send writes the buffered response to w.
func (c *capture) send(w http.ResponseWriter) {
	status, h := c.final()
	dst := w.Header()
	for k, v := range h {
		dst[k] = v
	}
	if bodyAllowed(status) && dst.Get("Content-Length") == "" {
		dst.Set("Content-Length", strconv.Itoa(len(c.body)))
	}
	w.WriteHeader(status)
	if len(c.body) > 0 && bodyAllowed(status) {
		_, _ = w.Write(c.body)
	}
}

// replay writes a stored response to w. The values of the fields it adds
// share one slice: a replay is the hot path of a retry storm.
func replay(w http.ResponseWriter, r *record) {
	h := w.Header()
	vals := make([]string, 0, len(r.header)+2)
	add := func(name, v string) {
		vals = append(vals, v)
		if old := h[name]; len(old) > 0 {
			h[name] = append(old, v)
			return
		}
		h[name] = vals[len(vals)-1 : len(vals) : len(vals)]
	}
	for _, f := range r.header {
		add(f[0], f[1])
	}
	delete(h, headerReplayed)
	add(headerReplayed, "true")
	if bodyAllowed(r.status) {
		delete(h, "Content-Length")
		add("Content-Length", strconv.Itoa(len(r.body)))
	}
	w.WriteHeader(r.status)
	if len(r.body) > 0 && bodyAllowed(r.status) {
		_, _ = w.Write(r.body)
	}
}
