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

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/peerdb"
)

// Benchmarks (no oracle, no trace):
//
//	go test -run '^$' -bench . -benchtime 20000x ./test/stress
//
// BenchmarkWorkload/networks=1 and /networks=32 run the stress workload's
// operation mix from 32 goroutines against one network or spread over 32.
// BenchmarkPeerEvents/sandbox=true/networks=1 sends peer events from 32
// goroutines to one network (contended); networks=32 spreads them over 32
// networks; sandbox=false takes the kernel out. The ratios show distinct
// networks proceeding in parallel.

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
	e := newEnv(b, true, false)
	u := benchUniverse(nets, e.vtep)
	for _, id := range u.nets {
		if err := e.d.CreateNetwork(createRequest(id, u.specs[id][0])); err != nil {
			b.Fatal(err)
		}
	}
	gens := make([]*gen, benchWorkers)
	for w := range gens {
		gens[w] = newGen(u, int64(w+1), e.announce)
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

// BenchmarkPeerEvents: 32 goroutines send single peer events, each cycling
// 64 records of its own (create, move to another VTEP with prev, delete), so
// that every event changes one neighbour or FDB entry. With sandbox=true
// every network has a sandbox (one joined endpoint), so each event is also a
// kernel write.
//
// With sandbox=false no endpoint is joined: the events only update the peer
// DBs (pure Go under the network locks), which isolates the locking from the
// kernel's own serialisation (rtnl) of neighbour and FDB writes.
func BenchmarkPeerEvents(b *testing.B) {
	for _, sandbox := range []bool{true, false} {
		for _, nets := range []int{1, 32} {
			b.Run(fmt.Sprintf("sandbox=%v/networks=%d", sandbox, nets), func(b *testing.B) { benchPeerEvents(b, nets, sandbox) })
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

func benchPeerEvents(b *testing.B, nets int, sandbox bool) {
	installLockCheck(b)
	e := newEnv(b, true, false)
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
		vteps := []netip.Addr{netip.MustParseAddr("192.0.2.50"), netip.MustParseAddr("192.0.2.51")}
		var recs [64]*peerdb.Peer
		for n := 0; pb.Next(); n++ {
			k := n % len(recs)
			cur := recs[k]
			var ev driver.PeerEvent
			switch {
			case cur == nil:
				ip := netip.AddrFrom4([4]byte{base[0], base[1], base[2] + byte(j), byte(10 + k)})
				p := peerdb.Peer{EndpointID: fmt.Sprintf("r%d-%d", g, k), IP: ip, MAC: peerdb.MAC{2, 0xcc, byte(g), byte(k), 0, 1}, VTEP: vteps[0]}
				recs[k], ev = &p, driver.PeerEvent{VNI: vni, Next: &p}
			case cur.VTEP == vteps[0]:
				q := *cur
				q.VTEP = vteps[1]
				recs[k], ev = &q, driver.PeerEvent{VNI: vni, Prev: cur, Next: &q}
			default:
				recs[k], ev = nil, driver.PeerEvent{VNI: vni, Prev: cur}
			}
			if err := e.d.ApplyPeerEvent(ev); err != nil {
				b.Error(err)
				return
			}
		}
	})
	elapsed := time.Since(start)
	b.StopTimer()
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "events/s")
	if problems, err := e.d.Audit(); err != nil || len(problems) > 0 {
		b.Fatalf("audit after the benchmark: %v %v", err, problems)
	}
}
