package ipam

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/overlayd/overlayd/internal/lockorder"
	"github.com/overlayd/overlayd/internal/statefile"
	"github.com/overlayd/overlayd/internal/testutil/logrec"
)

// The package's contract with the cluster is bytes in and out (Transport,
// HandleMessage), so these tests run several allocators over fakeNet, an
// in-memory Transport that can cut hosts off and drop or delay messages.
// It is a fake because the real cluster (memberlist over TCP) is not what
// these tests are about; internal/daemon's tests run the allocator over
// the real cluster.

var _ Store = (*statefile.File)(nil)

// testTiming: shorter timeouts so that the tests' failure paths are
// quick, long enough for a host answering under the race detector on a
// loaded machine.
var testTiming = timing{
	request: 3 * time.Second,
	donate:  time.Second,
	vote:    time.Second,
	backoff: 40 * time.Millisecond,
	gossip:  200 * time.Millisecond,
	query:   200 * time.Millisecond,
}

type fakeNet struct {
	mu *lockorder.Mutex
	// nodes by name; cut: pairs that cannot talk (both ways); gone: nodes
	// the others list as dead; guarded by mu.
	nodes map[string]*Allocator
	cut   map[[2]string]bool
	gone  map[string]bool
	// drop, when set, decides per message whether it is lost; guarded by mu.
	drop  func(from, to string, payload []byte) bool
	delay time.Duration // guarded by mu
	// slow: how long each Send blocks (as a TCP stream may); guarded by mu.
	slow time.Duration
	// sent counts sends per message kind; guarded by mu.
	sent map[msgKind]int
}

func newFakeNet() *fakeNet {
	return &fakeNet{mu: lockorder.New(lockorder.LevelLeaf), nodes: map[string]*Allocator{}, cut: map[[2]string]bool{}, gone: map[string]bool{}, sent: map[msgKind]int{}}
}

func pair(a, b string) [2]string {
	if a > b {
		a, b = b, a
	}
	return [2]string{a, b}
}

// partition cuts name off from every other node (or heals it) and tells
// everyone the membership changed.
func (n *fakeNet) partition(name string, cut bool) {
	n.mu.Lock()
	for other := range n.nodes {
		if other != name {
			if cut {
				n.cut[pair(name, other)] = true
			} else {
				delete(n.cut, pair(name, other))
			}
		}
	}
	nodes := slicesOf(n.nodes)
	n.mu.Unlock()
	for _, a := range nodes {
		a.MembersChanged()
	}
}

func slicesOf(m map[string]*Allocator) []*Allocator {
	out := make([]*Allocator, 0, len(m))
	for _, k := range sortedKeys(m) {
		out = append(out, m[k])
	}
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

type fakeTransport struct {
	net    *fakeNet
	name   string
	joined bool
}

func (t *fakeTransport) Send(node string, payload []byte) error {
	n := t.net
	n.mu.Lock()
	to := n.nodes[node]
	blocked := n.cut[pair(t.name, node)] || n.gone[node] || n.gone[t.name]
	drop := n.drop
	delay := n.delay
	slow := n.slow
	n.mu.Unlock()
	time.Sleep(slow)
	n.mu.Lock()
	if len(payload) > 3 {
		n.sent[msgKind(payload[3])]++
	}
	n.mu.Unlock()
	if to == nil || blocked {
		return fmt.Errorf("%s is unreachable", node)
	}
	if drop != nil && drop(t.name, node, payload) {
		return nil // lost after the send succeeded, as on a broken stream
	}
	b := append([]byte(nil), payload...)
	if delay > 0 {
		time.AfterFunc(delay, func() { to.HandleMessage(t.name, b) })
		return nil
	}
	to.HandleMessage(t.name, b)
	return nil
}

func (t *fakeTransport) Members() []Member {
	n := t.net
	n.mu.Lock()
	defer n.mu.Unlock()
	var out []Member
	for _, name := range sortedKeys(n.nodes) {
		if name == t.name {
			continue
		}
		st := Alive
		if n.cut[pair(t.name, name)] || n.gone[name] {
			st = Dead
		}
		out = append(out, Member{Name: name, State: st})
	}
	return out
}

func (t *fakeTransport) Joined() bool { return t.joined }

// memStore is an in-memory Store; failing makes writes fail.
type memStore struct {
	mu      *lockorder.Mutex
	data    map[string][]byte // guarded by mu
	failing error             // guarded by mu
	writes  int               // guarded by mu
}

func newMemStore() *memStore {
	return &memStore{mu: lockorder.New(lockorder.LevelLeaf), data: map[string][]byte{}}
}

func (s *memStore) LoadIPAM() (map[string][]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return maps.Clone(s.data), nil
}

func (s *memStore) WriteIPAM(puts map[string][]byte) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.failing != nil {
		return s.failing
	}
	s.writes++
	for k, v := range puts {
		if v == nil {
			delete(s.data, k)
		} else {
			s.data[k] = append([]byte(nil), v...)
		}
	}
	return nil
}

func (s *memStore) setFailing(err error) {
	s.mu.Lock()
	s.failing = err
	s.mu.Unlock()
}

// host is one allocator of a test cluster.
type host struct {
	name  string
	a     *Allocator
	store Store
	logs  *logrec.Recorder
}

type cluster struct {
	t     *testing.T
	net   *fakeNet
	hosts map[string]*host
}

func newCluster(t *testing.T, names ...string) *cluster {
	t.Helper()
	c := &cluster{t: t, net: newFakeNet(), hosts: map[string]*host{}}
	for _, n := range names {
		c.start(n, newMemStore())
	}
	for _, h := range c.hosts {
		h.a.MembersChanged()
	}
	return c
}

// start (re)starts host name on store and connects it.
func (c *cluster) start(name string, store Store) *host {
	c.t.Helper()
	return c.startWith(name, store, testTiming)
}

func (c *cluster) startWith(name string, store Store, tm timing) *host {
	c.t.Helper()
	logs := &logrec.Recorder{}
	a, err := newAllocator(Config{NodeName: name, Store: store, Logger: logs.Logger()}, tm)
	if err != nil {
		c.t.Fatalf("start %s: %v", name, err)
	}
	c.t.Cleanup(a.Close)
	h := &host{name: name, a: a, store: store, logs: logs}
	c.net.mu.Lock()
	c.net.nodes[name] = a
	delete(c.net.gone, name)
	c.net.mu.Unlock()
	c.hosts[name] = h
	a.SetTransport(&fakeTransport{net: c.net, name: name, joined: true})
	for _, o := range c.hosts {
		o.a.MembersChanged()
	}
	return h
}

// poolCluster starts hosts names with timing tm, each requesting the pool
// 198.51.100.0/24, and returns the cluster and the pool's ID.
func poolCluster(t *testing.T, tm timing, names ...string) (*cluster, string) {
	t.Helper()
	c := newCluster(t)
	for _, n := range names {
		c.startWith(n, newMemStore(), tm)
	}
	var poolID string
	for _, n := range c.names() {
		poolID = c.hosts[n].requestPool(t, "198.51.100.0/24", "")
	}
	return c, poolID
}

// stop closes host name; the others list it as dead.
func (c *cluster) stop(name string) {
	c.hosts[name].a.Close()
	c.net.mu.Lock()
	c.net.gone[name] = true
	c.net.mu.Unlock()
	for _, o := range c.hosts {
		o.a.MembersChanged()
	}
}

// remove takes host name out of the membership (a member that left).
func (c *cluster) remove(name string) {
	c.hosts[name].a.Close()
	c.net.mu.Lock()
	delete(c.net.nodes, name)
	c.net.mu.Unlock()
	delete(c.hosts, name)
	for _, o := range c.hosts {
		o.a.MembersChanged()
	}
}

func (c *cluster) names() []string { return sortedKeys(c.hosts) }

func ctxT(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func (h *host) requestPool(t *testing.T, pool, sub string) string {
	t.Helper()
	r, err := h.a.RequestPool(ctxT(t), PoolRequest{AddressSpace: AddressSpace, Pool: pool, SubPool: sub})
	if err != nil {
		t.Fatalf("%s: RequestPool %s: %v", h.name, pool, err)
	}
	return r.PoolID
}

func mac(host, i int) string { return fmt.Sprintf("02:42:%02x:00:%02x:%02x", host, i>>8, i&0xff) }

func (h *host) request(ctx context.Context, poolID, addr, macAddr string) (netip.Prefix, error) {
	opts := map[string]string{}
	if macAddr != "" {
		opts[OptionMACAddress] = macAddr
	}
	return h.a.RequestAddress(ctx, AddressRequest{PoolID: poolID, Address: addr, Options: opts})
}

// allocations returns every address the host has allocated in pool.
func (h *host) allocations(poolID string) []uint32 {
	p := h.a.lookupPool(poolID)
	if p == nil {
		return nil
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]uint32(nil), p.allocs.sorted...)
}

// checkNoDuplicates asserts, over the union of every host's allocations
// in pool, that no address is allocated twice, and that no host reports a
// conflict. Call it at quiet points.
func (c *cluster) checkNoDuplicates(poolID string) (total int) {
	c.t.Helper()
	seen := map[uint32]string{}
	for _, name := range c.names() {
		h := c.hosts[name]
		for _, x := range h.allocations(poolID) {
			if other, dup := seen[x]; dup {
				c.t.Fatalf("%s is allocated on %s and on %s", addrOf(x), other, name)
			}
			seen[x] = name
		}
		for _, ps := range h.a.Status().Pools {
			if len(ps.Conflicts) > 0 {
				c.t.Fatalf("%s reports conflicts in %s: %v", name, ps.PoolID, ps.Conflicts)
			}
		}
	}
	return len(seen)
}

// converge waits until every host holds the same view of pool's ring.
func (c *cluster) converge(poolID string) {
	c.t.Helper()
	waitUntil(c.t, 10*time.Second, "rings of "+poolID+" converge", func() bool {
		var first *ring
		for _, name := range c.names() {
			p := c.hosts[name].a.lookupPool(poolID)
			if p == nil {
				return false
			}
			p.mu.Lock()
			r := p.ring
			if r != nil {
				r = r.clone()
			}
			p.mu.Unlock()
			if r == nil {
				return false
			}
			if first == nil {
				first = r
			} else if !first.covers(r) || !r.covers(first) {
				return false
			}
		}
		return true
	})
}

func waitUntil(t *testing.T, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %s", what, d)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func wantErr(t *testing.T, err error, parts ...string) {
	t.Helper()
	if err == nil {
		t.Fatalf("no error, want one with %q", parts)
	}
	for _, p := range parts {
		if !strings.Contains(err.Error(), p) {
			t.Fatalf("error %q does not say %q", err, p)
		}
	}
}

// wantReason checks the reason an error gives the metrics.
func wantReason(t *testing.T, err error, reason string) {
	t.Helper()
	if got := ReasonOf(err); got != reason {
		t.Fatalf("error %q has refusal reason %q, want %q", err, got, reason)
	}
}

var errDisk = errors.New("disk on fire")
