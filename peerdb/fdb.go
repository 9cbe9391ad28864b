package peerdb

import (
	"bytes"
	"cmp"
	"fmt"
	"slices"
	"strings"
)

// refreshClaim brings the FDB proposals up to date after the claimants of
// claim ci changed; old is what the claim contributed before. (The neighbour
// entry of a claim is derived from the claim itself.)
func (db *DB) refreshClaim(ci int32, old contrib) {
	c := &db.claims[ci]
	cur := c.contrib()
	if cur == old {
		return
	}
	sub := int(c.sub)
	if old.ok {
		fi, ok := db.fdbIdx[sub].get(macKey(old.mac))
		if !ok {
			panic(fmt.Sprintf("peerdb: internal error: no FDB record for the proposal of %s", db.addr(c)))
		}
		db.noteFDB(fi, sub, old.mac)
		if cur.ok && cur.mac == old.mac {
			// Same key, another VTEP.
			db.recomputeFDB(fi)
			return
		}
		db.removeProposer(fi, ci)
		db.recomputeFDB(fi)
	}
	if cur.ok {
		fi := db.fdbFor(sub, cur.mac)
		db.noteFDB(fi, sub, cur.mac)
		db.addProposer(fi, ci)
		db.recomputeFDB(fi)
	}
}

// fdbFor returns the FDB record of (sub, mac), creating an empty one if there
// is none.
func (db *DB) fdbFor(sub int, mac MAC) int32 {
	x := &db.fdbIdx[sub]
	k := macKey(mac)
	slot, ok := x.slot(k)
	if ok {
		return x.at(slot)
	}
	var fi int32
	if n := len(db.freeFDB); n > 0 {
		fi = db.freeFDB[n-1]
		db.freeFDB = db.freeFDB[:n-1]
		db.fdbs[fi] = fdbRec{one: -1}
	} else {
		fi = int32(len(db.fdbs))
		db.fdbs = append(db.fdbs, fdbRec{one: -1})
	}
	x.set(slot, k, fi)
	return fi
}

// moreProposers are the proposers of an FDB record beyond its first one:
// second inline, as a dual-stack entry proposes its MAC from both its
// claims (so the common case allocates nothing), the others in rest.
type moreProposers struct {
	second int32
	rest   []int32
}

func (db *DB) addProposer(fi, ci int32) {
	r := &db.fdbs[fi]
	if r.one < 0 {
		r.one = ci
		return
	}
	if db.fdbMore == nil {
		db.fdbMore = make(map[int32]moreProposers)
	}
	if !r.multi {
		db.fdbMore[fi] = moreProposers{second: ci}
		r.multi = true
		return
	}
	m := db.fdbMore[fi]
	m.rest = append(m.rest, ci)
	db.fdbMore[fi] = m
}

func (db *DB) removeProposer(fi, ci int32) {
	r := &db.fdbs[fi]
	if r.one == ci && !r.multi {
		r.one = -1
		return
	}
	m := db.fdbMore[fi]
	switch {
	case r.one == ci:
		r.one, m.second = m.second, -1
	case m.second == ci:
		m.second = -1
	default:
		i := slices.Index(m.rest, ci)
		if i < 0 {
			panic(fmt.Sprintf("peerdb: internal error: no FDB proposal of %s", db.addr(&db.claims[ci])))
		}
		m.rest = swapRemove(m.rest, i)
	}
	if n := len(m.rest); m.second < 0 && n > 0 {
		m.second, m.rest = m.rest[n-1], m.rest[:n-1]
	}
	if m.second < 0 {
		delete(db.fdbMore, fi)
		r.multi = false
	} else {
		db.fdbMore[fi] = m
	}
}

// recomputeFDB recomputes the desired value of FDB record fi: the VTEP of the
// proposer with the smallest IP (IPv4 before IPv6), unless a local entry has
// the MAC.
func (db *DB) recomputeFDB(fi int32) {
	r := &db.fdbs[fi]
	if r.local > 0 || r.one < 0 {
		r.cur, r.ok = 0, false
		return
	}
	best := r.one
	if r.multi {
		m := db.fdbMore[fi]
		if db.compareClaims(m.second, best) < 0 {
			best = m.second
		}
		for _, ci := range m.rest {
			if db.compareClaims(ci, best) < 0 {
				best = ci
			}
		}
	}
	r.cur, r.ok = db.claims[best].vtep, true
}

// compareRemote orders remote claimants of one IP: EndpointID, MAC, VTEP
// (then IP and IPv6, so the order is total even across IPs; of two
// claimants of one address, the one without another address comes first).
func compareRemote(a, b Peer) int {
	if c := strings.Compare(a.EndpointID, b.EndpointID); c != 0 {
		return c
	}
	if c := bytes.Compare(a.MAC[:], b.MAC[:]); c != 0 {
		return c
	}
	if c := a.VTEP.Compare(b.VTEP); c != 0 {
		return c
	}
	return cmp.Or(a.IP.Compare(b.IP), a.IPv6.Compare(b.IPv6))
}
