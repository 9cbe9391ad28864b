package peerdb

import (
	"fmt"
	"slices"
)

// fdbKeys returns the number of FDB records indexed.
func fdbKeys(db *DB) int {
	n := 0
	for i := range db.fdbIdx {
		n += db.fdbIdx[i].len()
	}
	return n
}

// entries returns the contents of x, after checking its structure: the count
// and that every key is found from its home slot.
func entries(x *index) (map[uint64]int32, error) {
	m := map[uint64]int32{}
	for i, s := range x.slots {
		if s.val == 0 {
			continue
		}
		if s.val < 0 {
			return nil, fmt.Errorf("slot %d: value %d", i, s.val-1)
		}
		if _, dup := m[s.key()]; dup {
			return nil, fmt.Errorf("key %#x twice", s.key())
		}
		if j, ok := x.find(s.key()); !ok || j != i {
			return nil, fmt.Errorf("key %#x in slot %d found at %d %v", s.key(), i, j, ok)
		}
		m[s.key()] = s.val - 1
	}
	if len(m) != x.n {
		return nil, fmt.Errorf("%d keys, n = %d", len(m), x.n)
	}
	if len(x.slots) != 0 && (len(x.slots)&(len(x.slots)-1) != 0 || len(x.slots) < minSlots || x.n*4 > len(x.slots)*3) {
		return nil, fmt.Errorf("%d keys in %d slots", x.n, len(x.slots))
	}
	return m, nil
}

// checkInvariants verifies the internal consistency of db's indexes between
// mutations: every index agrees with the entries, cached values with their
// recomputation, and nothing unused is left allocated.
func checkInvariants(db *DB) error {
	// Claims.
	byIP, err := entries(&db.byIP)
	if err != nil {
		return fmt.Errorf("byIP: %v", err)
	}
	if len(byIP)+len(db.byIP6)+len(db.freeClaims) != len(db.claims) {
		return fmt.Errorf("%d IPv4 + %d IPv6 claims indexed + %d free != %d slots", len(byIP), len(db.byIP6), len(db.freeClaims), len(db.claims))
	}
	if len(db.byIP6)+len(db.free6) != len(db.addr6) {
		return fmt.Errorf("%d IPv6 claims + %d free slots != %d addresses", len(db.byIP6), len(db.free6), len(db.addr6))
	}
	used := make([]bool, len(db.claims))
	var all []int32 // the claims in use
	for ip64, ci := range byIP {
		ip := uint32(ip64)
		if uint64(ip) != ip64 {
			return fmt.Errorf("byIP key %#x", ip64)
		}
		if ci < 0 || int(ci) >= len(db.claims) || used[ci] {
			return fmt.Errorf("claim index %d of %s bad or shared", ci, addr4(ip))
		}
		used[ci] = true
		all = append(all, ci)
		c := &db.claims[ci]
		if c.ip != ip || c.v6 {
			return fmt.Errorf("claim %d: ip %s (v6 %v) indexed under %s", ci, db.addr(c), c.v6, addr4(ip))
		}
		if s, ok := db.subnet4(ip); !ok || int(c.sub) != s {
			return fmt.Errorf("claim %s: subnet %d, want %d %v", addr4(ip), c.sub, s, ok)
		}
	}
	slot6 := make([]bool, len(db.addr6))
	for a, ci := range db.byIP6 {
		if ci < 0 || int(ci) >= len(db.claims) || used[ci] {
			return fmt.Errorf("claim index %d of %s bad or shared", ci, a)
		}
		used[ci] = true
		all = append(all, ci)
		c := &db.claims[ci]
		if !c.v6 || int(c.ip) >= len(db.addr6) || db.addr6[c.ip] != a || slot6[c.ip] {
			return fmt.Errorf("claim %d: (v6 %v, slot %d) indexed under %s", ci, c.v6, c.ip, a)
		}
		slot6[c.ip] = true
		if s, ok := db.subnet6(a); !ok || int(c.sub) != s {
			return fmt.Errorf("claim %s: subnet %d, want %d %v", a, c.sub, s, ok)
		}
	}
	for _, i := range db.free6 {
		if slot6[i] {
			return fmt.Errorf("IPv6 slot %d both used and free", i)
		}
		slot6[i] = true
	}
	for _, ci := range all {
		c := &db.claims[ci]
		ip := db.addr(c)
		if c.empty() {
			return fmt.Errorf("claim %s is empty", ip)
		}
		if c.mark > db.tx.id {
			return fmt.Errorf("claim %s: mark %d > txn %d", ip, c.mark, db.tx.id)
		}
		if c.id != "" {
			if err := db.checkOther(ci, c.head()); err != nil {
				return err
			}
		}
		if c.x != nil {
			if len(c.x.remotes) == 0 && len(c.x.locals) == 0 {
				return fmt.Errorf("claim %s: empty extra", ip)
			}
			if c.id == "" && len(c.x.remotes) > 0 {
				return fmt.Errorf("claim %s: remotes without a head", ip)
			}
			h := c.head()
			for i := range c.x.remotes {
				r := &c.x.remotes[i]
				if !db.lessRemote(&h, r) {
					return fmt.Errorf("claim %s: head %+v is not below %+v", ip, h, *r)
				}
				for j := range i {
					if c.x.remotes[j] == *r {
						return fmt.Errorf("claim %s: remote %+v twice", ip, *r)
					}
				}
				if err := db.checkOther(ci, *r); err != nil {
					return err
				}
			}
			for i, l := range c.x.locals {
				mine := l.IP
				if c.v6 {
					mine = l.IPv6
				}
				if mine != ip || db.local[l.EndpointID] != l {
					return fmt.Errorf("claim %s: local %v not in the local table", ip, l)
				}
				if i > 0 && l.EndpointID <= c.x.locals[0].EndpointID {
					return fmt.Errorf("claim %s: locals[0] is not the smallest", ip)
				}
			}
		}
	}
	for _, ci := range db.freeClaims {
		if used[ci] {
			return fmt.Errorf("claim %d both used and free", ci)
		}
		used[ci] = true
		if db.claims[ci] != (claim{}) {
			return fmt.Errorf("free claim %d not cleared", ci)
		}
	}

	// Entry counts and the local table. A dual-stack entry is in two
	// claims: it is counted in the IPv4 one.
	nRemote, nLocal, nNeigh := 0, 0, 0
	vrefs := make([]int32, len(db.vteps.vals))
	for _, ci := range all {
		c := &db.claims[ci]
		if c.id != "" {
			if !c.v6 || !c.hasOther {
				nRemote++
			}
			vrefs[c.vtep]++
		}
		if c.x != nil {
			for _, r := range c.x.remotes {
				if !c.v6 || !r.hasOther {
					nRemote++
				}
				vrefs[r.vtep]++
			}
			for _, l := range c.x.locals {
				if !c.v6 || !l.IP.IsValid() {
					nLocal++
				}
			}
		}
		if c.contrib().ok {
			nNeigh++
		}
	}
	if nRemote != db.nRemote || nLocal != len(db.local) || nNeigh != db.nNeigh {
		return fmt.Errorf("counts: remote %d/%d local %d/%d neigh %d/%d", nRemote, db.nRemote, nLocal, len(db.local), nNeigh, db.nNeigh)
	}

	// FDB records.
	if fdbKeys(db)+len(db.freeFDB) != len(db.fdbs) {
		return fmt.Errorf("%d FDB records indexed + %d free != %d slots", fdbKeys(db), len(db.freeFDB), len(db.fdbs))
	}
	type key struct {
		sub int
		mac uint64
	}
	props := map[key][]int32{}
	for _, ci := range all {
		c := &db.claims[ci]
		if k := c.contrib(); k.ok {
			kk := key{int(c.sub), macKey(k.mac)}
			props[kk] = append(props[kk], ci)
		}
	}
	locals := map[key]int32{}
	for _, l := range db.local {
		ip := l.IP
		if !ip.IsValid() {
			ip = l.IPv6
		}
		s, _ := db.SubnetOf(ip)
		locals[key{s, macKey(l.MAC)}]++
	}
	fused := make([]bool, len(db.fdbs))
	nFDB, nMulti := 0, 0
	for sub := range db.fdbIdx {
		m, err := entries(&db.fdbIdx[sub])
		if err != nil {
			return fmt.Errorf("FDB index %d: %v", sub, err)
		}
		for mk, fi := range m {
			k := key{sub, mk}
			if fi < 0 || int(fi) >= len(db.fdbs) || fused[fi] {
				return fmt.Errorf("FDB record index %d of %v bad or shared", fi, k)
			}
			fused[fi] = true
			r := db.fdbs[fi]
			if r.mark > db.tx.id {
				return fmt.Errorf("FDB %v: mark %d > txn %d", k, r.mark, db.tx.id)
			}
			var got []int32
			if r.one >= 0 {
				got = append(got, r.one)
			}
			if r.multi {
				nMulti++
				more := db.fdbMore[fi]
				if more.second < 0 || r.one < 0 {
					return fmt.Errorf("FDB %v: multi without more proposers", k)
				}
				got = append(append(got, more.second), more.rest...)
			} else if _, ok := db.fdbMore[fi]; ok {
				return fmt.Errorf("FDB %v: stray more proposers", k)
			}
			slices.Sort(got)
			want := slices.Sorted(slices.Values(props[k]))
			if !slices.Equal(got, want) {
				return fmt.Errorf("FDB %v: proposers %v, want %v", k, got, want)
			}
			delete(props, k)
			if r.local != locals[k] {
				return fmt.Errorf("FDB %v: local count %d, want %d", k, r.local, locals[k])
			}
			delete(locals, k)
			if len(got) == 0 && r.local == 0 {
				return fmt.Errorf("FDB %v: unused record", k)
			}
			saved := r
			db.recomputeFDB(fi)
			if db.fdbs[fi] != saved {
				return fmt.Errorf("FDB %v: cached %+v, recomputed %+v", k, saved, db.fdbs[fi])
			}
			if r.ok {
				nFDB++
			}
		}
	}
	if len(props) != 0 || len(locals) != 0 {
		return fmt.Errorf("FDB keys without a record: proposals %v, locals %v", props, locals)
	}
	if nMulti != len(db.fdbMore) {
		return fmt.Errorf("%d multi records, %d in fdbMore", nMulti, len(db.fdbMore))
	}
	if nFDB != db.nFDB {
		return fmt.Errorf("nFDB %d, want %d", db.nFDB, nFDB)
	}
	for _, fi := range db.freeFDB {
		if fused[fi] {
			return fmt.Errorf("FDB record %d both used and free", fi)
		}
		fused[fi] = true
		if db.fdbs[fi] != (fdbRec{}) {
			return fmt.Errorf("free FDB record %d not cleared", fi)
		}
	}

	// Held records: each found by its key, each holding a reference to its
	// VTEP and its origin, the free ones cleared.
	h := &db.held
	nHeld, origins := 0, make([]int32, len(h.origins.vals))
	hashes := map[uint64]bool{}
	for i := range h.recs {
		r := &h.recs[i]
		if r.id == "" {
			continue
		}
		nHeld++
		k := h.key(r)
		ri, hash, ok := h.find(k)
		if !ok || ri != int32(i) {
			return fmt.Errorf("held record %d (%v): found at %d", i, k, ri)
		}
		hashes[hash] = true
		vrefs[r.vtep]++
		if r.has6 && (r.ip6 < 0 || int(r.ip6) >= len(db.claims) || !used[r.ip6] || !db.claims[r.ip6].v6) {
			return fmt.Errorf("held record %d (%v): IPv6 claim %d not an IPv6 claim in use", i, k, r.ip6)
		}
		if p := db.heldPeer(r); db.findRemote(db.claimOf(p), &p) == notFound {
			return fmt.Errorf("held record %d (%v): %v is not a remote entry", i, k, p)
		}
		origins[r.origin]++
	}
	if nHeld != h.n || nHeld+len(h.free) != len(h.recs) || len(hashes) != h.idx.len() {
		return fmt.Errorf("held: %d records, n %d, %d free of %d slots, %d hashes, %d indexed", nHeld, h.n, len(h.free), len(h.recs), len(hashes), h.idx.len())
	}
	for _, ri := range h.free {
		if h.recs[ri] != (heldRec{}) {
			return fmt.Errorf("free held record %d not cleared", ri)
		}
	}
	for i, name := range h.origins.vals {
		if h.origins.refs[i] != origins[i] {
			return fmt.Errorf("origin %d %q: %d refs, counted %d", i, name, h.origins.refs[i], origins[i])
		}
		if j, ok := h.origins.idx[name]; origins[i] > 0 && (!ok || j != uint32(i)) {
			return fmt.Errorf("origin %d %q: indexed at %d (%v)", i, name, j, ok)
		}
	}
	if len(h.origins.idx)+len(h.origins.free) != len(h.origins.vals) {
		return fmt.Errorf("origins: %d indexed, %d free of %d", len(h.origins.idx), len(h.origins.free), len(h.origins.vals))
	}

	// Interned VTEPs.
	t := &db.vteps
	if len(t.zero) != 0 {
		return fmt.Errorf("VTEPs pending release: %v", t.zero)
	}
	if len(t.refs) != len(t.vals) || len(t.idx)+len(t.free) != len(t.vals) {
		return fmt.Errorf("VTEP table sizes: %d refs, %d addrs, %d indexed, %d free", len(t.refs), len(t.vals), len(t.idx), len(t.free))
	}
	for a, i := range t.idx {
		if t.vals[i] != a || !a.IsValid() {
			return fmt.Errorf("VTEP %s indexed at %d holding %s", a, i, t.vals[i])
		}
		if t.refs[i] != vrefs[i] || vrefs[i] == 0 {
			return fmt.Errorf("VTEP %s: %d refs, counted %d", a, t.refs[i], vrefs[i])
		}
	}
	for _, i := range t.free {
		if t.vals[i].IsValid() || t.refs[i] != 0 {
			return fmt.Errorf("free VTEP slot %d holds %s (%d refs)", i, t.vals[i], t.refs[i])
		}
	}
	for i, c := range t.cache {
		if c.addr.IsValid() && (vtepSlot(c.addr) != i || int(c.idx) >= len(t.vals) || t.vals[c.idx] != c.addr) {
			return fmt.Errorf("VTEP cache slot %d: %s -> %d is stale", i, c.addr, c.idx)
		}
	}
	return nil
}

// claimOf returns the claim of p's first address (IPv4 if it has one).
func (db *DB) claimOf(p Peer) *claim {
	var ci int32
	var ok bool
	if p.IP.IsValid() {
		ci, ok = db.byIP.get(uint64(ip4(p.IP)))
	} else {
		ci, ok = db.byIP6[p.IPv6]
	}
	if !ok {
		return &claim{}
	}
	return &db.claims[ci]
}

// checkOther checks that remote claimant r of claim ci and its twin in the
// claim of its other address name each other.
func (db *DB) checkOther(ci int32, r remote) error {
	if !r.hasOther {
		return nil
	}
	c := &db.claims[ci]
	if r.other < 0 || int(r.other) >= len(db.claims) {
		return fmt.Errorf("claim %s: claimant %s names claim %d", db.addr(c), r.id, r.other)
	}
	o := &db.claims[r.other]
	if o.v6 == c.v6 || o.sub != c.sub {
		return fmt.Errorf("claim %s: claimant %s names claim %s of the same family or another segment", db.addr(c), r.id, db.addr(o))
	}
	twin := remote{id: r.id, mac: r.mac, vtep: r.vtep, hasOther: true, other: ci}
	if o.id != "" && o.head() == twin {
		return nil
	}
	if o.x != nil && slices.Contains(o.x.remotes, twin) {
		return nil
	}
	return fmt.Errorf("claim %s: claimant %s has no twin in claim %s", db.addr(c), r.id, db.addr(o))
}
