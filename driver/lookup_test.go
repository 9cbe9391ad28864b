package driver

import (
	"maps"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/overlayd/overlayd/internal/netdef"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
	"github.com/overlayd/overlayd/peerdb"
)

// hostDefinitions is a control plane's part for definitions: per other
// host, its definition of every VNI — this
// host's as published ("agree"), the same with another MTU ("differ"),
// none yet (Pending, "waiting") — and idle members with no network
// (Pending) that never have records. It counts the calls of each kind.
type hostDefinitions struct {
	mu        sync.Mutex
	published map[uint32]netdef.Definition // guarded by mu
	idle      int
	listed    atomic.Int64 // Definitions calls
	looked    atomic.Int64 // DefinitionOf calls
}

// The other hosts, by the VTEP of their records (memSource names the
// origin of a record after its VTEP: keyOf).
var (
	agreeVTEP   = netip.MustParseAddr("192.0.2.10")
	differVTEP  = netip.MustParseAddr("192.0.2.11")
	waitingVTEP = netip.MustParseAddr("192.0.2.12")
	strayVTEP   = netip.MustParseAddr("192.0.2.13") // not a member speaking definitions
)

func hostOf(vtep netip.Addr) string { return "host-" + vtep.String() }

func (h *hostDefinitions) entries(vni uint32) []netdef.Remote {
	h.mu.Lock()
	def, ok := h.published[vni]
	h.mu.Unlock()
	out := []netdef.Remote{{Host: hostOf(waitingVTEP), VTEP: waitingVTEP, Pending: true}}
	if ok {
		other := def
		other.MTU -= 50
		out = append(out, netdef.Remote{Host: hostOf(agreeVTEP), VTEP: agreeVTEP, Def: def},
			netdef.Remote{Host: hostOf(differVTEP), VTEP: differVTEP, Def: other})
	}
	for i := range h.idle {
		v := netip.AddrFrom4([4]byte{203, 0, 113, byte(i)})
		out = append(out, netdef.Remote{Host: hostOf(v), VTEP: v, Pending: true})
	}
	return out
}

func (h *hostDefinitions) Definitions(vni uint32) []netdef.Remote {
	h.listed.Add(1)
	return h.entries(vni)
}

func (h *hostDefinitions) DefinitionOf(vni uint32, host string) (netdef.Remote, bool) {
	h.looked.Add(1)
	for _, r := range h.entries(vni) {
		if r.Host == host {
			return r, true
		}
	}
	return netdef.Remote{}, false
}

func (h *hostDefinitions) PublishDefinition(vni uint32, def *netdef.Definition) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if def == nil {
		delete(h.published, vni)
	} else {
		h.published[vni] = *def
	}
	return nil
}

// TestKeyedPullAsksOnlyItsOrigins: a pull of some records asks the
// control plane about their origins only (once per origin, however many
// records), never for every host's definition, and refuses exactly the
// records a full pull refuses: those of a host whose definition
// contradicts the network's and of one whose definition has not arrived;
// a host that agrees, and one that is not listed at all, get theirs
// programmed. The full pull compares every host's definition and records
// the contradiction.
func TestKeyedPullAsksOnlyItsOrigins(t *testing.T) {
	hosts, vteps := nstest.Hosts(t, 1, false)
	defs := &hostDefinitions{published: map[uint32]netdef.Definition{}, idle: 50}
	d, _ := definitionsDriver(t, hosts[0], vteps[0], defs)

	// Three records of each host.
	var evs []PeerEvent
	ip := netip.MustParseAddr("198.51.100.10")
	for _, vtep := range []netip.Addr{agreeVTEP, differVTEP, waitingVTEP, strayVTEP} {
		for range 3 {
			p := peerdb.Peer{EndpointID: "ep-" + ip.String(), IP: ip, MAC: peerdb.MACFromIP(ip), VTEP: vtep}
			evs = append(evs, PeerEvent{VNI: 100, Next: &p})
			ip = ip.Next()
		}
	}
	src := source(d)
	_, byVNI := src.apply(evs)
	want := map[netip.Addr]bool{agreeVTEP: true, strayVTEP: true}
	wantFDB := func() map[string]string {
		out := map[string]string{}
		for _, ev := range evs {
			if want[ev.Next.VTEP] {
				out[ev.Next.MAC.String()] = ev.Next.VTEP.String()
			}
		}
		return out
	}

	listed, looked := defs.listed.Load(), defs.looked.Load()
	d.PeersChanged(100, byVNI[100])
	if n := defs.listed.Load() - listed; n != 0 {
		t.Errorf("a keyed pull listed every host's definitions %d times", n)
	}
	if n := defs.looked.Load() - looked; n != 4 {
		t.Errorf("a keyed pull of 12 records from 4 hosts asked about %d origins, want 4", n)
	}
	if _, fdb := dumpPeers(t, d, "n"); !maps.Equal(fdb, wantFDB()) {
		t.Fatalf("after the keyed pull the kernel holds FDB %v, want %v (the agreeing and the unlisted host's)", fdb, wantFDB())
	}

	listed = defs.listed.Load()
	d.PeersChanged(100, nil)
	if defs.listed.Load() == listed {
		t.Error("a full pull did not compare every host's definition")
	}
	if _, fdb := dumpPeers(t, d, "n"); !maps.Equal(fdb, wantFDB()) {
		t.Fatalf("after the full pull the kernel holds FDB %v, want %v", fdb, wantFDB())
	}
	nw, unlock, err := d.lockNetwork("n")
	if err != nil {
		t.Fatal(err)
	}
	_, found := nw.contra[100][hostOf(differVTEP)]
	n := len(nw.contra[100])
	unlock()
	if !found || n != 1 {
		t.Fatalf("the full pull recorded contradictions %v, want only %s's", nw.contra[100], hostOf(differVTEP))
	}
}

// TestKeyedPullLooksUpInBatches: a pull of many keys asks the PeerSource
// (PeersOf) pullLookahead keys at a time, never key by key, and
// programs what a pull by Peer would: 200 records arrive in 2 lookups
// (128 + 72 keys) and reach the kernel, go again in 2 more; a single key
// is asked with Peer.
func TestKeyedPullLooksUpInBatches(t *testing.T) {
	hosts, vteps := nstest.Hosts(t, 1, false)
	d := newTestDriver(t, hosts[0], vteps[0])
	mustCreate(t, d, createReq("n", "100", "198.51.100.0/24"))
	mustEndpoint(t, d, "n", "local", "198.51.100.254/24")
	mustJoin(t, d, "n", "local")

	const n = 200
	vtep := netip.MustParseAddr("192.0.2.40")
	var adds, dels []PeerEvent
	wantNeigh, wantFDB := map[string]string{}, map[string]string{}
	ip := netip.MustParseAddr("198.51.100.1")
	for range n {
		p := peerdb.Peer{EndpointID: "ep-" + ip.String(), IP: ip, MAC: peerdb.MACFromIP(ip), VTEP: vtep}
		adds = append(adds, PeerEvent{VNI: 100, Next: &p})
		dels = append(dels, PeerEvent{VNI: 100, Prev: &p})
		wantNeigh[ip.String()], wantFDB[p.MAC.String()] = p.MAC.String(), vtep.String()
		ip = ip.Next()
	}
	src := source(d)
	step := func(what string, evs []PeerEvent, peer, batches, keys int) {
		t.Helper()
		p0, b0, k0 := src.lookups()
		if err := applyPeerEvents(d, evs...); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
		p1, b1, k1 := src.lookups()
		if p1-p0 != peer || b1-b0 != batches || k1-k0 != keys {
			t.Errorf("%s: %d Peer calls and %d PeersOf calls for %d keys, want %d, %d and %d",
				what, p1-p0, b1-b0, k1-k0, peer, batches, keys)
		}
	}
	step("adding 200 records", adds, 0, 2, n)
	wantPeers(t, d, "n", wantNeigh, wantFDB)
	step("removing them", dels, 0, 2, n)
	wantPeers(t, d, "n", map[string]string{}, map[string]string{})
	step("adding one", adds[:1], 1, 0, 0)
	wantPeers(t, d, "n", map[string]string{"198.51.100.1": adds[0].Next.MAC.String()}, map[string]string{adds[0].Next.MAC.String(): vtep.String()})
	mustAudit(t, d)
}
