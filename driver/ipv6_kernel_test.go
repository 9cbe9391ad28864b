package driver

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"os/exec"
	"strings"
	"testing"
	"time"

	api "github.com/docker/go-plugins-helpers/network"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/overlayd/overlayd/internal/sandbox"
	"github.com/overlayd/overlayd/internal/statefile"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
	"github.com/overlayd/overlayd/peerdb"
)

// v6Hosts is two hosts (IPv4 underlay) with one network with IPv6 on
// both and one container on each, whose records are injected into the
// other host's driver.
type v6Hosts struct {
	hosts []*nstest.NS
	d     []*Driver
	ctrs  []*nstest.NS
	peers []peerdb.Peer // the record each host would publish for its container
}

const v6VNI = 77

// setupV6Hosts builds v6Hosts for a dual-stack network (198.51.100.0/24
// and 2001:db8:1::/64) or, with v6only, an IPv6-only one. Containers get
// their addresses with duplicate address detection, as dockerd gives them.
// onHosts (if not nil) runs once the hosts exist, before any network, and
// may return host 0's driver (nil: a test driver without state file).
func setupV6Hosts(t *testing.T, v6only bool, onHosts func([]*nstest.NS, []netip.Addr) *Driver) *v6Hosts {
	return setupV6HostsOn(t, false, v6only, onHosts)
}

// setupV6HostsOn is setupV6Hosts on an IPv6 underlay when v6underlay.
func setupV6HostsOn(t *testing.T, v6underlay, v6only bool, onHosts func([]*nstest.NS, []netip.Addr) *Driver) *v6Hosts {
	hosts, vteps := nstest.Hosts(t, 2, v6underlay)
	var d0 *Driver
	if onHosts != nil {
		d0 = onHosts(hosts, vteps)
	}
	s := &v6Hosts{hosts: hosts}
	pools := []string{"198.51.100.0/24", "2001:db8:1::/64"}
	if v6only {
		pools = pools[1:]
	}
	for i := range hosts {
		d := d0
		if i > 0 || d == nil {
			d = newTestDriver(t, hosts[i], vteps[i])
		}
		s.d = append(s.d, d)
		mustCreate(t, d, createReq6("net1", fmt.Sprint(v6VNI), pools...))
		var addr netip.Prefix
		if !v6only {
			addr = netip.MustParsePrefix(fmt.Sprintf("198.51.100.%d/24", 10+i))
		}
		addr6 := netip.MustParsePrefix(fmt.Sprintf("2001:db8:1::%x/64", 0x10+i))
		eid := fmt.Sprintf("ep-host%d", i)
		resp, err := d.CreateEndpoint(endpointReq6("net1", eid, prefixString(addr), addr6.String()))
		if err != nil {
			t.Fatal(err)
		}
		join := mustJoin(t, d, "net1", eid)
		if join.GatewayIPv6 != "2001:db8:1::1" {
			t.Fatalf("Join: GatewayIPv6 %q, want 2001:db8:1::1", join.GatewayIPv6)
		}
		first := addr6
		if addr.IsValid() {
			first = addr
		}
		c := nstest.Container(t, fmt.Sprintf("c%d", i), hosts[i], join.InterfaceName.SrcName, first, nil)
		if addr.IsValid() {
			eth0, err := c.NL.LinkByName("eth0")
			if err != nil {
				t.Fatal(err)
			}
			if err := c.NL.AddrAdd(eth0, &netlink.Addr{IPNet: &net.IPNet{IP: addr6.Addr().AsSlice(), Mask: net.CIDRMask(64, 128)}}); err != nil {
				t.Fatal(err)
			}
		}
		s.ctrs = append(s.ctrs, c)
		mac, _ := peerdb.ParseMAC(resp.Interface.MacAddress)
		s.peers = append(s.peers, peerdb.Peer{EndpointID: eid, IP: addr.Addr(), IPv6: addr6.Addr(), MAC: mac, VTEP: vteps[i]})
	}
	return s
}

// exchange gives each host the other's record.
func (s *v6Hosts) exchange(t *testing.T) {
	t.Helper()
	for i, d := range s.d {
		other := s.peers[1-i]
		if err := applyPeerEvent(d, PeerEvent{VNI: v6VNI, Next: &other}); err != nil {
			t.Fatal(err)
		}
		mustAudit(t, d)
	}
}

// pingBoth pings from each container the other's address of the family of
// pick, across the hosts.
func (s *v6Hosts) pingBoth(t *testing.T, pick func(peerdb.Peer) netip.Addr) {
	t.Helper()
	for i, c := range s.ctrs {
		if err := nstest.PingEventually(c, pick(s.peers[1-i]), 10*time.Second); err != nil {
			t.Fatal(err)
		}
	}
}

// Two hosts, a dual-stack network: containers on different hosts ping each
// other over IPv4 and over IPv6 (the kernel's permanent IPv6 neighbours
// and the VXLAN's FDB carry it), and each reaches its host's IPv6 gateway.
// A deleted record takes both families away.
func TestTwoHostsDualStack(t *testing.T) {
	s := setupV6Hosts(t, false, nil)
	s.exchange(t)
	s.pingBoth(t, func(p peerdb.Peer) netip.Addr { return p.IP })
	s.pingBoth(t, func(p peerdb.Peer) netip.Addr { return p.IPv6 })
	if err := nstest.PingEventually(s.ctrs[0], netip.MustParseAddr("2001:db8:1::1"), 5*time.Second); err != nil {
		t.Fatal(err)
	}
	mac1 := s.peers[1].MAC.String()
	wantPeers(t, s.d[0], "net1", map[string]string{"198.51.100.11": mac1, "2001:db8:1::11": mac1}, map[string]string{mac1: "192.0.2.11"})

	st := s.d[0].Status()
	rp := st.Networks[0].RemotePeers
	if len(rp) != 1 || rp[0].IP != "198.51.100.11" || rp[0].IPv6 != "2001:db8:1::11" || !rp[0].Active || !rp[0].ActiveIPv6 {
		t.Errorf("status of the remote peer: %+v", rp)
	}
	if ep := st.Networks[0].Endpoints; len(ep) != 1 || ep[0].AddressIPv6 != "2001:db8:1::10/64" {
		t.Errorf("status of the local endpoint: %+v", ep)
	}

	prev := s.peers[1]
	if err := applyPeerEvent(s.d[0], PeerEvent{VNI: v6VNI, Prev: &prev}); err != nil {
		t.Fatal(err)
	}
	wantPeers(t, s.d[0], "net1", map[string]string{}, map[string]string{})
	mustAudit(t, s.d[0])
	if err := nstest.Ping(s.ctrs[0], prev.IPv6, 300*time.Millisecond); err == nil {
		t.Fatal("ping -6 crossed after the peer was deleted")
	}
}

// Two hosts, an IPv6-only network: containers ping each other over IPv6;
// nothing IPv4 is programmed.
func TestTwoHostsIPv6Only(t *testing.T) {
	s := setupV6Hosts(t, true, nil)
	s.exchange(t)
	s.pingBoth(t, func(p peerdb.Peer) netip.Addr { return p.IPv6 })
	mac1 := s.peers[1].MAC.String()
	wantPeers(t, s.d[0], "net1", map[string]string{"2001:db8:1::11": mac1}, map[string]string{mac1: "192.0.2.11"})
}

// The reconcile finds a deleted IPv6 neighbour (the audit reports it) and
// puts it back; IPv6 traffic crosses again.
func TestReconcileRepairsIPv6Neighbour(t *testing.T) {
	s := setupV6Hosts(t, false, nil)
	s.exchange(t)
	s.pingBoth(t, func(p peerdb.Peer) netip.Addr { return p.IPv6 })
	h := sandboxHandle(t, s.d[0], "net1")
	vx, err := h.LinkByName(sandbox.VXLANName(v6VNI))
	if err != nil {
		t.Fatal(err)
	}
	if err := h.NeighDel(&netlink.Neigh{LinkIndex: vx.Attrs().Index, Family: unix.AF_INET6, IP: s.peers[1].IPv6.AsSlice()}); err != nil {
		t.Fatal(err)
	}
	problems, err := s.d[0].Audit()
	if err != nil {
		t.Fatal(err)
	}
	if all := strings.Join(problems, "\n"); !strings.Contains(all, "neighbour 2001:db8:1::11") || !strings.Contains(all, "missing") {
		t.Fatalf("audit does not report the deleted IPv6 neighbour:\n%s", all)
	}
	fixed, err := s.d[0].Reconcile()
	if err != nil {
		t.Fatal(err)
	}
	if all := strings.Join(fixed, "\n"); !strings.Contains(all, "2001:db8:1::11") {
		t.Errorf("reconcile does not name the IPv6 neighbour it repaired:\n%s", all)
	}
	mustAudit(t, s.d[0])
	mac1 := s.peers[1].MAC.String()
	wantPeers(t, s.d[0], "net1", map[string]string{"198.51.100.11": mac1, "2001:db8:1::11": mac1}, map[string]string{mac1: "192.0.2.11"})
	// The container's own cache of the neighbour may be fresh: flush it,
	// so the next ping needs the VXLAN proxy's answer again.
	flushNeighbours(t, s.ctrs[0])
	if err := nstest.PingEventually(s.ctrs[0], s.peers[1].IPv6, 10*time.Second); err != nil {
		t.Fatal(err)
	}
}

// flushNeighbours deletes every IPv6 neighbour entry on the container's
// eth0.
func flushNeighbours(t *testing.T, c *nstest.NS) {
	t.Helper()
	for _, n := range containerNeighbours(t, c) {
		if ip, _ := netip.AddrFromSlice(n.IP); ip.IsMulticast() {
			continue
		}
		c.NL.NeighDel(&n)
	}
}

// No multicast crosses between hosts: the containers' duplicate address
// detection, router solicitations and MLD reports, and their Neighbour
// Solicitations for remote addresses, stay on their host (the VXLAN
// link's proxy answers the latter from its permanent neighbours), while
// unicast IPv6 crosses. The sandbox's own links have no link-local
// address, so they send none of it themselves. The capture is shown to
// see floods: with an all-zeros FDB entry added by hand, it does.
func TestIPv6MulticastStaysLocal(t *testing.T) {
	var capt *nstest.Capture
	s := setupV6Hosts(t, false, func(hosts []*nstest.NS, _ []netip.Addr) *Driver {
		capt = nstest.StartCapture(t, hosts[0], "eth0", sandbox.DefaultVXLANPort)
		return nil
	})
	// Both containers' addresses have been through DAD (and their
	// link-local ones, which then send router solicitations).
	for _, c := range s.ctrs {
		if err := nstest.Eventually(10*time.Second, 50*time.Millisecond, func() error { return settledIPv6(c) }); err != nil {
			t.Fatal(err)
		}
	}
	s.exchange(t)
	s.pingBoth(t, func(p peerdb.Peer) netip.Addr { return p.IPv6 })
	// The capture counts as it reads: once it has seen the pings (sent
	// after everything the containers did on coming up), it has seen what
	// came before them.
	err := nstest.Eventually(5*time.Second, 10*time.Millisecond, func() error {
		if n := capt.Clear(); n < 2 {
			return fmt.Errorf("the capture saw %d VXLAN packets although ping -6 crossed both ways", n)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if n := capt.Flooded(); n != 0 {
		t.Fatalf("%d VXLAN packets to a multicast or broadcast MAC crossed the underlay, want none", n)
	}
	// The neighbour came from this host's proxy: no solicitation left it.
	if mac := containerNeighbour(t, s.ctrs[0], s.peers[1].IPv6); mac != s.peers[1].MAC.String() {
		t.Errorf("container 0 resolved %s to %q, want %s", s.peers[1].IPv6, mac, s.peers[1].MAC)
	}
	h := sandboxHandle(t, s.d[0], "net1")
	for _, name := range []string{sandbox.BridgeName(v6VNI), sandbox.VXLANName(v6VNI)} {
		l, err := h.LinkByName(name)
		if err != nil {
			t.Fatal(err)
		}
		addrs, err := h.AddrList(l, unix.AF_INET6)
		if err != nil {
			t.Fatal(err)
		}
		for _, a := range addrs {
			if a.IP.IsLinkLocalUnicast() {
				t.Errorf("%s in the sandbox has link-local address %s: it sends DAD, MLD and router solicitations of its own", name, a.IP)
			}
		}
	}

	// The check sees a flood when there is one.
	vx, err := h.LinkByName(sandbox.VXLANName(v6VNI))
	if err != nil {
		t.Fatal(err)
	}
	flood := &netlink.Neigh{LinkIndex: vx.Attrs().Index, Family: unix.AF_BRIDGE, Flags: netlink.NTF_SELF, State: netlink.NUD_PERMANENT,
		HardwareAddr: make(net.HardwareAddr, 6), IP: s.peers[1].VTEP.AsSlice()}
	if err := h.NeighAppend(flood); err != nil {
		t.Fatal(err)
	}
	defer h.NeighDel(flood)
	err = nstest.Eventually(5*time.Second, 0, func() error {
		nstest.Ping(s.ctrs[0], netip.MustParseAddr("2001:db8:1::99"), 100*time.Millisecond) // solicits an address nobody has
		if capt.Flooded() == 0 {
			return fmt.Errorf("no flooded VXLAN packet seen with an all-zeros FDB entry")
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// settledIPv6 says what IPv6 address of c's eth0 is still tentative (DAD
// not done), or nil.
func settledIPv6(c *nstest.NS) error {
	eth0, err := c.NL.LinkByName("eth0")
	if err != nil {
		return err
	}
	addrs, err := c.NL.AddrList(eth0, unix.AF_INET6)
	if err != nil {
		return err
	}
	linkLocal := false
	for _, a := range addrs {
		if a.Flags&unix.IFA_F_TENTATIVE != 0 {
			return fmt.Errorf("%s of %s is still tentative", a.IPNet, c.Name)
		}
		linkLocal = linkLocal || a.IP.IsLinkLocalUnicast()
	}
	if !linkLocal {
		return fmt.Errorf("%s has no link-local address yet", c.Name)
	}
	return nil
}

// containerNeighbour returns the MAC c's eth0 holds for ip ("" if none).
func containerNeighbour(t *testing.T, c *nstest.NS, ip netip.Addr) string {
	t.Helper()
	for _, n := range containerNeighbours(t, c) {
		if a, _ := netip.AddrFromSlice(n.IP); a == ip {
			return n.HardwareAddr.String()
		}
	}
	return ""
}

// containerNeighbours lists the IPv6 neighbour entries of c's eth0.
func containerNeighbours(t *testing.T, c *nstest.NS) []netlink.Neigh {
	t.Helper()
	eth0, err := c.NL.LinkByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	neighs, err := c.NL.NeighList(eth0.Attrs().Index, unix.AF_INET6)
	if err != nil {
		t.Fatal(err)
	}
	return neighs
}

// A restart adopts the sandbox of a dual-stack network: IPv6 pings keep
// crossing, the restored network and endpoint have their IPv6 subnets and
// address (from the state file), and once settled the reconcile finds
// nothing to change.
func TestRestartKeepsIPv6(t *testing.T) {
	stateDir := t.TempDir()
	var cfg Config
	var st *statefile.File
	s := setupV6Hosts(t, false, func(hosts []*nstest.NS, vteps []netip.Addr) *Driver {
		st = openStore(t, stateDir)
		cfg = Config{HostNS: hosts[0].Handle, NetnsDir: nstest.NetnsDir(t), AdvertiseAddr: vteps[0], Logger: testLogger(), StateFile: st, Peers: newMemSource()}
		d, err := New(alone(cfg))
		if err != nil {
			t.Fatal(err)
		}
		return d
	})
	s.exchange(t)
	s.pingBoth(t, func(p peerdb.Peer) netip.Addr { return p.IPv6 })
	pl := nstest.StartPingLoop(s.ctrs[0], s.peers[1].IPv6, 10*time.Millisecond, 200*time.Millisecond)

	s.d[0].Close()
	st.Close()
	st = openStore(t, stateDir)
	defer st.Close()
	cfg.StateFile, cfg.Peers = st, newMemSource()
	d, err := New(alone(cfg))
	if err != nil {
		t.Fatalf("restart: %v", err)
	}
	defer d.Close()
	if err := applyPeerEvent(d, PeerEvent{VNI: v6VNI, Next: &s.peers[1]}); err != nil {
		t.Fatal(err)
	}
	pl.WaitSent(20)
	sent, lost := pl.Stop()
	if lost != 0 {
		t.Errorf("%d of %d IPv6 pings lost across a restart", lost, sent)
	}
	ns := d.Status().Networks
	if len(ns) != 1 || fmt.Sprint(ns[0].Subnets) != "[198.51.100.0/24 2001:db8:1::/64]" || len(ns[0].Endpoints) != 1 || ns[0].Endpoints[0].AddressIPv6 != "2001:db8:1::10/64" {
		t.Fatalf("restored network: %+v", ns)
	}
	if err := d.Settle(); err != nil {
		t.Fatal(err)
	}
	if fixed, err := d.Reconcile(); err != nil || len(fixed) != 0 {
		t.Fatalf("Reconcile after the restart fixed %v (err %v), want nothing", fixed, err)
	}
	mustAudit(t, d)
	if err := nstest.Ping(s.ctrs[0], s.peers[1].IPv6, time.Second); err != nil {
		t.Fatal(err)
	}
}

// An IPv6 address that moves to another endpoint (another MAC) is
// reachable again at once from a container that had the old MAC cached as
// reachable: the sandbox sends an unsolicited Neighbour Advertisement with
// the override flag. Without it the container would keep sending to the
// old MAC for its reachable time (15 to 45 s) and the probes after it.
func TestMovedIPv6AddressIsAnnounced(t *testing.T) {
	s := setupV6Hosts(t, true, nil)
	s.exchange(t)
	s.pingBoth(t, func(p peerdb.Peer) netip.Addr { return p.IPv6 })
	if err := s.d[1].Leave(&api.LeaveRequest{NetworkID: "net1", EndpointID: "ep-host1"}); err != nil {
		t.Fatal(err)
	}
	addr6 := netip.PrefixFrom(s.peers[1].IPv6, 64)
	resp, err := s.d[1].CreateEndpoint(endpointReq6("net1", "ep-host1-new", "", addr6.String()))
	if err != nil {
		t.Fatal(err)
	}
	mac, _ := peerdb.ParseMAC(resp.Interface.MacAddress)
	join := mustJoin(t, s.d[1], "net1", "ep-host1-new")
	c := nstest.Container(t, "c1-new", s.hosts[1], join.InterfaceName.SrcName, addr6, nil)
	if err := nstest.Eventually(10*time.Second, 50*time.Millisecond, func() error { return settledIPv6(c) }); err != nil {
		t.Fatal(err)
	}
	moved := peerdb.Peer{EndpointID: "ep-host1-new", IPv6: addr6.Addr(), MAC: mac, VTEP: s.peers[1].VTEP}
	if err := applyPeerEvents(s.d[0], PeerEvent{VNI: v6VNI, Prev: &s.peers[1]}, PeerEvent{VNI: v6VNI, Next: &moved}); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := nstest.PingEventually(s.ctrs[0], addr6.Addr(), 2*time.Second); err != nil {
		t.Fatalf("the moved IPv6 address is not reachable within 2 s (the container still sends to the old MAC): %v", err)
	}
	t.Logf("moved IPv6 address reachable again after %v", time.Since(start).Round(time.Millisecond))
	if got := containerNeighbour(t, s.ctrs[0], addr6.Addr()); got != mac.String() {
		t.Errorf("container 0 has %s at %q, want %s", addr6.Addr(), got, mac)
	}
}

// A dual-stack network over an IPv6 underlay: both families cross in
// VXLAN over IPv6.
func TestTwoHostsDualStackIPv6Underlay(t *testing.T) {
	s := setupV6HostsOn(t, true, false, nil)
	s.exchange(t)
	s.pingBoth(t, func(p peerdb.Peer) netip.Addr { return p.IP })
	s.pingBoth(t, func(p peerdb.Peer) netip.Addr { return p.IPv6 })
	mac1 := s.peers[1].MAC.String()
	wantPeers(t, s.d[0], "net1", map[string]string{"198.51.100.11": mac1, "2001:db8:1::11": mac1}, map[string]string{mac1: s.peers[1].VTEP.String()})
}

// The bridge of a segment with IPv6 does not snoop multicast: with a
// querier on the segment, a snooping bridge sends a Neighbour
// Solicitation only to the ports listening to its solicited-node group,
// and a local container whose address shares that group with a remote
// one (the same last 24 bits) keeps the solicitation from the VXLAN proxy:
// the remote address cannot be resolved (seen here in most runs of this
// setup with snooping on; whether the bridge snoops at the moment of the
// solicitation depends on its query timers, so the test does not rely on
// it). Snooping turned back on by hand is reported by the audit and turned
// off by the reconcile; then, with a querier and a container in the remote
// address's group, the remote address resolves.
func TestIPv6SolicitationsReachTheProxy(t *testing.T) {
	s := setupV6Hosts(t, true, nil)
	s.exchange(t)
	// A second container on host 0 in the solicited-node group of the
	// remote 2001:db8:1::11.
	shadow := netip.MustParsePrefix("2001:db8:1::100:11/64")
	if _, err := s.d[0].CreateEndpoint(endpointReq6("net1", "ep-shadow", "", shadow.String())); err != nil {
		t.Fatal(err)
	}
	join := mustJoin(t, s.d[0], "net1", "ep-shadow")
	c := nstest.Container(t, "c-shadow", s.hosts[0], join.InterfaceName.SrcName, shadow, nil)
	if err := nstest.Eventually(10*time.Second, 50*time.Millisecond, func() error { return settledIPv6(c) }); err != nil {
		t.Fatal(err)
	}
	h := sandboxHandle(t, s.d[0], "net1")
	br, err := h.LinkByName(sandbox.BridgeName(v6VNI))
	if err != nil {
		t.Fatal(err)
	}
	if b, ok := br.(*netlink.Bridge); !ok || b.MulticastSnooping == nil || *b.MulticastSnooping {
		t.Fatalf("bridge %s snoops multicast", br.Attrs().Name)
	}
	// Snooping on again, and a querier on the segment: container 0 sends
	// MLD queries, the other container answers with its groups.
	sbPath := s.d[0].host.Path("net1")
	out, err := exec.Command("nsenter", "--net="+sbPath, "ip", "link", "set", br.Attrs().Name, "type", "bridge", "mcast_snooping", "1").CombinedOutput()
	if err != nil {
		t.Fatalf("turning snooping on: %v: %s", err, out)
	}
	err = nstest.Eventually(15*time.Second, 200*time.Millisecond, func() error {
		sendMLDQuery(t, s.ctrs[0])
		out, err := exec.Command("nsenter", "--net="+sbPath, "bridge", "mdb", "show", "dev", br.Attrs().Name).CombinedOutput()
		if err != nil || !strings.Contains(string(out), "ff02::1:ff00:11") {
			return fmt.Errorf("the bridge has not snooped the group ff02::1:ff00:11 yet: %v %s", err, out)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	problems, err := s.d[0].Audit()
	if err != nil {
		t.Fatal(err)
	}
	if all := strings.Join(problems, "\n"); !strings.Contains(all, "multicast snooping on, want off") {
		t.Fatalf("the audit does not report the snooping bridge:\n%s", all)
	}
	fixed, err := s.d[0].Reconcile()
	if err != nil {
		t.Fatal(err)
	}
	if all := strings.Join(fixed, "\n"); !strings.Contains(all, "multicast snooping on") {
		t.Errorf("the reconcile does not say it turned snooping off:\n%s", all)
	}
	mustAudit(t, s.d[0])
	sendMLDQuery(t, s.ctrs[0])
	flushNeighbours(t, s.ctrs[0])
	if err := nstest.PingEventually(s.ctrs[0], s.peers[1].IPv6, 10*time.Second); err != nil {
		t.Fatal(err)
	}
}

// sendMLDQuery sends from c's eth0 an MLDv2 general query (from a
// link-local address, hop limit 1, router alert, as RFC 3810 wants), so
// that c is the segment's querier and the others report their groups
// within 10 ms. (A bridge snoops only once the query's maximum response
// time has passed: the next command the test runs comes later.)
func sendMLDQuery(t *testing.T, c *nstest.NS) {
	t.Helper()
	eth0, err := c.NL.LinkByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	src := netip.MustParseAddr("fe80::1").As16()
	dst := netip.MustParseAddr("ff02::1").As16()
	f := make([]byte, 14+40+8+28)
	copy(f[0:6], []byte{0x33, 0x33, 0, 0, 0, 1})
	copy(f[6:12], eth0.Attrs().HardwareAddr)
	binary.BigEndian.PutUint16(f[12:], unix.ETH_P_IPV6)
	ip := f[14:]
	ip[0] = 6 << 4
	binary.BigEndian.PutUint16(ip[4:], 8+28)
	ip[6], ip[7] = 0, 1 // hop-by-hop options next, hop limit 1
	copy(ip[8:24], src[:])
	copy(ip[24:40], dst[:])
	hbh := ip[40:48]
	hbh[0] = unix.IPPROTO_ICMPV6
	copy(hbh[2:], []byte{5, 2, 0, 0, 1, 0}) // router alert (MLD), PadN
	q := ip[48:]
	q[0] = 130                             // multicast listener query
	binary.BigEndian.PutUint16(q[4:], 100) // maximum response: 100 ms
	q[24], q[25] = 2, 125                  // QRV 2, QQIC 125 s
	var sum uint32
	for _, b := range [][]byte{src[:], dst[:], q} {
		for i := 0; i+1 < len(b); i += 2 {
			sum += uint32(binary.BigEndian.Uint16(b[i:]))
		}
	}
	sum += uint32(len(q)) + unix.IPPROTO_ICMPV6
	for sum>>16 != 0 {
		sum = sum&0xffff + sum>>16
	}
	binary.BigEndian.PutUint16(q[2:], ^uint16(sum))
	fd, err := netnsutil.Socket(c.Handle, unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	sa := &unix.SockaddrLinklayer{Protocol: 0xdd86, Ifindex: eth0.Attrs().Index, Halen: 6} // ETH_P_IPV6 in network order
	copy(sa.Addr[:], f[:6])
	if err := unix.Sendto(fd, f, 0, sa); err != nil {
		t.Fatal(err)
	}
}
