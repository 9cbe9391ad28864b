package driver

import (
	"log/slog"
	"net/netip"
	"testing"

	api "github.com/docker/go-plugins-helpers/network"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/logkeys"
	"github.com/overlayd/overlayd/internal/sandbox"
	"github.com/overlayd/overlayd/internal/testutil/logrec"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
	"github.com/overlayd/overlayd/peerdb"
)

// TestStateChangesLoggedOnce: a network's creation and deletion and each
// kind of reconcile repair are one INFO line each with the event and keys
// of internal/logkeys; a refused create, a delete of an unknown network and
// a reconcile that finds nothing add none.
func TestStateChangesLoggedOnce(t *testing.T) {
	hosts, vteps := nstest.Hosts(t, 1, false)
	rec := &logrec.Recorder{}
	d := newTestDriverLogging(t, hosts[0], vteps[0], rec.Logger())
	net := []string{logkeys.Network, "n"}

	mustCreate(t, d, createReq("n", "4242", "198.51.100.0/24"))
	if err := d.CreateNetwork(createReq("m", "4242", "203.0.113.0/24")); err == nil {
		t.Fatal("a second network with VNI 4242 was accepted")
	}
	rec.One(t, slog.LevelInfo, logkeys.NetworkCreated, append(net, logkeys.VNIs, "4242", "subnets", "198.51.100.0/24", "mtu", "1450", "encrypted", "false"), "internal")

	mustEndpoint(t, d, "n", "e", "198.51.100.5/24")
	mustJoin(t, d, "n", "e")
	remote := peerdb.Peer{EndpointID: "r", IP: netip.MustParseAddr("198.51.100.20"),
		MAC: peerdb.MAC{0x02, 0x42, 0xc6, 0x33, 0x64, 0x14}, VTEP: netip.MustParseAddr("192.0.2.99")}
	if err := applyPeerEvent(d, PeerEvent{VNI: 4242, Next: &remote}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Reconcile(); err != nil {
		t.Fatal(err)
	}
	if got := rec.Events(logkeys.ReconcileRepair); len(got) != 0 {
		t.Fatalf("a reconcile with nothing to repair logged %v", got)
	}

	// Break the kernel: the remote peer's neighbour goes, and the local
	// endpoint's bridge port floods unknown unicast.
	h := sandboxHandle(t, d, "n")
	vx := sandboxLink(t, d, "n", sandbox.VXLANName(4242))
	if err := h.NeighDel(&netlink.Neigh{LinkIndex: vx, Family: unix.AF_INET, IP: remote.IP.AsSlice()}); err != nil {
		t.Fatal(err)
	}
	_, sbName := linkNames("n", "e")
	port, err := h.LinkByName(sbName)
	if err != nil {
		t.Fatal(err)
	}
	if err := h.LinkSetFlood(port, true); err != nil {
		t.Fatal(err)
	}
	for range 2 { // the second finds nothing
		if _, err := d.Reconcile(); err != nil {
			t.Fatal(err)
		}
	}
	rec.One(t, slog.LevelInfo, logkeys.ReconcileRepair, append(net, logkeys.Kind, logkeys.KindPeers, logkeys.Count, "1"), logkeys.First)
	rec.One(t, slog.LevelInfo, logkeys.ReconcileRepair, append(net, logkeys.Kind, logkeys.KindPorts, logkeys.Count, "1"), logkeys.First)
	if got := rec.Events(logkeys.ReconcileRepair); len(got) != 2 {
		t.Fatalf("reconcile repairs logged %v, want the peers and the ports", got)
	}
	mustAudit(t, d)

	for _, err := range []error{
		d.Leave(&api.LeaveRequest{NetworkID: "n", EndpointID: "e"}),
		d.DeleteEndpoint(&api.DeleteEndpointRequest{NetworkID: "n", EndpointID: "e"}),
		d.DeleteNetwork(&api.DeleteNetworkRequest{NetworkID: "n"}),
		d.DeleteNetwork(&api.DeleteNetworkRequest{NetworkID: "unknown"}),
	} {
		if err != nil {
			t.Fatal(err)
		}
	}
	rec.One(t, slog.LevelInfo, logkeys.NetworkDeleted, append(net, logkeys.VNIs, "4242"))
	if got := rec.Events(logkeys.NetworkDeleted); len(got) != 1 {
		t.Fatalf("deletes logged %v, want the one of n", got)
	}
}
