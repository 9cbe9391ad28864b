package peerdb

import (
	"net/netip"
	"testing"
)

var benchSubnets = []netip.Prefix{netip.MustParsePrefix("10.0.0.0/17"), netip.MustParsePrefix("10.0.128.0/17")}

// benchPeers returns n distinct remote records spread over both subnets and
// 50 hosts.
func benchPeers(n int) []Peer {
	out := make([]Peer, n)
	for i := range out {
		ip := netip.AddrFrom4([4]byte{10, 0, byte(i >> 8), byte(i)})
		out[i] = Peer{
			EndpointID: "endpoint-" + ip.String(),
			IP:         ip,
			MAC:        MACFromIP(ip),
			VTEP:       netip.AddrFrom4([4]byte{192, 0, 2, byte(1 + i%50)}),
		}
	}
	return out
}

func BenchmarkApplyAll20000(b *testing.B) {
	peers := benchPeers(20000)
	evs := make([]Event, len(peers))
	for i := range peers {
		evs[i] = Event{Next: &peers[i]}
	}
	b.ReportAllocs()
	for b.Loop() {
		db := New(benchSubnets)
		d, errs := db.ApplyAll(evs)
		if errs != nil || len(d.NeighSet) != 20000 || len(d.FDBSet) != 20000 {
			b.Fatalf("errs %v, %d neigh, %d fdb", errs, len(d.NeighSet), len(d.FDBSet))
		}
	}
}

// BenchmarkApply applies single events to a DB holding 5,000 entries: each
// iteration moves one endpoint to another host (an update).
func BenchmarkApply(b *testing.B) {
	peers := benchPeers(5000)
	db := New(benchSubnets)
	for i := range peers {
		if _, err := db.Apply(Event{Next: &peers[i]}); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		prev := peers[i%len(peers)]
		next := prev
		next.VTEP = netip.AddrFrom4([4]byte{192, 0, 2, 100 + byte(i/len(peers)%2)})
		d, err := db.Apply(Event{Prev: &prev, Next: &next})
		if err != nil || len(d.FDBSet) != 1 {
			b.Fatalf("%v %+v", err, d)
		}
		peers[i%len(peers)] = next
		i++
	}
}
