package driver

import (
	"net"
	"net/netip"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/sandbox"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
	"github.com/overlayd/overlayd/peerdb"
)

// The driver's counters (read by the metrics) follow the kernel work: a
// remote peer programs two entries (neighbour, FDB); a neighbour removed
// behind the driver's back is one peer_entry repair of the next Reconcile,
// which is counted as a run; nothing else is counted as repaired.
func TestCountersFollowProgrammingAndRepairs(t *testing.T) {
	hosts, vteps := nstest.Hosts(t, 1, false)
	d := newTestDriver(t, hosts[0], vteps[0])
	mustCreate(t, d, createReq("n", "46", "198.51.100.0/24"))
	mustEndpoint(t, d, "n", "local", "198.51.100.2/24")
	mustJoin(t, d, "n", "local")
	c0 := d.Counters()
	a := peerdb.Peer{EndpointID: "a", IP: netip.MustParseAddr("198.51.100.10"), MAC: peerdb.MAC{2, 0, 0, 0, 0, 10}, VTEP: netip.MustParseAddr("192.0.2.52")}
	if err := applyPeerEvent(d, PeerEvent{VNI: 46, Next: &a}); err != nil {
		t.Fatal(err)
	}
	c1 := d.Counters()
	if got := c1.PeerChanges - c0.PeerChanges; got != 2 {
		t.Errorf("one remote peer: %d peer changes counted, want 2 (neighbour and FDB entry)", got)
	}

	h := sandboxHandle(t, d, "n")
	vx, err := h.LinkByName(sandbox.VXLANName(46))
	if err != nil {
		t.Fatal(err)
	}
	if err := h.NeighDel(&netlink.Neigh{LinkIndex: vx.Attrs().Index, Family: unix.AF_INET, IP: net.ParseIP("198.51.100.10")}); err != nil {
		t.Fatal(err)
	}
	if _, err := d.Reconcile(); err != nil {
		t.Fatal(err)
	}
	c2 := d.Counters()
	if got := c2.Reconciles - c1.Reconciles; got != 1 {
		t.Errorf("%d reconcile runs counted, want 1", got)
	}
	want := map[string]uint64{RepairPeerEntry: 1, RepairBridgePort: 0, RepairSandbox: 0}
	for _, k := range RepairKinds {
		if got := c2.Repaired[k] - c1.Repaired[k]; got != want[k] {
			t.Errorf("repairs of kind %s: %d, want %d", k, got, want[k])
		}
	}
	if got := c2.PeerChanges - c1.PeerChanges; got != 1 {
		t.Errorf("the repair programmed %d entries, want 1", got)
	}
	mustAudit(t, d)
}
