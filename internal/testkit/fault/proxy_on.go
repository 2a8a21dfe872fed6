package fault

import (
	"fmt"
	"net"
)

// NewProxyOn is NewProxy listening on listen (host:port, port 0 for a free
// one) instead of 127.0.0.1: the host end of a network namespace's veth
// pair, say, so that a process in the namespace reaches a server that
// listens on 127.0.0.1 only (internal/testkit/netns). In Pass mode it adds
// nothing of its own: a connection whose client side fails or closes is
// closed on the server side at once, and the other way round; nothing is
// retried or redialled.
func NewProxyOn(listen, target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", listen)
	if err != nil {
		return nil, fmt.Errorf("fault: proxy: %w", err)
	}
	p := &Proxy{target: target, ln: ln, links: map[*link]struct{}{}}
	p.wg.Add(1)
	go p.accept()
	return p, nil
}
