package driver

import (
	"bytes"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"sort"
	"strings"
	"testing"
	"time"

	api "github.com/docker/go-plugins-helpers/network"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/overlayd/overlayd/internal/sandbox"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
	"github.com/overlayd/overlayd/peerdb"
)

// Two containers on one network on one host ping each other; after
// Leave/DeleteEndpoint/DeleteNetwork nothing of the network remains in any
// namespace.
func TestSingleHostPingAndCleanup(t *testing.T) {
	host := nstest.NewNS(t, "host")
	d := newTestDriver(t, host, netip.Addr{})
	mustCreate(t, d, createReq("net1", "42", "192.0.2.0/24"))
	var ctrs []*nstest.NS
	for i, addr := range []string{"192.0.2.2/24", "192.0.2.3/24"} {
		eid := fmt.Sprintf("ep%d", i)
		mustEndpoint(t, d, "net1", eid, addr)
		resp := mustJoin(t, d, "net1", eid)
		if resp.InterfaceName.DstPrefix != "eth" || resp.Gateway != "" || resp.DisableGatewayService {
			t.Fatalf("Join response %+v", resp)
		}
		ctrs = append(ctrs, nstest.Container(t, "c"+eid, host, resp.InterfaceName.SrcName, netip.MustParsePrefix(addr), nil))
	}
	mustAudit(t, d)
	if err := nstest.PingEventually(ctrs[0], netip.MustParseAddr("192.0.2.3"), 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := nstest.PingEventually(ctrs[1], netip.MustParseAddr("192.0.2.2"), 5*time.Second); err != nil {
		t.Fatal(err)
	}
	// The gateway on the sandbox bridge answers too.
	if err := nstest.PingEventually(ctrs[0], netip.MustParseAddr("192.0.2.1"), 5*time.Second); err != nil {
		t.Fatal(err)
	}

	// The sandbox holds the VXLAN with the configured attributes.
	sbPath := d.host.Path("net1")
	if !isNS(sbPath) {
		t.Fatalf("no sandbox namespace at %s", sbPath)
	}
	for i := 0; i < 2; i++ {
		eid := fmt.Sprintf("ep%d", i)
		if err := d.Leave(&api.LeaveRequest{NetworkID: "net1", EndpointID: eid}); err != nil {
			t.Fatal(err)
		}
		mustAudit(t, d)
		if err := d.DeleteEndpoint(&api.DeleteEndpointRequest{NetworkID: "net1", EndpointID: eid}); err != nil {
			t.Fatal(err)
		}
	}
	// The last Leave handed the sandbox to the reaper.
	d.WaitDeletions()
	if isNS(sbPath) {
		t.Fatalf("sandbox %s still mounted once the last Leave's deletions are done", sbPath)
	}
	if err := d.DeleteNetwork(&api.DeleteNetworkRequest{NetworkID: "net1"}); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, d, append([]*nstest.NS{host}, ctrs...)...)
}

// A sandbox's bridged traffic skips the namespace's netfilter hooks: the
// br_netfilter switches, 1 in a new namespace, are 0 in every sandbox (the
// hooks cost the data path throughput and latency, see
// docs/performance.md), and the driver logs nothing about them.
func TestSandboxBridgeNetfilterOff(t *testing.T) {
	if !brnfAvailable() {
		t.Skip("no br_netfilter in this kernel")
	}
	host := nstest.NewNS(t, "host")
	var logs bytes.Buffer
	d := newTestDriverLogging(t, host, netip.Addr{}, slog.New(slog.NewTextHandler(&logs, nil)))
	mustCreate(t, d, createReq("net1", "42", "192.0.2.0/24"))
	mustEndpoint(t, d, "net1", "ep0", "192.0.2.2/24")
	mustJoin(t, d, "net1", "ep0")
	// The host namespace the test made has the kernel's defaults.
	for name, v := range nsSysctls(t, host.Handle, brnfSysctls) {
		if v != "1" {
			t.Fatalf("a new namespace has %s=%s: the test expects the kernel's default 1", name, v)
		}
	}
	wantBridgeNetfilterOff(t, d, "net1")
	if strings.Contains(logs.String(), "netfilter") {
		t.Fatalf("driver logged about the netfilter hooks although it turned them off:\n%s", logs.String())
	}
}

var brnfSysctls = []string{"bridge-nf-call-iptables", "bridge-nf-call-ip6tables", "bridge-nf-call-arptables"}

// brnfAvailable reports whether br_netfilter is in the kernel (built in or
// loaded): only then do namespaces have its switches.
func brnfAvailable() bool {
	_, err := os.Stat("/proc/sys/net/bridge/bridge-nf-call-iptables")
	return err == nil
}

// nsSysctls reads /proc/sys/net/bridge/NAME for each name in ns.
func nsSysctls(t *testing.T, ns netns.NsHandle, names []string) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := netnsutil.DoIn(ns, func() error {
		for _, name := range names {
			b, err := os.ReadFile("/proc/sys/net/bridge/" + name)
			if err != nil {
				return err
			}
			out[name] = strings.TrimSpace(string(b))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func sandboxNS(t *testing.T, d *Driver, nid string) netns.NsHandle {
	t.Helper()
	h, err := netnsutil.Open(d.host.Path(nid))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

func wantBridgeNetfilterOff(t *testing.T, d *Driver, nid string) {
	t.Helper()
	for name, v := range nsSysctls(t, sandboxNS(t, d, nid), brnfSysctls) {
		if v != "0" {
			t.Errorf("sandbox of %s: net.bridge.%s=%s, want 0", nid, name, v)
		}
	}
}

// setBridgeNetfilter sets every br_netfilter switch of nid's sandbox to v.
func setBridgeNetfilter(t *testing.T, d *Driver, nid, v string) {
	t.Helper()
	err := netnsutil.DoIn(sandboxNS(t, d, nid), func() error {
		for _, name := range brnfSysctls {
			if err := os.WriteFile("/proc/sys/net/bridge/"+name, []byte(v), 0); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

// assertNothingLeft checks with netlink dumps that no overlayd link (veth
// ends, bridges, VXLANs) is left in the host or any container namespace, and
// that the sandbox directory is empty.
func assertNothingLeft(t *testing.T, d *Driver, nss ...*nstest.NS) {
	t.Helper()
	for _, ns := range nss {
		for _, name := range nstest.LinkNames(t, ns.NL) {
			if strings.HasPrefix(name, "ov") || name == "eth0" && ns.Name != "host" && !strings.HasPrefix(ns.Name, "host") {
				// eth0 in a container is the moved veth: it must be gone with its pair.
				t.Errorf("link %s left in namespace %s", name, ns.Name)
			}
		}
		links, _ := ns.NL.LinkList()
		for _, l := range links {
			if l.Type() == "vxlan" {
				t.Errorf("vxlan %s left in namespace %s", l.Attrs().Name, ns.Name)
			}
		}
	}
	entries, _ := os.ReadDir(d.cfg.NetnsDir)
	if len(entries) != 0 {
		t.Errorf("sandbox directory not empty: %v", entries)
	}
	mustAudit(t, d)
}

func isNS(path string) bool {
	var st unix.Statfs_t
	return unix.Statfs(path, &st) == nil && st.Type == unix.NSFS_MAGIC
}

// twoHosts sets up two drivers in two host namespaces joined by an underlay,
// the same network on both and one container on each.
type twoHostSetup struct {
	hosts []*nstest.NS
	vteps []netip.Addr
	d     []*Driver
	ctrs  []*nstest.NS
	peers []peerdb.Peer // the record each host would publish for its container
}

func setupTwoHosts(t *testing.T) *twoHostSetup {
	hosts, vteps := nstest.Hosts(t, 2, false)
	s := &twoHostSetup{hosts: hosts, vteps: vteps}
	for i := range hosts {
		d := newTestDriver(t, hosts[i], vteps[i])
		s.d = append(s.d, d)
		mustCreate(t, d, createReq("net1", "77", "198.51.100.0/24"))
		addr := netip.MustParsePrefix(fmt.Sprintf("198.51.100.%d/24", 10+i))
		eid := fmt.Sprintf("ep-host%d", i)
		mac := mustEndpoint(t, d, "net1", eid, addr.String())
		resp := mustJoin(t, d, "net1", eid)
		s.ctrs = append(s.ctrs, nstest.Container(t, fmt.Sprintf("c%d", i), hosts[i], resp.InterfaceName.SrcName, addr, nil))
		m, _ := peerdb.ParseMAC(mac)
		s.peers = append(s.peers, peerdb.Peer{EndpointID: eid, IP: addr.Addr(), MAC: m, VTEP: vteps[i]})
	}
	return s
}

// Two hosts with peers injected through the peer entry point: containers on
// different hosts ping each other over VXLAN; an update (the IP moves to a new
// MAC and VTEP) and a delete leave exactly the expected neighbour and FDB
// entries.
func TestTwoHostsInjectedPeers(t *testing.T) {
	s := setupTwoHosts(t)
	for i, d := range s.d {
		other := s.peers[1-i]
		if err := applyPeerEvent(d, PeerEvent{VNI: 77, Next: &other}); err != nil {
			t.Fatal(err)
		}
		mustAudit(t, d)
	}
	if err := nstest.PingEventually(s.ctrs[0], s.peers[1].IP, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	if err := nstest.PingEventually(s.ctrs[1], s.peers[0].IP, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	mac1 := s.peers[1].MAC.String()
	wantPeers(t, s.d[0], "net1", map[string]string{"198.51.100.11": mac1}, map[string]string{mac1: "192.0.2.11"})

	// Update: 198.51.100.11 moves to a new MAC on a new VTEP.
	prev := s.peers[1]
	next := peerdb.Peer{EndpointID: "ep-moved", IP: prev.IP, MAC: peerdb.MAC{0x02, 0, 0, 0, 0, 0x99}, VTEP: netip.MustParseAddr("192.0.2.99")}
	if err := applyPeerEvent(s.d[0], PeerEvent{VNI: 77, Prev: &prev, Next: &next}); err != nil {
		t.Fatal(err)
	}
	wantPeers(t, s.d[0], "net1", map[string]string{"198.51.100.11": "02:00:00:00:00:99"}, map[string]string{"02:00:00:00:00:99": "192.0.2.99"})
	mustAudit(t, s.d[0])

	// Delete.
	if err := applyPeerEvent(s.d[0], PeerEvent{VNI: 77, Prev: &next}); err != nil {
		t.Fatal(err)
	}
	wantPeers(t, s.d[0], "net1", map[string]string{}, map[string]string{})
	mustAudit(t, s.d[0])
	if err := nstest.Ping(s.ctrs[0], s.peers[1].IP, 300*time.Millisecond); err == nil {
		t.Fatal("ping crossed after the peer was deleted")
	}
}

// An IP claimed by two remote entries resolves the same way whatever the
// order the claims arrive in, and the loser takes over when the winner goes.
func TestRemoteIPConflictDeterministic(t *testing.T) {
	hosts, vteps := nstest.Hosts(t, 1, false)
	a := peerdb.Peer{EndpointID: "aaa", IP: netip.MustParseAddr("198.51.100.50"), MAC: peerdb.MAC{2, 0, 0, 0, 0, 0xa}, VTEP: netip.MustParseAddr("192.0.2.20")}
	b := peerdb.Peer{EndpointID: "bbb", IP: a.IP, MAC: peerdb.MAC{2, 0, 0, 0, 0, 0xb}, VTEP: netip.MustParseAddr("192.0.2.21")}
	var winners []string
	for run, order := range [][]peerdb.Peer{{a, b}, {b, a}, {a, b}} {
		d := newTestDriver(t, hosts[0], vteps[0])
		id := fmt.Sprintf("net%d", run)
		vni := uint32(500 + run)
		mustCreate(t, d, createReq(id, fmt.Sprint(vni), "198.51.100.0/24"))
		mustEndpoint(t, d, id, "local", "198.51.100.2/24")
		mustJoin(t, d, id, "local")
		for _, p := range order {
			p := p
			if err := applyPeerEvent(d, PeerEvent{VNI: vni, Next: &p}); err != nil {
				t.Fatal(err)
			}
		}
		neigh, fdb := dumpPeers(t, d, id)
		winners = append(winners, neigh["198.51.100.50"])
		if len(fdb) != 1 {
			t.Fatalf("run %d: fdb %v, want one entry", run, fdb)
		}
		mustAudit(t, d)
		// The winner leaves: the other claimant becomes active.
		win := a
		if neigh["198.51.100.50"] == b.MAC.String() {
			win = b
		}
		if err := applyPeerEvent(d, PeerEvent{VNI: vni, Prev: &win}); err != nil {
			t.Fatal(err)
		}
		neigh, _ = dumpPeers(t, d, id)
		if neigh["198.51.100.50"] == win.MAC.String() || neigh["198.51.100.50"] == "" {
			t.Fatalf("run %d: after the winner left, neighbour is %q", run, neigh["198.51.100.50"])
		}
		mustAudit(t, d)
		if err := d.DeleteNetwork(&api.DeleteNetworkRequest{NetworkID: id}); err != nil {
			t.Fatal(err)
		}
	}
	if winners[0] != winners[1] || winners[1] != winners[2] {
		t.Fatalf("conflict resolution depends on arrival order: %v", winners)
	}
}

// A remote record claiming a local endpoint's IP is never programmed; it
// takes over when the local endpoint leaves.
func TestRemoteNeverShadowsLocal(t *testing.T) {
	hosts, vteps := nstest.Hosts(t, 1, false)
	d := newTestDriver(t, hosts[0], vteps[0])
	mustCreate(t, d, createReq("n", "9", "198.51.100.0/24"))
	mustEndpoint(t, d, "n", "keep", "198.51.100.3/24")
	mustJoin(t, d, "n", "keep")
	mustEndpoint(t, d, "n", "local", "198.51.100.2/24")
	mustJoin(t, d, "n", "local")
	r := peerdb.Peer{EndpointID: "remote", IP: netip.MustParseAddr("198.51.100.2"), MAC: peerdb.MAC{2, 1, 1, 1, 1, 1}, VTEP: netip.MustParseAddr("192.0.2.30")}
	if err := applyPeerEvent(d, PeerEvent{VNI: 9, Next: &r}); err != nil {
		t.Fatal(err)
	}
	wantPeers(t, d, "n", map[string]string{}, map[string]string{})
	if err := d.Leave(&api.LeaveRequest{NetworkID: "n", EndpointID: "local"}); err != nil {
		t.Fatal(err)
	}
	wantPeers(t, d, "n", map[string]string{"198.51.100.2": "02:01:01:01:01:01"}, map[string]string{"02:01:01:01:01:01": "192.0.2.30"})
	mustAudit(t, d)
}

// Records that the source has before the network exists are pulled when
// it is created, and again when it is created anew after a delete: nothing
// is kept by the driver for networks it does not have, and nothing is
// lost. A record the network refuses stays at the source and is listed in
// Status with the reason.
func TestPeersBeforeNetwork(t *testing.T) {
	hosts, vteps := nstest.Hosts(t, 1, false)
	d := newTestDriver(t, hosts[0], vteps[0])
	p := peerdb.Peer{EndpointID: "early", IP: netip.MustParseAddr("198.51.100.9"), MAC: peerdb.MAC{2, 0, 0, 0, 0, 9}, VTEP: netip.MustParseAddr("192.0.2.40")}
	q := p
	q.EndpointID, q.IP, q.MAC = "gone", netip.MustParseAddr("198.51.100.10"), peerdb.MAC{2, 0, 0, 0, 0, 10}
	bad := peerdb.Peer{EndpointID: "bad", IP: netip.MustParseAddr("198.51.100.11"), VTEP: netip.MustParseAddr("192.0.2.41")}
	for _, ev := range []PeerEvent{{VNI: 31, Next: &p}, {VNI: 31, Next: &q}, {VNI: 31, Prev: &q}, {VNI: 31, Next: &bad}} {
		if err := applyPeerEvent(d, ev); err != nil {
			t.Fatal(err) // no network: nothing to refuse yet
		}
	}
	for round := 0; round < 2; round++ {
		mustCreate(t, d, createReq("n", "31", "198.51.100.0/24"))
		mustEndpoint(t, d, "n", "local", "198.51.100.2/24")
		mustJoin(t, d, "n", "local")
		wantPeers(t, d, "n", map[string]string{"198.51.100.9": "02:00:00:00:00:09"}, map[string]string{"02:00:00:00:00:09": "192.0.2.40"})
		mustAudit(t, d)
		st := d.Status()
		if rej := st.Networks[0].Rejected; len(rej) != 1 || rej[0].EndpointID != "bad" || !strings.Contains(rej[0].Reason, "MAC") {
			t.Fatalf("round %d: rejected records in status: %+v", round, rej)
		}
		if err := d.DeleteNetwork(&api.DeleteNetworkRequest{NetworkID: "n"}); err != nil {
			t.Fatal(err)
		}
	}
}

// A network with two subnets: one bridge and VXLAN per subnet, static routes
// to the other subnet through the own gateway, and routing between them.
func TestMultiSubnet(t *testing.T) {
	host := nstest.NewNS(t, "host")
	d := newTestDriver(t, host, netip.Addr{})
	mustCreate(t, d, createReq("n", "61,62", "198.51.100.0/24", "203.0.113.0/24"))
	mustEndpoint(t, d, "n", "a", "198.51.100.5/24")
	mustEndpoint(t, d, "n", "b", "203.0.113.5/24")
	ra := mustJoin(t, d, "n", "a")
	rb := mustJoin(t, d, "n", "b")
	if len(ra.StaticRoutes) != 1 || ra.StaticRoutes[0].Destination != "203.0.113.0/24" || ra.StaticRoutes[0].NextHop != "198.51.100.1" {
		t.Fatalf("static routes of a: %+v", ra.StaticRoutes)
	}
	ca := nstest.Container(t, "ca", host, ra.InterfaceName.SrcName, netip.MustParsePrefix("198.51.100.5/24"),
		map[netip.Prefix]netip.Addr{netip.MustParsePrefix("203.0.113.0/24"): netip.MustParseAddr("198.51.100.1")})
	nstest.Container(t, "cb", host, rb.InterfaceName.SrcName, netip.MustParsePrefix("203.0.113.5/24"),
		map[netip.Prefix]netip.Addr{netip.MustParsePrefix("198.51.100.0/24"): netip.MustParseAddr("203.0.113.1")})
	mustAudit(t, d)
	if err := nstest.PingEventually(ca, netip.MustParseAddr("203.0.113.5"), 5*time.Second); err != nil {
		t.Fatal(err)
	}
	// The sandbox has both VXLANs.
	names := sandboxLinks(t, d, "n")
	for _, want := range []string{sandbox.VXLANName(61), sandbox.VXLANName(62), sandbox.BridgeName(61), sandbox.BridgeName(62)} {
		if !contains(names, want) {
			t.Errorf("sandbox lacks %s: %v", want, names)
		}
	}
}

// An internal network disables the gateway service; a Join failure rolls
// back everything it made.
func TestInternalAndJoinRollback(t *testing.T) {
	host := nstest.NewNS(t, "host")
	d := newTestDriver(t, host, netip.Addr{})
	r := createReq("n", "8", "198.51.100.0/24")
	r.Options[OptInternal] = true
	mustCreate(t, d, r)
	mustEndpoint(t, d, "n", "e", "198.51.100.5/24")
	if resp := mustJoin(t, d, "n", "e"); !resp.DisableGatewayService {
		t.Fatal("internal network: DisableGatewayService not set")
	}
	if _, err := d.Join(&api.JoinRequest{NetworkID: "n", EndpointID: "e"}); err == nil {
		t.Fatal("second Join of one endpoint succeeded")
	}
	mustAudit(t, d)

	// Make the first Join of another network fail after its sandbox was
	// built: a host link already holds the veth name and cannot be removed
	// because ... we simulate with a VNI clash in the host namespace instead:
	// a stray VXLAN with the network's VNI and port blocks the sandbox.
	stray := &netlink.Vxlan{LinkAttrs: netlink.LinkAttrs{Name: "stray", TxQLen: -1}, VxlanId: 9, Port: d.cfg.VXLANPort}
	if err := host.NL.LinkAdd(stray); err != nil {
		t.Fatal(err)
	}
	mustCreate(t, d, createReq("n2", "9", "203.0.113.0/24"))
	mustEndpoint(t, d, "n2", "e2", "203.0.113.5/24")
	_, err := d.Join(&api.JoinRequest{NetworkID: "n2", EndpointID: "e2"})
	if err == nil || !strings.Contains(err.Error(), "VNI 9") {
		t.Fatalf("Join with a clashing VNI: %v", err)
	}
	if isNS(d.host.Path("n2")) {
		t.Fatal("failed Join left its sandbox behind")
	}
	hostNames := nstest.LinkNames(t, host.NL)
	hn, _ := linkNames("n2", "e2")
	if contains(hostNames, hn) {
		t.Fatal("failed Join left its veth behind")
	}
	mustAudit(t, d)
	host.NL.LinkDel(stray)
	mustJoin(t, d, "n2", "e2")
	mustAudit(t, d)
}

func contains(s []string, v string) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

func sandboxLinks(t *testing.T, d *Driver, id string) []string {
	return nstest.LinkNames(t, sandboxHandle(t, d, id))
}

// dumpPeers reads the permanent neighbours (ip → mac) and FDB self entries
// (mac → dst) of a network's sandbox straight from the kernel.
func dumpPeers(t *testing.T, d *Driver, id string) (map[string]string, map[string]string) {
	t.Helper()
	n, unlock, err := d.lockNetwork(id)
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	if n.sb == nil {
		t.Fatalf("network %s has no sandbox", id)
	}
	k, err := n.sb.Dump()
	if err != nil {
		t.Fatal(err)
	}
	neigh, fdb := map[string]string{}, map[string]string{}
	for key, mac := range k.Neigh {
		neigh[key.IP.String()] = mac.String()
	}
	for key, dst := range k.FDB {
		fdb[key.MAC.String()] = dst.String()
	}
	if len(k.Foreign) > 0 {
		t.Fatalf("unexpected entries: %v", k.Foreign)
	}
	return neigh, fdb
}

func wantPeers(t *testing.T, d *Driver, id string, neigh, fdb map[string]string) {
	t.Helper()
	gotN, gotF := dumpPeers(t, d, id)
	if fmt.Sprint(sortedMap(gotN)) != fmt.Sprint(sortedMap(neigh)) {
		t.Errorf("neighbours %v, want %v", gotN, neigh)
	}
	if fmt.Sprint(sortedMap(gotF)) != fmt.Sprint(sortedMap(fdb)) {
		t.Errorf("fdb %v, want %v", gotF, fdb)
	}
}

func sortedMap(m map[string]string) []string {
	var s []string
	for k, v := range m {
		s = append(s, k+"="+v)
	}
	sort.Strings(s)
	return s
}

// With an IPv6 underlay the VXLAN links take the IPv6 family (so IPv6 FDB
// destinations are accepted), the MTU default drops by 70, and containers
// on two hosts reach each other.
func TestIPv6Underlay(t *testing.T) {
	hosts, vteps := nstest.Hosts(t, 2, true)
	var ctrs []*nstest.NS
	var drivers []*Driver
	var peers []peerdb.Peer
	for i := range hosts {
		d := newTestDriver(t, hosts[i], vteps[i])
		drivers = append(drivers, d)
		mustCreate(t, d, createReq("net6", "600", "203.0.113.0/24"))
		addr := netip.MustParsePrefix(fmt.Sprintf("203.0.113.%d/24", 20+i))
		eid := fmt.Sprintf("e%d", i)
		mac := mustEndpoint(t, d, "net6", eid, addr.String())
		resp := mustJoin(t, d, "net6", eid)
		ctrs = append(ctrs, nstest.Container(t, eid, hosts[i], resp.InterfaceName.SrcName, addr, nil))
		m, _ := peerdb.ParseMAC(mac)
		peers = append(peers, peerdb.Peer{EndpointID: eid, IP: addr.Addr(), MAC: m, VTEP: vteps[i]})
		st := d.Status()
		if st.Networks[0].MTU != 1430 {
			t.Fatalf("MTU over an IPv6 underlay: %d, want 1500-70", st.Networks[0].MTU)
		}
	}
	for i, d := range drivers {
		if err := applyPeerEvent(d, PeerEvent{VNI: 600, Next: &peers[1-i]}); err != nil {
			t.Fatal(err)
		}
		mustAudit(t, d)
	}
	if err := nstest.PingEventually(ctrs[0], peers[1].IP, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	_, fdb := dumpPeers(t, drivers[0], "net6")
	if fdb[peers[1].MAC.String()] != vteps[1].String() {
		t.Fatalf("fdb %v, want %s → %s", fdb, peers[1].MAC, vteps[1])
	}
}
