package driver

import (
	"net/netip"
	"strings"
	"testing"
	"time"

	api "github.com/docker/go-plugins-helpers/network"
	"github.com/vishvananda/netlink"

	"github.com/overlayd/overlayd/internal/sandbox"
	"github.com/overlayd/overlayd/internal/statefile"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
	"github.com/overlayd/overlayd/peerdb"
)

func openStore(t testing.TB, dir string) *statefile.File {
	t.Helper()
	s, err := statefile.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// A restart of the daemon (a new Driver on the same state and namespaces)
// adopts the running sandboxes: pings between containers on two hosts keep
// flowing, the new driver knows the networks and endpoints, a stale peer is
// removed by Reconcile once the driver has settled, and
// Leave/DeleteEndpoint/DeleteNetwork still clean up completely.
func TestRestartAdoptsRunningSandbox(t *testing.T) {
	hosts, vteps := nstest.Hosts(t, 2, false)
	stateDir := t.TempDir()
	netnsDir := nstest.NetnsDir(t)
	st := openStore(t, stateDir)
	cfg := Config{HostNS: hosts[0].Handle, NetnsDir: netnsDir, AdvertiseAddr: vteps[0], Logger: testLogger(), StateFile: st, Peers: newMemSource()}
	dA, err := New(alone(cfg))
	if err != nil {
		t.Fatal(err)
	}
	dB := newTestDriver(t, hosts[1], vteps[1])
	var peers []peerdb.Peer
	var ctrs []*nstest.NS
	for i, d := range []*Driver{dA, dB} {
		mustCreate(t, d, createReq("net1", "77", "198.51.100.0/24"))
		addr := netip.MustParsePrefix([]string{"198.51.100.10/24", "198.51.100.11/24"}[i])
		eid := []string{"ep-a", "ep-b"}[i]
		mac := mustEndpoint(t, d, "net1", eid, addr.String())
		resp := mustJoin(t, d, "net1", eid)
		ctrs = append(ctrs, nstest.Container(t, eid, hosts[i], resp.InterfaceName.SrcName, addr, nil))
		m, _ := peerdb.ParseMAC(mac)
		peers = append(peers, peerdb.Peer{EndpointID: eid, IP: addr.Addr(), MAC: m, VTEP: vteps[i]})
	}
	stale := peerdb.Peer{EndpointID: "stale", IP: netip.MustParseAddr("198.51.100.99"), MAC: peerdb.MAC{2, 0, 0, 0, 0, 0x99}, VTEP: netip.MustParseAddr("192.0.2.99")}
	for _, ev := range []PeerEvent{{VNI: 77, Next: &peers[1]}, {VNI: 77, Next: &stale}} {
		if err := applyPeerEvent(dA, ev); err != nil {
			t.Fatal(err)
		}
	}
	if err := applyPeerEvent(dB, PeerEvent{VNI: 77, Next: &peers[0]}); err != nil {
		t.Fatal(err)
	}
	if err := nstest.PingEventually(ctrs[0], peers[1].IP, 5*time.Second); err != nil {
		t.Fatal(err)
	}

	// A sandbox of an earlier version passed bridged traffic through its
	// netfilter hooks: adopting it turns them off.
	brnf := brnfAvailable()
	if brnf {
		setBridgeNetfilter(t, dA, "net1", "1")
	}

	// Ping continuously across the restart and count what is lost.
	pl := nstest.StartPingLoop(ctrs[0], peers[1].IP, 10*time.Millisecond, 200*time.Millisecond)

	dA.Close()
	st.Close()
	st = openStore(t, stateDir)
	defer st.Close()
	cfg.StateFile = st
	cfg.Peers = newMemSource() // a restarted control plane: it learns the records again
	dA, err = New(alone(cfg))
	if err != nil {
		t.Fatalf("restart: %v", err)
	}
	defer dA.Close()
	// The control plane re-delivers the peers it knows (not the stale one).
	if err := applyPeerEvent(dA, PeerEvent{VNI: 77, Next: &peers[1]}); err != nil {
		t.Fatal(err)
	}
	for pl.Sent() < 20 {
		time.Sleep(10 * time.Millisecond)
	}
	sent, lost := pl.Stop()
	t.Logf("pings across the restart: %d sent, %d lost", sent, lost)
	if lost != 0 {
		t.Errorf("%d of %d pings lost across a restart", lost, sent)
	}
	if brnf {
		wantBridgeNetfilterOff(t, dA, "net1")
	}
	stat := dA.Status()
	if len(stat.Networks) != 1 || len(stat.Networks[0].Endpoints) != 1 || !stat.Networks[0].Endpoints[0].Joined {
		t.Fatalf("restored state: %+v", stat)
	}
	// The stale neighbour is still programmed until reconciled.
	if n, _ := dumpPeers(t, dA, "net1"); n["198.51.100.99"] == "" {
		t.Fatal("adoption dropped kernel peers before the control plane re-delivered them")
	}
	// Reconciling while adopting keeps it; once settled it goes.
	if fixed, err := dA.Reconcile(); err != nil || len(fixed) != 0 {
		t.Fatalf("Reconcile while adopting: fixed %v, err %v; want nothing removed", fixed, err)
	}
	if err := dA.Settle(); err != nil {
		t.Fatal(err)
	}
	fixed, err := dA.Reconcile()
	if err != nil {
		t.Fatal(err)
	}
	if len(fixed) != 2 { // the stale neighbour and its FDB entry
		t.Errorf("Reconcile fixed %v, want the stale neighbour and fdb entry", fixed)
	}
	mustAudit(t, dA)
	if err := nstest.Ping(ctrs[0], peers[1].IP, time.Second); err != nil {
		t.Fatal(err)
	}
	for _, step := range []error{
		dA.Leave(&api.LeaveRequest{NetworkID: "net1", EndpointID: "ep-a"}),
		dA.DeleteEndpoint(&api.DeleteEndpointRequest{NetworkID: "net1", EndpointID: "ep-a"}),
		dA.DeleteNetwork(&api.DeleteNetworkRequest{NetworkID: "net1"}),
	} {
		if step != nil {
			t.Fatal(step)
		}
	}
	assertNothingLeft(t, dA, hosts[0], ctrs[0])
	if s, _ := st.Load(); len(s.Networks) != 0 || len(s.Endpoints) != 0 {
		t.Fatalf("state not empty after delete: %+v", s)
	}
}

// Start-up removes overlayd-owned leftovers that belong to nothing, and
// rebuilds a sandbox that vanished.
func TestRestartCleansLeftoversAndRebuilds(t *testing.T) {
	host := nstest.NewNS(t, "host")
	stateDir := t.TempDir()
	netnsDir := nstest.NetnsDir(t)
	// A run without persistence leaves a sandbox and a host veth end.
	d0, err := New(alone(Config{HostNS: host.Handle, NetnsDir: netnsDir, Logger: testLogger()}))
	if err != nil {
		t.Fatal(err)
	}
	mustCreate(t, d0, createReq("orphan", "90", "203.0.113.0/24"))
	mustEndpoint(t, d0, "orphan", "e", "203.0.113.5/24")
	mustJoin(t, d0, "orphan", "e")
	d0.Close()
	orphanVeth, _ := linkNames("orphan", "e")

	// A persisted network whose sandbox is then destroyed behind our back.
	st := openStore(t, stateDir)
	cfg := Config{HostNS: host.Handle, NetnsDir: netnsDir, Logger: testLogger(), StateFile: st}
	d1, err := New(alone(cfg))
	if err != nil {
		t.Fatal(err)
	}
	if isNS(d1.host.Path("orphan")) || contains(nstest.LinkNames(t, host.NL), orphanVeth) {
		t.Fatal("leftover sandbox or veth of an unknown network survived start-up")
	}
	mustCreate(t, d1, createReq("kept", "91", "198.51.100.0/24"))
	mustEndpoint(t, d1, "kept", "e", "198.51.100.5/24")
	mustJoin(t, d1, "kept", "e")
	d1.Close()
	if err := sandbox.RemoveLeftover(d1.host, "kept"); err != nil {
		t.Fatal(err)
	}
	d2, err := New(alone(cfg))
	if err != nil {
		t.Fatal(err)
	}
	defer d2.Close()
	if !isNS(d2.host.Path("kept")) {
		t.Fatal("vanished sandbox not rebuilt")
	}
	// A new endpoint can join and the old one can leave.
	mustEndpoint(t, d2, "kept", "e2", "198.51.100.6/24")
	mustJoin(t, d2, "kept", "e2")
	if err := d2.Leave(&api.LeaveRequest{NetworkID: "kept", EndpointID: "e"}); err != nil {
		t.Fatal(err)
	}
	mustAudit(t, d2)
	st.Close()
}

// A state write that fails makes the call fail and leaves nothing behind.
func TestPersistFailureLeavesNothing(t *testing.T) {
	host := nstest.NewNS(t, "host")
	st := openStore(t, t.TempDir())
	d, err := New(alone(Config{HostNS: host.Handle, NetnsDir: nstest.NetnsDir(t), Logger: testLogger(), StateFile: st}))
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	mustCreate(t, d, createReq("ok", "5", "198.51.100.0/24"))
	mustEndpoint(t, d, "ok", "e", "198.51.100.5/24")
	st.Close() // every later write fails
	if err := d.CreateNetwork(createReq("n", "6", "203.0.113.0/24")); err == nil || !strings.Contains(err.Error(), "failed to save") {
		t.Fatalf("CreateNetwork with a failing store: %v", err)
	}
	if _, err := d.Join(&api.JoinRequest{NetworkID: "ok", EndpointID: "e"}); err == nil {
		t.Fatal("Join with a failing store succeeded")
	}
	d.mu.Lock()
	_, has := d.nets["n"]
	vniFree := d.byVNI[6] == nil
	d.mu.Unlock()
	if has || !vniFree {
		t.Fatal("failed CreateNetwork left the network registered")
	}
	if isNS(d.host.Path("ok")) {
		t.Fatal("failed Join left its sandbox")
	}
	links, _ := host.NL.LinkList()
	for _, l := range links {
		if _, ok := l.(*netlink.Veth); ok {
			t.Fatalf("failed Join left veth %s", l.Attrs().Name)
		}
	}
	mustAudit(t, d)
}
