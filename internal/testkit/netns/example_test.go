//go:build unix

package netns_test

import (
	"context"
	"fmt"
	"os"

	"github.com/idemkit/idem/internal/testkit/netns"
)

// A partition, the way a test cuts a process off from a server: the
// server (or a forwarder to it) listens on the Net's service address, the
// process runs in a namespace, and Cut drops its packets until Heal.
func Example() {
	if err := netns.Check(); err != nil {
		fmt.Println("cannot cut here:", err)
		return
	}
	ctx := context.Background()
	n, err := netns.New(ctx, 1)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer func() { _ = n.Close() }()
	s := n.Spaces()[0]
	// Listen on n.Service(), then run the client inside s:
	cmd := s.Command("/bin/true")
	cmd.Stdout = os.Stdout
	_ = cmd.Run()
	// Requests arrive and are served; their replies are lost.
	if err := s.Cut(ctx, netns.In, 5432); err != nil {
		fmt.Println(err)
		return
	}
	dropped, err := s.Heal(ctx)
	fmt.Println(dropped, err)
}

// The directions of a cut, as a cell's report names them.
func ExampleDirection() {
	fmt.Println(netns.Out, netns.In, netns.Both)
	// Output: out in both
}
