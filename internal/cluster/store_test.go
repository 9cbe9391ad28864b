package cluster

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"reflect"
	"testing"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/overlayd/overlayd/peerdb"
)

// fakeClock advances one ms per reading (versions from the wall clock).
type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time { c.t = c.t.Add(time.Millisecond); return c.t }

func mlNode(name string, inc uint64, vtep string) *memberlist.Node {
	return &memberlist.Node{Name: name, Addr: netip.MustParseAddr(vtep).AsSlice(), Port: 7947,
		Meta: encodeMeta(nodeMeta{ProtoMin: 1, ProtoMax: 1, Incarnation: inc, VTEP: netip.MustParseAddr(vtep)})}
}

// receiver is a store that knows origin "o" (incarnation inc, VTEP vtep).
type receiver struct {
	s      *store
	syncs  int
	syncTo map[string]int
	snaps  int
}

func newReceiver(inc uint64, vtep string) *receiver {
	r := &receiver{s: newStore("me"), syncTo: map[string]int{}}
	r.s.syncMinInterval = 0
	r.s.grace = time.Minute
	r.s.requestSync = func(name string) { r.syncs++; r.syncTo[name]++ }
	r.s.sendSnapshot = func(string) { r.snaps++ }
	r.s.memberAlive(mlNode("me", 1, "10.0.0.100"), time.Unix(0, 0))
	r.s.memberAlive(mlNode("o", inc, vtep), time.Unix(0, 0))
	return r
}

// effectiveOf returns o's effective records as a map.
func (r *receiver) effectiveOf() map[recKey]peerdb.Peer {
	out := make(map[recKey]peerdb.Peer)
	r.s.eachEffective(func(vni uint32, k pkey, p peerdb.Peer) {
		out[recKey{vni, k.EndpointID}] = p
	})
	return out
}

func liveSet(l *localStore) map[recKey]peerdb.Peer {
	out := make(map[recKey]peerdb.Peer)
	for k, r := range l.recs {
		if !r.rec.Deleted {
			out[k] = r.rec.peer()
		}
	}
	return out
}

// TestMergeReorderDuplicate drives an origin through random adds, updates
// and deletes, captures every message it would send (deltas coalesced at
// random points, digests and snapshots in between), and feeds them to
// receivers in random orders with random duplicates: all must end with the
// origin's live set, and equal to each other.
func TestMergeReorderDuplicate(t *testing.T) {
	const vtep = "10.0.0.1"
	for seed := range uint64(20) {
		rng := rand.New(rand.NewPCG(seed, 7))
		clk := &fakeClock{t: time.Unix(1_700_000_000, 0)}
		o := newLocalStore("o", 5, netip.MustParseAddr(vtep), clk.now)
		var msgs []*message
		flush := func() {
			if recs := o.takeDirty(); len(recs) > 0 {
				msgs = append(msgs, &message{Type: msgDelta, Origin: "o", Incarnation: 5, Records: recs})
			}
		}
		for i := range 400 {
			vni := uint32(1 + rng.IntN(3))
			id := fmt.Sprintf("ep%d", rng.IntN(15))
			if rng.IntN(3) == 0 {
				old := &peerdb.Peer{EndpointID: id}
				o.publish(vni, old, nil)
			} else {
				ip := netip.AddrFrom4([4]byte{10, 1, byte(vni), byte(1 + rng.IntN(200))})
				p := peerdb.Peer{EndpointID: id, IP: ip, MAC: peerdb.MACFromIP(ip), VTEP: netip.MustParseAddr(vtep)}
				o.publish(vni, nil, &p)
			}
			if rng.IntN(4) == 0 {
				flush()
			}
			switch rng.IntN(40) {
			case 0:
				flush()
				msgs = append(msgs, o.snapshot())
			case 1:
				flush()
				msgs = append(msgs, o.digest())
			}
			_ = i
		}
		flush()
		want := liveSet(o)
		var first map[recKey]*rrec
		for perm := range 5 {
			r := newReceiver(5, vtep)
			order := rng.Perm(len(msgs))
			for _, i := range order {
				// Through the wire, as the network would deliver.
				m, derr := decodeMessage(mustEncode(t, msgs[i]))
				if derr != nil {
					t.Fatal(derr)
				}
				for range 1 + rng.IntN(2) { // duplicates
					if reason, d := r.s.apply(m, clk.now()); reason != "" {
						t.Fatalf("seed %d: dropped %s: %s", seed, reason, d)
					}
				}
			}
			if got := r.effectiveOf(); !reflect.DeepEqual(got, want) {
				t.Fatalf("seed %d perm %d: effective set differs from the origin:\n got %v\nwant %v", seed, perm, got, want)
			}
			// Same stored state (records and tombstones not yet covered may
			// differ only if a floor covers them; live records must not).
			live := make(map[recKey]*rrec)
			for k, rr := range r.s.origins["o"].recs {
				if !rr.rec.Deleted {
					live[k] = &rrec{rec: rr.rec}
				}
			}
			if first == nil {
				first = live
			} else if !reflect.DeepEqual(first, live) {
				t.Fatalf("seed %d perm %d: receivers differ", seed, perm)
			}
			// A final digest agrees.
			d := o.digest()
			r.s.apply(d, clk.now())
			if !r.s.origins["o"].complete {
				t.Fatalf("seed %d perm %d: final digest does not match", seed, perm)
			}
		}
	}
}

// TestSnapshotFloorPreventsResurrection: a receiver that missed a delete
// learns it from a snapshot; late copies of the old add or of the delete
// change nothing, even after the tombstone is reaped.
func TestSnapshotFloorPreventsResurrection(t *testing.T) {
	clk := &fakeClock{t: time.Unix(1_700_000_000, 0)}
	o := newLocalStore("o", 5, netip.MustParseAddr("10.0.0.1"), clk.now)
	p := peerdb.Peer{EndpointID: "a", IP: netip.MustParseAddr("10.1.0.2"), MAC: peerdb.MACFromIP(netip.MustParseAddr("10.1.0.2")), VTEP: netip.MustParseAddr("10.0.0.1")}
	o.publish(7, nil, &p)
	add := &message{Type: msgDelta, Origin: "o", Incarnation: 5, Records: o.takeDirty()}
	o.publish(7, &p, nil)
	del := &message{Type: msgDelta, Origin: "o", Incarnation: 5, Records: o.takeDirty()}
	snap := o.snapshot()

	r := newReceiver(5, "10.0.0.1")
	r.s.apply(add, clk.now())
	if len(r.effectiveOf()) != 1 {
		t.Fatal("add not applied")
	}
	r.s.apply(snap, clk.now()) // the delete was lost; the snapshot lacks "a"
	if got := r.effectiveOf(); len(got) != 0 {
		t.Fatalf("after snapshot: %v", got)
	}
	r.s.reap(clk.now().Add(time.Hour), time.Minute, time.Hour)
	r.s.apply(add, clk.now()) // late duplicate of the add
	r.s.apply(del, clk.now())
	if got := r.effectiveOf(); len(got) != 0 {
		t.Fatalf("resurrected: %v", got)
	}

	// Without a snapshot: the tombstone guards against the reordered add.
	r2 := newReceiver(5, "10.0.0.1")
	r2.s.apply(del, clk.now())
	r2.s.apply(add, clk.now())
	if got := r2.effectiveOf(); len(got) != 0 {
		t.Fatalf("add after its delete resurrected it: %v", got)
	}
}

// TestDigestRepair: a receiver that lost a delta asks for a snapshot when
// the digest disagrees, and stops asking once it agrees.
func TestDigestRepair(t *testing.T) {
	clk := &fakeClock{t: time.Unix(1_700_000_000, 0)}
	o := newLocalStore("o", 5, netip.MustParseAddr("10.0.0.1"), clk.now)
	r := newReceiver(5, "10.0.0.1")
	r.syncs = 0
	for i := range 3 {
		ip := netip.AddrFrom4([4]byte{10, 1, 0, byte(2 + i)})
		o.publish(9, nil, &peerdb.Peer{EndpointID: fmt.Sprint("e", i), IP: ip, MAC: peerdb.MACFromIP(ip), VTEP: netip.MustParseAddr("10.0.0.1")})
		d := &message{Type: msgDelta, Origin: "o", Incarnation: 5, Records: o.takeDirty()}
		if i != 1 { // lost
			r.s.apply(d, clk.now())
		}
	}
	r.s.apply(o.digest(), clk.now())
	if r.syncs != 1 || r.s.stats.DigestMismatches != 1 {
		t.Fatalf("mismatch did not ask for a snapshot: syncs %d stats %+v", r.syncs, r.s.stats)
	}
	r.s.apply(o.snapshot(), clk.now())
	if got, want := r.effectiveOf(), liveSet(o); !reflect.DeepEqual(got, want) {
		t.Fatalf("after snapshot %v want %v", got, want)
	}
	r.s.apply(o.digest(), clk.now())
	if r.syncs != 1 || r.s.stats.DigestMatches != 1 {
		t.Fatalf("matching digest: syncs %d stats %+v", r.syncs, r.s.stats)
	}
}

// TestApplyValidatesBeforeApplying: membership checks refuse a message as a
// whole; nothing of it is applied.
func TestApplyValidatesBeforeApplying(t *testing.T) {
	good := liveRec(5, "a", "10.1.0.2", "10.0.0.1", 10)
	bad := liveRec(5, "b", "10.1.0.3", "10.0.0.99", 11) // not o's VTEP
	r := newReceiver(5, "10.0.0.1")
	for _, tc := range []struct {
		m      *message
		reason DropReason
	}{
		{&message{Type: msgDelta, Origin: "o", Incarnation: 5, Records: []record{good, bad}}, DropVTEPMatch},
		{&message{Type: msgDelta, Origin: "o", Incarnation: 4, Records: []record{good}}, DropIncarnation},
		{&message{Type: msgDelta, Origin: "stranger", Incarnation: 5, Records: []record{good}}, DropUnknownOrig},
		{&message{Type: msgDelta, Origin: "me", Incarnation: 1, Records: []record{good}}, DropSelfOrigin},
		{&message{Type: msgSyncRequest, Origin: "stranger", Incarnation: 5}, DropUnknownOrig},
	} {
		if reason, _ := r.s.apply(tc.m, time.Now()); reason != tc.reason {
			t.Errorf("%+v: reason %q, want %q", tc.m, reason, tc.reason)
		}
	}
	if got := r.effectiveOf(); len(got) != 0 || len(r.s.origins["o"].recs) != 0 || r.snaps != 0 {
		t.Fatalf("half-applied: %v", got)
	}
	// Bad metadata: the member is known but unusable.
	r.s.memberAlive(&memberlist.Node{Name: "junk", Meta: []byte("xx")}, time.Now())
	if reason, _ := r.s.apply(&message{Type: msgDelta, Origin: "junk", Incarnation: 1}, time.Now()); reason != DropBadMeta {
		t.Errorf("bad meta: reason %q", reason)
	}
	// A dead origin's messages are refused too.
	r.s.memberGone(mlNode("o", 5, "10.0.0.1"), time.Now())
	if reason, _ := r.s.apply(&message{Type: msgDelta, Origin: "o", Incarnation: 5, Records: []record{good}}, time.Now()); reason != DropUnknownOrig {
		t.Errorf("dead origin: reason %q", reason)
	}
}

// TestMembershipEffect: a dead origin's records leave the effective view
// and come back with it (same incarnation); a new incarnation replaces
// them, with the old ones in force until its snapshot (restart grace) or
// the grace's end.
func TestMembershipEffect(t *testing.T) {
	r := newReceiver(5, "10.0.0.1")
	dirty := map[recKey]int{}
	r.s.dirty = func(vni uint32, k pkey) { dirty[recKey{vni, k.EndpointID}]++ }
	a := liveRec(5, "a", "10.1.0.2", "10.0.0.1", 10)
	b := liveRec(5, "b", "10.1.0.3", "10.0.0.1", 11)
	r.s.apply(&message{Type: msgDelta, Origin: "o", Incarnation: 5, Records: []record{a, b}}, time.Now())
	if len(r.effectiveOf()) != 2 {
		t.Fatal("records not effective")
	}
	clear(dirty)
	r.s.memberGone(mlNode("o", 5, "10.0.0.1"), time.Now())
	if len(r.effectiveOf()) != 0 || dirty[a.key()] == 0 || dirty[b.key()] == 0 {
		t.Fatalf("dead origin still effective or not marked: %v %v", r.effectiveOf(), dirty)
	}
	syncs := r.syncs
	r.s.memberAlive(mlNode("o", 5, "10.0.0.1"), time.Now())
	if len(r.effectiveOf()) != 2 || r.syncs != syncs+1 {
		t.Fatalf("records not back with the member (or no sync request): %v", r.effectiveOf())
	}

	// Restart while alive: new incarnation 6.
	now := time.Now()
	r.s.memberAlive(mlNode("o", 6, "10.0.0.1"), now)
	if got := r.effectiveOf(); len(got) != 2 {
		t.Fatalf("grace: old records should stay in force, got %v", got)
	}
	// A delta of the old incarnation is refused now.
	if reason, _ := r.s.apply(&message{Type: msgDelta, Origin: "o", Incarnation: 5, Records: []record{a}}, now); reason != DropIncarnation {
		t.Fatalf("old incarnation accepted: %q", reason)
	}
	// The new incarnation's snapshot replaces the old set.
	a2 := liveRec(5, "a", "10.1.0.2", "10.0.0.1", 1) // versions restart
	r.s.apply(&message{Type: msgSnapshot, Origin: "o", Incarnation: 6, AsOf: 3, Records: []record{a2}}, now)
	if got := r.effectiveOf(); len(got) != 1 || got[a.key()] != a2.peer() {
		t.Fatalf("after new snapshot: %v", got)
	}

	// Grace expiry without a snapshot.
	r.s.memberAlive(mlNode("o", 7, "10.0.0.1"), now)
	if len(r.effectiveOf()) != 1 {
		t.Fatal("grace lost the records")
	}
	r.s.reap(now.Add(2*time.Minute), time.Minute, time.Hour)
	if got := r.effectiveOf(); len(got) != 0 {
		t.Fatalf("grace did not expire: %v", got)
	}
	// Back from dead with a new incarnation: no grace for the old records.
	r.s.apply(&message{Type: msgDelta, Origin: "o", Incarnation: 7, Records: []record{a2}}, now)
	r.s.memberGone(mlNode("o", 7, "10.0.0.1"), now)
	r.s.memberAlive(mlNode("o", 8, "10.0.0.1"), now)
	if got := r.effectiveOf(); len(got) != 0 {
		t.Fatalf("old incarnation's records back after death: %v", got)
	}
}

// TestSyncRequestRepeated: a sync request (or its UDP answer) may be lost;
// it is repeated every second until a complete view arrives.
func TestSyncRequestRepeated(t *testing.T) {
	r := newReceiver(5, "10.0.0.1")
	t0 := time.Unix(1000, 0)
	r.s.memberAlive(mlNode("p", 9, "10.0.0.2"), t0)
	base := r.syncTo["p"]
	r.s.tick(t0.Add(500 * time.Millisecond))
	if r.syncTo["p"] != base {
		t.Fatal("repeated too early")
	}
	r.s.tick(t0.Add(1100 * time.Millisecond))
	r.s.tick(t0.Add(2200 * time.Millisecond))
	if r.syncTo["p"] != base+2 {
		t.Fatalf("sync requests %d, want %d", r.syncTo["p"], base+2)
	}
	r.s.apply(&message{Type: msgSnapshot, Origin: "p", Incarnation: 9, AsOf: 0, Records: []record{}}, t0.Add(2300*time.Millisecond))
	r.s.tick(t0.Add(5 * time.Second))
	if r.syncTo["p"] != base+2 {
		t.Fatalf("still asking after the snapshot: %d", r.syncTo["p"]-base)
	}
	// A dead member is not asked.
	r.s.memberAlive(mlNode("q", 3, "10.0.0.3"), t0)
	r.s.memberGone(mlNode("q", 3, "10.0.0.3"), t0)
	n := r.syncTo["q"]
	r.s.tick(t0.Add(5 * time.Second))
	if r.syncTo["q"] != n {
		t.Fatal("asked a dead member")
	}
}
