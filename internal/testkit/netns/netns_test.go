//go:build unix

package netns

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/idemkit/idem/internal/testkit/testenv"
)

// clientEnv makes the test binary a client (see client): it dials the
// address in the variable from inside a namespace.
const clientEnv = "IDEM_NETNS_TEST_CLIENT"

func TestMain(m *testing.M) {
	if addr := os.Getenv(clientEnv); addr != "" {
		client(addr)
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// client reads lines from stdin and sends each to addr on one
// connection, dialled when there is none, and prints "echo LINE" when the
// echo came back within a second, else "dial error" or "timeout" (and
// drops the connection).
func client(addr string) {
	var c net.Conn
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		line := in.Text()
		if c == nil {
			var err error
			if c, err = net.DialTimeout("tcp", addr, time.Second); err != nil {
				fmt.Println("dial error")
				continue
			}
		}
		_ = c.SetDeadline(time.Now().Add(time.Second))
		r := bufio.NewReader(c)
		_, err := io.WriteString(c, line+"\n")
		var got string
		if err == nil {
			got, err = r.ReadString('\n')
		}
		if err != nil {
			fmt.Println("timeout")
			_ = c.Close()
			c = nil
			continue
		}
		fmt.Println("echo " + strings.TrimSpace(got))
	}
}

func need(t *testing.T) {
	t.Helper()
	if err := Check(); err != nil {
		if testenv.Required() {
			t.Fatal(err)
		}
		t.Skip(err)
	}
}

// echoServer listens on addr:0, echoes every line and sends what it
// received to got.
func echoServer(t *testing.T, addr string) (port uint16, got <-chan string) {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(addr, "0"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ln.Close() })
	ch := make(chan string, 100)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer func() { _ = c.Close() }()
				sc := bufio.NewScanner(c)
				for sc.Scan() {
					ch <- sc.Text()
					if _, err := io.WriteString(c, sc.Text()+"\n"); err != nil {
						return
					}
				}
			}()
		}
	}()
	return uint16(ln.Addr().(*net.TCPAddr).Port), ch
}

// startClient runs the test binary as a client inside s.
func startClient(t *testing.T, s *Space, addr string) (send func(string) string) {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := s.Command(exe)
	cmd.Env = append(os.Environ(), clientEnv+"="+addr)
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = stdin.Close(); _ = cmd.Wait() })
	out := bufio.NewScanner(stdout)
	return func(line string) string {
		if _, err := io.WriteString(stdin, line+"\n"); err != nil {
			t.Fatal(err)
		}
		if !out.Scan() {
			t.Fatalf("client ended: %v", out.Err())
		}
		return out.Text()
	}
}

// received reports whether line reaches the server within a second.
func received(got <-chan string, line string) bool {
	deadline := time.After(time.Second)
	for {
		select {
		case l := <-got:
			if l == line {
				return true
			}
		case <-deadline:
			return false
		}
	}
}

func TestCutDirections(t *testing.T) {
	need(t)
	ctx := context.Background()
	n, err := New(ctx, 2)
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := n.Close(); err != nil {
			t.Error(err)
		}
	}()
	port, got := echoServer(t, n.Service().String())
	addr := net.JoinHostPort(n.Service().String(), strconv.Itoa(int(port)))
	for i, s := range n.Spaces() {
		t.Run(fmt.Sprintf("space%d", i), func(t *testing.T) {
			send := startClient(t, s, addr)
			step := func(line, want string, arrives bool) {
				t.Helper()
				if r := send(line); r != want {
					t.Fatalf("%s: client says %q, want %q", line, r, want)
				}
				if r := received(got, line); r != arrives {
					t.Fatalf("%s: reached the server: %v, want %v", line, r, arrives)
				}
			}
			heal := func() {
				t.Helper()
				d, err := s.Heal(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if d == 0 {
					t.Fatal("the cut dropped no packet")
				}
			}
			step("a", "echo a", true)
			// Out: the request never arrives.
			if err := s.Cut(ctx, Out, port); err != nil {
				t.Fatal(err)
			}
			step("b", "timeout", false)
			heal()
			step("c", "echo c", true)
			// In: the request arrives and is answered, the reply is lost.
			if err := s.Cut(ctx, In, port); err != nil {
				t.Fatal(err)
			}
			step("d", "timeout", true)
			heal()
			step("e", "echo e", true)
			if err := s.Cut(ctx, Both); err != nil {
				t.Fatal(err)
			}
			step("f", "timeout", false)
			heal()
			// A new connection while everything is dropped.
			if err := s.Cut(ctx, Both); err != nil {
				t.Fatal(err)
			}
			step("f2", "dial error", false)
			heal()
			// A cut on another port leaves this one alone.
			if err := s.Cut(ctx, Both, port+1); err != nil {
				t.Fatal(err)
			}
			step("g", "echo g", true)
			if _, err := s.Heal(ctx); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestCloseRemovesEverything(t *testing.T) {
	need(t)
	ctx := context.Background()
	n, err := New(ctx, 2)
	if err != nil {
		t.Fatal(err)
	}
	if err := n.Close(); err != nil {
		t.Fatal(err)
	}
	for _, s := range n.Spaces() {
		if nsExists(t, s.name) || linkExists(t, s.hostLink) {
			t.Errorf("%s or %s still exists after Close", s.name, s.hostLink)
		}
	}
}

func TestCleanStale(t *testing.T) {
	need(t)
	ctx := context.Background()
	// The id of a process that has exited.
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	name := fmt.Sprintf("idem-%d-1", pid)
	link := fmt.Sprintf("idm%dh1", pid)
	if _, err := run(ctx, nil, "ip", "netns", "add", name); err != nil {
		t.Fatal(err)
	}
	if _, err := run(ctx, nil, "ip", "link", "add", link, "type", "veth", "peer", "name", fmt.Sprintf("idm%dc1", pid)); err != nil {
		_, _ = run(ctx, nil, "ip", "netns", "del", name)
		t.Fatal(err)
	}
	mine, err := New(ctx, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = mine.Close() }()
	removed, err := CleanStale(ctx)
	if err != nil {
		t.Fatal(err)
	}
	joined := " " + strings.Join(removed, " ") + " "
	if !strings.Contains(joined, " "+name+" ") || !strings.Contains(joined, " "+link+" ") {
		t.Fatalf("removed %v, want %s and %s among them", removed, name, link)
	}
	if nsExists(t, name) {
		t.Fatalf("%s still exists", name)
	}
	if !linkExists(t, mine.spaces[0].hostLink) {
		t.Fatal("CleanStale removed a live process's link")
	}
}

// nsExists reports whether the namespace name exists.
func nsExists(t *testing.T, name string) bool {
	t.Helper()
	out, err := run(context.Background(), nil, "ip", "netns", "list")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(out, "\n") {
		if f := strings.Fields(line); len(f) > 0 && f[0] == name {
			return true
		}
	}
	return false
}

// linkExists reports whether the host has the link name.
func linkExists(t *testing.T, name string) bool {
	t.Helper()
	out, err := run(context.Background(), nil, "ip", "-o", "link", "show", name)
	if err != nil {
		if gone(err) {
			return false
		}
		t.Fatal(err)
	}
	return strings.TrimSpace(out) != ""
}

func TestDirectionString(t *testing.T) {
	for d, want := range map[Direction]string{Out: "out", In: "in", Both: "both", 0: "direction(0)"} {
		if got := d.String(); got != want {
			t.Errorf("%d: %q, want %q", d, got, want)
		}
	}
	if err := (&Space{}).Cut(context.Background(), 0); err == nil || errors.Is(err, ErrUnsupported) {
		t.Fatalf("Cut(0): %v, want a bad direction error", err)
	}
}
