package peerdb

import (
	"errors"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"
)

var (
	sub0 = netip.MustParsePrefix("10.0.0.0/24")
	sub1 = netip.MustParsePrefix("10.0.1.0/24")

	ipA = netip.MustParseAddr("10.0.0.1")
	ipB = netip.MustParseAddr("10.0.0.2")
	ipC = netip.MustParseAddr("10.0.1.1")

	mac1 = MAC{0x02, 0x42, 0, 0, 0, 1}
	mac2 = MAC{0x02, 0x42, 0, 0, 0, 2}
	mac3 = MAC{0x02, 0x42, 0, 0, 0, 3}

	vtep1 = netip.MustParseAddr("192.0.2.1")
	vtep2 = netip.MustParseAddr("192.0.2.2")
	vtep3 = netip.MustParseAddr("2001:db8::3")
)

func newDB() *DB { return New([]netip.Prefix{sub0, sub1}) }

func pp(id string, ip netip.Addr, mac MAC, vtep netip.Addr) *Peer {
	return &Peer{EndpointID: id, IP: ip, MAC: mac, VTEP: vtep}
}

func create(p *Peer) Event                   { return Event{Next: p} }
func del(p *Peer) Event                      { return Event{Prev: p} }
func update(a, b *Peer) Event                { return Event{Prev: a, Next: b} }
func nset(s int, ip netip.Addr, m MAC) Neigh { return Neigh{Subnet: s, IP: ip, MAC: m} }
func fset(s int, m MAC, v netip.Addr) FDB    { return FDB{Subnet: s, MAC: m, VTEP: v} }

func mustApply(t *testing.T, db *DB, ev Event) Delta {
	t.Helper()
	d, err := db.applyEvent(ev)
	if err != nil {
		t.Fatalf("Apply: %v", err)
	}
	return d
}

func wantDelta(t *testing.T, got, want Delta) {
	t.Helper()
	if !reflect.DeepEqual(normDelta(got), normDelta(want)) {
		t.Fatalf("delta:\n got  %+v\n want %+v", got, want)
	}
}

func normDelta(d Delta) Delta {
	n := func(s []Neigh) []Neigh {
		if len(s) == 0 {
			return nil
		}
		return s
	}
	f := func(s []FDB) []FDB {
		if len(s) == 0 {
			return nil
		}
		return s
	}
	// NeighMoved is left out: TestDeltaNeighMoved checks it.
	return Delta{NeighSet: n(d.NeighSet), NeighDel: n(d.NeighDel), FDBSet: f(d.FDBSet), FDBDel: f(d.FDBDel)}
}

func wantState(t *testing.T, db *DB, neigh map[NeighKey]MAC, fdb map[FDBKey]netip.Addr) {
	t.Helper()
	if neigh == nil {
		neigh = map[NeighKey]MAC{}
	}
	if fdb == nil {
		fdb = map[FDBKey]netip.Addr{}
	}
	if err := checkInvariants(db); err != nil {
		t.Fatalf("invariants: %v", err)
	}
	got := db.Desired()
	if !reflect.DeepEqual(got, State{Neigh: neigh, FDB: fdb}) {
		t.Fatalf("Desired:\n got  %v\n want %v %v", got, neigh, fdb)
	}
}

func TestAddUpdateDelete(t *testing.T) {
	db := newDB()
	p := pp("ep1", ipA, mac1, vtep1)

	d := mustApply(t, db, create(p))
	wantDelta(t, d, Delta{NeighSet: []Neigh{nset(0, ipA, mac1)}, FDBSet: []FDB{fset(0, mac1, vtep1)}})
	wantState(t, db, map[NeighKey]MAC{{0, ipA}: mac1}, map[FDBKey]netip.Addr{{0, mac1}: vtep1})

	// Duplicate create: idempotent.
	d = mustApply(t, db, create(p))
	wantDelta(t, d, Delta{})
	if l, r := db.Len(); l != 0 || r != 1 {
		t.Fatalf("Len = %d, %d; want 0, 1", l, r)
	}

	// Update: same endpoint moves to another host.
	q := pp("ep1", ipA, mac1, vtep2)
	d = mustApply(t, db, update(p, q))
	wantDelta(t, d, Delta{FDBSet: []FDB{fset(0, mac1, vtep2)}})

	// Delete.
	d = mustApply(t, db, del(q))
	wantDelta(t, d, Delta{NeighDel: []Neigh{nset(0, ipA, mac1)}, FDBDel: []FDB{fset(0, mac1, vtep2)}})
	wantState(t, db, nil, nil)

	// Delete again (and delete of something never seen): no-op.
	wantDelta(t, mustApply(t, db, del(q)), Delta{})
	wantDelta(t, mustApply(t, db, del(pp("ghost", ipB, mac2, vtep1))), Delta{})
	if l, r := db.Len(); l != 0 || r != 0 || db.byIP.len() != 0 || fdbKeys(db) != 0 || len(db.vteps.idx) != 0 {
		t.Fatalf("DB not empty after deleting everything: %d %d %v %v %v", l, r, db.byIP.len(), fdbKeys(db), db.vteps.idx)
	}
}

func TestUpdateMovesIPToNewMACAndVTEP(t *testing.T) {
	db := newDB()
	old := pp("ep1", ipA, mac1, vtep1)
	mustApply(t, db, create(old))
	// The IP is reused by another endpoint on another host.
	next := pp("ep2", ipA, mac2, vtep2)
	d := mustApply(t, db, update(old, next))
	wantDelta(t, d, Delta{
		NeighSet: []Neigh{nset(0, ipA, mac2)}, // a single replace, no del of the IP
		FDBSet:   []FDB{fset(0, mac2, vtep2)},
		FDBDel:   []FDB{fset(0, mac1, vtep1)},
	})
	wantState(t, db, map[NeighKey]MAC{{0, ipA}: mac2}, map[FDBKey]netip.Addr{{0, mac2}: vtep2})
}

func TestUpdateWithAbsentPrevStillInserts(t *testing.T) {
	db := newDB()
	d := mustApply(t, db, update(pp("ep1", ipA, mac1, vtep1), pp("ep1", ipA, mac1, vtep2)))
	wantDelta(t, d, Delta{NeighSet: []Neigh{nset(0, ipA, mac1)}, FDBSet: []FDB{fset(0, mac1, vtep2)}})
}

func permutations(n int) [][]int {
	if n == 0 {
		return [][]int{{}}
	}
	var out [][]int
	for _, p := range permutations(n - 1) {
		for i := 0; i <= len(p); i++ {
			q := append(append(append([]int{}, p[:i]...), n-1), p[i:]...)
			out = append(out, q)
		}
	}
	return out
}

func TestRemoteConflictIndependentOfOrder(t *testing.T) {
	claimants := []*Peer{
		pp("ep2", ipA, mac1, vtep1),
		pp("ep1", ipA, mac3, vtep2), // smallest EndpointID: wins
		pp("ep1", ipA, mac3, vtep3), // same id and MAC, VTEP 2001:db8::3 > 192.0.2.2
	}
	wantActive := *claimants[1]
	perms := permutations(len(claimants))
	if len(perms) != 6 {
		t.Fatalf("got %d permutations", len(perms))
	}
	var first State
	var firstConf []Conflict
	for i, perm := range perms {
		db := newDB()
		for _, j := range perm {
			mustApply(t, db, create(claimants[j]))
		}
		p, local, ok := db.Active(ipA)
		if !ok || local || p != wantActive {
			t.Fatalf("perm %v: Active = %v %v %v, want %v", perm, p, local, ok, wantActive)
		}
		st, conf := db.Desired(), db.Conflicts()
		if i == 0 {
			first, firstConf = st, conf
			wantState(t, db, map[NeighKey]MAC{{0, ipA}: mac3}, map[FDBKey]netip.Addr{{0, mac3}: vtep2})
			want := []Conflict{{IP: ipA, Active: wantActive, Shadowed: []Peer{*claimants[2], *claimants[0]}}}
			if !reflect.DeepEqual(conf, want) {
				t.Fatalf("Conflicts = %+v, want %+v", conf, want)
			}
			continue
		}
		if !reflect.DeepEqual(st, first) || !reflect.DeepEqual(conf, firstConf) {
			t.Fatalf("perm %v: state/conflicts differ from perm %v", perm, perms[0])
		}
		// Removing in every order also converges.
		for _, j := range perm {
			mustApply(t, db, del(claimants[j]))
		}
		wantState(t, db, nil, nil)
	}
}

func TestMACWinnerTieBreak(t *testing.T) {
	// Same EndpointID, different MACs: the smaller MAC wins.
	for _, order := range [][2]*Peer{
		{pp("ep", ipA, mac2, vtep1), pp("ep", ipA, mac1, vtep2)},
		{pp("ep", ipA, mac1, vtep2), pp("ep", ipA, mac2, vtep1)},
	} {
		db := newDB()
		mustApply(t, db, create(order[0]))
		mustApply(t, db, create(order[1]))
		wantState(t, db, map[NeighKey]MAC{{0, ipA}: mac1}, map[FDBKey]netip.Addr{{0, mac1}: vtep2})
	}
}

func TestShadowedWinnerLeavesPromotesNext(t *testing.T) {
	db := newDB()
	a := pp("ep1", ipA, mac1, vtep1)
	b := pp("ep2", ipA, mac2, vtep2)
	mustApply(t, db, create(b))
	d := mustApply(t, db, create(a)) // a wins
	wantDelta(t, d, Delta{
		NeighSet: []Neigh{nset(0, ipA, mac1)},
		FDBSet:   []FDB{fset(0, mac1, vtep1)},
		FDBDel:   []FDB{fset(0, mac2, vtep2)},
	})
	d = mustApply(t, db, del(a)) // b is promoted back
	wantDelta(t, d, Delta{
		NeighSet: []Neigh{nset(0, ipA, mac2)},
		FDBSet:   []FDB{fset(0, mac2, vtep2)},
		FDBDel:   []FDB{fset(0, mac1, vtep1)},
	})
	// Deleting the shadowed one changes nothing desired.
	mustApply(t, db, create(a))
	wantDelta(t, mustApply(t, db, del(b)), Delta{})
}

func TestLocalShadowsRemote(t *testing.T) {
	db := newDB()
	r := pp("remote", ipA, mac1, vtep1)
	mustApply(t, db, create(r))

	loc := Peer{EndpointID: "zzz-local", IP: ipA, MAC: mac2} // no VTEP: fine for local
	d, err := db.AddLocal(loc)
	if err != nil {
		t.Fatal(err)
	}
	wantDelta(t, d, Delta{NeighDel: []Neigh{nset(0, ipA, mac1)}, FDBDel: []FDB{fset(0, mac1, vtep1)}})
	wantState(t, db, nil, nil)
	if p, local, ok := db.Active(ipA); !ok || !local || p != loc {
		t.Fatalf("Active = %v %v %v, want local %v", p, local, ok, loc)
	}
	wantConf := []Conflict{{IP: ipA, Active: loc, ActiveLocal: true, Shadowed: []Peer{*r}}}
	if got := db.Conflicts(); !reflect.DeepEqual(got, wantConf) {
		t.Fatalf("Conflicts = %+v, want %+v", got, wantConf)
	}
	// Remote events for a shadowed IP change nothing desired.
	r2 := pp("remote", ipA, mac1, vtep2)
	wantDelta(t, mustApply(t, db, update(r, r2)), Delta{})

	// Re-adding the same local entry is a no-op.
	if d, err := db.AddLocal(loc); err != nil || !d.Empty() {
		t.Fatalf("AddLocal again = %+v, %v", d, err)
	}

	d, ok := db.RemoveLocal(loc.EndpointID)
	if !ok {
		t.Fatal("RemoveLocal: not found")
	}
	wantDelta(t, d, Delta{NeighSet: []Neigh{nset(0, ipA, mac1)}, FDBSet: []FDB{fset(0, mac1, vtep2)}})
	if d, ok := db.RemoveLocal(loc.EndpointID); ok || !d.Empty() {
		t.Fatalf("second RemoveLocal = %+v, %v", d, ok)
	}
	if got := db.Conflicts(); got != nil {
		t.Fatalf("Conflicts = %+v after RemoveLocal", got)
	}
}

func TestAddLocalReplacesSameID(t *testing.T) {
	db := newDB()
	r := pp("remote", ipB, mac2, vtep1)
	mustApply(t, db, create(r))
	if _, err := db.AddLocal(Peer{EndpointID: "L", IP: ipA, MAC: mac1}); err != nil {
		t.Fatal(err)
	}
	// The local endpoint is re-added with the IP that the remote one claims.
	d, err := db.AddLocal(Peer{EndpointID: "L", IP: ipB, MAC: mac1})
	if err != nil {
		t.Fatal(err)
	}
	wantDelta(t, d, Delta{NeighDel: []Neigh{nset(0, ipB, mac2)}, FDBDel: []FDB{fset(0, mac2, vtep1)}})
	if got := db.Local(); len(got) != 1 || got[0].IP != ipB {
		t.Fatalf("Local = %v", got)
	}
	if _, local, ok := db.Active(ipA); ok || local {
		t.Fatal("old local IP still claimed")
	}
}

func TestTwoLocalsSmallestIDWins(t *testing.T) {
	for _, rev := range []bool{false, true} {
		db := newDB()
		ls := []Peer{{EndpointID: "b", IP: ipA, MAC: mac2}, {EndpointID: "a", IP: ipA, MAC: mac1}}
		if rev {
			ls[0], ls[1] = ls[1], ls[0]
		}
		for _, l := range ls {
			if _, err := db.AddLocal(l); err != nil {
				t.Fatal(err)
			}
		}
		if p, local, _ := db.Active(ipA); !local || p.EndpointID != "a" {
			t.Fatalf("Active = %v", p)
		}
	}
}

func TestFDBMACCollision(t *testing.T) {
	db := newDB()
	// Two IPs in subnet 0 share mac1 on different hosts: smallest IP wins.
	hi := pp("ep-hi", ipB, mac1, vtep2)
	lo := pp("ep-lo", ipA, mac1, vtep1)
	mustApply(t, db, create(hi))
	d := mustApply(t, db, create(lo))
	wantDelta(t, d, Delta{NeighSet: []Neigh{nset(0, ipA, mac1)}, FDBSet: []FDB{fset(0, mac1, vtep1)}})
	// Same MAC in another subnet is another key.
	other := pp("ep-other", ipC, mac1, vtep3)
	d = mustApply(t, db, create(other))
	wantDelta(t, d, Delta{NeighSet: []Neigh{nset(1, ipC, mac1)}, FDBSet: []FDB{fset(1, mac1, vtep3)}})
	wantState(t, db,
		map[NeighKey]MAC{{0, ipA}: mac1, {0, ipB}: mac1, {1, ipC}: mac1},
		map[FDBKey]netip.Addr{{0, mac1}: vtep1, {1, mac1}: vtep3})

	// Removing the winner hands the FDB key to the next IP.
	d = mustApply(t, db, del(lo))
	wantDelta(t, d, Delta{NeighDel: []Neigh{nset(0, ipA, mac1)}, FDBSet: []FDB{fset(0, mac1, vtep2)}})

	// A local endpoint with mac1 in subnet 0 (on an unrelated IP) suppresses
	// the FDB entry for (0, mac1) but not the neighbour nor (1, mac1).
	d, err := db.AddLocal(Peer{EndpointID: "L", IP: netip.MustParseAddr("10.0.0.9"), MAC: mac1})
	if err != nil {
		t.Fatal(err)
	}
	wantDelta(t, d, Delta{FDBDel: []FDB{fset(0, mac1, vtep2)}})
	wantState(t, db,
		map[NeighKey]MAC{{0, ipB}: mac1, {1, ipC}: mac1},
		map[FDBKey]netip.Addr{{1, mac1}: vtep3})
	d, _ = db.RemoveLocal("L")
	wantDelta(t, d, Delta{FDBSet: []FDB{fset(0, mac1, vtep2)}})
}

func TestShadowedClaimantProposesNoFDB(t *testing.T) {
	db := newDB()
	// ep2 at ipA is shadowed by ep1; its MAC must not reach the FDB.
	mustApply(t, db, create(pp("ep1", ipA, mac1, vtep1)))
	d := mustApply(t, db, create(pp("ep2", ipA, mac2, vtep2)))
	wantDelta(t, d, Delta{})
	wantState(t, db, map[NeighKey]MAC{{0, ipA}: mac1}, map[FDBKey]netip.Addr{{0, mac1}: vtep1})
}

func TestApplyAllNetDelta(t *testing.T) {
	db := newDB()
	a := pp("ep1", ipA, mac1, vtep1)
	b := pp("ep1", ipA, mac1, vtep2)
	c := pp("ep3", ipC, mac3, vtep3)
	mustApply(t, db, create(c))

	bad := pp("", ipA, mac1, vtep1)
	d, errs := db.applyEvents([]Event{
		create(a),    // neigh+fdb set…
		update(a, b), // …fdb replaced…
		create(bad),  // skipped
		del(c),       // removed
		create(c),    // …and back: net unchanged
		del(b),       // …and a/b gone: net unchanged
		create(pp("ep2", ipB, mac2, vtep2)),
	})
	if len(errs) != 7 || errs[2] == nil {
		t.Fatalf("errs = %v", errs)
	}
	for i, err := range errs {
		if (err != nil) != (i == 2) {
			t.Fatalf("errs[%d] = %v", i, err)
		}
	}
	wantDelta(t, d, Delta{NeighSet: []Neigh{nset(0, ipB, mac2)}, FDBSet: []FDB{fset(0, mac2, vtep2)}})

	d, errs = db.applyEvents([]Event{del(c)})
	if errs != nil {
		t.Fatalf("errs = %v, want nil", errs)
	}
	wantDelta(t, d, Delta{NeighDel: []Neigh{nset(1, ipC, mac3)}, FDBDel: []FDB{fset(1, mac3, vtep3)}})
}

func TestDeltaSorted(t *testing.T) {
	db := newDB()
	var evs []Event
	for i := 200; i > 0; i-- {
		ip := netip.AddrFrom4([4]byte{10, 0, byte(i % 2), byte(i)})
		evs = append(evs, create(pp("ep", ip, MACFromIP(ip), vtep1)))
	}
	d, errs := db.applyEvents(evs)
	if errs != nil {
		t.Fatal(errs)
	}
	if len(d.NeighSet) != 200 || len(d.FDBSet) != 200 {
		t.Fatalf("sizes %d %d", len(d.NeighSet), len(d.FDBSet))
	}
	for i := 1; i < len(d.NeighSet); i++ {
		if compareNeigh(d.NeighSet[i-1], d.NeighSet[i]) >= 0 {
			t.Fatalf("NeighSet not sorted at %d: %v %v", i, d.NeighSet[i-1], d.NeighSet[i])
		}
		if compareFDB(d.FDBSet[i-1], d.FDBSet[i]) >= 0 {
			t.Fatalf("FDBSet not sorted at %d", i)
		}
	}
	if d.NeighSet[0].Subnet != 0 || d.NeighSet[199].Subnet != 1 {
		t.Fatal("not sorted by subnet first")
	}
}

func TestValidate(t *testing.T) {
	db := New([]netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")})
	good := Peer{EndpointID: "ep1", IP: netip.MustParseAddr("192.0.2.5"), MAC: mac1, VTEP: vtep3}
	if err := db.Validate(good); err != nil {
		t.Fatalf("valid peer: %v", err)
	}
	with := func(f func(*Peer)) Peer { p := good; f(&p); return p }
	tests := []struct {
		name  string
		p     Peer
		field string
		want  []string // substrings of the message
	}{
		{"empty id", with(func(p *Peer) { p.EndpointID = "" }), "EndpointID", []string{`peer ""`, "EndpointID is empty", "128"}},
		{"long id", with(func(p *Peer) { p.EndpointID = strings.Repeat("x", 129) }), "EndpointID", []string{"EndpointID is 129 bytes", "at most 128"}},
		{"zero ip", with(func(p *Peer) { p.IP = netip.Addr{} }), "IP", []string{"IP is missing", "192.0.2.0/24"}},
		{"ipv6 ip", with(func(p *Peer) { p.IP = netip.MustParseAddr("2001:db8::5") }), "IP", []string{"IP 2001:db8::5 is not an IPv4 address"}},
		{"mapped ip", with(func(p *Peer) { p.IP = netip.MustParseAddr("::ffff:192.0.2.5") }), "IP", []string{"IP ::ffff:192.0.2.5", "IPv4-mapped"}},
		{"ip outside", with(func(p *Peer) { p.IP = netip.MustParseAddr("10.9.0.5") }), "IP",
			[]string{`peer "ep1": IP 10.9.0.5 is not in any subnet of this network (192.0.2.0/24)`}},
		{"zero mac", with(func(p *Peer) { p.MAC = MAC{} }), "MAC", []string{"MAC 00:00:00:00:00:00", "unicast"}},
		{"multicast mac", with(func(p *Peer) { p.MAC = MAC{1, 0, 0x5e, 0, 0, 1} }), "MAC", []string{"MAC 01:00:5e:00:00:01", "multicast", "unicast"}},
		{"broadcast mac", with(func(p *Peer) { p.MAC = MAC{0xff, 0xff, 0xff, 0xff, 0xff, 0xff} }), "MAC", []string{"MAC ff:ff:ff:ff:ff:ff"}},
		{"zero vtep", with(func(p *Peer) { p.VTEP = netip.Addr{} }), "VTEP", []string{"VTEP is missing", "unicast"}},
		{"unspecified vtep", with(func(p *Peer) { p.VTEP = netip.IPv4Unspecified() }), "VTEP", []string{"VTEP 0.0.0.0 is unspecified"}},
		{"unspecified v6 vtep", with(func(p *Peer) { p.VTEP = netip.IPv6Unspecified() }), "VTEP", []string{"VTEP :: is unspecified"}},
		{"multicast vtep", with(func(p *Peer) { p.VTEP = netip.MustParseAddr("239.1.1.1") }), "VTEP", []string{"VTEP 239.1.1.1 is a multicast address"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := db.Validate(tt.p)
			if err == nil {
				t.Fatal("no error")
			}
			var pe *InvalidPeerError
			if !errors.As(err, &pe) || pe.Field != tt.field {
				t.Fatalf("error %v: want *InvalidPeerError for field %s, got %#v", err, tt.field, pe)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not contain %q", err, w)
				}
			}
			// Local entries: same checks except VTEP.
			if _, err := db.AddLocal(tt.p); (err == nil) != (tt.field == "VTEP") {
				t.Errorf("AddLocal error = %v", err)
			}
		})
	}

	// Every bad field is reported.
	err := db.Validate(Peer{})
	for _, f := range []string{"EndpointID", "IP", "MAC", "VTEP"} {
		if !strings.Contains(err.Error(), f) {
			t.Errorf("error for the zero Peer does not mention %s: %v", f, err)
		}
	}
	// A DB without subnets rejects every IP and says so.
	if err := New(nil).Validate(good); err == nil || !strings.Contains(err.Error(), "(none)") {
		t.Errorf("no-subnet DB: %v", err)
	}
}

func TestInvalidEventMutatesNothing(t *testing.T) {
	db := newDB()
	a := pp("ep1", ipA, mac1, vtep1)
	mustApply(t, db, create(a))
	if _, err := db.AddLocal(Peer{EndpointID: "L", IP: ipB, MAC: mac2}); err != nil {
		t.Fatal(err)
	}
	before, remote, local := db.Desired(), db.Remote(), db.Local()

	badNext := pp("ep2", ipC, mac2, netip.MustParseAddr("224.0.0.1"))
	badPrev := pp("ep1", netip.MustParseAddr("172.16.0.1"), mac1, vtep1)
	for _, ev := range []Event{
		{},                 // neither prev nor next
		update(a, badNext), // valid prev is not removed when next is bad
		update(badPrev, pp("ep9", ipC, mac3, vtep2)), // valid next is not inserted when prev is bad
		create(pp("ep1", ipA, MAC{}, vtep1)),
	} {
		d, err := db.applyEvent(ev)
		if err == nil {
			t.Fatalf("Apply(%v) accepted", ev)
		}
		if !d.Empty() {
			t.Fatalf("Apply(%v) returned delta %+v with error", ev, d)
		}
		if ev.Prev == badPrev && !strings.Contains(err.Error(), "prev: ") {
			t.Errorf("error does not say prev: %v", err)
		}
		if ev.Next == badNext && !strings.Contains(err.Error(), "next: ") {
			t.Errorf("error does not say next: %v", err)
		}
	}
	if _, err := db.AddLocal(Peer{EndpointID: "L", IP: netip.MustParseAddr("10.1.0.1"), MAC: mac2}); err == nil {
		t.Fatal("AddLocal accepted an IP outside the subnets")
	}
	if !reflect.DeepEqual(before, db.Desired()) || !reflect.DeepEqual(remote, db.Remote()) || !reflect.DeepEqual(local, db.Local()) {
		t.Fatal("invalid input changed the DB")
	}
}

func TestRemoteLocalSorted(t *testing.T) {
	db := newDB()
	mustApply(t, db, create(pp("b", ipB, mac1, vtep1)))
	mustApply(t, db, create(pp("a", ipB, mac2, vtep1)))
	mustApply(t, db, create(pp("a", ipB, mac1, vtep2)))
	mustApply(t, db, create(pp("a", ipB, mac1, vtep1)))
	mustApply(t, db, create(pp("z", ipA, mac3, vtep1)))
	want := []Peer{*pp("z", ipA, mac3, vtep1), *pp("a", ipB, mac1, vtep1), *pp("a", ipB, mac1, vtep2), *pp("a", ipB, mac2, vtep1), *pp("b", ipB, mac1, vtep1)}
	if got := db.Remote(); !reflect.DeepEqual(got, want) {
		t.Fatalf("Remote = %v\nwant %v", got, want)
	}
	db.AddLocal(Peer{EndpointID: "y", IP: ipC, MAC: mac1})
	db.AddLocal(Peer{EndpointID: "x", IP: ipC, MAC: mac1})
	db.AddLocal(Peer{EndpointID: "w", IP: ipA, MAC: mac1})
	got := db.Local()
	if len(got) != 3 || got[0].EndpointID != "w" || got[1].EndpointID != "x" || got[2].EndpointID != "y" {
		t.Fatalf("Local = %v", got)
	}
}

func TestSubnets(t *testing.T) {
	in := []netip.Prefix{sub0, sub1}
	db := New(in)
	in[0] = netip.MustParsePrefix("1.0.0.0/8")
	got := db.Subnets()
	got[1] = netip.MustParsePrefix("2.0.0.0/8")
	if s := db.Subnets(); s[0] != sub0 || s[1] != sub1 {
		t.Fatalf("Subnets aliased: %v", s)
	}
	for _, tc := range []struct {
		ip  string
		idx int
		ok  bool
	}{{"10.0.0.7", 0, true}, {"10.0.1.7", 1, true}, {"10.0.2.7", 0, false}} {
		i, ok := db.SubnetOf(netip.MustParseAddr(tc.ip))
		if i != tc.idx || ok != tc.ok {
			t.Errorf("SubnetOf(%s) = %d %v", tc.ip, i, ok)
		}
	}
}

// TestDeltaNeighMoved: an address set to another MAC than it had is listed
// as moved (the sandbox announces those); a new address, a deleted one and
// an unchanged one are not.
func TestDeltaNeighMoved(t *testing.T) {
	db := newDB()
	old := pp("ep1", ipA, mac1, vtep1)
	if d := mustApply(t, db, create(old)); len(d.NeighMoved) != 0 {
		t.Fatalf("a new address is listed as moved: %+v", d.NeighMoved)
	}
	next := pp("ep2", ipA, mac2, vtep2)
	d := mustApply(t, db, update(old, next))
	if want := []Neigh{nset(0, ipA, mac2)}; !slices.Equal(d.NeighMoved, want) {
		t.Fatalf("moved in place: NeighMoved %+v, want %+v", d.NeighMoved, want)
	}
	// The same endpoint on another host keeps its MAC: not moved.
	d = mustApply(t, db, update(next, pp("ep2", ipA, mac2, vtep1)))
	if len(d.NeighMoved) != 0 {
		t.Fatalf("a VTEP change is listed as moved: %+v", d.NeighMoved)
	}
	if d := mustApply(t, db, del(pp("ep2", ipA, mac2, vtep1))); len(d.NeighMoved) != 0 || len(d.NeighDel) != 1 {
		t.Fatalf("delete: NeighMoved %+v NeighDel %+v", d.NeighMoved, d.NeighDel)
	}
}
