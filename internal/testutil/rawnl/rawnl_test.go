package rawnl

import (
	"errors"
	"net"
	"net/netip"
	"strconv"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

// testPeers returns n peers (n ≤ 508) with addresses in 192.0.2.0/24 and
// 198.51.100.0/24 and VTEPs in 203.0.113.0/24.
func testPeers(n int) []Peer {
	nets := [2][4]byte{{192, 0, 2, 0}, {198, 51, 100, 0}}
	peers := make([]Peer, n)
	for i := range peers {
		ip := nets[i/254]
		ip[3] = byte(i%254 + 1)
		peers[i] = Peer{IP: ip, MAC: [6]byte{2, 0x42, ip[0], ip[1], ip[2], ip[3]}, VTEP: [4]byte{203, 0, 113, byte(i%8 + 1)}}
	}
	return peers
}

// dump returns the permanent IPv4 neighbours and the FDB self entries of
// link.
func dump(t *testing.T, h *netlink.Handle, link int) (map[[4]byte][6]byte, map[[6]byte][4]byte) {
	t.Helper()
	neigh := map[[4]byte][6]byte{}
	fdb := map[[6]byte][4]byte{}
	ns, err := h.NeighList(link, unix.AF_INET)
	if err != nil {
		t.Fatalf("neighbour dump: %v", err)
	}
	for _, n := range ns {
		if n.State&netlink.NUD_PERMANENT != 0 {
			neigh[[4]byte(n.IP.To4())] = [6]byte(n.HardwareAddr)
		}
	}
	fs, err := h.NeighList(link, unix.AF_BRIDGE)
	if err != nil {
		t.Fatalf("fdb dump: %v", err)
	}
	for _, f := range fs {
		if f.Flags&netlink.NTF_SELF != 0 && f.State&netlink.NUD_PERMANENT != 0 && f.LinkIndex == link {
			fdb[[6]byte(f.HardwareAddr)] = [4]byte(f.IP.To4())
		}
	}
	return neigh, fdb
}

// openOnVXLAN makes a namespace with a VXLAN link and opens the reference
// on it.
func openOnVXLAN(t *testing.T, name string) (*nstest.NS, int, *Programmer) {
	t.Helper()
	ns := nstest.NewNS(t, name)
	vx := &netlink.Vxlan{LinkAttrs: netlink.LinkAttrs{Name: "vx9", Flags: net.FlagUp}, VxlanId: 9, Port: 4899, Learning: false}
	if err := ns.NL.LinkAdd(vx); err != nil {
		t.Fatalf("create vxlan: %v", err)
	}
	p, err := Open(ns.Handle, vx.Attrs().Index)
	if err != nil {
		t.Fatal(err)
	}
	return ns, vx.Attrs().Index, p
}

// TestProgramsPeers checks the reference against the kernel: every peer of
// several batches lands (exactly the neighbour and FDB entry asked for),
// adding an existing one fails (NLM_F_EXCL), deletes remove everything, and
// a failure in the middle of a batch is reported.
func TestProgramsPeers(t *testing.T) {
	ns, link, p := openOnVXLAN(t, "rawnl")
	defer p.Close()

	peers := testPeers(300) // three batches of 128, 128 and 44 peers
	if err := p.Add(peers); err != nil {
		t.Fatalf("Add: %v", err)
	}
	neigh, fdb := dump(t, ns.NL, link)
	if len(neigh) != len(peers) || len(fdb) != len(peers) {
		t.Fatalf("kernel holds %d neighbours and %d FDB entries, want %d each", len(neigh), len(fdb), len(peers))
	}
	for _, q := range peers {
		if neigh[q.IP] != q.MAC || fdb[q.MAC] != q.VTEP {
			t.Fatalf("peer %v: kernel has lladdr %x, dst %v; want %x, %v",
				netip.AddrFrom4(q.IP), neigh[q.IP], netip.AddrFrom4(fdb[q.MAC]), q.MAC, netip.AddrFrom4(q.VTEP))
		}
	}

	// A batch whose middle request fails still ends (its last request is
	// acknowledged) and reports the failure.
	fresh := testPeers(400)[300:]
	mixed := append(append(append([]Peer{}, fresh[:50]...), peers[7]), fresh[50:]...)
	if err := p.Add(mixed); !errors.Is(err, unix.EEXIST) {
		t.Fatalf("Add of an existing peer: got %v, want EEXIST", err)
	}
	if neigh, _ := dump(t, ns.NL, link); len(neigh) != 400 {
		t.Fatalf("after the failed batch the kernel holds %d neighbours, want 400", len(neigh))
	}

	if err := p.Delete(testPeers(400)); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	if neigh, fdb := dump(t, ns.NL, link); len(neigh) != 0 || len(fdb) != 0 {
		t.Fatalf("after Delete the kernel holds %d neighbours and %d FDB entries, want none", len(neigh), len(fdb))
	}
	if err := p.Delete(peers[:1]); !errors.Is(err, unix.ENOENT) {
		t.Fatalf("Delete of a missing peer: got %v, want ENOENT", err)
	}
}

// BenchmarkReference adds and deletes n peers with the reference alone, on
// a VXLAN link in a bare namespace (no bridge, nothing else running): how
// the kernel's own cost per peer changes with the size of the tables,
// without a Go heap or a sandbox around it.
func BenchmarkReference(b *testing.B) {
	for _, n := range []int{1000, 10000, 50000, 100000} {
		b.Run(strconv.Itoa(n), func(b *testing.B) {
			ns := nstest.NewNS(b, "rawnl")
			vx := &netlink.Vxlan{LinkAttrs: netlink.LinkAttrs{Name: "vx9", Flags: net.FlagUp}, VxlanId: 9, Port: 4899, Learning: false}
			if err := ns.NL.LinkAdd(vx); err != nil {
				b.Fatalf("create vxlan: %v", err)
			}
			p, err := Open(ns.Handle, vx.Attrs().Index)
			if err != nil {
				b.Fatal(err)
			}
			defer p.Close()
			// 198.18.0.0/15 is reserved for benchmarking (RFC 2544): the
			// documentation ranges hold too few addresses, and these never
			// leave the namespace.
			peers := make([]Peer, n)
			for i := range peers {
				v := uint32(198<<24|18<<16) + uint32(i+10)
				ip := [4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)}
				peers[i] = Peer{IP: ip, MAC: [6]byte{2, 0x42, ip[0], ip[1], ip[2], ip[3]}, VTEP: [4]byte{192, 0, 2, 99}}
			}
			var addT, delT time.Duration
			for i := 0; i < b.N; i++ {
				t0 := time.Now()
				if err := p.Add(peers); err != nil {
					b.Fatal(err)
				}
				addT += time.Since(t0)
				t0 = time.Now()
				if err := p.Delete(peers); err != nil {
					b.Fatal(err)
				}
				delT += time.Since(t0)
			}
			b.ReportMetric(float64(n*b.N)/addT.Seconds(), "add-peers/s")
			b.ReportMetric(float64(n*b.N)/delT.Seconds(), "del-peers/s")
			b.ReportMetric(float64(addT.Nanoseconds())/1e3/float64(n*b.N), "add-us/peer")
			b.ReportMetric(float64(delT.Nanoseconds())/1e3/float64(n*b.N), "del-us/peer")
		})
	}
}

// TestProgramsIPv6Peers: the reference programs IPv6 neighbours (and
// their FDB entries) as it does IPv4 ones, mixed in one batch, and
// deletes them.
func TestProgramsIPv6Peers(t *testing.T) {
	ns, link, p := openOnVXLAN(t, "rawnl6")
	defer p.Close()
	peers := testPeers(300)
	for i := range peers {
		if i%3 != 0 { // two in three are IPv6
			peers[i].V6 = true
			peers[i].IPv6 = netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 0, 0x12, 14: byte(i >> 8), 15: byte(i)}).As16()
		}
	}
	if err := p.Add(peers); err != nil {
		t.Fatalf("Add: %v", err)
	}
	ns6, err := ns.NL.NeighList(link, unix.AF_INET6)
	if err != nil {
		t.Fatal(err)
	}
	got6 := map[[16]byte][6]byte{}
	for _, n := range ns6 {
		if n.State&netlink.NUD_PERMANENT != 0 {
			got6[[16]byte(n.IP.To16())] = [6]byte(n.HardwareAddr)
		}
	}
	neigh4, fdb := dump(t, ns.NL, link)
	if len(got6) != 200 || len(neigh4) != 100 || len(fdb) != 300 {
		t.Fatalf("kernel holds %d IPv6 and %d IPv4 neighbours and %d FDB entries, want 200, 100, 300", len(got6), len(neigh4), len(fdb))
	}
	for _, q := range peers {
		if q.V6 && got6[q.IPv6] != q.MAC {
			t.Fatalf("peer %v: kernel has lladdr %x, want %x", netip.AddrFrom16(q.IPv6), got6[q.IPv6], q.MAC)
		}
	}
	if err := p.Delete(peers); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	if ns6, _ := ns.NL.NeighList(link, unix.AF_INET6); len(ns6) != 0 {
		for _, n := range ns6 {
			if n.State&netlink.NUD_PERMANENT != 0 {
				t.Fatalf("after Delete the kernel holds IPv6 neighbour %v", n)
			}
		}
	}
}
