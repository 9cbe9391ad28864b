//go:build testhooks

package stress

import (
	"fmt"
	"net/netip"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	api "github.com/docker/go-plugins-helpers/network"

	"github.com/overlayd/overlayd/peerdb"
)

// Benchmarks (no oracle, no trace):
//
//	go test -run '^$' -bench . -benchtime 20000x ./test/stress
//
// BenchmarkWorkload/networks=1 and /networks=32 run the stress workload's
// operation mix from 32 goroutines against one network or spread over 32.
// BenchmarkPeerPulls/sandbox=true/networks=1 changes records at the source
// and notifies the driver from 32 goroutines for one network (contended);
// networks=32 spreads them over 32 networks; sandbox=false takes the kernel
// out. The ratios show distinct networks proceeding in parallel.

const benchWorkers = 32

func BenchmarkWorkload(b *testing.B) {
	for _, nets := range []int{1, 32} {
		b.Run(fmt.Sprintf("networks=%d", nets), func(b *testing.B) { benchWorkload(b, nets) })
	}
}

// benchWorkload runs b.N operations of the stress mix from 32 goroutines over
// nets networks (which exist at the start).
func benchWorkload(b *testing.B, nets int) {
	installLockCheck(b)
	e := newEnv(b, true, false, false)
	u := benchUniverse(nets, e.vtep)
	for _, id := range u.nets {
		if err := e.d.CreateNetwork(createRequest(id, u.specs[id][0])); err != nil {
			b.Fatal(err)
		}
	}
	gens := make([]*gen, benchWorkers)
	for w := range gens {
		gens[w] = newGen(u, e.src, int64(w+1), e.announce)
	}
	var unexpected atomic.Int64
	var firstBad atomic.Pointer[string]
	b.ResetTimer()
	start := time.Now()
	var wg sync.WaitGroup
	for w := 0; w < benchWorkers; w++ {
		n := b.N / benchWorkers
		if w < b.N%benchWorkers {
			n++
		}
		wg.Add(1)
		go func(g *gen, n int) {
			defer wg.Done()
			for i := 0; i < n; i++ {
				o := g.next()
				if err := o.run(e.d); !o.ok(err) {
					unexpected.Add(1)
					s := fmt.Sprintf("%s => %v", o.desc, err)
					firstBad.CompareAndSwap(nil, &s)
				}
			}
		}(gens[w], n)
	}
	wg.Wait()
	elapsed := time.Since(start)
	b.StopTimer()
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "ops/s")
	if n := unexpected.Load(); n > 0 {
		b.Fatalf("%d impossible outcomes, first: %s", n, *firstBad.Load())
	}
	if problems, err := e.d.Audit(); err != nil || len(problems) > 0 {
		b.Fatalf("audit after the benchmark: %v %v", err, problems)
	}
}

// BenchmarkPeerPulls: 32 goroutines each cycle 64 records of their own
// at the source (create under one host, move to another host — a delete
// under one origin and a create under the other —, delete), notifying the
// driver after each change as the control plane does, so that every
// notification makes the network pull and change one neighbour or FDB
// entry. With sandbox=true every network has a sandbox (one joined
// endpoint), so each pull is also a kernel write.
//
// With sandbox=false no endpoint is joined: the pulls only update the peer
// tables (pure Go under the network locks), which isolates the locking
// from the kernel's own serialisation (rtnl) of neighbour and FDB writes.
func BenchmarkPeerPulls(b *testing.B) {
	for _, sandbox := range []bool{true, false} {
		for _, nets := range []int{1, 32} {
			b.Run(fmt.Sprintf("sandbox=%v/networks=%d", sandbox, nets), func(b *testing.B) { benchPeerPulls(b, nets, sandbox) })
		}
	}
}

// peerPool is the pool of network i of nets: a /16 for a single network
// (32 goroutines × 64 records), else a /20 of 198.18.0.0/15 each.
func peerPool(i, nets int) netip.Prefix {
	if nets == 1 {
		return pfx("198.18.0.0/16")
	}
	return netip.PrefixFrom(netip.AddrFrom4([4]byte{198, byte(18 + i/16), byte(i % 16 * 16), 0}), 20)
}

func benchPeerPulls(b *testing.B, nets int, sandbox bool) {
	installLockCheck(b)
	e := newEnv(b, true, false, false)
	for i := 0; i < nets; i++ {
		id := fmt.Sprintf("p%d", i)
		pool := peerPool(i, nets)
		s := &netSpec{vnis: []uint32{uint32(300 + i)}, pools: []netip.Prefix{pool}}
		if err := e.d.CreateNetwork(createRequest(id, s)); err != nil {
			b.Fatal(err)
		}
		if !sandbox {
			continue
		}
		addr := netip.PrefixFrom(pool.Addr().Next().Next(), pool.Bits())
		if _, err := e.d.CreateEndpoint(&api.CreateEndpointRequest{NetworkID: id, EndpointID: "local",
			Interface: &api.EndpointInterface{Address: addr.String()}}); err != nil {
			b.Fatal(err)
		}
		if _, err := e.d.Join(&api.JoinRequest{NetworkID: id, EndpointID: "local"}); err != nil {
			b.Fatal(err)
		}
	}
	var slot atomic.Int32
	b.SetParallelism(max(1, benchWorkers/runtime.GOMAXPROCS(0)))
	b.ResetTimer()
	start := time.Now()
	b.RunParallel(func(pb *testing.PB) {
		g := int(slot.Add(1) - 1)
		i, j := g%nets, g/nets // network, and this goroutine's index on it
		vni := uint32(300 + i)
		base := peerPool(i, nets).Addr().As4()
		hosts := []origin{originOf(remoteVTEPs[0]), originOf(remoteVTEPs[1])}
		var at [64]int // per record: 0 none, 1 at hosts[0], 2 at hosts[1]
		for n := 0; pb.Next(); n++ {
			k := n % len(at)
			ep := fmt.Sprintf("r%d-%d", g, k)
			ip := netip.AddrFrom4([4]byte{base[0], base[1], base[2] + byte(j), byte(10 + k)})
			key := func(h int) peerdb.Key { return peerdb.Key{VNI: vni, Origin: hosts[h].name, EndpointID: ep} }
			rec := func(h int) peerdb.Peer {
				return peerdb.Peer{EndpointID: ep, IP: ip, MAC: peerdb.MAC{2, 0xcc, byte(g), byte(k), 0, 1}, VTEP: hosts[h].vtep}
			}
			var keys []peerdb.Key
			e.src.mutate(func() {
				switch at[k] {
				case 0:
					e.src.setLocked(key(0), rec(0))
					keys, at[k] = []peerdb.Key{key(0)}, 1
				case 1:
					e.src.delLocked(key(0))
					e.src.setLocked(key(1), rec(1))
					keys, at[k] = []peerdb.Key{key(0), key(1)}, 2
				default:
					e.src.delLocked(key(1))
					keys, at[k] = []peerdb.Key{key(1)}, 0
				}
			})
			e.d.PeersChanged(vni, keys)
		}
	})
	elapsed := time.Since(start)
	b.StopTimer()
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "notifications/s")
	if problems, err := e.d.Audit(); err != nil || len(problems) > 0 {
		b.Fatalf("audit after the benchmark: %v %v", err, problems)
	}
}
