package driver

import (
	"context"
	"net"
	"net/netip"
	"os"
	"slices"
	"sync"
	"testing"
	"time"

	api "github.com/docker/go-plugins-helpers/network"
	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/dnsserver"
	"github.com/overlayd/overlayd/internal/nameindex"
	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/overlayd/overlayd/internal/sandbox"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
	"github.com/overlayd/overlayd/internal/testutil/solo"
)

// testNameServer serves the driver's sockets with a real dnsserver over an
// index the test rebuilds from the driver (as the daemon does).
type testNameServer struct {
	srv    *dnsserver.Server
	ix     nameindex.Index
	ctx    context.Context
	mu     sync.Mutex
	served []string
}

func (s *testNameServer) Serve(network string, pc net.PacketConn, ln net.Listener) {
	s.mu.Lock()
	s.served = append(s.served, network)
	s.mu.Unlock()
	go s.srv.Serve(s.ctx, network, pc, ln)
}

func (s *testNameServer) NamesChanged() {}

func (s *testNameServer) servedCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.served)
}

// recordedNames is a control plane's LocalPublisher that keeps the names
// published.
type recordedNames struct {
	solo.ControlPlane
	mu  sync.Mutex
	got map[string]string // endpoint → packed
}

func (r *recordedNames) PublishLocalNames(vni uint32, ep, packed string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.got[ep] = packed
	return nil
}

// queryIn asks the server at addr:53 for name from inside ns, over UDP.
func queryIn(t *testing.T, ns *nstest.NS, server netip.Addr, name string, qtype uint16) (*dns.Msg, error) {
	t.Helper()
	fd, err := netnsutil.Socket(ns.Handle, unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(fd), "query")
	defer f.Close()
	pc, err := net.FilePacketConn(f)
	if err != nil {
		return nil, err
	}
	defer pc.Close()
	c := &dns.Client{Net: "udp", Timeout: 2 * time.Second}
	m := new(dns.Msg)
	m.SetQuestion(dns.Fqdn(name), qtype)
	to := net.UDPAddrFromAddrPort(netip.AddrPortFrom(server, 53))
	r, _, err := c.ExchangeWithConn(m, &dns.Conn{Conn: &boundUDP{UDPConn: pc.(*net.UDPConn), to: to}})
	return r, err
}

// boundUDP sends every write of an unconnected UDP socket to one address
// (dns.Conn writes with Write).
type boundUDP struct {
	*net.UDPConn
	to *net.UDPAddr
}

func (b *boundUDP) Write(p []byte) (int, error) { return b.UDPConn.WriteTo(p, b.to) }

func answersOf(r *dns.Msg) []string {
	var out []string
	for _, rr := range r.Answer {
		switch rr := rr.(type) {
		case *dns.A:
			out = append(out, rr.A.String())
		case *dns.AAAA:
			out = append(out, rr.AAAA.String())
		}
	}
	slices.Sort(out)
	return out
}

// A container resolves the names of the containers on every network it
// shares with them, from the name server in the network's sandbox, reached
// through the route its Join handed over (one per container); a container
// that shares no network with a name does not get it; a name goes with its
// endpoint's Leave; a bridge stripped of the server's address gets it back
// on the next Reconcile.
func TestNamesServedInSandbox(t *testing.T) {
	host := nstest.NewNS(t, "host")
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ns := &testNameServer{ctx: ctx}
	srv, err := dnsserver.New(dnsserver.Config{Names: &ns.ix, Logger: testLogger(), Timeout: 200 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	ns.srv = srv
	pub := &recordedNames{got: map[string]string{}}
	d, err := New(alone(Config{HostNS: host.Handle, NetnsDir: nstest.NetnsDir(t), Logger: testLogger(), Peers: newMemSource(),
		NameServer: ns, Publisher: pub}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	rebuild := func() { ns.ix.Store(nameindex.Build(d.LocalNames())) }
	dnsAddr := DefaultDNSAddress
	dnsRoute := netip.PrefixFrom(dnsAddr, 32).String()

	mustCreate(t, d, createReq("net1", "42", "192.0.2.0/24"))
	mustCreate(t, d, createReq("net2", "43", "198.51.100.0/24"))
	type ctr struct {
		net, ep, addr, key string
		route              bool // the Join must hand over the DNS route
	}
	ctrs := []ctr{
		{"net1", "ep-a", "192.0.2.2/24", "/run/docker/netns/a", true},
		{"net2", "ep-a2", "198.51.100.2/24", "/run/docker/netns/a", false}, // a's second network: a holds the route already
		{"net1", "ep-b", "192.0.2.3/24", "/run/docker/netns/b", true},
		{"net2", "ep-c", "198.51.100.4/24", "/run/docker/netns/c", true},
	}
	nss := map[string]*nstest.NS{}
	for _, c := range ctrs {
		mustEndpoint(t, d, c.net, c.ep, c.addr)
		resp, err := d.Join(&api.JoinRequest{NetworkID: c.net, EndpointID: c.ep, SandboxKey: c.key})
		if err != nil {
			t.Fatal(err)
		}
		got := slices.ContainsFunc(resp.StaticRoutes, func(r *api.StaticRoute) bool {
			return r.Destination == dnsRoute && r.RouteType == routeConnected && r.NextHop == ""
		})
		if got != c.route {
			t.Fatalf("Join of %s: DNS route handed over %v, want %v (routes %+v)", c.ep, got, c.route, resp.StaticRoutes)
		}
		routes := map[netip.Prefix]netip.Addr{}
		if c.route {
			routes[netip.MustParsePrefix(dnsRoute)] = netip.Addr{}
		}
		if nss[c.key] == nil {
			nss[c.key] = nstest.Container(t, c.ep, host, resp.InterfaceName.SrcName, netip.MustParsePrefix(c.addr), routes)
		} else { // a second link of the same container
			link, err := host.NL.LinkByName(resp.InterfaceName.SrcName)
			if err != nil {
				t.Fatal(err)
			}
			cns := nss[c.key]
			if err := host.NL.LinkSetNsFd(link, int(cns.Handle)); err != nil {
				t.Fatal(err)
			}
			link, _ = cns.NL.LinkByName(resp.InterfaceName.SrcName)
			cns.NL.AddrAdd(link, &netlink.Addr{IPNet: netipToIPNet(netip.MustParsePrefix(c.addr))})
			if err := cns.NL.LinkSetUp(link); err != nil {
				t.Fatal(err)
			}
		}
	}
	if n := ns.servedCount(); n != 2 {
		t.Fatalf("name server sockets handed over %d times, want 2 (one per sandbox)", n)
	}
	mustAudit(t, d)
	if !d.SetNames(map[string][]string{"ep-a": {"web"}, "ep-a2": {"web"}, "ep-b": {"db", "DB.Primary", "bad name"}, "ep-c": {"cache"}}) {
		t.Fatal("SetNames reported no change")
	}
	if d.SetNames(map[string][]string{"ep-a": {"web"}, "ep-a2": {"web"}, "ep-b": {"db", "DB.Primary", "bad name"}, "ep-c": {"cache"}}) {
		t.Fatal("SetNames reported a change for the same names")
	}
	if got := pub.got["ep-b"]; got == "" {
		t.Fatalf("names of ep-b not published: %v", pub.got)
	}
	rebuild()
	a, b := nss["/run/docker/netns/a"], nss["/run/docker/netns/b"]
	for _, q := range []struct {
		from *nstest.NS
		name string
		want []string
	}{
		{a, "db", []string{"192.0.2.3"}},
		{a, "db.primary", []string{"192.0.2.3"}},
		{a, "cache", []string{"198.51.100.4"}}, // a is on net2 too
		{a, "web", []string{"192.0.2.2", "198.51.100.2"}},
		{b, "web", []string{"192.0.2.2"}},
	} {
		r, err := queryIn(t, q.from, dnsAddr, q.name, dns.TypeA)
		if err != nil {
			t.Fatalf("%s from %s: %v", q.name, q.from.Name, err)
		}
		if r.Rcode != dns.RcodeSuccess || !slices.Equal(answersOf(r), q.want) {
			t.Fatalf("%s from %s: rcode %s answers %v, want %v", q.name, q.from.Name, dns.RcodeToString[r.Rcode], answersOf(r), q.want)
		}
	}
	// b shares no network with c: "cache" is not its name, so it is
	// forwarded (no upstream here: SERVFAIL), never answered.
	r, err := queryIn(t, b, dnsAddr, "cache", dns.TypeA)
	if err != nil || r.Rcode != dns.RcodeServerFailure || len(r.Answer) != 0 {
		t.Fatalf("cache from b: %v %v, want a SERVFAIL without answers", r, err)
	}
	// The address gone from the bridge: Reconcile puts it back.
	sbns := d.nets["net1"].sb.NS()
	h, err := netlink.NewHandleAt(sbns)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	br, err := h.LinkByName(sandbox.BridgeName(42))
	if err != nil {
		t.Fatal(err)
	}
	if err := h.AddrDel(br, &netlink.Addr{IPNet: netipToIPNet(netip.MustParsePrefix(dnsRoute))}); err != nil {
		t.Fatal(err)
	}
	if problems, _ := d.Audit(); len(problems) == 0 {
		t.Fatal("audit found nothing with the name server's address gone from the bridge")
	}
	if _, err := d.Reconcile(); err != nil {
		t.Fatal(err)
	}
	mustAudit(t, d)
	if r, err := queryIn(t, a, dnsAddr, "db", dns.TypeA); err != nil || !slices.Equal(answersOf(r), []string{"192.0.2.3"}) {
		t.Fatalf("db from a after the repair: %v %v", r, err)
	}
	// b leaves: its names are not served any more.
	if err := d.Leave(&api.LeaveRequest{NetworkID: "net1", EndpointID: "ep-b"}); err != nil {
		t.Fatal(err)
	}
	rebuild()
	if r, err := queryIn(t, a, dnsAddr, "db", dns.TypeA); err != nil || r.Rcode != dns.RcodeServerFailure {
		t.Fatalf("db from a after b left: %v %v, want SERVFAIL (forwarded)", r, err)
	}
	// A's route holder leaves: the route is free for its next Join.
	if err := d.Leave(&api.LeaveRequest{NetworkID: "net1", EndpointID: "ep-a"}); err != nil {
		t.Fatal(err)
	}
	if len(d.dnsRoutes) != 1 {
		t.Fatalf("DNS routes held after the Leaves: %v, want c's only", d.dnsRoutes)
	}
}

func netipToIPNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}
