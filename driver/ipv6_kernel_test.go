package driver

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/sandbox"
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
// onHosts (if not nil) runs once the hosts exist, before any network.
func setupV6Hosts(t *testing.T, v6only bool, onHosts func([]*nstest.NS)) *v6Hosts {
	hosts, vteps := nstest.Hosts(t, 2, false)
	if onHosts != nil {
		onHosts(hosts)
	}
	s := &v6Hosts{hosts: hosts}
	pools := []string{"198.51.100.0/24", "2001:db8:1::/64"}
	if v6only {
		pools = pools[1:]
	}
	for i := range hosts {
		d := newTestDriver(t, hosts[i], vteps[i])
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
	s := setupV6Hosts(t, false, func(hosts []*nstest.NS) {
		capt = nstest.StartCapture(t, hosts[0], "eth0", sandbox.DefaultVXLANPort)
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
	if capt.Clear() == 0 {
		t.Fatal("the capture saw no VXLAN packet although ping -6 crossed")
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
