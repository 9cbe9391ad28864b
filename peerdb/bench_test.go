package peerdb

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"strconv"
	"testing"
	"time"
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

// BenchmarkVTEPs20000 lists the distinct VTEPs of a 20,000-entry DB's
// desired FDB entries (an encrypted network's remote hosts, asked after
// each change): compare with BenchmarkDesired20000, what it replaced.
func BenchmarkVTEPs20000(b *testing.B) {
	db := loadedDB(b, benchPeers(20000))
	var buf []netip.Addr
	b.ReportAllocs()
	for b.Loop() {
		buf = db.VTEPs(buf[:0])
		if len(buf) == 0 {
			b.Fatal("no VTEPs")
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

// BenchmarkPull loads n records of one VNI into a table holding one local
// endpoint, then removes them, through Pull as the driver's pull path does
// (one source lookup per key), and reports the time per record of each.
// It is the user-space part of BenchmarkPeers in package driver.
func BenchmarkPull(b *testing.B) {
	for _, n := range []int{1000, 20000, 100000} {
		b.Run(strconv.Itoa(n), func(b *testing.B) {
			subnet := netip.MustParsePrefix("198.18.0.0/15")
			src := make(map[Key]Peer, n)
			keys := make([]Key, n)
			base := ip4(subnet.Addr())
			for i := range keys {
				ip := addr4(base + uint32(i) + 10)
				p := Peer{EndpointID: fmt.Sprintf("%064x", i), IP: ip, MAC: MACFromIP(ip), VTEP: netip.AddrFrom4([4]byte{192, 0, 2, byte(1 + i%50)})}
				keys[i] = Key{VNI: 100, Origin: "host-" + p.VTEP.String(), EndpointID: p.EndpointID}
				src[keys[i]] = p
			}
			db := New([]netip.Prefix{subnet}, 100)
			if _, err := db.AddLocal(Peer{EndpointID: "local", IP: addr4(base + 2), MAC: MAC{2, 0, 0, 0, 0, 1}}); err != nil {
				b.Fatal(err)
			}
			present := true
			get := func(k Key) (Peer, bool) {
				if !present {
					return Peer{}, false
				}
				p, ok := src[k]
				return p, ok
			}
			var addT, delT time.Duration
			b.ReportAllocs()
			for b.Loop() {
				present = true
				t0 := time.Now()
				d, rej := db.Pull(100, keys, func(i int) (Peer, bool) { return get(keys[i]) })
				addT += time.Since(t0)
				if len(rej) != 0 || len(d.NeighSet) != n {
					b.Fatalf("add: %d rejections, %d neighbours set", len(rej), len(d.NeighSet))
				}
				present = false
				t0 = time.Now()
				d, _ = db.Pull(100, keys, func(i int) (Peer, bool) { return get(keys[i]) })
				delT += time.Since(t0)
				if len(d.NeighDel) != n {
					b.Fatalf("delete: %d neighbours deleted", len(d.NeighDel))
				}
			}
			b.ReportMetric(float64(addT.Nanoseconds())/float64(n*b.N), "add-ns/peer")
			b.ReportMetric(float64(delT.Nanoseconds())/float64(n*b.N), "del-ns/peer")
		})
	}
}

// benchSegments are benchSubnets with an IPv6 subnet each, VNIs 100, 101.
var benchSegments = []Segment{
	{Prefixes: []netip.Prefix{benchSubnets[0], netip.MustParsePrefix("2001:db8::/64")}, VNI: 100},
	{Prefixes: []netip.Prefix{benchSubnets[1], netip.MustParsePrefix("2001:db8:1::/64")}, VNI: 101},
}

// benchPeers6 is benchPeers with IPv6 addresses instead of IPv4 ones
// (dual: both), on the segments of the IPv4 ones.
func benchPeers6(n int, dual bool) []Peer {
	out := benchPeers(n)
	for i := range out {
		seg := byte(0)
		if benchSubnets[1].Contains(out[i].IP) {
			seg = 1
		}
		out[i].IPv6 = netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 0, seg, 14: byte(i >> 8), 15: byte(i)})
		if !dual {
			out[i].IP = netip.Addr{}
		}
	}
	return out
}

// BenchmarkSetRemotes20000IPv6 is BenchmarkSetRemotes20000 with IPv6-only
// records, then dual-stack ones (two neighbours each).
func BenchmarkSetRemotes20000IPv6(b *testing.B) {
	for _, dual := range []bool{false, true} {
		b.Run(map[bool]string{false: "only", true: "dual"}[dual], func(b *testing.B) {
			peers := benchPeers6(20000, dual)
			ups := make([]Update, len(peers))
			for i := range peers {
				vni := uint32(100)
				if peers[i].IPv6.As16()[5] == 1 {
					vni = 101
				}
				ups[i] = Update{Key: Key{VNI: vni, Origin: "host-" + peers[i].VTEP.String(), EndpointID: peers[i].EndpointID}, Peer: &peers[i]}
			}
			want := 20000
			if dual {
				want = 40000
			}
			b.ReportAllocs()
			for b.Loop() {
				db := NewSegments(benchSegments)
				d, rej := db.SetRemotes(ups)
				if rej != nil || len(d.NeighSet) != want || len(d.FDBSet) != 20000 {
					b.Fatalf("rejections %v, %d neigh, %d fdb", rej, len(d.NeighSet), len(d.FDBSet))
				}
			}
		})
	}
}
