package driver

import (
	"net/netip"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/overlayd/overlayd/internal/netdef"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

// A notification of one peer, the control plane's common case, costs no
// allocation on its way from PeersChanged to the kernel and back: the
// per-call work is fixed (the kernel's request pair is the real cost), so
// an allocation per call shows in BenchmarkPeersOneByOne as garbage that
// the timed loop collects. Allowed: the sandbox's memory of deleted
// neighbours growing while a burst of deletions comes in (a few per burst,
// not one per call). Both without a definition source and with another
// host's agreeing definition of the VNI, which every pull compares with
// the network's, asked about the record's origin only, as the daemon's
// control plane answers. (Not parallel: it counts every allocation beneath
// PeersChanged in the process.)
func TestPeersChangedOneKeyAllocs(t *testing.T) {
	hosts, vteps := nstest.Hosts(t, 1, false)
	t.Run("no-definitions", func(t *testing.T) { oneKeyAllocs(t, hosts[0], vteps[0], nil, nil) })
	t.Run("agreeing-definition", func(t *testing.T) {
		defs := &echoDefinitions{vtep: netip.MustParseAddr("192.0.2.98")}
		oneKeyAllocs(t, hosts[0], vteps[0], defs, &defs.asked)
	})
}

func oneKeyAllocs(t *testing.T, host *nstest.NS, vtep netip.Addr, defs DefinitionSource, asked *atomic.Int64) {
	const n = 100
	d, pool := definitionsDriver(t, host, vtep, defs)
	src := source(d)
	peers := remotePeers(pool, n, netip.MustParseAddr("192.0.2.99"))
	add := make([]PeerEvent, n)
	for i := range peers {
		add[i] = PeerEvent{VNI: 100, Next: &peers[i]}
	}
	_, byVNI := src.apply(add)
	keys := byVNI[100]
	notify := func() {
		for j := range keys {
			d.PeersChanged(100, keys[j:j+1])
		}
	}
	// Once untimed, checking that the calls program the kernel (the tables
	// and buffers grow to their size meanwhile).
	src.put(keys, add)
	notify()
	if neigh, fdb := dumpPeers(t, d, "n"); len(neigh) != n || len(fdb) != n {
		t.Fatalf("after %d one-key adds the kernel holds %d neighbours and %d fdb entries", n, len(neigh), len(fdb))
	}
	src.drop(keys)
	notify()
	wantPeers(t, d, "n", map[string]string{}, map[string]string{})
	if asked != nil && asked.Load() < 2*n {
		t.Fatalf("the definition source was asked %d times in %d pulls", asked.Load(), 2*n)
	}
	const rounds = 5
	allocs := allocsUnder("driver.(*Driver).PeersChanged", func() {
		for range rounds {
			src.put(keys, add)
			notify()
			src.drop(keys)
			notify()
		}
	})
	perCall := float64(allocs) / (rounds * 2 * n)
	t.Logf("%d allocations in %d one-key notifications (%.3f per call)", allocs, rounds*2*n, perCall)
	if perCall > 0.1 {
		t.Errorf("%.2f allocations per one-key PeersChanged, want none (%d in %d calls)", perCall, allocs, rounds*2*n)
	}
	wantPeers(t, d, "n", map[string]string{}, map[string]string{})
	nw, unlock, err := d.lockNetwork("n")
	if err != nil {
		t.Fatal(err)
	}
	defer unlock()
	if nw.lastErr != nil {
		t.Fatalf("programming failed: %v", nw.lastErr)
	}
	if len(nw.contra) != 0 {
		t.Fatalf("the agreeing definition was taken as a contradiction: %v", nw.contra)
	}
}

// definitionsDriver returns a driver whose control plane's part for
// definitions is defs (a host alone's if nil), with network "n" (VNI 100,
// pool returned) joined by a local endpoint.
func definitionsDriver(t *testing.T, host *nstest.NS, vtep netip.Addr, defs DefinitionSource) (*Driver, netip.Prefix) {
	t.Helper()
	cfg := Config{HostNS: host.Handle, NetnsDir: nstest.NetnsDir(t), AdvertiseAddr: vtep, Logger: testLogger(), Peers: newMemSource()}
	if defs != nil {
		cfg.Definitions = defs
	}
	d, err := New(alone(cfg))
	if err != nil {
		t.Fatalf("driver.New: %v", err)
	}
	t.Cleanup(func() { d.Close() })
	pool := netip.MustParsePrefix("198.51.100.0/24")
	mustCreate(t, d, createReq("n", "100", pool.String()))
	mustEndpoint(t, d, "n", "local", "198.51.100.2/24")
	mustJoin(t, d, "n", "local")
	return d, pool
}

// echoDefinitions is the control plane's part for definitions in
// TestPeersChangedOneKeyAllocs: another host ("other") that defines every
// VNI as this host publishes it, so the two always agree; asked about any
// host, it answers the same. Definitions hands out the same list every
// time, allocating nothing of its own.
type echoDefinitions struct {
	vtep  netip.Addr
	asked atomic.Int64
	mu    sync.Mutex
	defs  map[uint32][]netdef.Remote // guarded by mu
}

func (e *echoDefinitions) Definitions(vni uint32) []netdef.Remote {
	e.asked.Add(1)
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.defs[vni]
}

func (e *echoDefinitions) PublishDefinition(vni uint32, def *netdef.Definition) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if def == nil {
		delete(e.defs, vni)
		return nil
	}
	if e.defs == nil {
		e.defs = map[uint32][]netdef.Remote{}
	}
	e.defs[vni] = []netdef.Remote{{Host: "other", VTEP: e.vtep, Def: *def}}
	return nil
}

func (e *echoDefinitions) DefinitionOf(vni uint32, host string) (netdef.Remote, bool) {
	e.asked.Add(1)
	e.mu.Lock()
	defer e.mu.Unlock()
	if rs := e.defs[vni]; len(rs) > 0 {
		return netdef.Remote{Host: host, VTEP: e.vtep, Def: rs[0].Def}, true
	}
	return netdef.Remote{}, false
}

// allocsUnder returns how many heap objects f allocates beneath a call of
// the function named within (as runtime.FuncForPC names it), not counting
// the lockcheck build's bookkeeping (internal/lockorder records every
// acquisition's goroutine and stack, which allocates; normal builds have
// none of it). It samples every allocation while f runs.
func allocsUnder(within string, f func()) int64 {
	defer func(rate int) { runtime.MemProfileRate = rate }(runtime.MemProfileRate)
	runtime.GC() // publish what was allocated at the old rate
	runtime.MemProfileRate = 1
	before := countAllocsUnder(within)
	f()
	runtime.GC() // publish f's allocations
	return countAllocsUnder(within) - before
}

func countAllocsUnder(within string) int64 {
	var recs []runtime.MemProfileRecord
	for {
		n, ok := runtime.MemProfile(recs, true)
		if ok {
			recs = recs[:n]
			break
		}
		recs = make([]runtime.MemProfileRecord, n+64)
	}
	var total int64
	for _, r := range recs {
		under, lockcheck := false, false
		frames := runtime.CallersFrames(r.Stack())
		for {
			fr, more := frames.Next()
			under = under || strings.HasSuffix(fr.Function, "/"+within)
			lockcheck = lockcheck || strings.Contains(fr.Function, "/internal/lockorder.")
			if !more {
				break
			}
		}
		if under && !lockcheck {
			total += r.AllocObjects
		}
	}
	return total
}
