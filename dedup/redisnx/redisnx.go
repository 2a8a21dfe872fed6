package redisnx

import (
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/idemkit/idem/dedup"
)

// The defaults of the zero Options, as each field's doc states them.
const (
	defaultLease        = 30 * time.Second
	defaultTTL          = 24 * time.Hour
	defaultPrefix       = "idem"
	defaultFailoverWait = 2 * time.Second
)

// maxPrefixLen limits Options.Prefix.
const maxPrefixLen = 64

// Options configure a Store. The zero value is usable.
type Options struct {
	// Lease is how long a claim is held without Extend. A worker that
	// crashes mid-message blocks the key's redelivery for at most this
	// long. Rounded up to whole milliseconds. Defaults to 30s.
	Lease time.Duration
	// TTL is how long a completed key is remembered (its retention); it
	// must outlive the longest redelivery horizon of the broker. Rounded
	// up to whole milliseconds. Defaults to 24h.
	TTL time.Duration
	// Prefix starts every Redis key, so several applications or
	// environments can share one Redis. 1 to 64 characters from
	// [A-Za-z0-9_.:-]. Defaults to "idem".
	Prefix string
	// MaxKeyLen limits scope and id, in bytes. Defaults to
	// dedup.DefaultMaxKeyLen.
	MaxKeyLen int
	// FailoverWait applies to a *redis.ClusterClient only: it bounds how
	// long a call keeps trying a key whose node it cannot reach. On such
	// an error the Store asks the client to reload the slot map
	// (ClusterClient.ReloadState) and tries again every 100ms, so a call
	// made while a replica takes over from a dead master succeeds as soon
	// as the new master is known, whatever the client's
	// ClusterStateReloadInterval. Meanwhile the call waits, and after
	// FailoverWait (or when its ctx ends) it returns the error: it never
	// answers as if the key were absent. A negative value returns the
	// error at once (the slot map is still reloaded). Defaults to 2s.
	FailoverWait time.Duration
	// SkipPreviousLayout stops claims from reading the key of the
	// previous key layout (see the package doc), which saves one read per
	// claim. Set it only when no mark of that layout can still be
	// live: a TTL after the last process that wrote them stopped.
	// Defaults to false (read it).
	SkipPreviousLayout bool
}

// Store is a lease store on Redis. It is safe for concurrent use. It holds no
// resources of its own: close the client when done.
type Store struct {
	client    redis.UniversalClient
	lease     time.Duration
	ttl       time.Duration
	prefix    string // Prefix + ":2{"
	oldPrefix string // Prefix + ":v1:{", the previous layout; "" to skip it
	maxKeyLen int
	leaseArg  any // lease in milliseconds, as a script argument
	ttlArg    any // TTL in milliseconds, as a script argument

	// legacy is set once Redis has refused SET NX GET (Redis before 7.0):
	// claims then go through the claim script.
	legacy atomic.Bool

	// The scripts are package variables in production; tests swap in
	// scripts unknown to the server to exercise the NOSCRIPT path.
	claim                     *redis.Script
	extend, complete, release *tokenScript

	// cluster is the client when it is a Redis Cluster client: calls
	// are then grouped per master node, and a call that cannot reach its
	// node reloads the slot map and tries again for up to failoverWait.
	cluster      *redis.ClusterClient
	failoverWait time.Duration

	// single holds the groups of a client that is not a cluster client;
	// nodes those of each master of a cluster, by address. The entries of
	// masters that left the cluster's topology, or that no call used for
	// nodeIdle, are dropped (see pruneNodes), at most once per nodeIdle,
	// from pruneAt on.
	single  *node
	nodesMu sync.Mutex
	nodes   map[string]*node
	pruneAt time.Time
	now     func() time.Time // time.Now; tests move it on
	pruned  func()           // called when a look at the topology ends; tests wait on it
	pruning atomic.Bool      // a look is running: the next one waits for its turn
}

var (
	_ dedup.LeaseStore      = (*Store)(nil)
	_ dedup.BatchLeaseStore = (*Store)(nil)
)

// New returns a Store on client. It does no I/O. It returns an error when
// client is nil or an option is out of range.
func New(client redis.UniversalClient, opts Options) (*Store, error) {
	if isNil(client) {
		return nil, errors.New("redisnx: New: client is nil; pass a redis.UniversalClient, for example redis.NewClient(&redis.Options{Addr: \"127.0.0.1:6379\"})")
	}
	lease, err := duration("Lease", opts.Lease, defaultLease, "30s")
	if err != nil {
		return nil, err
	}
	ttl, err := duration("TTL", opts.TTL, defaultTTL, "24h")
	if err != nil {
		return nil, err
	}
	prefix := opts.Prefix
	if prefix == "" {
		prefix = defaultPrefix
	}
	if err := validPrefix(prefix); err != nil {
		return nil, err
	}
	maxKeyLen := opts.MaxKeyLen
	switch {
	case maxKeyLen < 0:
		return nil, fmt.Errorf("redisnx: Options.MaxKeyLen is %d; it must be positive (or zero for the default of %d bytes)", maxKeyLen, dedup.DefaultMaxKeyLen)
	case maxKeyLen == 0:
		maxKeyLen = dedup.DefaultMaxKeyLen
	}
	failoverWait := opts.FailoverWait
	if failoverWait == 0 {
		failoverWait = defaultFailoverWait
	}
	s := &Store{
		client:    client,
		lease:     lease,
		ttl:       ttl,
		prefix:    prefix + ":2{",
		oldPrefix: prefix + ":v1:{",
		maxKeyLen: maxKeyLen,
		leaseArg:  strconv.FormatInt(lease.Milliseconds(), 10),
		ttlArg:    strconv.FormatInt(ttl.Milliseconds(), 10),
		claim:     claimScript,
		extend:    extendScript,
		complete:  completeScript,
		release:   releaseScript,

		failoverWait: failoverWait,
		nodes:        map[string]*node{},
		now:          time.Now,
	}
	if opts.SkipPreviousLayout {
		s.oldPrefix = ""
	}
	s.cluster, _ = client.(*redis.ClusterClient)
	s.single = s.newNode()
	s.pruneAt = s.now().Add(nodeIdle)
	return s, nil
}

// isNil reports whether client is nil, including a typed nil pointer such as
// (*redis.Client)(nil), which would panic on first use.
func isNil(client redis.UniversalClient) bool {
	if client == nil {
		return true
	}
	v := reflect.ValueOf(client)
	return v.Kind() == reflect.Pointer && v.IsNil()
}

// duration applies the default to a zero duration, refuses a negative one
// and rounds the rest up to whole milliseconds, the unit of Redis expiries.
func duration(name string, d, def time.Duration, defText string) (time.Duration, error) {
	switch {
	case d == 0:
		return def, nil
	case d < 0:
		return 0, fmt.Errorf("redisnx: Options.%s is %v; it must be positive (or zero for the %s default)", name, d, defText)
	}
	if r := d % time.Millisecond; r != 0 {
		d += time.Millisecond - r
	}
	return d, nil
}

func validPrefix(p string) error {
	if len(p) > maxPrefixLen {
		return fmt.Errorf("redisnx: Options.Prefix is %d bytes; the limit is %d (or leave it empty for %q)", len(p), maxPrefixLen, defaultPrefix)
	}
	for i := 0; i < len(p); i++ {
		c := p[i]
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' ||
			c == '_' || c == '.' || c == ':' || c == '-'
		if !ok {
			return fmt.Errorf("redisnx: Options.Prefix %q has %q at offset %d; use only letters, digits and _ . : - (or leave it empty for %q)", p, c, i, defaultPrefix)
		}
	}
	return nil
}
