package peerdb

import (
	"errors"
	"net/netip"
	"reflect"
	"slices"
	"testing"
)

// Tests of IPv6 and dual-stack entries (issue 12). The model tests mix
// IPv4-only, IPv6-only and dual-stack entries too; these pin the exact
// deltas of the common moves.

var (
	seg0v6 = netip.MustParsePrefix("2001:db8::/64")
	seg1v6 = netip.MustParsePrefix("2001:db8:1::/64")

	ip6A = netip.MustParseAddr("2001:db8::a")
	ip6B = netip.MustParseAddr("2001:db8::b")
	ip6C = netip.MustParseAddr("2001:db8:1::c")
)

// newDualDB returns a DB of two dual-stack segments with VNIs 100 and 101.
func newDualDB() *DB {
	return NewSegments([]Segment{
		{Prefixes: []netip.Prefix{sub0, seg0v6}, VNI: 100},
		{Prefixes: []netip.Prefix{sub1, seg1v6}, VNI: 101},
	})
}

func dual(id string, ip, ip6 netip.Addr, mac MAC, vtep netip.Addr) *Peer {
	return &Peer{EndpointID: id, IP: ip, IPv6: ip6, MAC: mac, VTEP: vtep}
}

func set1(t *testing.T, db *DB, k Key, p *Peer) Delta {
	t.Helper()
	d, rej := db.SetRemotes([]Update{{Key: k, Peer: p}})
	if len(rej) != 0 {
		t.Fatalf("SetRemotes(%v, %v): rejected %v", k, fmtP(p), rej)
	}
	return d
}

func TestSegmentsSubnetOf(t *testing.T) {
	db := newDualDB()
	for _, tc := range []struct {
		ip  string
		seg int
		ok  bool
	}{
		{"10.0.0.7", 0, true}, {"2001:db8::7", 0, true},
		{"10.0.1.7", 1, true}, {"2001:db8:1::7", 1, true},
		{"2001:db8:2::7", 0, false}, {"::ffff:10.0.0.7", 0, false}, {"10.0.2.1", 0, false},
	} {
		seg, ok := db.SubnetOf(netip.MustParseAddr(tc.ip))
		if seg != tc.seg || ok != tc.ok {
			t.Errorf("SubnetOf(%s) = %d %v, want %d %v", tc.ip, seg, ok, tc.seg, tc.ok)
		}
	}
	segs := db.Segments()
	if len(segs) != 2 || segs[1].VNI != 101 || !slices.Equal(segs[1].Prefixes, []netip.Prefix{sub1, seg1v6}) {
		t.Fatalf("Segments = %v", segs)
	}
	segs[0].Prefixes[0] = sub1 // a copy
	if db.Segments()[0].Prefixes[0] != sub0 {
		t.Fatal("Segments returned the DB's own slices")
	}
}

// TestDualStackLifecycle: a dual-stack entry yields a neighbour per
// address and one FDB entry; it moves (prev -> next) to another MAC, VTEP
// and IPv6 address, drops its IPv4 address, and goes.
func TestDualStackLifecycle(t *testing.T) {
	db := newDualDB()
	k := Key{VNI: 100, Origin: "h1", EndpointID: "ep1"}

	d := set1(t, db, k, dual("ep1", ipA, ip6A, mac1, vtep1))
	wantDelta(t, d, Delta{
		NeighSet: []Neigh{nset(0, ipA, mac1), nset(0, ip6A, mac1)}, // IPv4 before IPv6
		FDBSet:   []FDB{fset(0, mac1, vtep1)},
	})
	if got := db.Remote(); len(got) != 1 || got[0] != *dual("ep1", ipA, ip6A, mac1, vtep1) {
		t.Fatalf("Remote = %v", got)
	}
	for _, ip := range []netip.Addr{ipA, ip6A} {
		if p, local, ok := db.Active(ip); !ok || local || p.IPv6 != ip6A || p.IP != ipA {
			t.Fatalf("Active(%s) = %v %v %v", ip, p, local, ok)
		}
	}

	// Move: another IPv6 address, MAC and VTEP; the IPv4 address stays.
	d = set1(t, db, k, dual("ep1", ipA, ip6B, mac2, vtep2))
	wantDelta(t, d, Delta{
		NeighSet:   []Neigh{nset(0, ipA, mac2), nset(0, ip6B, mac2)},
		NeighDel:   []Neigh{nset(0, ip6A, mac1)},
		FDBSet:     []FDB{fset(0, mac2, vtep2)},
		FDBDel:     []FDB{fset(0, mac1, vtep1)},
		NeighMoved: []Neigh{nset(0, ipA, mac2)},
	})

	// Drop the IPv4 address: IPv6 only now.
	d = set1(t, db, k, dual("ep1", netip.Addr{}, ip6B, mac2, vtep2))
	wantDelta(t, d, Delta{NeighDel: []Neigh{nset(0, ipA, mac2)}})

	// The IPv6-only entry moves to the other segment (and VNI).
	k2 := Key{VNI: 101, Origin: "h1", EndpointID: "ep1"}
	d, _ = db.SetRemotes([]Update{{Key: k}, {Key: k2, Peer: dual("ep1", netip.Addr{}, ip6C, mac2, vtep2)}})
	wantDelta(t, d, Delta{
		NeighSet: []Neigh{nset(1, ip6C, mac2)},
		NeighDel: []Neigh{nset(0, ip6B, mac2)},
		FDBSet:   []FDB{fset(1, mac2, vtep2)},
		FDBDel:   []FDB{fset(0, mac2, vtep2)},
	})

	// Delete.
	d = set1(t, db, k2, nil)
	wantDelta(t, d, Delta{NeighDel: []Neigh{nset(1, ip6C, mac2)}, FDBDel: []FDB{fset(1, mac2, vtep2)}})
	wantState(t, db, nil, nil)
	if err := checkInvariants(db); err != nil {
		t.Fatal(err)
	}
}

// TestIPv6PullAndSync: the pull path and the level-triggered resync carry
// IPv6 records like IPv4 ones.
func TestIPv6PullAndSync(t *testing.T) {
	db := newDualDB()
	ka := Key{VNI: 100, Origin: "h1", EndpointID: "a"}
	kb := Key{VNI: 100, Origin: "h2", EndpointID: "b"}
	src := map[Key]Peer{
		ka: *dual("a", netip.Addr{}, ip6A, mac1, vtep1),
		kb: *dual("b", ipB, ip6B, mac2, vtep2),
	}
	keys := []Key{ka, kb}
	d, rej := db.Pull(100, keys, func(i int) (Peer, bool) { p, ok := src[keys[i]]; return p, ok })
	if len(rej) != 0 {
		t.Fatal(rej)
	}
	wantDelta(t, d, Delta{
		NeighSet: []Neigh{nset(0, ipB, mac2), nset(0, ip6A, mac1), nset(0, ip6B, mac2)},
		FDBSet:   []FDB{fset(0, mac1, vtep1), fset(0, mac2, vtep2)},
	})
	if !reflect.DeepEqual(db.Held(), src) {
		t.Fatalf("Held = %v", db.Held())
	}

	// The source lost a; b moved its IPv6 address.
	delete(src, ka)
	src[kb] = *dual("b", ipB, ip6A, mac2, vtep2)
	d, rej = db.SyncVNI(100, src)
	if len(rej) != 0 {
		t.Fatal(rej)
	}
	wantDelta(t, d, Delta{
		NeighSet:   []Neigh{nset(0, ip6A, mac2)},
		NeighDel:   []Neigh{nset(0, ip6B, mac2)},
		FDBDel:     []FDB{fset(0, mac1, vtep1)},
		NeighMoved: []Neigh{nset(0, ip6A, mac2)},
	})
	if !reflect.DeepEqual(db.Held(), src) {
		t.Fatalf("Held = %v", db.Held())
	}
	if err := checkInvariants(db); err != nil {
		t.Fatal(err)
	}
}

// TestIPv6ConflictIndependentOfOrder: IPv4-only, IPv6-only and dual-stack
// claimants of overlapping addresses, in every arrival order, added as
// events and as keyed records, give the same winners, state and
// conflicts; removed in any order they leave nothing.
func TestIPv6ConflictIndependentOfOrder(t *testing.T) {
	claimants := []*Peer{
		dual("ep2", ipA, ip6A, mac1, vtep1),          // dual: shadowed on both addresses
		dual("ep1", ipA, netip.Addr{}, mac3, vtep2),  // IPv4 only: wins ipA
		dual("ep1", netip.Addr{}, ip6A, mac3, vtep3), // IPv6 only: wins ip6A (ep1 < ep2)
		dual("ep3", ipB, ip6A, mac2, vtep1),          // dual: wins ipB alone, shadowed on ip6A
		dual("ep1", ipB, ip6B, mac3, vtep2),          // same id, MAC, VTEP as the second on ipB: wins ipB
	}
	wantActive := map[netip.Addr]Peer{
		ipA: *claimants[1], ip6A: *claimants[2], ipB: *claimants[4], ip6B: *claimants[4],
	}
	wantConflicts := []Conflict{
		{IP: ipA, Active: *claimants[1], Shadowed: []Peer{*claimants[0]}},
		{IP: ipB, Active: *claimants[4], Shadowed: []Peer{*claimants[3]}},
		{IP: ip6A, Active: *claimants[2], Shadowed: []Peer{*claimants[0], *claimants[3]}},
	}
	wantNeigh := map[NeighKey]MAC{{0, ipA}: mac3, {0, ipB}: mac3, {0, ip6A}: mac3, {0, ip6B}: mac3}
	// mac3 is proposed by ipA (vtep2), ipB (vtep2), ip6A (vtep3), ip6B
	// (vtep2): the smallest IP, ipA, wins.
	wantFDB := map[FDBKey]netip.Addr{{0, mac3}: vtep2}

	perms := permutations(len(claimants))
	for _, perm := range perms {
		for _, keyed := range []bool{false, true} {
			db := newDualDB()
			for _, j := range perm {
				if keyed {
					set1(t, db, Key{VNI: 100, Origin: "h" + string(rune('0'+j)), EndpointID: claimants[j].EndpointID}, claimants[j])
				} else {
					mustApply(t, db, create(claimants[j]))
				}
			}
			for ip, want := range wantActive {
				if p, local, ok := db.Active(ip); !ok || local || p != want {
					t.Fatalf("perm %v keyed %v: Active(%s) = %v, want %v", perm, keyed, ip, p, want)
				}
			}
			wantState(t, db, wantNeigh, wantFDB)
			if got := db.Conflicts(); !reflect.DeepEqual(got, wantConflicts) {
				t.Fatalf("perm %v keyed %v: Conflicts\n got  %+v\n want %+v", perm, keyed, got, wantConflicts)
			}
			if err := checkInvariants(db); err != nil {
				t.Fatalf("perm %v: %v", perm, err)
			}
			// Removing in the same order (any order: perm is every one).
			for _, j := range perm {
				if keyed {
					set1(t, db, Key{VNI: 100, Origin: "h" + string(rune('0'+j)), EndpointID: claimants[j].EndpointID}, nil)
				} else {
					mustApply(t, db, del(claimants[j]))
				}
				if err := checkInvariants(db); err != nil {
					t.Fatalf("perm %v after removing %d: %v", perm, j, err)
				}
			}
			wantState(t, db, nil, nil)
			if l, r := db.Len(); l+r != 0 {
				t.Fatalf("perm %v: %d local %d remote left", perm, l, r)
			}
		}
	}
}

// TestRecordsDifferingOnlyInOtherAddress: two keys hold records equal but
// for the IPv6 address; each is an entry of its own, and the IPv4 claim
// keeps both claimants until both are gone.
func TestRecordsDifferingOnlyInOtherAddress(t *testing.T) {
	db := newDualDB()
	k1, k2 := Key{VNI: 100, Origin: "h1", EndpointID: "a"}, Key{VNI: 100, Origin: "h2", EndpointID: "a"}
	p1, p2 := dual("a", ipA, ip6A, mac1, vtep1), dual("a", ipA, ip6B, mac1, vtep1)
	set1(t, db, k1, p1)
	set1(t, db, k2, p2)
	if got := db.Remote(); !reflect.DeepEqual(got, []Peer{*p1, *p2}) {
		t.Fatalf("Remote = %v", got)
	}
	if c := db.Conflicts(); len(c) != 1 || c[0].IP != ipA || c[0].Active != *p1 {
		t.Fatalf("Conflicts = %+v", c)
	}
	d := set1(t, db, k1, nil)
	wantDelta(t, d, Delta{NeighDel: []Neigh{nset(0, ip6A, mac1)}})
	d = set1(t, db, k2, nil)
	wantDelta(t, d, Delta{NeighDel: []Neigh{nset(0, ipA, mac1), nset(0, ip6B, mac1)}, FDBDel: []FDB{fset(0, mac1, vtep1)}})
}

// TestLocalDualStackShadows: a local dual-stack endpoint shadows remote
// claimants of both its addresses and suppresses the FDB entry of its MAC.
func TestLocalDualStackShadows(t *testing.T) {
	db := newDualDB()
	set1(t, db, Key{VNI: 100, Origin: "h1", EndpointID: "r"}, dual("r", ipB, ip6A, mac2, vtep1))
	d, err := db.AddLocal(*dual("l", ipA, ip6A, mac2, netip.Addr{}))
	if err != nil {
		t.Fatal(err)
	}
	// ip6A is now local; ipB stays remote but its MAC is local: no FDB.
	wantDelta(t, d, Delta{NeighDel: []Neigh{nset(0, ip6A, mac2)}, FDBDel: []FDB{fset(0, mac2, vtep1)}})
	if p, local, ok := db.Active(ip6A); !ok || !local || p.EndpointID != "l" {
		t.Fatalf("Active(%s) = %v %v %v", ip6A, p, local, ok)
	}
	d, _ = db.RemoveLocal("l")
	wantDelta(t, d, Delta{NeighSet: []Neigh{nset(0, ip6A, mac2)}, FDBSet: []FDB{fset(0, mac2, vtep1)}})
	if err := checkInvariants(db); err != nil {
		t.Fatal(err)
	}
}

// TestIPv6Rejections: bad IPv6 addresses name the field and what is
// allowed, and leave the table as it was.
func TestIPv6Rejections(t *testing.T) {
	v4only := New([]netip.Prefix{sub0})
	for _, tc := range []struct {
		name  string
		db    *DB
		p     Peer
		field string
		says  []string
	}{
		{"outside every prefix", newDualDB(), *dual("a", netip.Addr{}, netip.MustParseAddr("2001:db8:9::1"), mac1, vtep1),
			"IPv6", []string{"2001:db8:9::1", "not in any subnet", "2001:db8::/64", "2001:db8:1::/64"}},
		{"no IPv6 subnet", v4only, *dual("a", ipA, ip6A, mac1, vtep1),
			"IPv6", []string{"2001:db8::a", "not in any subnet", "10.0.0.0/24"}},
		{"v4-mapped", newDualDB(), *dual("a", netip.Addr{}, netip.MustParseAddr("::ffff:10.0.0.1"), mac1, vtep1),
			"IPv6", []string{"::ffff:10.0.0.1", "IPv4-mapped"}},
		{"IPv4 in the IPv6 field", newDualDB(), *dual("a", netip.Addr{}, ipA, mac1, vtep1),
			"IPv6", []string{"10.0.0.1", "is an IPv4 address"}},
		{"IPv6 in the IP field", newDualDB(), *dual("a", ip6A, netip.Addr{}, mac1, vtep1),
			"IP", []string{"2001:db8::a", "not an IPv4 address"}},
		{"zone", newDualDB(), *dual("a", netip.Addr{}, netip.MustParseAddr("2001:db8::a%eth0"), mac1, vtep1),
			"IPv6", []string{"zone"}},
		{"two segments", newDualDB(), *dual("a", ipA, ip6C, mac1, vtep1),
			"IPv6", []string{"2001:db8:1::c", "10.0.0.1", "one segment"}},
		{"no address", newDualDB(), *dual("a", netip.Addr{}, netip.Addr{}, mac1, vtep1),
			"IP", []string{"IP is missing and so is IPv6"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.db.Validate(tc.p)
			var ipe *InvalidPeerError
			if !errors.As(err, &ipe) || ipe.Field != tc.field || !containsAll(err.Error(), tc.says...) {
				t.Fatalf("Validate(%v) = %v, want a %s error saying %q", tc.p, err, tc.field, tc.says)
			}
			if _, err := tc.db.AddLocal(tc.p); err == nil {
				t.Fatal("AddLocal accepted it")
			}
			k := Key{VNI: 100, Origin: "h1", EndpointID: "a"}
			d, rej := tc.db.SetRemotes([]Update{{Key: k, Peer: &tc.p}})
			if len(rej) != 1 || !d.Empty() || len(tc.db.Held()) != 0 {
				t.Fatalf("SetRemotes: delta %+v rejections %v held %v", d, rej, tc.db.Held())
			}
			if err := checkInvariants(tc.db); err != nil {
				t.Fatal(err)
			}
		})
	}

	// A record under one VNI whose IPv6 address lies on another VNI's
	// segment is refused, naming both.
	db := newDualDB()
	p := dual("a", netip.Addr{}, ip6C, mac1, vtep1)
	_, rej := db.SetRemotes([]Update{{Key: Key{VNI: 100, Origin: "h1", EndpointID: "a"}, Peer: p}})
	if len(rej) != 1 || !containsAll(rej[0].Err.Error(), "IPv6 2001:db8:1::c", "VNI 100", "10.0.0.0/24 + 2001:db8::/64") {
		t.Fatalf("rejections %v", rej)
	}
}

// TestDeltaSortedMixed: a batch of IPv4 and IPv6 addresses in two segments
// yields a Delta sorted by segment, then address (IPv4 first).
func TestDeltaSortedMixed(t *testing.T) {
	db := newDualDB()
	var ups []Update
	for i := 200; i > 0; i-- {
		seg := byte(i % 2)
		ip := netip.AddrFrom4([4]byte{10, 0, seg, byte(i)})
		ip6 := netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 0, seg, 14: byte(i * 7), 15: byte(i * 13)})
		p := dual("ep"+ip.String(), ip, ip6, MACFromIP(ip), vtep1)
		switch i % 3 {
		case 0:
			p.IP = netip.Addr{}
		case 1:
			p.IPv6 = netip.Addr{}
		}
		ups = append(ups, Update{Key: Key{VNI: 100 + uint32(seg), Origin: "h", EndpointID: p.EndpointID}, Peer: p})
	}
	d, rej := db.SetRemotes(ups)
	if len(rej) != 0 {
		t.Fatal(rej)
	}
	if n := len(d.NeighSet); n != 200+67 { // every third has both
		t.Fatalf("%d neighbours", n)
	}
	if !slices.IsSortedFunc(d.NeighSet, compareNeigh) || !slices.IsSortedFunc(d.FDBSet, compareFDB) {
		t.Fatal("delta not sorted")
	}
}
