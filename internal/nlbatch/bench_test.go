package nlbatch

import (
	"fmt"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/testutil/rawnl"
)

// Benchmark peers have IPv6 overlay addresses (the IPv4 documentation
// ranges hold too few) and IPv4 VTEPs.

// BenchmarkApplyPeers programs n peers (a neighbour and an FDB entry each)
// into empty tables (set), programs them again while they all exist (reset:
// what a resync does) and deletes them (del), reporting the three rates.
func BenchmarkApplyPeers(b *testing.B) {
	for _, n := range []int{1000, 5000, 20000} {
		b.Run(fmt.Sprintf("peers=%d", n), func(b *testing.B) {
			e := newEnv(b, envOpts{gcThresh: 4 * n})
			set := peerOps(e.link, 0, n, peerIP6, vtep4)
			del := delOps(e.link, 0, n, peerIP6, vtep4)
			var setDur, resetDur, delDur time.Duration
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				t0 := time.Now()
				if err := e.conn.Apply(set); err != nil {
					b.Fatal(err)
				}
				setDur += time.Since(t0)
				if i == 0 {
					b.StopTimer()
					if nn, nf := len(e.neighbours(b)), len(e.fdb(b)); nn != n || nf != n {
						b.Fatalf("kernel has %d neighbours and %d fdb entries, want %d each", nn, nf, n)
					}
					b.StartTimer()
				}
				// The same again: every entry exists already (a resync).
				t0 = time.Now()
				if err := e.conn.Apply(set); err != nil {
					b.Fatal(err)
				}
				resetDur += time.Since(t0)
				t0 = time.Now()
				if err := e.conn.Apply(del); err != nil {
					b.Fatal(err)
				}
				delDur += time.Since(t0)
				if i == 0 {
					b.StopTimer()
					if nn, nf := len(e.neighbours(b)), len(e.fdb(b)); nn != 0 || nf != 0 {
						b.Fatalf("kernel has %d neighbours and %d fdb entries after delete, want none", nn, nf)
					}
					b.StartTimer()
				}
			}
			b.ReportMetric(float64(n)*float64(b.N)/setDur.Seconds(), "set-peers/s")
			b.ReportMetric(float64(n)*float64(b.N)/resetDur.Seconds(), "reset-peers/s")
			b.ReportMetric(float64(n)*float64(b.N)/delDur.Seconds(), "del-peers/s")
		})
	}
}

// BenchmarkNeighSetOneAtATime is the baseline: the same work with
// vishvananda/netlink, one request (and one ACK) per entry.
func BenchmarkNeighSetOneAtATime(b *testing.B) {
	const n = 5000
	b.Run(fmt.Sprintf("peers=%d", n), func(b *testing.B) {
		e := newEnv(b, envOpts{gcThresh: 4 * n})
		neighs := make([]netlink.Neigh, 0, 2*n)
		for i := range n {
			mac := peerMAC(i)
			neighs = append(neighs,
				netlink.Neigh{
					LinkIndex:    e.link,
					Family:       unix.AF_INET6,
					State:        netlink.NUD_PERMANENT,
					IP:           net.IP(peerIP6(i).AsSlice()),
					HardwareAddr: net.HardwareAddr(mac[:]),
				},
				netlink.Neigh{
					LinkIndex:    e.link,
					Family:       unix.AF_BRIDGE,
					State:        netlink.NUD_PERMANENT,
					Flags:        netlink.NTF_SELF,
					IP:           net.IP(vtep4(i).AsSlice()),
					HardwareAddr: net.HardwareAddr(mac[:]),
				})
		}
		del := delOps(e.link, 0, n, peerIP6, vtep4)
		var setDur time.Duration
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			t0 := time.Now()
			for j := range neighs {
				if err := e.h.NeighSet(&neighs[j]); err != nil {
					b.Fatal(err)
				}
			}
			setDur += time.Since(t0)
			b.StopTimer()
			if i == 0 {
				if nn, nf := len(e.neighbours(b)), len(e.fdb(b)); nn != n || nf != n {
					b.Fatalf("kernel has %d neighbours and %d fdb entries, want %d each", nn, nf, n)
				}
			}
			if err := e.conn.Apply(del); err != nil {
				b.Fatal(err)
			}
			b.StartTimer()
		}
		b.ReportMetric(float64(n)*float64(b.N)/setDur.Seconds(), "set-peers/s")
	})
}

// BenchmarkApplyOnePeerPerCall adds 5,000 peers with one Apply of their two
// operations each, then deletes them likewise, against the raw reference
// (internal/testutil/rawnl) doing the same one peer per call on the same
// link in the same rounds (this first in even rounds, the reference in odd
// ones). It isolates the socket path of the driver's one-notification-
// per-peer case (BenchmarkPeersOneByOne in package driver) from the peer
// table and the sandbox: ratio_to_raw is the median over the rounds of
// the reference's time over this package's.
func BenchmarkApplyOnePeerPerCall(b *testing.B) {
	const n = 5000
	e := newEnv(b, envOpts{gcThresh: 4 * n})
	set := peerOps(e.link, 0, n, peerIP6, vtep4)
	del := delOps(e.link, 0, n, peerIP6, vtep4)
	raw, err := rawnl.Open(e.ns, e.link)
	if err != nil {
		b.Fatal(err)
	}
	defer raw.Close()
	peers := make([]rawnl.Peer, n)
	for i := range peers {
		peers[i] = rawnl.Peer{IPv6: peerIP6(i).As16(), V6: true, MAC: peerMAC(i), VTEP: vtep4(i).As4()}
	}
	onePerCall := func(ops []Op) {
		for i := 0; i < len(ops); i += 2 {
			if err := e.conn.Apply(ops[i : i+2]); err != nil {
				b.Fatal(err)
			}
		}
	}
	ours := func() {
		onePerCall(set)
		onePerCall(del)
	}
	// Once untimed: the calls program every peer (deletes of what is
	// missing would succeed too).
	onePerCall(set)
	if nn, nf := len(e.neighbours(b)), len(e.fdb(b)); nn != n || nf != n {
		b.Fatalf("kernel has %d neighbours and %d fdb entries, want %d each", nn, nf, n)
	}
	onePerCall(del)
	ref := func() {
		for _, program := range []func([]rawnl.Peer) error{raw.Add, raw.Delete} {
			for i := range peers {
				if err := program(peers[i : i+1]); err != nil {
					b.Fatal(err)
				}
			}
		}
	}
	timed := func(f func()) time.Duration {
		t0 := time.Now()
		f()
		return time.Since(t0)
	}
	var oursSum, refSum time.Duration
	ratios := make([]float64, 0, b.N)
	b.ResetTimer()
	for round := 0; round < b.N; round++ {
		var o, r time.Duration
		if round%2 == 0 {
			o = timed(ours)
			r = timed(ref)
		} else {
			r = timed(ref)
			o = timed(ours)
		}
		if round == 0 {
			b.StopTimer()
			if nn, nf := len(e.neighbours(b)), len(e.fdb(b)); nn != 0 || nf != 0 {
				b.Fatalf("kernel has %d neighbours and %d fdb entries after the deletes, want none", nn, nf)
			}
			b.StartTimer()
		}
		oursSum += o
		refSum += r
		ratios = append(ratios, r.Seconds()/o.Seconds())
	}
	b.StopTimer()
	slices.Sort(ratios)
	calls := float64(2 * n * b.N)
	b.ReportMetric(float64(oursSum.Nanoseconds())/calls, "ns/call")
	b.ReportMetric(float64(refSum.Nanoseconds())/calls, "raw-ns/call")
	b.ReportMetric(ratios[len(ratios)/2], "ratio_to_raw")
}
