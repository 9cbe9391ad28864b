package driver

import (
	"bytes"
	"encoding/json"
	"fmt"
	"log/slog"
	"net/netip"
	"strings"
	"testing"
	"time"

	api "github.com/docker/go-plugins-helpers/network"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/sandbox"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
	"github.com/overlayd/overlayd/peerdb"
)

// A frame from a remote host that carries a local endpoint's MAC as its
// source (here the remote duplicate of a local address, with the same MAC
// as dockerd gave both) never moves that MAC to the tunnel: the two local
// containers keep reaching each other while the duplicate sends. When
// someone turns learning back on on the VXLAN's bridge port, the audit
// reports it and the reconcile restores it, removing what was learned.
func TestRemoteFrameCannotMoveLocalMAC(t *testing.T) {
	hosts, vteps := nstest.Hosts(t, 2, false)
	const mac = "02:00:5e:00:53:10"
	dup := netip.MustParsePrefix("198.51.100.10/24")
	other := netip.MustParsePrefix("198.51.100.11/24")
	var d []*Driver
	for i := range hosts {
		d = append(d, newTestDriver(t, hosts[i], vteps[i]))
		mustCreate(t, d[i], createReq("net1", "77", "198.51.100.0/24"))
	}
	// host0: c1 (the duplicate address, MAC given) and c2; host1: the
	// duplicate of c1.
	ctr := func(i int, eid string, addr netip.Prefix, mac string) *nstest.NS {
		t.Helper()
		if _, err := d[i].CreateEndpoint(&api.CreateEndpointRequest{NetworkID: "net1", EndpointID: eid,
			Interface: &api.EndpointInterface{Address: addr.String(), MacAddress: mac}}); err != nil {
			t.Fatal(err)
		}
		resp := mustJoin(t, d[i], "net1", eid)
		return nstest.Container(t, eid, hosts[i], resp.InterfaceName.SrcName, addr, nil)
	}
	c1 := ctr(0, "c1", dup, mac)
	c2 := ctr(0, "c2", other, "")
	remote := ctr(1, "remote-dup", dup, mac)
	// Each host learns the other's records, as from the control plane.
	m, _ := peerdb.ParseMAC(mac)
	for _, ev := range []struct {
		d *Driver
		p peerdb.Peer
	}{
		{d[0], peerdb.Peer{EndpointID: "remote-dup", IP: dup.Addr(), MAC: m, VTEP: vteps[1]}},
		{d[1], peerdb.Peer{EndpointID: "c2", IP: other.Addr(), MAC: endpointMAC(t, d[0], "net1", "c2"), VTEP: vteps[0]}},
		{d[1], peerdb.Peer{EndpointID: "c1", IP: dup.Addr(), MAC: m, VTEP: vteps[0]}},
	} {
		if err := applyPeerEvent(ev.d, PeerEvent{VNI: 77, Next: &ev.p}); err != nil {
			t.Fatal(err)
		}
	}
	mustAudit(t, d[0])

	// The duplicate pings c2 continuously: its frames reach host0's
	// bridge through the VXLAN link with c1's MAC as their source.
	loop := nstest.StartPingLoop(remote, other.Addr(), 0, 20*time.Millisecond)
	defer loop.Stop()
	vx := sandboxLink(t, d[0], "net1", sandbox.VXLANName(77))
	base := rxPackets(t, d[0], "net1", vx)
	if err := nstest.Eventually(10*time.Second, 10*time.Millisecond, func() error {
		if got := rxPackets(t, d[0], "net1", vx) - base; got < 20 {
			return fmt.Errorf("host0's VXLAN received %d frames from the duplicate, want 20", got)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if port, ok := bridgePortOf(t, d[0], "net1", m); ok && port == vx {
		t.Fatalf("the bridge moved c1's MAC %s to the VXLAN port", mac)
	}
	if lost := pingLosses(c2, c1, dup.Addr(), other.Addr(), 10); lost != 0 {
		t.Fatalf("c1 and c2 lost %d of 20 pings while the remote duplicate sends", lost)
	}
	mustAudit(t, d[0])

	// Someone turns learning on: the duplicate's frames move c1's MAC.
	h := sandboxHandle(t, d[0], "net1")
	if err := h.LinkSetLearning(&netlink.Vxlan{LinkAttrs: netlink.LinkAttrs{Index: vx}}, true); err != nil {
		t.Fatal(err)
	}
	if err := nstest.Eventually(10*time.Second, 10*time.Millisecond, func() error {
		if port, ok := bridgePortOf(t, d[0], "net1", m); !ok || port != vx {
			return fmt.Errorf("c1's MAC not learned on the VXLAN port yet")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	// The audit reports both (polled: a frame of c1's own may move the
	// MAC back between the learning above and a dump; the duplicate's next
	// frame moves it again).
	if err := nstest.Eventually(10*time.Second, 10*time.Millisecond, func() error {
		problems, err := d[0].Audit()
		if err != nil {
			return err
		}
		all := strings.Join(problems, "\n")
		for _, want := range []string{"vxlan ovvx-77: bridge port learning on, want off", "vxlan ovvx-77: bridge learned " + mac + " on the port"} {
			if !strings.Contains(all, want) {
				return fmt.Errorf("audit does not report %q:\n%s", want, all)
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	fixed, err := d[0].Reconcile()
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(strings.Join(fixed, "\n"), "bridge port learning on") {
		t.Fatalf("reconcile did not report the repair: %v", fixed)
	}
	mustAudit(t, d[0])
	if lost := pingLosses(c2, c1, dup.Addr(), other.Addr(), 10); lost != 0 {
		t.Fatalf("after the repair, c1 and c2 lost %d of 20 pings", lost)
	}
}

// pingLosses pings n times each way between a (at addrA) and b (at addrB)
// and returns how many got no reply. b pings a first: b never sends from
// a's MAC, so only the bridge's own entry can bring its frames to a.
func pingLosses(b, a *nstest.NS, addrA, addrB netip.Addr, n int) int {
	lost := 0
	for range n {
		if nstest.Ping(b, addrA, time.Second) != nil {
			lost++
		}
		if nstest.Ping(a, addrB, time.Second) != nil {
			lost++
		}
	}
	return lost
}

func endpointMAC(t *testing.T, d *Driver, nid, eid string) peerdb.MAC {
	t.Helper()
	n, unlock, err := d.lockNetwork(nid)
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	return n.endpoints[eid].mac
}

// sandboxHandle opens a netlink handle in the sandbox of network id.
func sandboxHandle(t *testing.T, d *Driver, id string) *netlink.Handle {
	t.Helper()
	n, unlock, err := d.lockNetwork(id)
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	h, err := netlink.NewHandleAt(n.sb.NS(), unix.NETLINK_ROUTE)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Close)
	return h
}

func sandboxLink(t *testing.T, d *Driver, id, name string) int {
	t.Helper()
	l, err := sandboxHandle(t, d, id).LinkByName(name)
	if err != nil {
		t.Fatal(err)
	}
	return l.Attrs().Index
}

func rxPackets(t *testing.T, d *Driver, id string, index int) uint64 {
	t.Helper()
	l, err := sandboxHandle(t, d, id).LinkByIndex(index)
	if err != nil {
		t.Fatal(err)
	}
	return l.Attrs().Statistics.RxPackets
}

// bridgePortOf returns the ifindex of the bridge port the sandbox's bridge
// forwards mac to, if it has an entry for it.
func bridgePortOf(t *testing.T, d *Driver, id string, mac peerdb.MAC) (int, bool) {
	t.Helper()
	fdb, err := sandboxHandle(t, d, id).NeighList(0, unix.AF_BRIDGE)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range fdb {
		// The bridge's entries come with their master, the VXLAN's own
		// with NTF_SELF.
		if f.MasterIndex != 0 && f.Flags&netlink.NTF_SELF == 0 && len(f.HardwareAddr) == 6 && peerdb.MAC(f.HardwareAddr) == mac {
			return f.LinkIndex, true
		}
	}
	return 0, false
}

// Two hosts that hand out the same address (two engines with the same
// --subnet) give their endpoints different MACs; a MAC dockerd gives is
// kept as it is; and a restarted driver has the MAC it answered before.
func TestDuplicateAddressesGetDistinctMACs(t *testing.T) {
	stateDir := t.TempDir()
	host := nstest.NewNS(t, "host")
	cfg := Config{HostNS: host.Handle, NetnsDir: nstest.NetnsDir(t), Logger: testLogger(), Peers: newMemSource(), StateFile: openStore(t, stateDir)}
	d0, err := New(alone(cfg))
	if err != nil {
		t.Fatal(err)
	}
	d1 := newOfflineDriver(t)
	for _, d := range []*Driver{d0, d1} {
		mustCreate(t, d, createReq("net1", "77", "198.51.100.0/24"))
	}
	mac0 := mustEndpoint(t, d0, "net1", "ep-on-host0", "198.51.100.10/24")
	mac1 := mustEndpoint(t, d1, "net1", "ep-on-host1", "198.51.100.10/24")
	if mac0 == mac1 {
		t.Fatalf("endpoints with the same address on two hosts both got MAC %s", mac0)
	}
	resp, err := d1.CreateEndpoint(&api.CreateEndpointRequest{NetworkID: "net1", EndpointID: "given",
		Interface: &api.EndpointInterface{Address: "198.51.100.11/24", MacAddress: "02:00:5e:00:53:11"}})
	if err != nil || resp.Interface != nil {
		t.Fatalf("CreateEndpoint with dockerd's MAC: %+v, %v; want it kept and nothing returned", resp, err)
	}
	if got := endpointMAC(t, d1, "net1", "given").String(); got != "02:00:5e:00:53:11" {
		t.Fatalf("dockerd's MAC became %s", got)
	}

	d0.Close()
	cfg.StateFile.Close()
	cfg.StateFile = openStore(t, stateDir)
	defer cfg.StateFile.Close()
	d0, err = New(alone(cfg))
	if err != nil {
		t.Fatal(err)
	}
	defer d0.Close()
	if got := endpointMAC(t, d0, "net1", "ep-on-host0").String(); got != mac0 {
		t.Fatalf("after a restart the endpoint's MAC is %s, want %s", got, mac0)
	}
}

// A cross-host address conflict is logged once at WARN on both hosts,
// naming the network, its VNI, the address and the two hosts, however
// often the periodic reconcile finds it, and counted in the status; when it
// goes away it is logged once at INFO.
func TestAddressConflictLoggedOnceOnBothHosts(t *testing.T) {
	addr := netip.MustParsePrefix("198.51.100.10/24")
	vteps := []netip.Addr{netip.MustParseAddr("192.0.2.10"), netip.MustParseAddr("192.0.2.11")}
	var d []*Driver
	var logs []*bytes.Buffer
	var recs []peerdb.Peer
	for i := range vteps {
		buf := &bytes.Buffer{}
		logs = append(logs, buf)
		d = append(d, newTestDriverLogging(t, nil, vteps[i], slog.New(slog.NewJSONHandler(buf, nil))))
		mustCreate(t, d[i], createReq("net1", "77", "198.51.100.0/24"))
		eid := fmt.Sprintf("ep-on-host%d", i)
		mac, _ := peerdb.ParseMAC(mustEndpoint(t, d[i], "net1", eid, addr.String()))
		mustJoin(t, d[i], "net1", eid)
		recs = append(recs, peerdb.Peer{EndpointID: eid, IP: addr.Addr(), MAC: mac, VTEP: vteps[i]})
	}
	for i := range d {
		if err := applyPeerEvent(d[i], PeerEvent{VNI: 77, Next: &recs[1-i]}); err != nil {
			t.Fatal(err)
		}
		for range 3 { // three reconcile ticks
			if _, err := d[i].Reconcile(); err != nil {
				t.Fatal(err)
			}
		}
	}
	for i := range d {
		warns := logLines(t, logs[i], "WARN", "address conflict:")
		if len(warns) != 1 {
			t.Fatalf("host%d logged the conflict %d times at WARN, want once:\n%s", i, len(warns), logs[i])
		}
		w := warns[0]
		want := map[string]any{"event": "conflict_found", "kind": "address", "network": "net1", "vni": float64(77), "address": "198.51.100.10",
			"winner_host": fmt.Sprintf("this host (%s)", vteps[i]), "winner_endpoint": recs[i].EndpointID,
			"other_hosts": fmt.Sprintf("host-%s (%s)", vteps[1-i], vteps[1-i]), "other_endpoints": recs[1-i].EndpointID}
		for k, v := range want {
			if w[k] != v {
				t.Errorf("host%d: WARN line has %s=%v, want %v: %v", i, k, w[k], v, w)
			}
		}
		ns := d[i].Status().Networks[0]
		if len(ns.Conflicts) != 1 || ns.ConflictsSeen != 1 {
			t.Errorf("host%d status: conflicts %+v, seen %d; want 1 and 1", i, ns.Conflicts, ns.ConflictsSeen)
		}
	}
	// host1's endpoint goes: host0's conflict is resolved.
	if err := applyPeerEvent(d[0], PeerEvent{VNI: 77, Prev: &recs[1]}); err != nil {
		t.Fatal(err)
	}
	for range 2 {
		if _, err := d[0].Reconcile(); err != nil {
			t.Fatal(err)
		}
	}
	if infos := logLines(t, logs[0], "INFO", "address conflict resolved"); len(infos) != 1 || infos[0]["address"] != "198.51.100.10" ||
		infos[0]["event"] != "conflict_resolved" || infos[0]["kind"] != "address" || infos[0]["network"] != "net1" || infos[0]["vni"] != float64(77) {
		t.Fatalf("host0 logged the resolution %d times, want once:\n%s", len(infos), logs[0])
	}
	if ns := d[0].Status().Networks[0]; len(ns.Conflicts) != 0 || ns.ConflictsSeen != 1 {
		t.Fatalf("host0 status after the resolution: conflicts %+v, seen %d; want none now, 1 seen", ns.Conflicts, ns.ConflictsSeen)
	}
}

// logLines returns the JSON log lines at level whose message starts with
// prefix.
func logLines(t *testing.T, buf *bytes.Buffer, level, prefix string) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, line := range strings.Split(strings.TrimSpace(buf.String()), "\n") {
		var m map[string]any
		if err := json.Unmarshal([]byte(line), &m); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		if m["level"] == level && strings.HasPrefix(fmt.Sprint(m["msg"]), prefix) {
			out = append(out, m)
		}
	}
	return out
}

// An address that moves to another endpoint (so to another MAC: MACs are
// no longer derived from the address) is reachable again at once from a
// container that had the old MAC cached: the sandbox announces the new one.
func TestMovedAddressIsAnnounced(t *testing.T) {
	// The move reaches host0 as one change (the record replaced in place),
	// or as a deletion and a later addition (the old host's record went
	// first): both are announced.
	t.Run("in-one-change", func(t *testing.T) { testMovedAddressIsAnnounced(t, false) })
	t.Run("deleted-then-added", func(t *testing.T) { testMovedAddressIsAnnounced(t, true) })
}

func testMovedAddressIsAnnounced(t *testing.T, twoChanges bool) {
	s := setupTwoHosts(t)
	for i, d := range s.d {
		if err := applyPeerEvent(d, PeerEvent{VNI: 77, Next: &s.peers[1-i]}); err != nil {
			t.Fatal(err)
		}
	}
	if err := nstest.PingEventually(s.ctrs[0], s.peers[1].IP, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	// host1's container goes, another one with its address comes: the
	// container on host0 has the old MAC cached, as reachable.
	if err := s.d[1].Leave(&api.LeaveRequest{NetworkID: "net1", EndpointID: "ep-host1"}); err != nil {
		t.Fatal(err)
	}
	addr := netip.PrefixFrom(s.peers[1].IP, 24)
	mac, _ := peerdb.ParseMAC(mustEndpoint(t, s.d[1], "net1", "ep-host1-new", addr.String()))
	if mac == s.peers[1].MAC {
		t.Fatalf("the new endpoint has the old one's MAC %s", mac)
	}
	resp := mustJoin(t, s.d[1], "net1", "ep-host1-new")
	nstest.Container(t, "c1-new", s.hosts[1], resp.InterfaceName.SrcName, addr, nil)
	moved := peerdb.Peer{EndpointID: "ep-host1-new", IP: addr.Addr(), MAC: mac, VTEP: s.vteps[1]}
	if twoChanges {
		if err := applyPeerEvent(s.d[0], PeerEvent{VNI: 77, Prev: &s.peers[1]}); err != nil {
			t.Fatal(err)
		}
		if err := applyPeerEvent(s.d[0], PeerEvent{VNI: 77, Next: &moved}); err != nil {
			t.Fatal(err)
		}
	} else if err := applyPeerEvents(s.d[0], PeerEvent{VNI: 77, Prev: &s.peers[1]}, PeerEvent{VNI: 77, Next: &moved}); err != nil {
		t.Fatal(err)
	}
	if err := applyPeerEvent(s.d[1], PeerEvent{VNI: 77, Next: &s.peers[0]}); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := nstest.PingEventually(s.ctrs[0], addr.Addr(), 2*time.Second); err != nil {
		t.Fatalf("the moved address is not reachable within 2 s (the container still sends to the old MAC): %v", err)
	}
	t.Logf("moved address reachable again after %v", time.Since(start).Round(time.Millisecond))
}

// With no learning on the VXLAN's bridge port, the bridge never learns
// where a remote MAC is; frames to remote endpoints must still go to the
// VXLAN link only, not be flooded to every local container (which would
// cost a copy per container and show one container's cross-host traffic
// to the others). Only broadcasts (ARP) reach a bystander.
func TestCrossHostTrafficNotFloodedToLocalContainers(t *testing.T) {
	s := setupTwoHosts(t)
	for i, d := range s.d {
		if err := applyPeerEvent(d, PeerEvent{VNI: 77, Next: &s.peers[1-i]}); err != nil {
			t.Fatal(err)
		}
	}
	mustEndpoint(t, s.d[0], "net1", "bystander", "198.51.100.20/24")
	resp := mustJoin(t, s.d[0], "net1", "bystander")
	by := nstest.Container(t, "bystander", s.hosts[0], resp.InterfaceName.SrcName, netip.MustParsePrefix("198.51.100.20/24"), nil)
	if err := nstest.PingEventually(s.ctrs[0], s.peers[1].IP, 5*time.Second); err != nil {
		t.Fatal(err)
	}
	rx := func() uint64 {
		l, err := by.NL.LinkByName("eth0")
		if err != nil {
			t.Fatal(err)
		}
		return l.Attrs().Statistics.RxPackets
	}
	before := rx()
	for range 50 {
		if err := nstest.Ping(s.ctrs[0], s.peers[1].IP, time.Second); err != nil {
			t.Fatal(err)
		}
	}
	got := rx() - before
	t.Logf("a bystander received %d frames while its neighbour exchanged 100 with a remote container", got)
	if got > 5 {
		t.Fatalf("a bystander container received %d frames while its neighbour exchanged 100 with a remote container", got)
	}
	mustAudit(t, s.d[0])

	// Someone floods to the bystander's port again and removes its static
	// entry: the audit reports both, the reconcile restores them.
	_, sbName := linkNames("net1", "bystander")
	h := sandboxHandle(t, s.d[0], "net1")
	port, err := h.LinkByName(sbName)
	if err != nil {
		t.Fatal(err)
	}
	mac := endpointMAC(t, s.d[0], "net1", "bystander")
	if err := h.LinkSetFlood(port, true); err != nil {
		t.Fatal(err)
	}
	if err := h.NeighDel(&netlink.Neigh{LinkIndex: port.Attrs().Index, Family: unix.AF_BRIDGE, Flags: netlink.NTF_MASTER, HardwareAddr: mac.HardwareAddr()}); err != nil {
		t.Fatal(err)
	}
	problems, err := s.d[0].Audit()
	if err != nil {
		t.Fatal(err)
	}
	all := strings.Join(problems, "\n")
	for _, want := range []string{"veth " + sbName + ": unknown-unicast flooding on, want off", "veth " + sbName + ": static bridge entry for " + mac.String() + " missing"} {
		if !strings.Contains(all, want) {
			t.Fatalf("audit does not report %q:\n%s", want, all)
		}
	}
	if _, err := s.d[0].Reconcile(); err != nil {
		t.Fatal(err)
	}
	mustAudit(t, s.d[0])
}

// Two local endpoints dockerd gave the same MAC share the bridge's one
// static entry for it: when the one holding it leaves, the other gets it
// back at once (the audit finds nothing to repair).
func TestSharedMACKeepsItsBridgeEntry(t *testing.T) {
	host := nstest.NewNS(t, "host")
	d := newTestDriver(t, host, netip.Addr{})
	mustCreate(t, d, createReq("n", "9", "198.51.100.0/24"))
	for i, eid := range []string{"a", "b"} {
		if _, err := d.CreateEndpoint(&api.CreateEndpointRequest{NetworkID: "n", EndpointID: eid,
			Interface: &api.EndpointInterface{Address: fmt.Sprintf("198.51.100.%d/24", 5+i), MacAddress: "02:00:5e:00:53:05"}}); err != nil {
			t.Fatal(err)
		}
		mustJoin(t, d, "n", eid)
		mustAudit(t, d)
	}
	// b joined last: the entry is on its port.
	if err := d.Leave(&api.LeaveRequest{NetworkID: "n", EndpointID: "b"}); err != nil {
		t.Fatal(err)
	}
	mustAudit(t, d)
}

// An endpoint without a MAC from dockerd gets the one derived from its id
// and is told it; one dockerd gives is kept and not answered.
func TestCreateEndpointMAC(t *testing.T) {
	d := newOfflineDriver(t)
	mustCreate(t, d, createReq("n1", "5", "198.51.100.0/24"))
	if mac, want := mustEndpoint(t, d, "n1", "e1", "198.51.100.7/24"), peerdb.MACFromEndpointID("e1").String(); mac != want {
		t.Fatalf("derived MAC %s, want %s (from the endpoint id)", mac, want)
	}
	resp, err := d.CreateEndpoint(&api.CreateEndpointRequest{NetworkID: "n1", EndpointID: "e2",
		Interface: &api.EndpointInterface{Address: "198.51.100.8/24", MacAddress: "02:00:00:00:00:08"}})
	if err != nil {
		t.Fatal(err)
	}
	if resp.Interface != nil {
		t.Fatalf("CreateEndpoint changed fields Docker filled: %+v", resp.Interface)
	}
}
