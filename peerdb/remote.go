package peerdb

import (
	"iter"
	"net/netip"
	"slices"
)

// reserve makes room for a batch of n changes whose new records nexts
// yields. Every change touches about one neighbour and one FDB key; a batch
// that is large against the DB (a bulk load) also sizes the indexes for its
// creates, saving their incremental growth.
func (db *DB) reserve(n int, nexts iter.Seq[*Peer]) {
	if !db.reserveNotes(n) {
		return
	}
	perSubnet := make([]int, len(db.segs))
	total, n4, n6 := 0, 0, 0
	for p := range nexts {
		if p.IP.Is4() {
			if s, ok := db.subnet4(ip4(p.IP)); ok {
				perSubnet[s]++
				total++
				n4++
				if p.IPv6.IsValid() {
					n6++
				}
			}
		} else if s, ok := db.SubnetOf(p.IPv6); ok {
			perSubnet[s]++
			total++
			n6++
		}
	}
	db.reserveEntries(total, n4, n6)
	for sub, n := range perSubnet {
		db.reserveFDB(sub, n)
	}
}

// reserveVNI is reserve for a batch of n changes to the records of vni,
// which all lie in the subnet of vni when the DB knows its VNIs.
func (db *DB) reserveVNI(vni uint32, n int) {
	if !db.reserveNotes(n) {
		return
	}
	sub := slices.Index(db.vnis, vni)
	n4, n6 := n, 0
	if sub >= 0 && !db.segHas4(sub) { // an IPv6-only segment
		n4, n6 = 0, n
	}
	db.reserveEntries(n, n4, n6)
	if sub >= 0 {
		db.reserveFDB(sub, n)
	}
}

// segHas4 reports whether segment sub has an IPv4 prefix.
func (db *DB) segHas4(sub int) bool {
	for _, n := range db.nets {
		if n.seg == sub {
			return true
		}
	}
	return false
}

// reserveNotes makes room for the notes of n changes and reports whether
// the batch is a bulk load: large, and large against what the DB holds
// (a periodic resync of what it holds must not double its indexes).
func (db *DB) reserveNotes(n int) bool {
	db.tx.neigh = slices.Grow(db.tx.neigh, n)
	db.tx.fdb = slices.Grow(db.tx.fdb, n)
	return n >= 64 && db.byIP.len()+len(db.byIP6) < n/2
}

// reserveEntries sizes the claims, the remote records and their indexes
// for total new entries, n4 with an IPv4 address and n6 with an IPv6 one.
func (db *DB) reserveEntries(total, n4, n6 int) {
	if total == 0 {
		return
	}
	if n4 > 0 {
		db.byIP.reserve(db.byIP.len() + n4)
	}
	if n6 > 0 && len(db.byIP6) == 0 { // a Go map cannot grow ahead: only a new one is sized
		db.byIP6 = make(map[netip.Addr]int32, n6)
		db.addr6 = slices.Grow(db.addr6, n6)
	}
	db.claims = slices.Grow(db.claims, n4+n6)
	db.fdbs = slices.Grow(db.fdbs, total)
	db.held.reserve(db.held.n + total)
}

// reserveFDB sizes the FDB index of subnet sub for n new keys.
func (db *DB) reserveFDB(sub, n int) {
	if n > 0 {
		db.fdbIdx[sub].reserve(db.fdbIdx[sub].len() + n)
	}
}

// addRemote inserts p as a remote claimant of its addresses; it returns
// false if p is there already (set semantics).
func (db *DB) addRemote(p *Peer, sub int) bool {
	c4, c6 := int32(-1), int32(-1)
	if p.IP.IsValid() {
		ip := ip4(p.IP)
		slot, ok := db.byIP.slot(uint64(ip))
		if ok {
			c4 = db.byIP.at(slot)
			if db.findRemote(&db.claims[c4], p) != notFound {
				return false
			}
		} else {
			c4 = db.newClaim(ip, sub)
			db.byIP.set(slot, uint64(ip), c4)
		}
	}
	if p.IPv6.IsValid() {
		c6 = db.claimFor6(p.IPv6, sub)
		// A record in a claim is in all its claims: the IPv4 one
		// answered already if there is one.
		if c4 < 0 && db.findRemote(&db.claims[c6], p) != notFound {
			return false
		}
	}
	db.nRemote++
	vtep := db.vteps.ref(p.VTEP)
	if c4 >= 0 {
		db.addClaimant(c4, remote{id: p.EndpointID, mac: p.MAC, vtep: vtep, hasOther: c6 >= 0, other: c6})
	}
	if c6 >= 0 {
		if c4 >= 0 {
			db.vteps.refs[vtep]++ // each claim holds a reference
		}
		db.addClaimant(c6, remote{id: p.EndpointID, mac: p.MAC, vtep: vtep, hasOther: c4 >= 0, other: c4})
	}
	return true
}

// addClaimant adds remote claimant r to claim ci.
func (db *DB) addClaimant(ci int32, r remote) {
	db.noteNeigh(ci)
	c := &db.claims[ci]
	old := c.contrib()
	switch {
	case c.id == "":
		c.setHead(r)
	default:
		if c.x == nil {
			c.x = new(claimExtra)
		}
		if h := c.head(); db.lessRemote(&r, &h) {
			c.x.remotes = append(c.x.remotes, h)
			c.setHead(r)
		} else {
			c.x.remotes = append(c.x.remotes, r)
		}
	}
	db.refreshClaim(ci, old)
}

func (db *DB) removeRemote(p *Peer) {
	found := false
	if p.IP.IsValid() {
		if ci, ok := db.byIP.get(uint64(ip4(p.IP))); ok {
			found = db.removeClaimant(ci, p)
		}
	}
	if p.IPv6.IsValid() {
		if ci, ok := db.byIP6[p.IPv6]; ok {
			found = db.removeClaimant(ci, p) || found
		}
	}
	if found {
		db.nRemote--
	}
}

// removeClaimant removes remote p from claim ci, if it is there.
func (db *DB) removeClaimant(ci int32, p *Peer) bool {
	c := &db.claims[ci]
	pos := db.findRemote(c, p)
	if pos == notFound {
		return false
	}
	db.noteNeigh(ci)
	old := c.contrib()
	var gone uint32
	if pos == headPos {
		gone = c.vtep
		if c.x == nil || len(c.x.remotes) == 0 {
			c.setHead(remote{})
		} else {
			// Promote the smallest of the others.
			rs := c.x.remotes
			best := 0
			for i := 1; i < len(rs); i++ {
				if db.lessRemote(&rs[i], &rs[best]) {
					best = i
				}
			}
			c.setHead(rs[best])
			c.x.remotes = swapRemove(rs, best)
		}
	} else {
		gone = c.x.remotes[pos].vtep
		c.x.remotes = swapRemove(c.x.remotes, pos)
	}
	c.tidy()
	db.vteps.unref(gone)
	db.refreshClaim(ci, old)
	return true
}
