package driver

import (
	"fmt"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	api "github.com/docker/go-plugins-helpers/network"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/testutil/nstest"
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
func benchJoins(b *testing.B, d *Driver, addr string) {
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		eid := fmt.Sprintf("e%d", i)
		b.StopTimer()
		mustEndpoint(b, d, "n", eid, addr)
		b.StartTimer()
		mustJoin(b, d, "n", eid)
		b.StopTimer()
		leaveDelete(b, d, "n", eid)
		d.WaitDeletions()
		b.StartTimer()
	}
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

// peerPool is the pool of the peer benchmarks: 198.18.0.0/15 is reserved for
// benchmarking (RFC 2544) and the addresses never leave the test's namespaces.
var peerPool = netip.MustParsePrefix("198.18.0.0/15")

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
// then deletes them the same way, and reports both rates. Only the
// driver's pull path is timed (the pulls from the source included), not the
// test source's own bookkeeping.
func BenchmarkPeers(b *testing.B) {
	for _, n := range []int{1000, 5000, 20000} {
		b.Run(strconv.Itoa(n), func(b *testing.B) {
			d := benchDriver(b)
			joinedNetwork(b, d, "n", 100, peerPool)
			peers := remotePeers(peerPool, n, netip.MustParseAddr("192.0.2.99"))
			add := make([]PeerEvent, n)
			del := make([]PeerEvent, n)
			for i := range peers {
				add[i] = PeerEvent{VNI: 100, Next: &peers[i]}
				del[i] = PeerEvent{VNI: 100, Prev: &peers[i]}
			}
			src := source(d)
			var addT, delT time.Duration
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				_, keys := src.apply(add)
				t0 := time.Now()
				d.PeersChanged(100, keys[100])
				addT += time.Since(t0)
				_, keys = src.apply(del)
				t1 := time.Now()
				d.PeersChanged(100, keys[100])
				delT += time.Since(t1)
			}
			b.ReportMetric(float64(n*b.N)/addT.Seconds(), "add-peers/s")
			b.ReportMetric(float64(n*b.N)/delT.Seconds(), "del-peers/s")
			b.StopTimer()
			// Verify once that the adds really reached the kernel.
			if err := applyPeerEvents(d, add...); err != nil {
				b.Fatal(err)
			}
			neigh, fdb := dumpPeersB(b, d, "n")
			if neigh != n || fdb != n {
				b.Fatalf("kernel holds %d neighbours and %d fdb entries, want %d", neigh, fdb, n)
			}
			if n == 5000 {
				b.ReportMetric(float64(peakRSS())/(1<<20), "peak-RSS-MB")
			}
		})
	}
}

// BenchmarkPeersOneByOne programs 5,000 peers with one notification per
// record, as a control plane without batching would.
func BenchmarkPeersOneByOne(b *testing.B) {
	d := benchDriver(b)
	joinedNetwork(b, d, "n", 100, peerPool)
	peers := remotePeers(peerPool, 5000, netip.MustParseAddr("192.0.2.99"))
	src := source(d)
	var addT, delT time.Duration
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j := range peers {
			_, keys := src.apply([]PeerEvent{{VNI: 100, Next: &peers[j]}})
			t0 := time.Now()
			d.PeersChanged(100, keys[100])
			addT += time.Since(t0)
		}
		for j := range peers {
			_, keys := src.apply([]PeerEvent{{VNI: 100, Prev: &peers[j]}})
			t0 := time.Now()
			d.PeersChanged(100, keys[100])
			delT += time.Since(t0)
		}
	}
	b.ReportMetric(float64(len(peers)*b.N)/addT.Seconds(), "add-peers/s")
	b.ReportMetric(float64(len(peers)*b.N)/delT.Seconds(), "del-peers/s")
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
