package fault

import (
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// FreePort returns a TCP port on 127.0.0.1 that nothing listened on a moment
// ago. Another process may take it before the caller binds it; callers that
// start a server on it retry with another port when the bind fails.
func FreePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("fault: free port: %w", err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	if err := l.Close(); err != nil {
		return 0, fmt.Errorf("fault: free port: %w", err)
	}
	return port, nil
}

// Mode is what a Proxy does with the bytes it relays.
type Mode int

// The modes of a Proxy. A mode applies to every connection, open or new, from
// the next chunk of bytes it relays.
const (
	// Pass relays bytes both ways as they come.
	Pass Mode = iota
	// Delay holds every chunk, each way, for the proxy's delay before
	// relaying it.
	Delay
	// Reset resets a connection (RST to the client and the server) when
	// the client sends anything, without relaying it: the request never
	// reaches the server.
	Reset
	// Cut relays the client's bytes to the server and then closes the
	// connection when the server's reply arrives, without relaying it: the
	// server did the work, the client sees its connection drop and cannot
	// know. This is the ambiguous acknowledgement (a COMMIT whose reply is
	// lost, a publish whose confirm is lost).
	Cut
)

func (m Mode) String() string {
	switch m {
	case Pass:
		return "pass"
	case Delay:
		return "delay"
	case Reset:
		return "reset"
	case Cut:
		return "cut"
	default:
		return fmt.Sprintf("Mode(%d)", int(m))
	}
}

// CutWait is how long a connection in Cut mode waits for the server's reply
// to a forwarded request before it is closed anyway (a request without a
// reply, such as a Terminate message).
const CutWait = 2 * time.Second

// ProxyStats counts what a Proxy did.
type ProxyStats struct {
	Accepted int64 // client connections accepted
	Resets   int64 // connections reset (Reset mode and ResetAll)
	Cuts     int64 // replies swallowed after a forwarded request (Cut mode)
	Delayed  int64 // chunks held back in Delay mode, counted when the hold starts
}

// Proxy is a TCP proxy on 127.0.0.1 that forwards every connection to a
// target address and misbehaves on demand (see Mode). Each accepted
// connection dials the target; a failed dial closes the client's
// connection. Close stops the listener, resets every connection and waits
// for every goroutine. Safe for concurrent use.
type Proxy struct {
	target string
	ln     net.Listener

	mu     sync.Mutex
	mode   Mode
	delay  time.Duration
	links  map[*link]struct{}
	closed bool

	wg                              sync.WaitGroup
	accepted, resets, cuts, delayed atomic.Int64
}

// NewProxy listens on a free port of 127.0.0.1 and forwards to target, in
// Pass mode.
func NewProxy(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, fmt.Errorf("fault: proxy: %w", err)
	}
	p := &Proxy{target: target, ln: ln, links: map[*link]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the proxy's listening address, host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Target is the address the proxy forwards to.
func (p *Proxy) Target() string { return p.target }

// SetMode switches the mode; d is the delay of Delay mode (ignored by the
// others).
func (p *Proxy) SetMode(m Mode, d time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.mode, p.delay = m, d
}

// Mode returns the current mode and delay.
func (p *Proxy) Mode() (Mode, time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.mode, p.delay
}

// ResetAll resets every open connection now (RST both ways), whatever the
// mode, and returns how many it reset.
func (p *Proxy) ResetAll() int {
	p.mu.Lock()
	links := make([]*link, 0, len(p.links))
	for l := range p.links {
		links = append(links, l)
	}
	p.mu.Unlock()
	n := 0
	for _, l := range links {
		if l.kill(true) {
			n++
			p.resets.Add(1)
		}
	}
	return n
}

// Stats returns the counters.
func (p *Proxy) Stats() ProxyStats {
	return ProxyStats{Accepted: p.accepted.Load(), Resets: p.resets.Load(), Cuts: p.cuts.Load(), Delayed: p.delayed.Load()}
}

// Close stops accepting, resets every connection and waits for the proxy's
// goroutines to return.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	links := make([]*link, 0, len(p.links))
	for l := range p.links {
		links = append(links, l)
	}
	p.mu.Unlock()
	err := p.ln.Close()
	for _, l := range links {
		l.kill(true)
	}
	p.wg.Wait()
	if errors.Is(err, net.ErrClosed) {
		err = nil
	}
	return err
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// A transient accept error (too many open files): back off.
			time.Sleep(10 * time.Millisecond)
			continue
		}
		p.accepted.Add(1)
		l := &link{p: p, client: c.(*net.TCPConn), done: make(chan struct{})}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			_ = c.Close()
			return
		}
		p.links[l] = struct{}{}
		p.wg.Add(1)
		p.mu.Unlock()
		go l.run()
	}
}

// link is one proxied connection.
type link struct {
	p      *Proxy
	client *net.TCPConn
	server *net.TCPConn // set before the pumps start

	once sync.Once
	done chan struct{} // closed by kill

	mu      sync.Mutex
	cutting bool // a request went to the server in Cut mode: swallow the reply
}

func (l *link) run() {
	defer l.p.wg.Done()
	defer func() {
		l.p.mu.Lock()
		delete(l.p.links, l)
		l.p.mu.Unlock()
	}()
	d := net.Dialer{Timeout: 5 * time.Second}
	sc, err := d.Dial("tcp", l.p.target)
	if err != nil {
		l.kill(false)
		return
	}
	l.mu.Lock()
	l.server = sc.(*net.TCPConn)
	l.mu.Unlock()
	select {
	case <-l.done: // killed while dialing
		_ = sc.Close()
		return
	default:
	}
	var wg sync.WaitGroup
	wg.Add(2)
	go func() { defer wg.Done(); l.up() }()
	go func() { defer wg.Done(); l.down() }()
	wg.Wait()
}

// kill closes both connections, with an RST when rst is set. It reports
// whether this call closed them (false when they already were).
func (l *link) kill(rst bool) bool {
	killed := false
	l.once.Do(func() {
		killed = true
		close(l.done)
		l.mu.Lock()
		server := l.server
		l.mu.Unlock()
		for _, c := range []*net.TCPConn{l.client, server} {
			if c == nil {
				continue
			}
			if rst {
				_ = c.SetLinger(0)
			}
			_ = c.Close()
		}
	})
	return killed
}

// sleep holds a chunk in Delay mode: it waits d, or until the link is
// killed, and reports whether the link is still alive.
func (l *link) sleep(d time.Duration) bool {
	if d <= 0 {
		return true
	}
	l.p.delayed.Add(1)
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-l.done:
		return false
	}
}

// up relays client → server.
func (l *link) up() {
	var cutTimer *time.Timer
	defer func() {
		if cutTimer != nil {
			cutTimer.Stop()
		}
	}()
	buf := make([]byte, 32<<10)
	for {
		n, err := l.client.Read(buf)
		if n > 0 {
			mode, delay := l.p.Mode()
			switch mode {
			case Reset:
				if l.kill(true) {
					l.p.resets.Add(1)
				}
				return
			case Delay:
				if !l.sleep(delay) {
					return
				}
			case Cut:
				l.mu.Lock()
				first := !l.cutting
				l.cutting = true
				l.mu.Unlock()
				if first {
					// A request with no reply: close it anyway.
					cutTimer = time.AfterFunc(CutWait, func() { l.kill(false) })
				}
			}
			if _, werr := l.server.Write(buf[:n]); werr != nil {
				l.kill(false)
				return
			}
		}
		if err != nil {
			l.kill(false)
			return
		}
	}
}

// down relays server → client.
func (l *link) down() {
	buf := make([]byte, 32<<10)
	for {
		n, err := l.server.Read(buf)
		if n > 0 {
			l.mu.Lock()
			cutting := l.cutting
			l.mu.Unlock()
			if cutting {
				// The server answered a request the client will never
				// see answered.
				if l.kill(false) {
					l.p.cuts.Add(1)
				}
				return
			}
			if mode, delay := l.p.Mode(); mode == Delay && !l.sleep(delay) {
				return
			}
			if _, werr := l.client.Write(buf[:n]); werr != nil {
				l.kill(false)
				return
			}
		}
		if err != nil {
			l.kill(false)
			return
		}
	}
}
