package cluster

import (
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
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
	"github.com/overlayd/overlayd/peerdb"
)

var testKey = []byte("0123456789abcdef0123456789abcdef")

// sinkKey identifies a delivered peer in a test sink: the VTEP tells the
// origin apart.
type sinkKey struct {
	VNI  uint32
	VTEP netip.Addr
	ID   string
}

// testSink applies events to a map with (prev, next) semantics and records
// every violation: a create of a key it has, a prev that differs from what
// it holds, an update that changes the key, an empty event.
type testSink struct {
	mu         sync.Mutex
	state      map[sinkKey]peerdb.Peer
	violations []string
	events     []Event
	keepEvents bool
	fail       atomic.Bool // return an error (after applying)
	onApply    func(Event, time.Time)
	calls      atomic.Int64
	concurrent atomic.Int32
	maxConc    atomic.Int32
}

func newTestSink() *testSink { return &testSink{state: make(map[sinkKey]peerdb.Peer)} }

func keyOf(vni uint32, p *peerdb.Peer) sinkKey { return sinkKey{vni, p.VTEP, p.EndpointID} }

func (s *testSink) ApplyPeerEvents(evs []Event) error {
	n := s.concurrent.Add(1)
	defer s.concurrent.Add(-1)
	for {
		m := s.maxConc.Load()
		if n <= m || s.maxConc.CompareAndSwap(m, n) {
			break
		}
	}
	s.calls.Add(1)
	now := time.Now()
	s.mu.Lock()
	for i, ev := range evs {
		if i > 0 && evs[i-1].VNI > ev.VNI {
			s.violations = append(s.violations, "events not sorted by VNI")
		}
		if s.keepEvents {
			s.events = append(s.events, ev)
		}
		switch {
		case ev.Prev == nil && ev.Next == nil:
			s.violations = append(s.violations, "empty event")
		case ev.Prev == nil:
			k := keyOf(ev.VNI, ev.Next)
			if old, ok := s.state[k]; ok {
				s.violations = append(s.violations, fmt.Sprintf("create of %v which holds %v", k, old))
			}
			s.state[k] = *ev.Next
		default:
			k := keyOf(ev.VNI, ev.Prev)
			old, ok := s.state[k]
			if !ok || old != *ev.Prev {
				s.violations = append(s.violations, fmt.Sprintf("prev %v of %v does not match held %v (%v)", *ev.Prev, k, old, ok))
			}
			delete(s.state, k)
			if ev.Next != nil {
				if nk := keyOf(ev.VNI, ev.Next); nk != k {
					s.violations = append(s.violations, fmt.Sprintf("update changes key %v -> %v", k, nk))
				}
				s.state[keyOf(ev.VNI, ev.Next)] = *ev.Next
			}
		}
	}
	s.mu.Unlock()
	if s.onApply != nil {
		for _, ev := range evs {
			s.onApply(ev, now)
		}
	}
	if s.fail.Load() {
		return errors.New("test sink failure")
	}
	return nil
}

func (s *testSink) snapshot() map[sinkKey]peerdb.Peer {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := make(map[sinkKey]peerdb.Peer, len(s.state))
	for k, v := range s.state {
		out[k] = v
	}
	return out
}

func (s *testSink) checkViolations(t testing.TB, name string) {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, v := range s.violations {
		t.Errorf("%s: sink violation: %s", name, v)
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
	streamCh chan net.Conn
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
		streamCh: make(chan net.Conn), done: make(chan struct{})}
	go ft.pump()
	return ft
}

func (f *faultTransport) pump() {
	for {
		select {
		case c := <-f.inner.StreamCh():
			if f.part != nil && f.part.blocked(hostOf(c.RemoteAddr().String()), f.host) {
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
	if f.part != nil && f.part.blocked(f.host, hostOf(addr)) {
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

func (f *faultTransport) PacketCh() <-chan *memberlist.Packet { return f.inner.PacketCh() }

func (f *faultTransport) DialTimeout(addr string, timeout time.Duration) (net.Conn, error) {
	if f.part != nil && f.part.blocked(f.host, hostOf(addr)) {
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
	sink  *testSink
	c     *Cluster
	tr    *faultTransport
	local map[sinkKey]peerdb.Peer // what it publishes (test bookkeeping)
}

type nodeOpts struct {
	key      []byte
	seeds    []string
	part     *partition
	bytes    *atomic.Int64
	dupProb  float64
	maxDelay time.Duration
	tweak    func(*Config)
}

func startNode(t testing.TB, name, host string, port int, o nodeOpts) *node {
	t.Helper()
	n := &node{t: t, name: name, host: host, port: port, vtep: netip.MustParseAddr(host),
		sink: newTestSink(), local: make(map[sinkKey]peerdb.Peer)}
	n.start(o)
	return n
}

func (n *node) start(o nodeOpts) {
	t := n.t
	t.Helper()
	key := o.key
	if key == nil {
		key = testKey
	}
	cfg := Config{
		NodeName:          n.name,
		BindAddr:          netip.MustParseAddr(n.host),
		BindPort:          n.port,
		Key:               key,
		Seeds:             o.seeds,
		Sink:              n.sink,
		Logger:            testLogger(t).With("node", n.name),
		DigestInterval:    500 * time.Millisecond,
		ReconnectInterval: 500 * time.Millisecond,
	}
	n.tr = newFaultTransport(t, n.host, n.port, o.part, o.bytes)
	n.tr.dupProb, n.tr.maxDelay = o.dupProb, o.maxDelay
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
	t.Cleanup(func() { n.stop() })
}

func (n *node) stop() {
	if n.c != nil {
		_ = n.c.Shutdown()
	}
}

func (n *node) addr() string { return net.JoinHostPort(n.host, fmt.Sprint(n.port)) }

// peer makes a record of this node for endpoint i.
func (n *node) peer(id string, ip string) peerdb.Peer {
	a := netip.MustParseAddr(ip)
	return peerdb.Peer{EndpointID: id, IP: a, MAC: peerdb.MACFromIP(a), VTEP: n.vtep}
}

func (n *node) publish(vni uint32, p peerdb.Peer) {
	k := keyOf(vni, &p)
	if old, ok := n.local[k]; ok {
		n.c.PublishLocalPeer(vni, &old, &p)
	} else {
		n.c.PublishLocalPeer(vni, nil, &p)
	}
	n.local[k] = p
}

func (n *node) unpublish(vni uint32, id string) {
	k := sinkKey{vni, n.vtep, id}
	old, ok := n.local[k]
	if !ok {
		n.t.Fatalf("%s: unpublish of unknown %v", n.name, k)
	}
	n.c.PublishLocalPeer(vni, &old, nil)
	delete(n.local, k)
}

// expectedFor returns what node n's sink should hold: every other listed
// node's local records.
func expectedFor(n *node, nodes []*node) map[sinkKey]peerdb.Peer {
	want := make(map[sinkKey]peerdb.Peer)
	for _, o := range nodes {
		if o == n {
			continue
		}
		for k, v := range o.local {
			want[k] = v
		}
	}
	return want
}

func diffState(got, want map[sinkKey]peerdb.Peer) string {
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

// waitConverged waits until every live node's sink holds exactly the other
// live nodes' records.
func waitConverged(t testing.TB, timeout time.Duration, nodes []*node) time.Duration {
	t.Helper()
	return waitFor(t, timeout, "convergence", func() (bool, string) {
		for _, n := range nodes {
			if d := diffState(n.sink.snapshot(), expectedFor(n, nodes)); d != "" {
				return false, n.name + ": " + d
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
