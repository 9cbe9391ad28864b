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
	s      *replica
	syncs  int
	syncTo map[string]int
	snaps  int
}

func newReceiver(inc uint64, vtep string) *receiver {
	r := &receiver{s: newReplica("me"), syncTo: map[string]int{}}
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
			checkIndex(t, r.s)
			r.s.reap(clk.now().Add(time.Hour), time.Minute, time.Hour)
			checkIndex(t, r.s)
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
	checkIndex(t, r.s)
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

// checkIndex verifies the per-VNI index against the origins: it holds
// exactly the keys they store (records, tombstones, previous records), and
// peers(vni) is the effective set of that VNI.
func checkIndex(t *testing.T, s *replica) {
	t.Helper()
	want := map[uint32]map[pkey]struct{}{}
	add := func(vni uint32, k pkey) {
		if want[vni] == nil {
			want[vni] = map[pkey]struct{}{}
		}
		want[vni][k] = struct{}{}
	}
	eff := map[uint32]map[pkey]peerdb.Peer{}
	for name, o := range s.origins {
		for k := range o.recs {
			add(k.VNI, pkey{name, k.EndpointID})
		}
		for k := range o.prev {
			add(k.VNI, pkey{name, k.EndpointID})
		}
	}
	if !reflect.DeepEqual(want, s.byVNI) {
		t.Fatalf("index %v, origins hold %v", s.byVNI, want)
	}
	for vni, keys := range want {
		for k := range keys {
			if p, ok := s.effective(vni, k); ok {
				if eff[vni] == nil {
					eff[vni] = map[pkey]peerdb.Peer{}
				}
				eff[vni][k] = p
			}
		}
		got := s.peers(vni)
		if len(got) == 0 && len(eff[vni]) == 0 {
			continue
		}
		if !reflect.DeepEqual(got, eff[vni]) {
			t.Fatalf("peers(%d) = %v, effective %v", vni, got, eff[vni])
		}
	}
}

// TestFailedGrace: a dead member's records stay in force for FailedGrace
// with nothing marked; a return with the same incarnation changes nothing;
// without a return they go at the grace's end; a return with a new
// incarnation keeps the old ones until its first complete view, and only
// keys whose value changes are marked; a leave (before or after the death)
// takes them out at once.
func TestFailedGrace(t *testing.T) {
	r := newReceiver(5, "10.0.0.1")
	r.s.failedGrace = 10 * time.Second
	dirty := map[recKey]int{}
	r.s.dirty = func(vni uint32, k pkey) { dirty[recKey{vni, k.EndpointID}]++ }
	a := liveRec(5, "a", "10.1.0.2", "10.0.0.1", 10)
	b := liveRec(6, "b", "10.1.0.3", "10.0.0.1", 11)
	t0 := time.Unix(1000, 0)
	r.s.apply(&message{Type: msgDelta, Origin: "o", Incarnation: 5, Records: []record{a, b}}, t0)
	want := r.effectiveOf()
	if len(want) != 2 {
		t.Fatalf("records not in force: %v", want)
	}
	checkIndex(t, r.s)
	same := func(step string) {
		t.Helper()
		if got := r.effectiveOf(); !reflect.DeepEqual(got, want) {
			t.Fatalf("%s: in force %v, want %v", step, got, want)
		}
		checkIndex(t, r.s)
	}

	clear(dirty)
	r.s.memberGone(mlNode("o", 5, "10.0.0.1"), t0)
	same("dead")
	if exp := r.s.tick(t0.Add(9 * time.Second)); len(exp) != 0 {
		t.Fatalf("grace ended early: %v", exp)
	}
	same("dead, within the grace")
	syncs := r.syncs
	r.s.memberAlive(mlNode("o", 5, "10.0.0.1"), t0.Add(9*time.Second))
	same("back, same incarnation")
	if len(dirty) != 0 || r.s.stats.MemberReturns != 1 || r.syncs != syncs+1 {
		t.Fatalf("a return within the grace marked %v (returns %d, syncs %d)", dirty, r.s.stats.MemberReturns, r.syncs-syncs)
	}

	t1 := t0.Add(20 * time.Second)
	r.s.memberGone(mlNode("o", 5, "10.0.0.1"), t1)
	if exp := r.s.tick(t1.Add(10 * time.Second)); len(exp) != 1 || exp[0] != "o" {
		t.Fatalf("grace did not end: %v", exp)
	}
	if got := r.effectiveOf(); len(got) != 0 || dirty[a.key()] != 1 || dirty[b.key()] != 1 || r.s.stats.FailedGraceExpired != 1 {
		t.Fatalf("after the grace: in force %v, marked %v", got, dirty)
	}
	checkIndex(t, r.s)
	clear(dirty)
	r.s.memberAlive(mlNode("o", 5, "10.0.0.1"), t1.Add(time.Minute))
	same("back after the grace, same incarnation")
	if dirty[a.key()] == 0 || dirty[b.key()] == 0 {
		t.Fatalf("records back in force not marked: %v", dirty)
	}

	// A restart within the grace: incarnation 6.
	t2 := t1.Add(2 * time.Minute)
	r.s.memberGone(mlNode("o", 5, "10.0.0.1"), t2)
	clear(dirty)
	r.s.memberAlive(mlNode("o", 6, "10.0.0.1"), t2.Add(time.Second))
	same("restarted, before its snapshot")
	if len(dirty) != 0 {
		t.Fatalf("a restart within the grace marked %v", dirty)
	}
	a6 := liveRec(5, "a", "10.1.0.2", "10.0.0.1", 3) // same value, new version
	c6 := liveRec(5, "c", "10.1.0.4", "10.0.0.1", 4)
	r.s.apply(&message{Type: msgSnapshot, Origin: "o", Incarnation: 6, AsOf: 5, Records: []record{a6, c6}}, t2.Add(time.Second))
	want = map[recKey]peerdb.Peer{a.key(): a.peer(), c6.key(): c6.peer()}
	same("restarted, after its snapshot")
	if dirty[a.key()] != 0 || dirty[b.key()] != 1 || dirty[c6.key()] != 1 {
		t.Fatalf("marked %v: want b and c only", dirty)
	}

	// A leave that arrives after memberlist declared the death: out at once.
	r.s.memberGone(mlNode("o", 6, "10.0.0.1"), t2.Add(2*time.Second))
	same("dead again")
	if reason, d := r.s.apply(&message{Type: msgLeave, Origin: "o", Incarnation: 6}, t2.Add(2*time.Second)); reason != "" {
		t.Fatalf("leave of a dead member refused: %s %s", reason, d)
	}
	if got := r.effectiveOf(); len(got) != 0 || r.s.members["o"].state != StateLeft || r.s.origins["o"] != nil {
		t.Fatalf("after a leave: in force %v, state %s", got, r.s.members["o"].state)
	}
	checkIndex(t, r.s)

	// A leave announced first: the death that follows is a leave.
	r.s.memberAlive(mlNode("p", 3, "10.0.0.2"), t2)
	r.s.apply(&message{Type: msgDelta, Origin: "p", Incarnation: 3, Records: []record{liveRec(5, "pa", "10.1.0.9", "10.0.0.2", 1)}}, t2)
	if len(r.effectiveOf()) != 1 {
		t.Fatal("p's record not in force")
	}
	r.s.apply(&message{Type: msgLeave, Origin: "p", Incarnation: 3}, t2)
	if st := r.s.memberGone(mlNode("p", 3, "10.0.0.2"), t2); st != StateLeft || len(r.effectiveOf()) != 0 {
		t.Fatalf("left member: state %s, in force %v", st, r.effectiveOf())
	}
	checkIndex(t, r.s)
}

// TestVTEPChange: a member that advertises a new VTEP keeps its records
// of the former one in force until its records of the new one arrive (a
// delta replaces one, its snapshot the rest), or until RestartGrace ends.
func TestVTEPChange(t *testing.T) {
	r := newReceiver(5, "10.0.0.1")
	dirty := map[recKey]int{}
	r.s.dirty = func(vni uint32, k pkey) { dirty[recKey{vni, k.EndpointID}]++ }
	now := time.Unix(1000, 0)
	a := liveRec(5, "a", "10.1.0.2", "10.0.0.1", 10)
	b := liveRec(5, "b", "10.1.0.3", "10.0.0.1", 11)
	r.s.apply(&message{Type: msgDelta, Origin: "o", Incarnation: 5, Records: []record{a, b}}, now)
	old := r.effectiveOf()
	clear(dirty)
	syncs := r.syncs
	r.s.memberAlive(mlNode("o", 5, "10.0.0.9"), now)
	if got := r.effectiveOf(); !reflect.DeepEqual(got, old) || len(dirty) != 0 || r.syncs != syncs+1 {
		t.Fatalf("after the new VTEP: in force %v, marked %v, syncs %d", got, dirty, r.syncs-syncs)
	}
	checkIndex(t, r.s)
	if reason, _ := r.s.apply(&message{Type: msgDelta, Origin: "o", Incarnation: 5, Records: []record{liveRec(5, "a", "10.1.0.2", "10.0.0.1", 20)}}, now); reason != DropVTEPMatch {
		t.Fatalf("record of the former VTEP accepted: %q", reason)
	}
	a2 := liveRec(5, "a", "10.1.0.2", "10.0.0.9", 21)
	r.s.apply(&message{Type: msgDelta, Origin: "o", Incarnation: 5, Records: []record{a2}}, now)
	if got := r.effectiveOf(); got[a.key()] != a2.peer() || got[b.key()] != b.peer() {
		t.Fatalf("after a delta: %v", got)
	}
	b2 := liveRec(5, "b", "10.1.0.3", "10.0.0.9", 22)
	r.s.apply(&message{Type: msgSnapshot, Origin: "o", Incarnation: 5, AsOf: 22, Records: []record{a2, b2}}, now)
	if got := r.effectiveOf(); len(got) != 2 || got[b.key()] != b2.peer() || r.s.origins["o"].prev != nil {
		t.Fatalf("after the snapshot: %v", got)
	}
	checkIndex(t, r.s)

	// Another VTEP, and no records of it within RestartGrace.
	r.s.memberAlive(mlNode("o", 5, "10.0.0.10"), now)
	if len(r.effectiveOf()) != 2 {
		t.Fatal("records of the former VTEP left force at once")
	}
	r.s.tick(now.Add(r.s.grace))
	if got := r.effectiveOf(); len(got) != 0 {
		t.Fatalf("records of the former VTEP in force after the grace: %v", got)
	}
	checkIndex(t, r.s)
}

// BenchmarkPeersSmallVNI: Peers of a VNI with 10 records costs the same
// whether the store holds 10 or 100,000 records of another VNI (the
// per-VNI index).
func BenchmarkPeersSmallVNI(b *testing.B) {
	for _, other := range []int{10, 100_000} {
		b.Run(fmt.Sprintf("other=%d", other), func(b *testing.B) {
			r := newReceiver(5, "10.0.0.1")
			var recs []record
			for i := range other {
				recs = append(recs, liveRec(1, fmt.Sprintf("big%d", i), fmt.Sprintf("10.%d.%d.%d", 1+i>>16, i>>8&255, 1+i&127), "10.0.0.1", uint64(i+1)))
			}
			for i := range 10 {
				recs = append(recs, liveRec(2, fmt.Sprintf("small%d", i), fmt.Sprintf("10.200.0.%d", 2+i), "10.0.0.1", uint64(other+i+1)))
			}
			r.s.apply(&message{Type: msgDelta, Origin: "o", Incarnation: 5, Records: recs}, time.Now())
			b.ResetTimer()
			for b.Loop() {
				if len(r.s.peers(2)) != 10 {
					b.Fatal("wrong count")
				}
			}
		})
	}
}
