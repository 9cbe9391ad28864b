package sandbox

import (
	"maps"
	"net/netip"
	"slices"
	"testing"

	"github.com/overlayd/overlayd/peerdb"
)

func mac(b byte) peerdb.MAC { return peerdb.MAC{0x02, 0, 0, 0, 0, b} }

// Diff, pure: every kind of difference (missing, wrong value, not
// desired, foreign) in both tables becomes the delta that repairs it and
// one problem naming it; the delta is sorted whatever the maps' order,
// and equal states give nothing.
func TestDiff(t *testing.T) {
	ip := func(s string) netip.Addr { return netip.MustParseAddr(s) }
	vtep1, vtep2 := ip("198.51.100.1"), ip("198.51.100.2")
	want := peerdb.State{
		Neigh: map[peerdb.NeighKey]peerdb.MAC{},
		FDB:   map[peerdb.FDBKey]netip.Addr{},
	}
	var have Kernel
	// Subnet 1 and 0, addresses out of order: the delta sorts them.
	for i, a := range []string{"192.0.2.9", "192.0.2.3", "192.0.2.7", "192.0.2.5"} {
		want.Neigh[peerdb.NeighKey{Subnet: 1 - i%2, IP: ip(a)}] = mac(byte(10 + i))
		want.FDB[peerdb.FDBKey{Subnet: 1 - i%2, MAC: mac(byte(10 + i))}] = vtep1
	}
	if d, p := Diff(want, Kernel{Neigh: maps.Clone(want.Neigh), FDB: maps.Clone(want.FDB)}); !d.Empty() || len(p) != 0 {
		t.Fatalf("equal states: %+v %v", d, p)
	}
	// have: one neighbour with another MAC, one missing, one not desired;
	// one FDB entry to another VTEP, one missing, one not desired; one
	// foreign entry.
	have.Neigh, have.FDB = maps.Clone(want.Neigh), maps.Clone(want.FDB)
	have.Neigh[peerdb.NeighKey{Subnet: 0, IP: ip("192.0.2.3")}] = mac(99)
	delete(have.Neigh, peerdb.NeighKey{Subnet: 1, IP: ip("192.0.2.9")})
	have.Neigh[peerdb.NeighKey{Subnet: 0, IP: ip("192.0.2.200")}] = mac(98)
	have.FDB[peerdb.FDBKey{Subnet: 1, MAC: mac(12)}] = vtep2
	delete(have.FDB, peerdb.FDBKey{Subnet: 0, MAC: mac(11)})
	have.FDB[peerdb.FDBKey{Subnet: 1, MAC: mac(97)}] = vtep2
	have.Foreign = []string{"fdb 02:00:00:00:00:60 dst 198.51.100.3 on ovvx-1"}

	for range 20 { // map order varies from run to run: the result must not
		d, problems := Diff(want, have)
		wantSet := []peerdb.Neigh{{Subnet: 0, IP: ip("192.0.2.3"), MAC: mac(11)}, {Subnet: 1, IP: ip("192.0.2.9"), MAC: mac(10)}}
		if !slices.Equal(d.NeighSet, wantSet) {
			t.Fatalf("NeighSet %v, want %v", d.NeighSet, wantSet)
		}
		if !slices.Equal(d.NeighMoved, wantSet[:1]) {
			t.Fatalf("NeighMoved %v, want %v", d.NeighMoved, wantSet[:1])
		}
		if want := []peerdb.Neigh{{Subnet: 0, IP: ip("192.0.2.200"), MAC: mac(98)}}; !slices.Equal(d.NeighDel, want) {
			t.Fatalf("NeighDel %v, want %v", d.NeighDel, want)
		}
		if want := []peerdb.FDB{{Subnet: 0, MAC: mac(11), VTEP: vtep1}, {Subnet: 1, MAC: mac(12), VTEP: vtep1}}; !slices.Equal(d.FDBSet, want) {
			t.Fatalf("FDBSet %v, want %v", d.FDBSet, want)
		}
		if want := []peerdb.FDB{{Subnet: 1, MAC: mac(97), VTEP: vtep2}}; !slices.Equal(d.FDBDel, want) {
			t.Fatalf("FDBDel %v, want %v", d.FDBDel, want)
		}
		if len(problems) != 7 || !slices.IsSorted(problems) {
			t.Fatalf("problems %q: want 7, sorted", problems)
		}
	}
}
