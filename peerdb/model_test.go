package peerdb

import (
	"bytes"
	"cmp"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"reflect"
	"slices"
	"strings"
	"testing"
)

// The model keeps the entry sets naively and recomputes everything from
// scratch; it shares no code with the DB.

var (
	modelSubnets = []netip.Prefix{netip.MustParsePrefix("10.0.0.0/24"), netip.MustParsePrefix("10.0.1.0/24")}
	// modelSubnets6[i] is on the segment of modelSubnets[i].
	modelSubnets6 = []netip.Prefix{netip.MustParsePrefix("2001:db8::/64"), netip.MustParsePrefix("2001:db8:1::/64")}

	uIDs     = []string{"a", "b", "c", "d"}
	uBadIDs  = []string{"", strings.Repeat("l", 129)}
	uIPs     = addrs("10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.1.1", "10.0.1.2")
	uBadIPs  = addrs("192.168.9.9", "::ffff:10.0.0.1", "2001:db8::1")
	uIP6s    = addrs("2001:db8::1", "2001:db8::2", "2001:db8::3", "2001:db8:1::1", "2001:db8:1::2")
	uBadIP6s = addrs("2001:db8:9::1", "::ffff:10.0.0.1", "10.0.0.1", "2001:db8::1%eth0")
	uMACs    = []MAC{{2, 0, 0, 0, 0, 1}, {2, 0, 0, 0, 0, 2}, {2, 0, 0, 0, 0, 3}}
	uBadMACs = []MAC{{}, {1, 0, 0x5e, 0, 0, 1}}
	uVTEPs   = addrs("192.0.2.1", "192.0.2.2", "2001:db8::2")
	uBadVTEP = []netip.Addr{{}, netip.IPv4Unspecified(), netip.MustParseAddr("239.0.0.1")}
)

func addrs(s ...string) []netip.Addr {
	out := make([]netip.Addr, len(s))
	for i, a := range s {
		out[i] = netip.MustParseAddr(a)
	}
	return out
}

type model struct {
	local  map[string]Peer
	remote map[Peer]bool
}

func newModel() *model { return &model{local: map[string]Peer{}, remote: map[Peer]bool{}} }

// modelSegments returns the model's segments: one IPv4 and one IPv6
// subnet each, with VNIs when vnis.
func modelSegments(vnis bool) []Segment {
	segs := make([]Segment, len(modelSubnets))
	for i := range segs {
		segs[i].Prefixes = []netip.Prefix{modelSubnets[i], modelSubnets6[i]}
		if vnis {
			segs[i].VNI = keyedVNIs[i]
		}
	}
	return segs
}

// modelSubnet returns the segment of ip (IPv4 or IPv6).
func modelSubnet(ip netip.Addr) (int, bool) {
	for i, p := range modelSubnets {
		if ip.Is4() && p.Contains(ip) {
			return i, true
		}
	}
	for i, p := range modelSubnets6 {
		if ip.Is6() && !ip.Is4In6() && ip.Zone() == "" && p.Contains(ip) {
			return i, true
		}
	}
	return 0, false
}

// modelSegment returns the segment of p's addresses: each present one must
// be of its family and on it.
func modelSegment(p Peer) (int, bool) {
	s4, ok4 := modelSubnet(p.IP)
	s6, ok6 := modelSubnet(p.IPv6)
	switch {
	case p.IP.IsValid() && (!ok4 || !p.IP.Is4()):
		return 0, false
	case p.IPv6.IsValid() && (!ok6 || !p.IPv6.Is6()):
		return 0, false
	case ok4 && ok6:
		return s4, s4 == s6
	case ok4:
		return s4, true
	}
	return s6, ok6
}

func modelValid(p Peer, remote bool) bool {
	if p.EndpointID == "" || len(p.EndpointID) > 128 {
		return false
	}
	if _, ok := modelSegment(p); !ok {
		return false
	}
	if p.MAC == (MAC{}) || p.MAC[0]&1 != 0 {
		return false
	}
	if remote && (!p.VTEP.IsValid() || p.VTEP.IsUnspecified() || p.VTEP.IsMulticast()) {
		return false
	}
	return true
}

type mClaim struct {
	p     Peer
	local bool
}

// less is the precedence rule written out directly.
func mLess(a, b mClaim) bool {
	if a.local != b.local {
		return a.local
	}
	if a.p.EndpointID != b.p.EndpointID {
		return a.p.EndpointID < b.p.EndpointID
	}
	if a.local {
		return false // unreachable: local ids are unique
	}
	if a.p.MAC != b.p.MAC {
		return string(a.p.MAC[:]) < string(b.p.MAC[:])
	}
	if a.p.VTEP != b.p.VTEP {
		return a.p.VTEP.Less(b.p.VTEP)
	}
	if a.p.IP != b.p.IP {
		return a.p.IP.Less(b.p.IP)
	}
	return a.p.IPv6.Less(b.p.IPv6)
}

// addrsOf returns the addresses p claims.
func addrsOf(p Peer) []netip.Addr {
	var out []netip.Addr
	for _, a := range []netip.Addr{p.IP, p.IPv6} {
		if a.IsValid() {
			out = append(out, a)
		}
	}
	return out
}

// claims returns every IP's claimants, sorted best first: each address of
// an entry is a claim of its own.
func (m *model) claims() map[netip.Addr][]mClaim {
	out := map[netip.Addr][]mClaim{}
	for _, p := range m.local {
		for _, a := range addrsOf(p) {
			out[a] = append(out[a], mClaim{p, true})
		}
	}
	for p := range m.remote {
		for _, a := range addrsOf(p) {
			out[a] = append(out[a], mClaim{p, false})
		}
	}
	for _, cs := range out {
		// insertion sort with mLess: deliberately naive
		for i := 1; i < len(cs); i++ {
			for j := i; j > 0 && mLess(cs[j], cs[j-1]); j-- {
				cs[j], cs[j-1] = cs[j-1], cs[j]
			}
		}
	}
	return out
}

func (m *model) desired() State {
	st := State{Neigh: map[NeighKey]MAC{}, FDB: map[FDBKey]netip.Addr{}}
	bestIP := map[FDBKey]netip.Addr{}
	for ip, cs := range m.claims() {
		w := cs[0]
		if w.local {
			continue
		}
		s, _ := modelSubnet(ip)
		st.Neigh[NeighKey{s, ip}] = w.p.MAC
		k := FDBKey{s, w.p.MAC}
		if cur, ok := bestIP[k]; !ok || ip.Less(cur) {
			bestIP[k] = ip
			st.FDB[k] = w.p.VTEP
		}
	}
	for _, l := range m.local {
		s, _ := modelSegment(l)
		delete(st.FDB, FDBKey{s, l.MAC})
	}
	return st
}

func (m *model) conflicts() []Conflict {
	var out []Conflict
	for ip, cs := range m.claims() {
		if len(cs) < 2 {
			continue
		}
		c := Conflict{IP: ip, Active: cs[0].p, ActiveLocal: cs[0].local}
		for _, s := range cs[1:] {
			c.Shadowed = append(c.Shadowed, s.p)
		}
		out = append(out, c)
	}
	slices.SortFunc(out, func(a, b Conflict) int { return a.IP.Compare(b.IP) })
	return out
}

func (m *model) apply(ev Event) bool {
	if ev.Prev == nil && ev.Next == nil {
		return false
	}
	if (ev.Prev != nil && !modelValid(*ev.Prev, true)) || (ev.Next != nil && !modelValid(*ev.Next, true)) {
		return false
	}
	if ev.Prev != nil {
		delete(m.remote, *ev.Prev)
	}
	if ev.Next != nil {
		m.remote[*ev.Next] = true
	}
	return true
}

// byteSource hands out the fuzz input, then zeros.
type byteSource struct{ b []byte }

func (s *byteSource) more() bool { return len(s.b) > 0 }

func (s *byteSource) next() byte {
	if len(s.b) == 0 {
		return 0
	}
	c := s.b[0]
	s.b = s.b[1:]
	return c
}

// pick chooses from good most of the time and from bad when the byte is high.
func pick[T any](s *byteSource, good, bad []T) T {
	c := int(s.next())
	if c >= 244 && len(bad) > 0 {
		return bad[c%len(bad)]
	}
	return good[c%len(good)]
}

// peer returns a record with an IPv4 address, an IPv6 one or both (the
// last byte says which: all three kinds mix in every sequence).
func (s *byteSource) peer() Peer {
	p := Peer{
		EndpointID: pick(s, uIDs, uBadIDs),
		IP:         pick(s, uIPs, uBadIPs),
		MAC:        pick(s, uMACs, uBadMACs),
		VTEP:       pick(s, uVTEPs, uBadVTEP),
	}
	switch s.next() % 4 {
	case 2: // IPv6 only
		p.IP, p.IPv6 = netip.Addr{}, pick(s, uIP6s, uBadIP6s)
	case 3: // dual stack
		p.IPv6 = pick(s, uIP6s, uBadIP6s)
	}
	return p
}

// existing returns a present remote entry most of the time (so deletes and
// updates hit), otherwise an arbitrary record.
func (s *byteSource) existing(m *model) Peer {
	c := s.next()
	if c < 200 && len(m.remote) > 0 {
		all := make([]Peer, 0, len(m.remote))
		for p := range m.remote {
			all = append(all, p)
		}
		slices.SortFunc(all, func(a, b Peer) int {
			return cmp.Or(strings.Compare(a.EndpointID, b.EndpointID), a.IP.Compare(b.IP),
				bytes.Compare(a.MAC[:], b.MAC[:]), a.VTEP.Compare(b.VTEP), a.IPv6.Compare(b.IPv6))
		})
		return all[int(c)%len(all)]
	}
	return s.peer()
}

// mutate changes one field of p, as moves and reuses do.
func (s *byteSource) mutate(p Peer) Peer {
	switch s.next() % 7 {
	case 0:
		p.EndpointID = pick(s, uIDs, uBadIDs)
	case 1:
		p.IP = pick(s, uIPs, uBadIPs)
	case 5:
		p.IPv6 = pick(s, uIP6s, uBadIP6s)
	case 6: // drops one address
		if s.next()%2 == 0 {
			p.IP = netip.Addr{}
		} else {
			p.IPv6 = netip.Addr{}
		}
	case 2:
		p.MAC = pick(s, uMACs, uBadMACs)
	case 3:
		p.VTEP = pick(s, uVTEPs, uBadVTEP)
	default:
		p = s.peer()
	}
	return p
}

func (s *byteSource) event(m *model) Event {
	switch s.next() % 5 {
	case 0, 1:
		p := s.peer()
		return Event{Next: &p}
	case 2:
		p := s.existing(m)
		return Event{Prev: &p}
	case 3:
		p := s.existing(m)
		q := s.mutate(p)
		return Event{Prev: &p, Next: &q}
	default:
		if s.next() < 16 {
			return Event{}
		}
		p := s.existing(m)
		return Event{Prev: &p, Next: &p}
	}
}

// harness runs one operation sequence against the DB and the model.
type harness struct {
	t     testing.TB
	db    *DB
	m     *model
	state State // running copy maintained only from deltas
	steps int
	// seen counts what the checked states held, so a run can show it
	// covered IPv6: neighbours of IPv6 addresses, dual-stack remote
	// entries, conflicts over an IPv6 address.
	seen struct{ neigh6, dual, conflict6 int }
}

func newHarness(t testing.TB) *harness {
	return &harness{t: t, db: NewSegments(modelSegments(false)), m: newModel(),
		state: State{Neigh: map[NeighKey]MAC{}, FDB: map[FDBKey]netip.Addr{}}}
}

func (h *harness) run(data []byte) {
	s := &byteSource{b: data}
	for s.more() {
		h.step(s)
	}
}

func (h *harness) step(s *byteSource) {
	t := h.t
	h.steps++
	var d Delta
	var desc func() string // built only when reporting a failure
	switch op := s.next() % 8; op {
	case 0, 1, 2: // Apply
		ev := s.event(h.m)
		desc = func() string { return fmt.Sprintf("Apply(%s)", evString(ev)) }
		var err error
		d, err = h.db.applyEvent(ev)
		if ok := h.m.apply(ev); ok != (err == nil) {
			t.Fatalf("step %d %s: err = %v, model valid = %v", h.steps, desc(), err, ok)
		}
		if err != nil && !d.Empty() {
			t.Fatalf("step %d %s: error with non-empty delta", h.steps, desc())
		}
	case 3: // AddLocal
		p := s.peer()
		desc = func() string { return fmt.Sprintf("AddLocal(%v)", p) }
		var err error
		d, err = h.db.AddLocal(p)
		valid := modelValid(p, false)
		if valid != (err == nil) {
			t.Fatalf("step %d %s: err = %v, model valid = %v", h.steps, desc(), err, valid)
		}
		if valid {
			h.m.local[p.EndpointID] = p
		}
	case 4: // RemoveLocal
		id := pick(s, uIDs, uBadIDs)
		desc = func() string { return fmt.Sprintf("RemoveLocal(%q)", id) }
		var ok bool
		d, ok = h.db.RemoveLocal(id)
		_, want := h.m.local[id]
		if ok != want {
			t.Fatalf("step %d %s: ok = %v, want %v", h.steps, desc(), ok, want)
		}
		delete(h.m.local, id)
	default: // ApplyAll
		n := int(s.next() % 12)
		evs := make([]Event, n)
		for i := range evs {
			evs[i] = s.event(h.m)
		}
		desc = func() string {
			s := make([]string, len(evs))
			for i, ev := range evs {
				s[i] = evString(ev)
			}
			return fmt.Sprintf("ApplyAll(%s)", strings.Join(s, ", "))
		}
		var errs []error
		d, errs = h.db.applyEvents(evs)
		allOK := true
		for i, ev := range evs {
			ok := h.m.apply(ev)
			allOK = allOK && ok
			var err error
			if errs != nil {
				err = errs[i]
			}
			if ok != (err == nil) {
				t.Fatalf("step %d %s: event %d %s: err = %v, model valid = %v", h.steps, desc(), i, evString(ev), err, ok)
			}
		}
		if allOK != (errs == nil) {
			t.Fatalf("step %d %s: errs = %v but all valid = %v", h.steps, desc(), errs, allOK)
		}
		if errs != nil && len(errs) != n {
			t.Fatalf("step %d %s: len(errs) = %d", h.steps, desc(), len(errs))
		}
	}
	h.check(desc, d)
}

func evString(ev Event) string {
	f := func(p *Peer) string {
		if p == nil {
			return "nil"
		}
		return p.String()
	}
	return fmt.Sprintf("{%s -> %s}", f(ev.Prev), f(ev.Next))
}

// check verifies the delta against the running state, then the DB against the
// model.
func (h *harness) check(desc func() string, d Delta) {
	t := h.t
	fail := func(format string, args ...any) {
		t.Helper()
		t.Fatalf("step %d %s: %s\nlocal %v\nremote %v\ndelta %+v", h.steps, desc(), fmt.Sprintf(format, args...), h.m.local, h.m.remote, d)
	}

	// (b) the delta is well formed and transforms the previous state.
	sortedN := func(s []Neigh) bool {
		return slices.IsSortedFunc(s, func(a, b Neigh) int { return cmp.Or(cmp.Compare(a.Subnet, b.Subnet), a.IP.Compare(b.IP)) })
	}
	sortedF := func(s []FDB) bool {
		return slices.IsSortedFunc(s, func(a, b FDB) int {
			return cmp.Or(cmp.Compare(a.Subnet, b.Subnet), bytes.Compare(a.MAC[:], b.MAC[:]))
		})
	}
	if !sortedN(d.NeighSet) || !sortedN(d.NeighDel) || !sortedF(d.FDBSet) || !sortedF(d.FDBDel) {
		fail("delta not sorted")
	}
	nk := map[NeighKey]bool{}
	for _, n := range d.NeighDel {
		k := NeighKey{n.Subnet, n.IP}
		if nk[k] {
			fail("neighbour %v twice", k)
		}
		nk[k] = true
		if cur, ok := h.state.Neigh[k]; !ok || cur != n.MAC {
			fail("NeighDel %v: previously desired %v (present %v)", n, cur, ok)
		}
		delete(h.state.Neigh, k)
	}
	for _, n := range d.NeighSet {
		k := NeighKey{n.Subnet, n.IP}
		if nk[k] {
			fail("neighbour %v in Set and Del, or twice", k)
		}
		nk[k] = true
		if cur, ok := h.state.Neigh[k]; ok && cur == n.MAC {
			fail("NeighSet %v does not change anything", n)
		}
		h.state.Neigh[k] = n.MAC
	}
	fk := map[FDBKey]bool{}
	for _, f := range d.FDBDel {
		k := FDBKey{f.Subnet, f.MAC}
		if fk[k] {
			fail("fdb %v twice", k)
		}
		fk[k] = true
		if cur, ok := h.state.FDB[k]; !ok || cur != f.VTEP {
			fail("FDBDel %v: previously desired %v (present %v)", f, cur, ok)
		}
		delete(h.state.FDB, k)
	}
	for _, f := range d.FDBSet {
		k := FDBKey{f.Subnet, f.MAC}
		if fk[k] {
			fail("fdb %v in Set and Del, or twice", k)
		}
		fk[k] = true
		if cur, ok := h.state.FDB[k]; ok && cur == f.VTEP {
			fail("FDBSet %v does not change anything", f)
		}
		h.state.FDB[k] = f.VTEP
	}
	if err := checkInvariants(h.db); err != nil {
		fail("invariants: %v", err)
	}
	got := h.db.Desired()
	if !reflect.DeepEqual(got, h.state) {
		fail("deltas do not add up:\n desired %v\n from deltas %v", got, h.state)
	}

	// (a) the desired state matches the model.
	if want := h.m.desired(); !reflect.DeepEqual(got, want) {
		fail("Desired:\n got  %v\n want %v", got, want)
	}
	// VTEPs is the distinct, sorted values of Desired().FDB.
	var vteps []netip.Addr
	for _, v := range got.FDB {
		if !slices.Contains(vteps, v) {
			vteps = append(vteps, v)
		}
	}
	slices.SortFunc(vteps, func(a, b netip.Addr) int { return a.Compare(b) })
	if have := h.db.VTEPs([]netip.Addr{netip.MustParseAddr("203.0.113.255")}); len(have) != len(vteps)+1 || !slices.Equal(have[1:], vteps) {
		fail("VTEPs (after a given element):\n got  %v\n want [203.0.113.255] + %v", have, vteps)
	}

	// (c) Active and Conflicts match the model.
	claims := h.m.claims()
	for _, ip := range slices.Concat(uIPs, uBadIPs, uIP6s, uBadIP6s) {
		p, local, ok := h.db.Active(ip)
		cs := claims[ip]
		if ok != (len(cs) > 0) || (ok && (p != cs[0].p || local != cs[0].local)) || (!ok && (local || p != Peer{})) {
			fail("Active(%s) = %v %v %v, model %v", ip, p, local, ok, cs)
		}
	}
	conflicts := h.db.Conflicts()
	if want := h.m.conflicts(); !reflect.DeepEqual(conflicts, want) {
		fail("Conflicts:\n got  %+v\n want %+v", conflicts, want)
	}
	for _, c := range conflicts {
		if c.IP.Is6() {
			h.seen.conflict6++
		}
	}
	for k := range got.Neigh {
		if k.IP.Is6() {
			h.seen.neigh6++
		}
	}

	// Entry listings.
	l, r := h.db.Len()
	if l != len(h.m.local) || r != len(h.m.remote) {
		fail("Len = %d, %d; model %d, %d", l, r, len(h.m.local), len(h.m.remote))
	}
	for _, p := range h.db.Local() {
		if h.m.local[p.EndpointID] != p {
			fail("Local has %v, model %v", p, h.m.local[p.EndpointID])
		}
	}
	remote := h.db.Remote()
	for i, p := range remote {
		if !h.m.remote[p] {
			fail("Remote has %v, model does not", p)
		}
		if i > 0 && remote[i-1].IP.Compare(p.IP) > 0 {
			fail("Remote not sorted by IP")
		}
		if p.IP.IsValid() && p.IPv6.IsValid() {
			h.seen.dual++
		}
	}
}

var fuzzSeeds = [][]byte{
	{},
	// create, create same IP other id, delete winner
	{0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 1, 1, 0, 2, 0},
	// AddLocal then ApplyAll of 5 events, then RemoveLocal
	{3, 1, 0, 0, 0, 5, 5, 0, 0, 0, 0, 0, 0, 1, 0, 1, 1, 2, 0, 3, 0, 2, 0, 2, 0, 4, 1},
	// updates with mutations, invalid bytes sprinkled in
	{0, 0, 2, 1, 2, 0, 3, 0, 1, 0, 0, 3, 3, 0, 250, 0, 2, 2, 2, 3, 3, 2, 3, 0, 1, 1, 3, 250, 0, 0, 0, 4, 2},
	// local and remote with the same MAC in one subnet
	{3, 0, 0, 0, 0, 0, 0, 1, 1, 0, 1, 6, 2, 4, 0, 7, 1, 0, 0, 0},
	// Event{} and Prev==Next
	{0, 4, 0, 0, 4, 50, 1},
}

func FuzzDB(f *testing.F) {
	for _, s := range fuzzSeeds {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if len(data) > 1024 { // ~250 steps: plenty for this small universe, and fast to minimize
			t.Skip()
		}
		newHarness(t).run(data)
	})
}

// TestModelRandom drives the harness with a deterministic pseudo-random
// operation stream (the fuzz seeds run as FuzzDB's subtests).
func TestModelRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	steps := 0
	var neigh6, dual, conflict6 int
	for run := 0; run < 40; run++ {
		h := newHarness(t)
		data := make([]byte, 1500)
		for i := range data {
			data[i] = byte(rng.Uint32())
		}
		h.run(data)
		steps += h.steps
		neigh6, dual, conflict6 = neigh6+h.seen.neigh6, dual+h.seen.dual, conflict6+h.seen.conflict6
	}
	if steps < 3000 || neigh6 < 1000 || dual < 1000 || conflict6 < 100 {
		t.Fatalf("only %d steps, %d IPv6 neighbours, %d dual-stack entries, %d IPv6 conflicts", steps, neigh6, dual, conflict6)
	}
	t.Logf("%d steps, %d IPv6 neighbours, %d dual-stack entries, %d IPv6 conflicts", steps, neigh6, dual, conflict6)
}
