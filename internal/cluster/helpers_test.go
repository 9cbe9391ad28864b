package cluster

import (
	"fmt"
	"io"
	"log"
	"log/slog"
	"maps"
	"math/rand/v2"
	"net"
	"net/netip"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/overlayd/overlayd/internal/lockorder"
	"github.com/overlayd/overlayd/peerdb"
)

var testKey = []byte("0123456789abcdef0123456789abcdef")

// testWatcher plays the driver: on PeersChanged it takes a lock at the
// network level (as a network's lock) and pulls the keys with Peer, or the
// whole VNI with Peers for nil keys, into its own copy of the remote
// records. It records every breach of the Watcher contract: concurrent
// calls for one VNI, unsorted or duplicate keys, keys of another VNI or of
// this node.
type testWatcher struct {
	self  string
	net   *lockorder.Mutex // LevelNetwork: pulls run under it, as in the driver
	c     atomic.Pointer[Cluster]
	ready chan struct{} // closed once c is set

	mu         sync.Mutex // test bookkeeping (below); taken under net
	state      map[peerdb.Key]peerdb.Peer
	busy       map[uint32]bool // VNIs with a call in progress
	violations []string
	// onChange, if set, is told of every change of the copy (prev or next
	// nil for a create or removal), under mu.
	onChange func(k peerdb.Key, prev, next *peerdb.Peer, at time.Time)
	// removals counts the removals per key (a record that left the copy).
	removals map[peerdb.Key]int
	calls    atomic.Int64
	maxConc  atomic.Int32
	conc     atomic.Int32
}

func newTestWatcher(self string) *testWatcher {
	return &testWatcher{self: self, net: lockorder.New(lockorder.LevelNetwork), ready: make(chan struct{}),
		state: make(map[peerdb.Key]peerdb.Peer), busy: make(map[uint32]bool), removals: make(map[peerdb.Key]int)}
}

func (w *testWatcher) setCluster(c *Cluster) {
	w.c.Store(c)
	close(w.ready)
}

func (w *testWatcher) violation(format string, args ...any) {
	w.violations = append(w.violations, fmt.Sprintf(format, args...))
}

func (w *testWatcher) PeersChanged(vni uint32, keys []peerdb.Key) {
	<-w.ready
	c := w.c.Load()
	n := w.conc.Add(1)
	defer w.conc.Add(-1)
	for {
		m := w.maxConc.Load()
		if n <= m || w.maxConc.CompareAndSwap(m, n) {
			break
		}
	}
	w.calls.Add(1)
	w.mu.Lock()
	if w.busy[vni] {
		w.violation("concurrent calls for VNI %d", vni)
	}
	w.busy[vni] = true
	for i, k := range keys {
		if k.VNI != vni {
			w.violation("key %v in a call for VNI %d", k, vni)
		}
		if k.Origin == w.self {
			w.violation("key %v of this node", k)
		}
		if i > 0 && compareKeys(keys[i-1], k) >= 0 {
			w.violation("keys not sorted or duplicated: %v then %v", keys[i-1], k)
		}
	}
	w.mu.Unlock()
	defer func() {
		w.mu.Lock()
		w.busy[vni] = false
		w.mu.Unlock()
	}()

	w.net.Lock() // the network's lock: Peer/Peers take cluster.mu under it
	defer w.net.Unlock()
	got := make(map[peerdb.Key]*peerdb.Peer, len(keys))
	if keys == nil {
		w.mu.Lock()
		for k := range w.state {
			if k.VNI == vni {
				got[k] = nil
			}
		}
		w.mu.Unlock()
		for k, p := range c.Peers(vni) {
			got[k] = &p
		}
	} else {
		// As the driver pulls: one batched lookup for the call's keys.
		found := make([]peerdb.Found, len(keys))
		c.PeersOf(keys, found)
		for i, k := range keys {
			if found[i].OK {
				got[k] = &found[i].Peer
			} else {
				got[k] = nil
			}
		}
	}
	now := time.Now()
	w.mu.Lock()
	defer w.mu.Unlock()
	for k, next := range got {
		prev, had := w.state[k]
		switch {
		case next == nil && !had:
			continue
		case next == nil:
			delete(w.state, k)
			w.removals[k]++
			if w.onChange != nil {
				w.onChange(k, &prev, nil, now)
			}
		case had && prev == *next:
			continue
		default:
			w.state[k] = *next
			if w.onChange != nil {
				var pp *peerdb.Peer
				if had {
					pp = &prev
				}
				w.onChange(k, pp, next, now)
			}
		}
	}
}

func (w *testWatcher) snapshot() map[peerdb.Key]peerdb.Peer {
	w.mu.Lock()
	defer w.mu.Unlock()
	return maps.Clone(w.state)
}

func (w *testWatcher) removalsOf(k peerdb.Key) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.removals[k]
}

func (w *testWatcher) checkViolations(t testing.TB, name string) {
	t.Helper()
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, v := range w.violations {
		t.Errorf("%s: watcher contract broken: %s", name, v)
	}
}

// waitFor polls cond until it holds or the deadline passes.
func waitFor(t testing.TB, timeout time.Duration, what string, cond func() (bool, string)) time.Duration {
	t.Helper()
	start := time.Now()
	deadline := start.Add(timeout)
	for {
		ok, detail := cond()
		if ok {
			return time.Since(start)
		}
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s: %s", timeout, what, detail)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// partition blocks traffic between addresses of different groups.
type partition struct {
	mu    sync.RWMutex
	group map[string]int // host -> group; absent: no restriction
}

func (p *partition) set(groups ...[]string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.group = make(map[string]int)
	for i, g := range groups {
		for _, h := range g {
			p.group[h] = i + 1
		}
	}
}

func (p *partition) heal() { p.set() }

func (p *partition) blocked(from, to string) bool {
	p.mu.RLock()
	defer p.mu.RUnlock()
	gf, okf := p.group[from]
	gt, okt := p.group[to]
	return okf && okt && gf != gt
}

// faultTransport wraps memberlist's NetTransport: it drops traffic across
// a partition, duplicates and delays packets (reordering them), and counts
// the bytes this node sends (packets and streams, both directions of the
// streams it dials or accepts count what it writes).
type faultTransport struct {
	inner    *memberlist.NetTransport
	host     string
	part     *partition
	dupProb  float64
	maxDelay time.Duration
	bytes    *atomic.Int64 // shared counter
	// held: drop every packet and stream, both ways (a process that is not
	// reachable yet); release with held.Store(false).
	held     atomic.Bool
	streamCh chan net.Conn
	packetCh chan *memberlist.Packet
	done     chan struct{}
	once     sync.Once
}

// newFaultTransport binds host:port; port 0 picks a free port (the same
// for TCP and UDP), so concurrent test runs on one machine cannot collide.
func newFaultTransport(t testing.TB, host string, port int, part *partition, bytes *atomic.Int64) *faultTransport {
	t.Helper()
	var nt *memberlist.NetTransport
	var err error
	for range 20 { // TCP may get a port whose UDP twin is taken: retry
		nt, err = memberlist.NewNetTransport(&memberlist.NetTransportConfig{
			BindAddrs: []string{host}, BindPort: port,
			Logger: newDiscardStdLogger(),
		})
		if err == nil || port != 0 {
			break
		}
	}
	if err != nil {
		t.Fatalf("transport on %s:%d: %v", host, port, err)
	}
	ft := &faultTransport{inner: nt, host: host, part: part, bytes: bytes,
		streamCh: make(chan net.Conn), packetCh: make(chan *memberlist.Packet), done: make(chan struct{})}
	go ft.pump()
	return ft
}

func (f *faultTransport) pump() {
	for {
		select {
		case p := <-f.inner.PacketCh():
			if f.held.Load() {
				continue
			}
			select {
			case f.packetCh <- p:
			case <-f.done:
				return
			}
		case c := <-f.inner.StreamCh():
			if f.held.Load() || f.part != nil && f.part.blocked(hostOf(c.RemoteAddr().String()), f.host) {
				c.Close()
				continue
			}
			select {
			case f.streamCh <- &countConn{Conn: c, n: f.bytes}:
			case <-f.done:
				c.Close()
				return
			}
		case <-f.done:
			return
		}
	}
}

func hostOf(addr string) string {
	h, _, err := net.SplitHostPort(addr)
	if err != nil {
		return addr
	}
	return h
}

func (f *faultTransport) FinalAdvertiseAddr(ip string, port int) (net.IP, int, error) {
	return f.inner.FinalAdvertiseAddr(ip, port)
}

func (f *faultTransport) WriteTo(b []byte, addr string) (time.Time, error) {
	if f.held.Load() || f.part != nil && f.part.blocked(f.host, hostOf(addr)) {
		return time.Now(), nil // silently lost
	}
	if f.bytes != nil {
		f.bytes.Add(int64(len(b)))
	}
	if f.maxDelay > 0 || f.dupProb > 0 {
		copies := 1
		if rand.Float64() < f.dupProb {
			copies = 2
		}
		for range copies {
			buf := append([]byte(nil), b...)
			if d := time.Duration(rand.Int64N(int64(f.maxDelay) + 1)); d > 0 {
				time.AfterFunc(d, func() {
					select {
					case <-f.done:
					default:
						_, _ = f.inner.WriteTo(buf, addr)
					}
				})
			} else {
				_, _ = f.inner.WriteTo(buf, addr)
			}
		}
		return time.Now(), nil
	}
	return f.inner.WriteTo(b, addr)
}

func (f *faultTransport) WriteToAddress(b []byte, a memberlist.Address) (time.Time, error) {
	return f.WriteTo(b, a.Addr)
}

func (f *faultTransport) PacketCh() <-chan *memberlist.Packet { return f.packetCh }

func (f *faultTransport) DialTimeout(addr string, timeout time.Duration) (net.Conn, error) {
	if f.held.Load() || f.part != nil && f.part.blocked(f.host, hostOf(addr)) {
		return nil, fmt.Errorf("partitioned from %s", addr)
	}
	c, err := f.inner.DialTimeout(addr, timeout)
	if err != nil {
		return nil, err
	}
	return &countConn{Conn: c, n: f.bytes}, nil
}

func (f *faultTransport) DialAddressTimeout(a memberlist.Address, timeout time.Duration) (net.Conn, error) {
	return f.DialTimeout(a.Addr, timeout)
}

func (f *faultTransport) StreamCh() <-chan net.Conn { return f.streamCh }

// Shutdown stops the inner transport first: its listener goroutines block
// handing connections over until the pump takes them, so the pump must
// keep running until they have exited.
func (f *faultTransport) Shutdown() error {
	err := f.inner.Shutdown()
	f.once.Do(func() { close(f.done) })
	return err
}

type countConn struct {
	net.Conn
	n *atomic.Int64
}

func (c *countConn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	if c.n != nil {
		c.n.Add(int64(n))
	}
	return n, err
}

// testLogger logs warnings and errors to the test log (or stderr with -v
// OVERLAYD_TEST_LOG=debug).
func testLogger(t testing.TB) *slog.Logger {
	level := slog.LevelError + 1 // quiet: tests assert counters instead
	switch os.Getenv("OVERLAYD_TEST_LOG") {
	case "debug":
		level = slog.LevelDebug
	case "info":
		level = slog.LevelInfo
	case "warn":
		level = slog.LevelWarn
	}
	if f := os.Getenv("OVERLAYD_TEST_LOGFILE"); f != "" {
		logFileOnce.Do(func() {
			var err error
			if logFile, err = os.Create(f); err != nil {
				t.Fatal(err)
			}
		})
		return slog.New(slog.NewTextHandler(logFile, &slog.HandlerOptions{Level: level}))
	}
	return slog.New(slog.NewTextHandler(&tbWriter{t: t}, &slog.HandlerOptions{Level: level}))
}

var (
	logFileOnce sync.Once
	logFile     *os.File
)

type tbWriter struct {
	t  testing.TB
	mu sync.Mutex
}

func (w *tbWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	defer func() { _ = recover() }() // logging after the test ended
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

func newDiscardStdLogger() *log.Logger { return log.New(io.Discard, "", 0) }

// node is one test node.
type node struct {
	t     testing.TB
	name  string
	host  string
	port  int
	vtep  netip.Addr
	w     *testWatcher
	c     *Cluster
	tr    *faultTransport
	local map[peerdb.Key]peerdb.Peer // what it publishes (test bookkeeping)
}

type nodeOpts struct {
	key      []byte
	seeds    []string
	part     *partition
	bytes    *atomic.Int64
	dupProb  float64
	maxDelay time.Duration
	held     bool // the transport drops everything until released
	tweak    func(*Config)
}

func startNode(t testing.TB, name, host string, port int, o nodeOpts) *node {
	t.Helper()
	n := &node{t: t, name: name, host: host, port: port, vtep: netip.MustParseAddr(host),
		local: make(map[peerdb.Key]peerdb.Peer)}
	n.start(o)
	return n
}

// start starts a new process of the node (a new incarnation, a new
// watcher) on n.host:n.port.
func (n *node) start(o nodeOpts) {
	t := n.t
	t.Helper()
	key := o.key
	if key == nil {
		key = testKey
	}
	n.w = newTestWatcher(n.name)
	cfg := Config{
		NodeName:          n.name,
		BindAddr:          netip.MustParseAddr(n.host),
		BindPort:          n.port,
		Key:               key,
		Seeds:             o.seeds,
		Watcher:           n.w,
		Logger:            testLogger(t).With("node", n.name),
		DigestInterval:    500 * time.Millisecond,
		ReconnectInterval: 500 * time.Millisecond,
	}
	n.tr = newFaultTransport(t, n.host, n.port, o.part, o.bytes)
	n.tr.dupProb, n.tr.maxDelay = o.dupProb, o.maxDelay
	n.tr.held.Store(o.held)
	cfg.Transport = n.tr
	n.port = n.tr.inner.GetAutoBindPort() // a restart keeps the port
	cfg.BindPort = n.port
	if o.tweak != nil {
		o.tweak(&cfg)
	}
	c, err := New(cfg)
	if err != nil {
		t.Fatalf("New %s: %v", n.name, err)
	}
	n.c = c
	n.w.setCluster(c)
	t.Cleanup(func() { n.stop() })
}

func (n *node) stop() {
	if n.c != nil {
		_ = n.c.Shutdown()
	}
}

// advertiseProtocol makes n advertise max as the highest protocol it
// speaks (an older overlayd) and gossips that.
func (n *node) advertiseProtocol(max byte) {
	n.t.Helper()
	l := n.c.local
	l.mu.Lock()
	l.protoMax = max
	b := encodeMeta(l.metaLocked())
	l.metaBytes.Store(&b)
	l.mu.Unlock()
	if err := n.c.updateNode(); err != nil {
		n.t.Fatal(err)
	}
}

func (n *node) addr() string { return net.JoinHostPort(n.host, fmt.Sprint(n.port)) }

func (n *node) key(vni uint32, id string) peerdb.Key {
	return peerdb.Key{VNI: vni, Origin: n.name, EndpointID: id}
}

// peer makes a record of this node for endpoint id.
func (n *node) peer(id string, ip string) peerdb.Peer {
	a := netip.MustParseAddr(ip)
	return peerdb.Peer{EndpointID: id, IP: a, MAC: peerdb.MACFromIP(a), VTEP: n.vtep}
}

func (n *node) publish(vni uint32, p peerdb.Peer) {
	k := n.key(vni, p.EndpointID)
	if old, ok := n.local[k]; ok {
		n.c.PublishLocalPeer(vni, &old, &p)
	} else {
		n.c.PublishLocalPeer(vni, nil, &p)
	}
	n.local[k] = p
}

func (n *node) unpublish(vni uint32, id string) {
	k := n.key(vni, id)
	old, ok := n.local[k]
	if !ok {
		n.t.Fatalf("%s: unpublish of unknown %v", n.name, k)
	}
	n.c.PublishLocalPeer(vni, &old, nil)
	delete(n.local, k)
}

// expectedFor returns what node n should hold in force: every other
// listed node's local records.
func expectedFor(n *node, nodes []*node) map[peerdb.Key]peerdb.Peer {
	want := make(map[peerdb.Key]peerdb.Peer)
	for _, o := range nodes {
		if o == n {
			continue
		}
		maps.Copy(want, o.local)
	}
	return want
}

func diffState(got, want map[peerdb.Key]peerdb.Peer) string {
	var d []string
	for k, v := range want {
		if g, ok := got[k]; !ok {
			d = append(d, fmt.Sprintf("missing %v", k))
		} else if g != v {
			d = append(d, fmt.Sprintf("%v: got %v want %v", k, g, v))
		}
	}
	for k := range got {
		if _, ok := want[k]; !ok {
			d = append(d, fmt.Sprintf("extra %v", k))
		}
	}
	sort.Strings(d)
	if len(d) > 6 {
		d = append(d[:6], fmt.Sprintf("... %d more", len(d)-6))
	}
	return strings.Join(d, "; ")
}

// inForce returns every record in force at n for the VNIs of want and
// got, pulled with Peers.
func inForce(n *node, vnis map[uint32]bool) map[peerdb.Key]peerdb.Peer {
	out := make(map[peerdb.Key]peerdb.Peer)
	for vni := range vnis {
		maps.Copy(out, n.c.Peers(vni))
	}
	return out
}

func vnisOf(ms ...map[peerdb.Key]peerdb.Peer) map[uint32]bool {
	out := make(map[uint32]bool)
	for _, m := range ms {
		for k := range m {
			out[k.VNI] = true
		}
	}
	return out
}

// waitConverged waits until every live node's watcher copy, and what its
// Peers returns, hold exactly the other live nodes' records.
func waitConverged(t testing.TB, timeout time.Duration, nodes []*node) time.Duration {
	t.Helper()
	return waitFor(t, timeout, "convergence", func() (bool, string) {
		for _, n := range nodes {
			want, got := expectedFor(n, nodes), n.w.snapshot()
			if d := diffState(got, want); d != "" {
				return false, n.name + " (watcher): " + d
			}
			if d := diffState(inForce(n, vnisOf(want, got)), want); d != "" {
				return false, n.name + " (Peers): " + d
			}
		}
		return true, ""
	})
}

// waitMembers waits until every node sees exactly the given nodes alive.
func waitMembers(t testing.TB, timeout time.Duration, nodes []*node) {
	t.Helper()
	waitFor(t, timeout, "membership", func() (bool, string) {
		for _, n := range nodes {
			if got := n.c.ml.NumMembers(); got != len(nodes) {
				return false, fmt.Sprintf("%s sees %d members, want %d", n.name, got, len(nodes))
			}
		}
		return true, ""
	})
}

// startCluster starts a node per host (on free ports); the others join
// the first.
func startCluster(t testing.TB, prefix string, hosts []string, o nodeOpts) []*node {
	t.Helper()
	var nodes []*node
	for i, h := range hosts {
		oo := o
		if i > 0 {
			oo.seeds = []string{nodes[0].addr()}
		}
		nodes = append(nodes, startNode(t, fmt.Sprintf("%s%d", prefix, i+1), h, 0, oo))
	}
	return nodes
}

// freePort returns a port that was free on host for TCP and UDP (for a
// seed address needed before its node exists).
func freePort(t testing.TB, host string) int {
	t.Helper()
	for range 20 {
		l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
		if err != nil {
			t.Fatal(err)
		}
		port := l.Addr().(*net.TCPAddr).Port
		u, err := net.ListenPacket("udp", net.JoinHostPort(host, fmt.Sprint(port)))
		l.Close()
		if err == nil {
			u.Close()
			return port
		}
	}
	t.Fatal("no free port")
	return 0
}

var _ io.Writer = (*tbWriter)(nil)
