//go:build unix

// Package netns puts a test's processes in Linux network namespaces of their
// own and cuts them off from the host by dropping their packets: a real
// network partition, seen by the kernel's TCP stack on both ends, with no
// proxy deciding what a cut connection does.
//
// New creates a Net: n namespaces, each joined to the host by a veth pair
// with a /30 of its own in 10.213.0.0/16 (the host end .1, the namespace
// end .2). Net.Service is the host end of the first pair: a server (or a
// forwarder to a server on 127.0.0.1) listens there, and every namespace
// reaches it through its own veth (the other namespaces through a /32
// route). A namespace has no default route, so its processes reach the
// service address and nothing else; nothing it sends leaves the machine.
//
// Space.Cut installs nftables rules inside one namespace, so the host's own
// rule set is never touched: Out drops the packets the namespace sends to the
// service address, In drops those it receives from there, Both does both. A
// list of ports narrows the cut to those server ports (one service among
// several on the same address). Space.Heal removes the rules and returns
// how many packets they dropped.
//
// Names carry the creating process's id (namespaces "idem-PID-N", veth ends
// "idmPIDhN" and "idmPIDcN"): Close removes a Net's namespaces and links,
// and CleanStale removes those left by a process that no longer runs (a run
// that crashed or was SIGKILLed). Check tells whether this machine can do
// all this: root, iproute2's ip, nftables' nft, and a kernel that lets a
// probe namespace hold a veth and an nftables table.
package netns

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// ErrUnsupported is wrapped by Check's error when namespaces, veth pairs or
// nftables cannot be used here.
var ErrUnsupported = errors.New("netns: network namespaces with nftables cannot be used here")

// Direction is what a cut drops, seen from the namespace.
type Direction int

// The directions of a cut.
const (
	// Out drops the packets the namespace sends to the service address:
	// requests never arrive, replies already on their way still do.
	Out Direction = 1 << iota
	// In drops the packets the namespace receives from the service
	// address: requests arrive and are served, their replies are lost.
	In
	// Both drops every packet between the namespace and the service
	// address.
	Both = Out | In
)

// String names the direction: "out", "in" or "both".
func (d Direction) String() string {
	switch d {
	case Out:
		return "out"
	case In:
		return "in"
	case Both:
		return "both"
	}
	return "direction(" + strconv.Itoa(int(d)) + ")"
}

// commandTimeout bounds one ip or nft command.
const commandTimeout = 20 * time.Second

// nftTable is the table of a namespace's rules (inside the namespace).
const nftTable = "idem"

var (
	checkOnce sync.Once
	checkErr  error
	seq       atomic.Int64
	newMu     sync.Mutex // held by New from picking a block to using it
)

// Check reports whether namespaces can be used here (nil), or why not,
// wrapping ErrUnsupported. The probe runs once per process.
func Check() error {
	checkOnce.Do(func() { checkErr = probe() })
	return checkErr
}

func probe() error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("%w: not root", ErrUnsupported)
	}
	for _, tool := range []string{"ip", "nft"} {
		if _, err := exec.LookPath(tool); err != nil {
			pkg := map[string]string{"ip": "iproute2", "nft": "nftables"}[tool]
			return fmt.Errorf("%w: %s not found (Debian package %s; scripts/services.sh up installs it)", ErrUnsupported, tool, pkg)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	n, err := New(ctx, 1)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrUnsupported, err)
	}
	if err := n.Close(); err != nil {
		return fmt.Errorf("%w: %w", ErrUnsupported, err)
	}
	return nil
}

// Net is a set of namespaces with one service address on the host.
type Net struct {
	service netip.Addr
	spaces  []*Space
	closed  bool
}

// Space is one namespace of a Net.
type Space struct {
	name, hostLink, link string
	hostAddr, addr       netip.Addr
	service              netip.Addr

	mu      sync.Mutex
	cut     Direction
	dropped int64
}

// New creates n namespaces (see the package documentation). Close removes
// them; on error nothing is left behind.
func New(ctx context.Context, n int) (*Net, error) {
	if n < 1 {
		return nil, errors.New("netns: New needs at least one namespace")
	}
	// One New at a time in this process: the block is free only until
	// its first address is added, and a run may create Nets at once.
	newMu.Lock()
	defer newMu.Unlock()
	base, err := freeBlock(ctx, n)
	if err != nil {
		return nil, err
	}
	nt := &Net{}
	pid := os.Getpid()
	for i := range n {
		k := seq.Add(1) % 10000
		s := &Space{
			name:     fmt.Sprintf("idem-%d-%d", pid, k),
			hostLink: fmt.Sprintf("idm%dh%d", pid, k),
			link:     fmt.Sprintf("idm%dc%d", pid, k),
			hostAddr: offset(base, 4*i+1),
			addr:     offset(base, 4*i+2),
		}
		if i == 0 {
			nt.service = s.hostAddr
		}
		s.service = nt.service
		nt.spaces = append(nt.spaces, s)
		if err := s.create(ctx, i > 0); err != nil {
			return nil, errors.Join(err, nt.Close())
		}
	}
	return nt, nil
}

// Service is the host address every namespace reaches.
func (n *Net) Service() netip.Addr { return n.service }

// Spaces returns the namespaces, in creation order.
func (n *Net) Spaces() []*Space { return append([]*Space(nil), n.spaces...) }

// Close removes the namespaces and their veth pairs. Processes still
// running in a namespace keep it (without its name) until they exit.
func (n *Net) Close() error {
	if n.closed {
		return nil
	}
	n.closed = true
	var errs []error
	for _, s := range n.spaces {
		errs = append(errs, s.remove())
	}
	return errors.Join(errs...)
}

// Name is the namespace's name (for `ip netns exec`).
func (s *Space) Name() string { return s.name }

// Addr is the namespace end's address.
func (s *Space) Addr() netip.Addr { return s.addr }

// Command returns a command that runs name with args inside the namespace
// (`ip netns exec`, which execs it: the process's id is the command's).
func (s *Space) Command(name string, args ...string) *exec.Cmd {
	return exec.Command("ip", append([]string{"netns", "exec", s.name, name}, args...)...)
}

// Cut drops the namespace's packets in direction d, to and from the service
// address on the given server ports (every port when none is given),
// replacing the cut in force.
func (s *Space) Cut(ctx context.Context, d Direction, ports ...uint16) error {
	if d&Both == 0 || d&^Both != 0 {
		return fmt.Errorf("netns: bad direction %d", d)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.collect(ctx); err != nil {
		return err
	}
	match := func(string) string { return "" }
	if len(ports) > 0 {
		ps := make([]string, len(ports))
		for i, p := range ports {
			ps[i] = strconv.Itoa(int(p))
		}
		set := strings.Join(ps, ", ")
		match = func(field string) string { return " tcp " + field + " { " + set + " }" }
	}
	var script strings.Builder
	flush(&script)
	if d&Out != 0 {
		fmt.Fprintf(&script, "add rule inet %s out ip daddr %s%s counter drop\n", nftTable, s.service, match("dport"))
	}
	if d&In != 0 {
		fmt.Fprintf(&script, "add rule inet %s in ip saddr %s%s counter drop\n", nftTable, s.service, match("sport"))
	}
	if err := s.nft(ctx, script.String()); err != nil {
		return err
	}
	s.cut = d
	return nil
}

// Heal removes the cut and returns how many packets it dropped.
func (s *Space) Heal(ctx context.Context) (dropped int64, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	before := s.dropped
	if err := s.collect(ctx); err != nil {
		return 0, err
	}
	var script strings.Builder
	flush(&script)
	if err := s.nft(ctx, script.String()); err != nil {
		return 0, err
	}
	s.cut = 0
	return s.dropped - before, nil
}

// Dropped is the number of packets every cut of the namespace dropped so
// far (a cut in force counts at its Heal).
func (s *Space) Dropped() int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.dropped
}

func flush(b *strings.Builder) {
	fmt.Fprintf(b, "flush chain inet %s out\nflush chain inet %s in\n", nftTable, nftTable)
}

var packetsRE = regexp.MustCompile(`counter packets (\d+)`)

// collect adds the packet counters of the rules in force to dropped.
func (s *Space) collect(ctx context.Context) error {
	if s.cut == 0 {
		return nil
	}
	out, err := run(ctx, nil, "ip", "netns", "exec", s.name, "nft", "list", "table", "inet", nftTable)
	if err != nil {
		return err
	}
	for _, m := range packetsRE.FindAllStringSubmatch(out, -1) {
		n, _ := strconv.ParseInt(m[1], 10, 64)
		s.dropped += n
	}
	return nil
}

func (s *Space) nft(ctx context.Context, script string) error {
	_, err := run(ctx, []byte(script), "ip", "netns", "exec", s.name, "nft", "-f", "-")
	return err
}

// create makes the namespace, its veth pair, the addresses, the route to
// the service address (route) and the empty nftables chains.
func (s *Space) create(ctx context.Context, route bool) error {
	hostPfx := netip.PrefixFrom(s.hostAddr, 30).String()
	pfx := netip.PrefixFrom(s.addr, 30).String()
	steps := [][]string{
		{"ip", "netns", "add", s.name},
		{"ip", "link", "add", s.hostLink, "type", "veth", "peer", "name", s.link, "netns", s.name},
		{"ip", "addr", "add", hostPfx, "dev", s.hostLink},
		{"ip", "link", "set", s.hostLink, "up"},
		{"ip", "-n", s.name, "addr", "add", pfx, "dev", s.link},
		{"ip", "-n", s.name, "link", "set", s.link, "up"},
		{"ip", "-n", s.name, "link", "set", "lo", "up"},
	}
	if route {
		steps = append(steps, []string{"ip", "-n", s.name, "route", "add", s.service.String() + "/32", "dev", s.link})
	}
	for _, st := range steps {
		if _, err := run(ctx, nil, st[0], st[1:]...); err != nil {
			return errors.Join(err, s.remove())
		}
	}
	table := fmt.Sprintf(`table inet %[1]s {
	chain out { type filter hook output priority 0; policy accept; }
	chain in { type filter hook input priority 0; policy accept; }
}
`, nftTable)
	if err := s.nft(ctx, table); err != nil {
		return errors.Join(err, s.remove())
	}
	return nil
}

// remove deletes the host end of the veth pair (which takes the other end
// with it) and the namespace; what is already gone is not an error.
func (s *Space) remove() error {
	ctx, cancel := context.WithTimeout(context.Background(), commandTimeout)
	defer cancel()
	var errs []error
	if _, err := run(ctx, nil, "ip", "link", "del", s.hostLink); err != nil && !gone(err) {
		errs = append(errs, err)
	}
	if _, err := run(ctx, nil, "ip", "netns", "del", s.name); err != nil && !gone(err) {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// gone reports whether an ip error says the object does not exist.
func gone(err error) bool {
	msg := err.Error()
	return strings.Contains(msg, "Cannot find device") || strings.Contains(msg, "No such file") ||
		strings.Contains(msg, "does not exist")
}

var (
	staleNS   = regexp.MustCompile(`^idem-(\d+)-\d+$`)
	staleLink = regexp.MustCompile(`^idm(\d+)h\d+$`)
)

// CleanStale removes the namespaces and host veth ends left by processes
// that no longer run, and returns their names.
func CleanStale(ctx context.Context) ([]string, error) {
	var removed []string
	var errs []error
	out, err := run(ctx, nil, "ip", "netns", "list")
	if err != nil {
		return nil, err
	}
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) == 0 {
			continue
		}
		if m := staleNS.FindStringSubmatch(f[0]); m != nil && dead(m[1]) {
			if _, err := run(ctx, nil, "ip", "netns", "del", f[0]); err != nil && !gone(err) {
				errs = append(errs, err)
				continue
			}
			removed = append(removed, f[0])
		}
	}
	out, err = run(ctx, nil, "ip", "-o", "link", "show")
	if err != nil {
		return removed, errors.Join(append(errs, err)...)
	}
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) < 2 {
			continue
		}
		name, _, _ := strings.Cut(strings.TrimSuffix(f[1], ":"), "@")
		if m := staleLink.FindStringSubmatch(name); m != nil && dead(m[1]) {
			if _, err := run(ctx, nil, "ip", "link", "del", name); err != nil && !gone(err) {
				errs = append(errs, err)
				continue
			}
			removed = append(removed, name)
		}
	}
	return removed, errors.Join(errs...)
}

// dead reports whether no process has the id pid.
func dead(pid string) bool {
	n, err := strconv.Atoi(pid)
	if err != nil || n <= 0 {
		return false
	}
	return errors.Is(syscall.Kill(n, 0), syscall.ESRCH)
}

// freeBlock picks the base of a block of n /30s in 10.213.0.0/16 that no
// address of the host falls in.
func freeBlock(ctx context.Context, n int) (netip.Addr, error) {
	if n > 64 {
		return netip.Addr{}, errors.New("netns: at most 64 namespaces in one Net")
	}
	out, err := run(ctx, nil, "ip", "-4", "-o", "addr", "show")
	if err != nil {
		return netip.Addr{}, err
	}
	var used []netip.Prefix
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		for i := 0; i+1 < len(f); i++ {
			if f[i] == "inet" {
				if p, err := netip.ParsePrefix(f[i+1]); err == nil {
					used = append(used, p)
				}
			}
		}
	}
	size := 4 * n
	for range 200 {
		// A block of size addresses, aligned on size rounded up to a
		// power of two so it never straddles a /24.
		align := 4
		for align < size {
			align *= 2
		}
		start := rand.IntN(65536/align) * align
		base := netip.AddrFrom4([4]byte{10, 213, byte(start >> 8), byte(start)})
		block := netip.PrefixFrom(base, 32-log2(align))
		free := true
		for _, p := range used {
			if p.Overlaps(block) {
				free = false
				break
			}
		}
		if free {
			return base, nil
		}
	}
	return netip.Addr{}, errors.New("netns: no free block in 10.213.0.0/16")
}

func log2(n int) int {
	k := 0
	for n > 1 {
		n >>= 1
		k++
	}
	return k
}

// offset returns a + k (k small, within the block).
func offset(a netip.Addr, k int) netip.Addr {
	for range k {
		a = a.Next()
	}
	return a
}

// run runs a command with stdin and returns its stdout; the error carries
// its stderr.
func run(ctx context.Context, stdin []byte, name string, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, commandTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	if stdin != nil {
		cmd.Stdin = bytes.NewReader(stdin)
	}
	var out, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("netns: %s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(stderr.String()))
	}
	return out.String(), nil
}
