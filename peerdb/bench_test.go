package peerdb

import (
	"math/rand/v2"
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
		d, errs := db.applyEvents(evs)
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
		if _, err := db.applyEvent(Event{Next: &peers[i]}); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		prev := peers[i%len(peers)]
		next := prev
		next.VTEP = netip.AddrFrom4([4]byte{192, 0, 2, 100 + byte(i/len(peers)%2)})
		d, err := db.applyEvent(Event{Prev: &prev, Next: &next})
		if err != nil || len(d.FDBSet) != 1 {
			b.Fatalf("%v %+v", err, d)
		}
		peers[i%len(peers)] = next
		i++
	}
}

// loadedDB returns a DB holding peers, created with one ApplyAll.
func loadedDB(b *testing.B, peers []Peer) *DB {
	b.Helper()
	evs := make([]Event, len(peers))
	for i := range peers {
		evs[i] = Event{Next: &peers[i]}
	}
	db := New(benchSubnets)
	if _, errs := db.applyEvents(evs); errs != nil {
		b.Fatal(errs)
	}
	return db
}

// BenchmarkApplyAll20000Shuffled is BenchmarkApplyAll20000 with the events in
// random order, as gossip delivers them: the delta must still come out sorted.
func BenchmarkApplyAll20000Shuffled(b *testing.B) {
	peers := benchPeers(20000)
	rng := rand.New(rand.NewPCG(1, 2))
	rng.Shuffle(len(peers), func(i, j int) { peers[i], peers[j] = peers[j], peers[i] })
	evs := make([]Event, len(peers))
	for i := range peers {
		evs[i] = Event{Next: &peers[i]}
	}
	b.ReportAllocs()
	for b.Loop() {
		db := New(benchSubnets)
		d, errs := db.applyEvents(evs)
		if errs != nil || len(d.NeighSet) != 20000 || len(d.FDBSet) != 20000 {
			b.Fatalf("errs %v, %d neigh, %d fdb", errs, len(d.NeighSet), len(d.FDBSet))
		}
	}
}

// BenchmarkApplyAllDelete20000 removes every entry of a 20,000-entry DB with
// one ApplyAll (filling the DB is not timed).
func BenchmarkApplyAllDelete20000(b *testing.B) {
	peers := benchPeers(20000)
	dels := make([]Event, len(peers))
	for i := range peers {
		dels[i] = Event{Prev: &peers[i]}
	}
	b.ReportAllocs()
	for b.Loop() {
		b.StopTimer()
		db := loadedDB(b, peers)
		b.StartTimer()
		d, errs := db.applyEvents(dels)
		if errs != nil || len(d.NeighDel) != 20000 || len(d.FDBDel) != 20000 || len(d.NeighSet)+len(d.FDBSet) != 0 {
			b.Fatalf("errs %v, %d neigh, %d fdb", errs, len(d.NeighDel), len(d.FDBDel))
		}
	}
}

// BenchmarkDesired20000 snapshots the desired state of a 20,000-entry DB.
func BenchmarkDesired20000(b *testing.B) {
	db := loadedDB(b, benchPeers(20000))
	b.ReportAllocs()
	for b.Loop() {
		s := db.Desired()
		if len(s.Neigh) != 20000 || len(s.FDB) != 20000 {
			b.Fatalf("%d neigh, %d fdb", len(s.Neigh), len(s.FDB))
		}
	}
}

// benchUpdates returns the keyed updates that load peers (two VNIs, one
// per subnet; 50 origins).
func benchUpdates(peers []Peer) []Update {
	ups := make([]Update, len(peers))
	for i := range peers {
		vni := uint32(100)
		if benchSubnets[1].Contains(peers[i].IP) {
			vni = 101
		}
		ups[i] = Update{Key: Key{VNI: vni, Origin: "host-" + peers[i].VTEP.String(), EndpointID: peers[i].EndpointID}, Peer: &peers[i]}
	}
	return ups
}

// BenchmarkSetRemotes20000 loads 20,000 records by key into an empty table
// (the pull path's batch), as BenchmarkApplyAll20000 does with events.
func BenchmarkSetRemotes20000(b *testing.B) {
	ups := benchUpdates(benchPeers(20000))
	b.ReportAllocs()
	for b.Loop() {
		db := New(benchSubnets, 100, 101)
		d, rej := db.SetRemotes(ups)
		if rej != nil || len(d.NeighSet) != 20000 || len(d.FDBSet) != 20000 {
			b.Fatalf("rejections %v, %d neigh, %d fdb", rej, len(d.NeighSet), len(d.FDBSet))
		}
	}
}

// BenchmarkSetRemote moves one keyed record per call in a table of 5,000,
// as BenchmarkApply does with events.
func BenchmarkSetRemote(b *testing.B) {
	peers := benchPeers(5000)
	ups := benchUpdates(peers)
	db := New(benchSubnets, 100, 101)
	db.SetRemotes(ups)
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		u := ups[i%len(ups)]
		next := *u.Peer
		next.VTEP = netip.AddrFrom4([4]byte{192, 0, 2, 100 + byte(i/len(ups)%2)})
		u.Peer = &next
		d, rej := db.SetRemotes([]Update{u})
		if rej != nil || len(d.FDBSet) != 1 {
			b.Fatalf("%v %+v", rej, d)
		}
		ups[i%len(ups)] = u
		i++
	}
}

// BenchmarkSyncVNI20000 is a full pull of a VNI whose 10,000 records the
// table already holds: the periodic level-triggered repair with nothing to
// repair.
func BenchmarkSyncVNI20000(b *testing.B) {
	ups := benchUpdates(benchPeers(20000))
	db := New(benchSubnets, 100, 101)
	db.SetRemotes(ups)
	all := map[Key]Peer{}
	for _, u := range ups {
		if u.Key.VNI == 100 {
			all[u.Key] = *u.Peer
		}
	}
	b.ReportAllocs()
	for b.Loop() {
		if d, rej := db.SyncVNI(100, all); !d.Empty() || rej != nil {
			b.Fatalf("%v %+v", rej, d)
		}
	}
}
