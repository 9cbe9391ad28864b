package driver

import (
	"fmt"
	"net/netip"
	"os"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	api "github.com/docker/go-plugins-helpers/network"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/sandbox"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
	"github.com/overlayd/overlayd/internal/testutil/rawnl"
	"github.com/overlayd/overlayd/peerdb"
)

// benchDriver makes a driver in a fresh host namespace whose neighbour
// table can hold many thousands of entries.
func benchDriver(b *testing.B) *Driver {
	b.Helper()
	hosts, vteps := nstest.Hosts(b, 1, false)
	return newTestDriver(b, hosts[0], vteps[0])
}

// The Join and Leave benchmarks have twins of the same names that drive
// Docker's in-tree overlay driver (bench/intree): same network, same timed
// calls, a new endpoint id every round as dockerd gives every container.
// bench/intree/compare.sh runs both in interleaved rounds.

// BenchmarkJoinFirst measures the first Join of a network, which builds its
// sandbox (namespace, bridge, VXLAN) and the endpoint's veth.
func BenchmarkJoinFirst(b *testing.B) {
	d := benchDriver(b)
	mustCreate(b, d, createReq("n", "100", "198.51.100.0/24"))
	benchJoins(b, d, "198.51.100.2/24")
}

// BenchmarkJoinLater measures a Join into a network whose sandbox exists.
func BenchmarkJoinLater(b *testing.B) {
	d := benchDriver(b)
	networkWithFirstB(b, d)
	benchJoins(b, d, "198.51.100.3/24")
}

// benchJoins times, every round, the Join of a new endpoint of network "n"
// with address addr. Its Leave, DeleteEndpoint and the deletions they hand
// over are done untimed: a first Join finds its network's previous sandbox
// gone, as it is unless the Join comes within the teardown's 50 ms (it
// then finishes that teardown first).
func benchJoins(b *testing.B, d *Driver, addr string) { benchJoinsDual(b, d, addr, "") }

// benchJoinsDual is benchJoins for endpoints with an IPv4 address addr and
// an IPv6 address addr6 (either may be "").
func benchJoinsDual(b *testing.B, d *Driver, addr, addr6 string) {
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		eid := fmt.Sprintf("e%d", i)
		b.StopTimer()
		if _, err := d.CreateEndpoint(endpointReq6("n", eid, addr, addr6)); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		mustJoin(b, d, "n", eid)
		b.StopTimer()
		leaveDelete(b, d, "n", eid)
		d.WaitDeletions()
		b.StartTimer()
	}
}

// BenchmarkJoinFirstDualStack is BenchmarkJoinFirst for a dual-stack
// network: the sandbox also gets its IPv6 gateway and its links' IPv6
// set up.
func BenchmarkJoinFirstDualStack(b *testing.B) {
	d := benchDriver(b)
	mustCreate(b, d, createReq6("n", "100", "198.51.100.0/24", "2001:db8:1::/64"))
	benchJoinsDual(b, d, "198.51.100.2/24", "2001:db8:1::2/64")
}

// BenchmarkJoinLaterDualStack is BenchmarkJoinLater for a dual-stack
// network (the veth's sandbox end gets no IPv6 address generation).
func BenchmarkJoinLaterDualStack(b *testing.B) {
	d := benchDriver(b)
	mustCreate(b, d, createReq6("n", "100", "198.51.100.0/24", "2001:db8:1::/64"))
	if _, err := d.CreateEndpoint(endpointReq6("n", "first", "198.51.100.2/24", "2001:db8:1::2/64")); err != nil {
		b.Fatal(err)
	}
	mustJoin(b, d, "n", "first")
	benchJoinsDual(b, d, "198.51.100.3/24", "2001:db8:1::3/64")
}

// BenchmarkLeaveLast measures the last Leave and its DeleteEndpoint, which
// tear the sandbox down (leave-ns/op: the Leave alone).
func BenchmarkLeaveLast(b *testing.B) {
	d := benchDriver(b)
	mustCreate(b, d, createReq("n", "100", "198.51.100.0/24"))
	benchLeaves(b, d, "198.51.100.2/24")
}

// BenchmarkLeaveVeth measures a Leave that is not the network's last and
// its DeleteEndpoint: only the endpoint's veth goes (leave-ns/op: the Leave
// alone).
func BenchmarkLeaveVeth(b *testing.B) {
	d := benchDriver(b)
	networkWithFirstB(b, d)
	benchLeaves(b, d, "198.51.100.3/24")
}

// benchLeaves times, every round, the Leave and DeleteEndpoint of a new
// endpoint of network "n" with address addr, joined untimed.
func benchLeaves(b *testing.B, d *Driver, addr string) {
	var leave time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		eid := fmt.Sprintf("e%d", i)
		b.StopTimer()
		mustEndpoint(b, d, "n", eid, addr)
		mustJoin(b, d, "n", eid)
		b.StartTimer()
		leave += leaveDelete(b, d, "n", eid)
	}
	b.ReportMetric(float64(leave.Nanoseconds())/float64(b.N), "leave-ns/op")
}

// BenchmarkLeaveBurst measures 32 containers of one network stopping at
// once (Leave and DeleteEndpoint of each, the network keeping one joined
// endpoint) until the kernel holds none of their veths: the deletions the
// Leaves hand over are waited for, so ns/op is the whole kernel work.
func BenchmarkLeaveBurst(b *testing.B) {
	const burst = 32
	d := benchDriver(b)
	networkWithFirstB(b, d)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		for j := 0; j < burst; j++ {
			eid := fmt.Sprintf("e%d-%d", i, j)
			mustEndpoint(b, d, "n", eid, fmt.Sprintf("198.51.100.%d/24", 10+j))
			mustJoin(b, d, "n", eid)
		}
		b.StartTimer()
		for j := 0; j < burst; j++ {
			leaveDelete(b, d, "n", fmt.Sprintf("e%d-%d", i, j))
		}
		d.WaitDeletions()
	}
}

// networkWithFirstB creates network "n" (VNI 100, 198.51.100.0/24) with
// the joined endpoint "first", so that later Joins and Leaves are not the
// first and last.
func networkWithFirstB(b *testing.B, d *Driver) {
	b.Helper()
	mustCreate(b, d, createReq("n", "100", "198.51.100.0/24"))
	mustEndpoint(b, d, "n", "first", "198.51.100.2/24")
	mustJoin(b, d, "n", "first")
}

// leaveDelete is what dockerd sends when a container stops: Leave, then
// DeleteEndpoint. It returns how long the Leave alone took.
func leaveDelete(b *testing.B, d *Driver, nid, eid string) time.Duration {
	b.Helper()
	t0 := time.Now()
	if err := d.Leave(&api.LeaveRequest{NetworkID: nid, EndpointID: eid}); err != nil {
		b.Fatal(err)
	}
	leave := time.Since(t0)
	if err := d.DeleteEndpoint(&api.DeleteEndpointRequest{NetworkID: nid, EndpointID: eid}); err != nil {
		b.Fatal(err)
	}
	return leave
}

// remotePeers returns n distinct remote peers from pool (permanent
// neighbour entries are exempt from the neighbour table's gc limits, so no
// sysctl needs raising).
func remotePeers(pool netip.Prefix, n int, vtep netip.Addr) []peerdb.Peer {
	peers := make([]peerdb.Peer, n)
	base := pool.Addr().As4()
	for i := 0; i < n; i++ {
		ip := base
		v := uint32(ip[0])<<24 | uint32(ip[1])<<16 | uint32(ip[2])<<8 | uint32(ip[3])
		v += uint32(i + 10)
		a := netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v)})
		peers[i] = peerdb.Peer{EndpointID: "r" + strconv.Itoa(i), IP: a, MAC: peerdb.MACFromIP(a), VTEP: vtep}
	}
	return peers
}

// remotePeers6 returns n distinct IPv6-only remote peers from pool6.
func remotePeers6(pool6 netip.Prefix, n int, vtep netip.Addr) []peerdb.Peer {
	peers := make([]peerdb.Peer, n)
	base := pool6.Addr().As16()
	for i := 0; i < n; i++ {
		a := base
		v := uint32(i + 10)
		a[12], a[13], a[14], a[15] = byte(v>>24), byte(v>>16), byte(v>>8), byte(v)
		ip6 := netip.AddrFrom16(a)
		peers[i] = peerdb.Peer{EndpointID: "r" + strconv.Itoa(i), IPv6: ip6, MAC: peerdb.MACFromIP(ip6), VTEP: vtep}
	}
	return peers
}

// peerPool is the pool of the peer benchmarks: 198.18.0.0/15 is reserved for
// benchmarking (RFC 2544) and the addresses never leave the test's namespaces.
// peerPool6 is the IPv6 pool of the IPv6 peer benchmark, in the
// documentation prefix (2001:db8::/32), inside the test's namespaces too.
var (
	peerPool  = netip.MustParsePrefix("198.18.0.0/15")
	peerPool6 = netip.MustParsePrefix("2001:db8:18::/64")
)

func joinedNetwork(b *testing.B, d *Driver, id string, vni uint32, pool netip.Prefix) {
	b.Helper()
	req := createReq(id, fmt.Sprint(vni), pool.String())
	mustCreate(b, d, req)
	gw := pool.Addr().Next()
	mustEndpoint(b, d, id, "local", netip.PrefixFrom(gw.Next(), pool.Bits()).String())
	mustJoin(b, d, id, "local")
}

// BenchmarkPeers programs N remote peers into one joined network in one
// batch — the source holds them, then one PeersChanged with their keys —
// then deletes them the same way. Only the driver's pull path is timed (the
// pulls from the source included), not the test source's own bookkeeping.
//
// Each round also adds and deletes the same peers on the same VXLAN link
// with rawnl, the least work that programs them (overlayd first in even
// rounds, the reference first in odd ones), so every run states overlayd
// against the kernel's limit on this machine at that moment:
// add-ratio_to_raw and del-ratio_to_raw are the medians over the rounds of
// the reference's time over overlayd's (1 = as fast as the reference).
// The rates and µs/peer are totals over the rounds. heap-B/peer is the Go
// heap the network keeps per peer held, at rest (after a notification that
// changes nothing, as the periodic pull; after GC; the source's records
// are not counted).
func BenchmarkPeers(b *testing.B) { benchPeers(b, false) }

// BenchmarkPeersIPv6 is BenchmarkPeers with IPv6-only remote peers (a
// permanent IPv6 neighbour and an FDB entry each) on a dual-stack network,
// in the same batch sizes, against the reference programming the same
// IPv6 neighbours.
func BenchmarkPeersIPv6(b *testing.B) { benchPeers(b, true) }

func benchPeers(b *testing.B, ipv6 bool) {
	for _, n := range []int{1000, 5000, 10000, 20000, 50000, 100000} {
		b.Run(strconv.Itoa(n), func(b *testing.B) {
			d, add, del, raw, rawPeers := peerBenchFamily(b, n, ipv6)
			src := source(d)
			var ours, ref [2][]spent // [add, del] per round
			var heapPerPeer float64
			_, byVNI := src.apply(add)
			keys := byVNI[100]
			src.apply(del)
			overlayd := func(round int) {
				src.put(keys, add)
				var before int64
				if round == 0 {
					before = heapInUse()
				}
				t0 := startClock()
				d.PeersChanged(100, keys)
				ours[0] = append(ours[0], t0.spent())
				if round == 0 {
					// At rest: a repeated notification changes nothing,
					// as the periodic full pull of a network at rest,
					// and lets the table drop the add's scratch space.
					d.PeersChanged(100, keys)
					heapPerPeer = float64(heapInUse()-before) / float64(n)
					wantPeersB(b, d, "n", n)
				}
				src.drop(keys)
				t0 = startClock()
				d.PeersChanged(100, keys)
				ours[1] = append(ours[1], t0.spent())
				if round == 0 {
					wantPeersB(b, d, "n", 0)
				}
			}
			reference := func(round int) {
				t0 := startClock()
				if err := raw.Add(rawPeers); err != nil {
					b.Fatal(err)
				}
				ref[0] = append(ref[0], t0.spent())
				if round == 0 {
					wantPeersB(b, d, "n", n)
				}
				t0 = startClock()
				if err := raw.Delete(rawPeers); err != nil {
					b.Fatal(err)
				}
				ref[1] = append(ref[1], t0.spent())
			}
			interleave(b, overlayd, reference)
			for i, op := range []string{"add", "del"} {
				reportRates(b, op, n, ours[i], ref[i])
			}
			b.ReportMetric(heapPerPeer, "heap-B/peer")
			if n == 5000 {
				b.ReportMetric(float64(peakRSS())/(1<<20), "peak-RSS-MB")
			}
		})
	}
}

// interleave runs b.N rounds of overlayd's work and the reference's,
// overlayd first in even rounds and the reference first in odd ones, so
// that neither always follows the other's deletes (whose memory the kernel
// frees later) or always meets the machine in the same state.
func interleave(b *testing.B, overlayd, reference func(round int)) {
	b.ResetTimer()
	for round := 0; round < b.N; round++ {
		if round%2 == 0 {
			overlayd(round)
			reference(round)
		} else {
			reference(round)
			overlayd(round)
		}
	}
	b.StopTimer()
}

// reportRates reports, for op ("add" or "del") of n peers per round,
// overlayd's and the reference's rate and µs per peer over all rounds
// (wall clock), and the medians over the rounds of the reference's time
// over overlayd's: op-ratio_to_raw by the wall clock, op-cpu-ratio_to_raw
// by the CPU time of the process (user and system, the kernel's work for
// our requests included), which the other processes of a busy machine
// disturb less.
func reportRates(b *testing.B, op string, n int, ours, ref []spent) {
	var sumOurs, sumRef time.Duration
	wall := make([]float64, len(ours))
	cpu := make([]float64, len(ours))
	for i := range ours {
		sumOurs += ours[i].wall
		sumRef += ref[i].wall
		wall[i] = ref[i].wall.Seconds() / ours[i].wall.Seconds()
		cpu[i] = ref[i].cpu.Seconds() / ours[i].cpu.Seconds()
	}
	peers := float64(n * len(ours))
	b.ReportMetric(peers/sumOurs.Seconds(), op+"-peers/s")
	b.ReportMetric(peers/sumRef.Seconds(), "raw-"+op+"-peers/s")
	b.ReportMetric(float64(sumOurs.Nanoseconds())/1e3/peers, op+"-us/peer")
	b.ReportMetric(float64(sumRef.Nanoseconds())/1e3/peers, "raw-"+op+"-us/peer")
	b.ReportMetric(median(wall), op+"-ratio_to_raw")
	b.ReportMetric(median(cpu), op+"-cpu-ratio_to_raw")
}

func median(v []float64) float64 {
	v = slices.Sorted(slices.Values(v))
	m := v[len(v)/2]
	if len(v)%2 == 0 {
		m = (v[len(v)/2-1] + m) / 2
	}
	return m
}

// clock is the start of a timed phase: the wall clock and the CPU time the
// process has used.
type clock struct {
	wall time.Time
	cpu  time.Duration
}

// spent is what a phase took.
type spent struct{ wall, cpu time.Duration }

func startClock() clock { return clock{wall: time.Now(), cpu: processCPU()} }

func (c clock) spent() spent {
	return spent{wall: time.Since(c.wall), cpu: processCPU() - c.cpu}
}

// processCPU returns the user and system time the process has used.
func processCPU() time.Duration {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// put sets the records of creates evs under their keys at the source, and
// drop removes the records of keys: the benchmarks' changes of the
// source, which keep the room of its map and so leave no garbage for a
// timed phase to collect (src.apply allocates its keys).
func (s *memSource) put(keys []peerdb.Key, evs []PeerEvent) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, ev := range evs {
		s.recs[keys[i]] = *ev.Next
	}
}

func (s *memSource) drop(keys []peerdb.Key) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, k := range keys {
		delete(s.recs, k)
	}
}

// peerBench makes a driver with network "n" (VNI 100) joined, and n
// remote peers for it: the events that add and delete them, and the
// reference programmer on the network's VXLAN link with the same peers.
func peerBench(b *testing.B, n int) (d *Driver, add, del []PeerEvent, raw *rawnl.Programmer, rawPeers []rawnl.Peer) {
	return peerBenchFamily(b, n, false)
}

// peerBenchFamily is peerBench with IPv6-only peers when ipv6, on a
// network with an IPv6 subnet beside its IPv4 one.
func peerBenchFamily(b *testing.B, n int, ipv6 bool) (d *Driver, add, del []PeerEvent, raw *rawnl.Programmer, rawPeers []rawnl.Peer) {
	d = benchDriver(b)
	vtep := netip.MustParseAddr("192.0.2.99")
	var peers []peerdb.Peer
	if ipv6 {
		mustCreate(b, d, createReq6("n", "100", peerPool.String(), peerPool6.String()))
		gw := peerPool.Addr().Next()
		mustEndpoint(b, d, "n", "local", netip.PrefixFrom(gw.Next(), peerPool.Bits()).String())
		mustJoin(b, d, "n", "local")
		peers = remotePeers6(peerPool6, n, vtep)
	} else {
		joinedNetwork(b, d, "n", 100, peerPool)
		peers = remotePeers(peerPool, n, vtep)
	}
	add = make([]PeerEvent, n)
	del = make([]PeerEvent, n)
	for i := range peers {
		add[i] = PeerEvent{VNI: 100, Next: &peers[i]}
		del[i] = PeerEvent{VNI: 100, Prev: &peers[i]}
	}
	raw, rawPeers = rawProgrammer(b, d, "n", 100, peers)
	return d, add, del, raw, rawPeers
}

// rawProgrammer opens the reference programmer on the VXLAN link of vni in
// network id's sandbox, and returns peers in its form.
func rawProgrammer(b *testing.B, d *Driver, id string, vni uint32, peers []peerdb.Peer) (*rawnl.Programmer, []rawnl.Peer) {
	b.Helper()
	n, unlock, err := d.lockNetwork(id)
	if err != nil {
		b.Fatal(err)
	}
	defer unlock()
	h, err := netlink.NewHandleAt(n.sb.NS())
	if err != nil {
		b.Fatal(err)
	}
	defer h.Close()
	vx, err := h.LinkByName(sandbox.VXLANName(vni))
	if err != nil {
		b.Fatal(err)
	}
	raw, err := rawnl.Open(n.sb.NS(), vx.Attrs().Index)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { raw.Close() })
	out := make([]rawnl.Peer, len(peers))
	for i, p := range peers {
		out[i] = rawnl.Peer{MAC: p.MAC, VTEP: p.VTEP.As4()}
		if p.IP.IsValid() {
			out[i].IP = p.IP.As4()
		} else {
			out[i].IPv6, out[i].V6 = p.IPv6.As16(), true
		}
	}
	return raw, out
}

// wantPeersB fails the benchmark unless network id's sandbox holds exactly
// n neighbours and n FDB entries: the rates count work that was done.
func wantPeersB(b *testing.B, d *Driver, id string, n int) {
	b.Helper()
	b.StopTimer()
	defer b.StartTimer()
	neigh, fdb := dumpPeersB(b, d, id)
	if neigh != n || fdb != n {
		b.Fatalf("kernel holds %d neighbours and %d fdb entries, want %d", neigh, fdb, n)
	}
}

// heapInUse returns the bytes of live Go heap objects after a collection.
func heapInUse() int64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}

// BenchmarkPeersOneByOne programs 5,000 peers with one notification per
// record, as a control plane without batching would, then deletes them
// likewise; the reference does the same one peer per call (one request
// pair and its acknowledgement each) in the same rounds. The source holds
// every record before the adds and none before the deletes, so the timed
// loops are the driver's alone.
func BenchmarkPeersOneByOne(b *testing.B) {
	const n = 5000
	d, add, del, raw, rawPeers := peerBench(b, n)
	src := source(d)
	var ours, ref [2][]spent
	_, byVNI := src.apply(add)
	keys := byVNI[100]
	src.apply(del)
	overlayd := func(round int) {
		for i := range 2 {
			if i == 0 {
				src.put(keys, add)
			} else {
				src.drop(keys)
			}
			t0 := startClock()
			for j := range keys {
				d.PeersChanged(100, keys[j:j+1])
			}
			ours[i] = append(ours[i], t0.spent())
			if round == 0 {
				wantPeersB(b, d, "n", n*(1-i))
			}
		}
	}
	reference := func(round int) {
		for i, program := range []func([]rawnl.Peer) error{raw.Add, raw.Delete} {
			t0 := startClock()
			for j := range rawPeers {
				if err := program(rawPeers[j : j+1]); err != nil {
					b.Fatal(err)
				}
			}
			ref[i] = append(ref[i], t0.spent())
			if round == 0 {
				wantPeersB(b, d, "n", n*(1-i))
			}
		}
	}
	interleave(b, overlayd, reference)
	for i, op := range []string{"add", "del"} {
		reportRates(b, op, n, ours[i], ref[i])
	}
}

// BenchmarkPeersParallel spreads 32 × 500 one-by-one peer events over 32
// networks from 32 goroutines, against the same 16,000 events on one
// network: the ratio shows whether distinct networks proceed in parallel.
func BenchmarkPeersParallel(b *testing.B) {
	const nets, per = 32, 500
	for _, spread := range []bool{false, true} {
		name := "1network"
		if spread {
			name = "32networks"
		}
		b.Run(name, func(b *testing.B) {
			d := benchDriver(b)
			pools := make([]netip.Prefix, nets)
			for i := range pools {
				pools[i] = netip.PrefixFrom(netip.AddrFrom4([4]byte{198, 18, byte(i * 4), 0}), 22)
				if !spread && i == 0 {
					joinedNetwork(b, d, "n0", 100, peerPool)
				} else if spread {
					joinedNetwork(b, d, fmt.Sprintf("n%d", i), uint32(100+i), pools[i])
				}
			}
			work := make([][]peerdb.Peer, nets)
			for i := range work {
				pool, vni := pools[i], uint32(100+i)
				if !spread {
					pool = peerPool
				}
				_ = vni
				all := remotePeers(pool, per*nets, netip.MustParseAddr("192.0.2.99"))
				if spread {
					work[i] = all[:per]
				} else {
					work[i] = all[i*per : (i+1)*per]
				}
			}
			b.ResetTimer()
			start := time.Now()
			for it := 0; it < b.N; it++ {
				var wg sync.WaitGroup
				for i := 0; i < nets; i++ {
					wg.Add(1)
					go func(i int) {
						defer wg.Done()
						vni := uint32(100)
						if spread {
							vni = uint32(100 + i)
						}
						for j := range work[i] {
							applyPeerEvent(d, PeerEvent{VNI: vni, Next: &work[i][j]})
						}
						for j := range work[i] {
							applyPeerEvent(d, PeerEvent{VNI: vni, Prev: &work[i][j]})
						}
					}(i)
				}
				wg.Wait()
			}
			b.ReportMetric(float64(2*nets*per*b.N)/time.Since(start).Seconds(), "events/s")
		})
	}
}

// BenchmarkNetworksParallel measures distinct networks proceeding in
// parallel: 32 networks, each a Join (which builds its sandbox) and 200
// remote peers added, done by 32 goroutines at once against the same work
// done network after network by one. Both runs alternate within every
// round, so they see the same machine; speedup is serial/parallel time.
// batched: the 200 peers come in one notification; one-by-one: one
// notification each. Between rounds (untimed) the networks leave, their
// sandboxes' teardowns finish and the records are removed again.
func BenchmarkNetworksParallel(b *testing.B) {
	const nets, per = 32, 200
	for _, batched := range []bool{true, false} {
		name := "one-by-one"
		if batched {
			name = "batched"
		}
		b.Run(name, func(b *testing.B) {
			d := benchDriver(b)
			src := source(d)
			add := make([][]PeerEvent, nets)
			del := make([][]PeerEvent, nets)
			for i := 0; i < nets; i++ {
				pool := netip.PrefixFrom(netip.AddrFrom4([4]byte{198, 18, byte(i * 4), 0}), 22)
				id, vni := fmt.Sprintf("n%d", i), uint32(100+i)
				mustCreate(b, d, createReq(id, fmt.Sprint(vni), pool.String()))
				mustEndpoint(b, d, id, "local", netip.PrefixFrom(pool.Addr().Next().Next(), pool.Bits()).String())
				peers := remotePeers(pool, per, netip.MustParseAddr("192.0.2.99"))
				for j := range peers {
					add[i] = append(add[i], PeerEvent{VNI: vni, Next: &peers[j]})
					del[i] = append(del[i], PeerEvent{VNI: vni, Prev: &peers[j]})
				}
			}
			// work is one network's timed part: its Join, then its peers
			// (the source's own bookkeeping is done before, untimed).
			work := func(i int, keys [][]peerdb.Key) {
				mustJoin(b, d, fmt.Sprintf("n%d", i), "local")
				vni := uint32(100 + i)
				if batched {
					d.PeersChanged(vni, keys[i])
					return
				}
				for _, k := range keys[i] {
					d.PeersChanged(vni, []peerdb.Key{k})
				}
			}
			// run returns the wall time of one run and the CPU time the
			// process used meanwhile, in user space and in the kernel
			// (system: the kernel's work in the calls, most of it under
			// its one RTNL lock), which bound what two cores can shorten.
			run := func(parallel bool) (wall time.Duration, cpu cpuUse) {
				keys := make([][]peerdb.Key, nets)
				for i := range keys {
					_, k := src.apply(add[i])
					keys[i] = k[uint32(100+i)]
				}
				cpu0, idle0 := cpuNow(), machineIdle()
				t0 := time.Now()
				if parallel {
					var wg sync.WaitGroup
					for i := 0; i < nets; i++ {
						wg.Add(1)
						go func() { defer wg.Done(); work(i, keys) }()
					}
					wg.Wait()
				} else {
					for i := 0; i < nets; i++ {
						work(i, keys)
					}
				}
				wall, cpu = time.Since(t0), cpuNow().sub(cpu0)
				cpu.idle = machineIdle().sub(idle0)
				for i := 0; i < nets; i++ {
					if err := d.Leave(&api.LeaveRequest{NetworkID: fmt.Sprintf("n%d", i), EndpointID: "local"}); err != nil {
						b.Fatal(err)
					}
					applyPeerEvents(d, del[i]...)
				}
				d.WaitDeletions()
				return wall, cpu
			}
			var serial, parallel time.Duration
			var serialCPU, parallelCPU cpuUse
			b.ResetTimer()
			for it := 0; it < b.N; it++ {
				for _, par := range [][2]bool{{false, true}, {true, false}}[it%2] {
					w, c := run(par)
					if par {
						parallel, parallelCPU = parallel+w, parallelCPU.add(c)
					} else {
						serial, serialCPU = serial+w, serialCPU.add(c)
					}
				}
			}
			perRun := func(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 / float64(b.N) }
			b.ReportMetric(perRun(serial), "serial-ms")
			b.ReportMetric(perRun(parallel), "parallel-ms")
			b.ReportMetric(serial.Seconds()/parallel.Seconds(), "speedup")
			// The most two cores could gain if all the kernel's work
			// were serialised (most of it runs under RTNL: building the
			// sandboxes, every neighbour and FDB change): the serial
			// run's wall time over its system CPU time. A speedup at or
			// above it means the parallel run waits for nothing but the
			// kernel.
			b.ReportMetric(serial.Seconds()/serialCPU.sys.Seconds(), "speedup-bound")
			b.ReportMetric(perRun(serialCPU.user), "serial-user-ms")
			b.ReportMetric(perRun(serialCPU.sys), "serial-sys-ms")
			b.ReportMetric(perRun(parallelCPU.user), "parallel-user-ms")
			b.ReportMetric(perRun(parallelCPU.sys), "parallel-sys-ms")
			// How much of the machine's CPU nobody used meanwhile (0: both
			// cores busy, with this process's work or others').
			b.ReportMetric(serialCPU.idle.fraction(), "serial-idle")
			b.ReportMetric(parallelCPU.idle.fraction(), "parallel-idle")
		})
	}
}

func dumpPeersB(b *testing.B, d *Driver, id string) (int, int) {
	n, unlock, err := d.lockNetwork(id)
	if err != nil {
		b.Fatal(err)
	}
	defer unlock()
	k, err := n.sb.Dump()
	if err != nil {
		b.Fatal(err)
	}
	return len(k.Neigh), len(k.FDB)
}

// cpuUse is CPU time spent in user space and in the kernel, and the
// machine's idle time meanwhile.
type cpuUse struct {
	user, sys time.Duration
	idle      idleTicks
}

func (c cpuUse) add(o cpuUse) cpuUse {
	return cpuUse{c.user + o.user, c.sys + o.sys, idleTicks{c.idle.idle + o.idle.idle, c.idle.total + o.idle.total}}
}
func (c cpuUse) sub(o cpuUse) cpuUse { return cpuUse{user: c.user - o.user, sys: c.sys - o.sys} }

// idleTicks counts the machine's idle and total CPU time (/proc/stat).
type idleTicks struct{ idle, total uint64 }

func (t idleTicks) sub(o idleTicks) idleTicks { return idleTicks{t.idle - o.idle, t.total - o.total} }

func (t idleTicks) fraction() float64 {
	if t.total == 0 {
		return 0
	}
	return float64(t.idle) / float64(t.total)
}

// machineIdle reads the machine's CPU times so far.
func machineIdle() idleTicks {
	raw, err := os.ReadFile("/proc/stat")
	if err != nil {
		return idleTicks{}
	}
	line, _, _ := strings.Cut(string(raw), "\n")
	var t idleTicks
	for i, f := range strings.Fields(line)[1:] {
		v, _ := strconv.ParseUint(f, 10, 64)
		t.total += v
		if i == 3 || i == 4 { // idle, iowait
			t.idle += v
		}
	}
	return t
}

// cpuNow returns the CPU time the process has used so far.
func cpuNow() cpuUse {
	var ru unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &ru); err != nil {
		return cpuUse{}
	}
	return cpuUse{user: time.Duration(ru.Utime.Nano()), sys: time.Duration(ru.Stime.Nano())}
}

// peakRSS returns the process's peak resident set size in bytes (VmHWM).
func peakRSS() int64 {
	raw, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(raw), "\n") {
		if strings.HasPrefix(line, "VmHWM:") {
			f := strings.Fields(line)
			if len(f) >= 2 {
				kb, _ := strconv.ParseInt(f[1], 10, 64)
				return kb * 1024
			}
		}
	}
	return 0
}
