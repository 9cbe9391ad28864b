package cluster

import (
	"net/netip"
	"testing"
	"time"

	"github.com/overlayd/overlayd/peerdb"
)

func lpeer(id, ip string) peerdb.Peer {
	a := netip.MustParseAddr(ip)
	return peerdb.Peer{EndpointID: id, IP: a, MAC: peerdb.MACFromIP(a)}
}

func liveLocal(o *localStore) map[string]peerdb.Peer {
	out := map[string]peerdb.Peer{}
	for _, r := range o.snapshot().Records {
		out[r.EndpointID] = r.peer()
	}
	return out
}

// A local record without VTEP gets the node's current one, so a
// publication racing with a VTEP change is never refused.
func TestPublishStampsVTEP(t *testing.T) {
	clk := &fakeClock{t: time.Unix(1_700_000_000, 0)}
	o := newLocalStore("o", 5, netip.MustParseAddr("10.0.0.1"), clk.now)
	p := lpeer("a", "10.1.0.2")
	if reason, _ := o.publish(7, nil, &p); reason != "" {
		t.Fatalf("record without VTEP refused: %s", reason)
	}
	if got := liveLocal(o)["a"].VTEP; got != netip.MustParseAddr("10.0.0.1") {
		t.Fatalf("stamped VTEP %v", got)
	}
	p.VTEP = netip.MustParseAddr("10.0.0.9")
	if reason, _ := o.publish(7, nil, &p); reason != DropVTEPMatch {
		t.Fatalf("record with another VTEP: reason %q", reason)
	}
}

// SyncLocal makes the local records exactly the list, except keys changed
// after the mark the list was taken under: a Join or Leave racing with the
// listing wins.
func TestSyncLocal(t *testing.T) {
	clk := &fakeClock{t: time.Unix(1_700_000_000, 0)}
	o := newLocalStore("o", 5, netip.MustParseAddr("10.0.0.1"), clk.now)
	kept, gone, left := lpeer("kept", "10.1.0.2"), lpeer("gone", "10.1.0.3"), lpeer("left", "10.1.0.4")
	for _, p := range []peerdb.Peer{kept, gone, left} {
		o.publish(7, nil, &p)
	}
	mark := o.mark()
	// After the mark: a Join and a Leave the list does not know of yet.
	joined := lpeer("joined", "10.1.0.5")
	o.publish(7, nil, &joined)
	o.publish(7, &left, nil)
	moved := kept
	moved.IP = netip.MustParseAddr("10.1.0.9")
	// The list taken after the mark still shows "left" (listed before its
	// Leave), misses "joined", and no longer has "gone".
	errs, changed := o.sync(mark, []LocalRecord{{VNI: 7, Peer: moved}, {VNI: 7, Peer: left}})
	if len(errs) != 0 || !changed {
		t.Fatalf("sync: errs %v changed %v", errs, changed)
	}
	live := liveLocal(o)
	if _, ok := live["gone"]; ok {
		t.Error("record of an endpoint the list lacks was not withdrawn")
	}
	if _, ok := live["left"]; ok {
		t.Error("a Leave after the mark was undone by the older list")
	}
	if _, ok := live["joined"]; !ok {
		t.Error("a Join after the mark was withdrawn by the older list")
	}
	if live["kept"].IP != moved.IP {
		t.Errorf("listed record not updated: %v", live["kept"])
	}
	// Nothing to do the second time.
	if _, changed := o.sync(o.mark(), []LocalRecord{{VNI: 7, Peer: moved}, {VNI: 7, Peer: joined}}); changed {
		t.Error("a sync with nothing to change changed something")
	}
	// Bad input is refused, naming the VNI.
	if errs, _ := o.sync(o.mark(), []LocalRecord{{VNI: 0, Peer: moved}}); len(errs) != 1 || errs[0].reason != DropInvalidVNI {
		t.Errorf("VNI 0: %v", errs)
	}
}
