package peerdb

import (
	"fmt"
	"slices"
)

// AddLocal records a local endpoint (one joined on this host), replacing the
// local entry with the same EndpointID if there is one. It is validated as in
// Validate, except that VTEP is not checked (it may be zero). A local entry
// produces no kernel state of its own but shadows remote claimants of its IP
// and suppresses the FDB entry of its MAC in its subnet.
func (db *DB) AddLocal(p Peer) (Delta, error) {
	sub, err := db.validate(&p, false)
	if err != nil {
		return Delta{}, err
	}
	old, exists := db.local[p.EndpointID]
	if exists && old == p {
		return Delta{}, nil
	}
	db.begin()
	if exists {
		db.removeLocal(old)
	}
	db.addLocal(p, sub)
	return db.finish(), nil
}

// RemoveLocal removes the local entry of endpointID; ok is false (and d
// empty) if there was none.
func (db *DB) RemoveLocal(endpointID string) (d Delta, ok bool) {
	p, ok := db.local[endpointID]
	if !ok {
		return Delta{}, false
	}
	db.begin()
	db.removeLocal(p)
	return db.finish(), true
}

func (db *DB) addLocal(p Peer, sub int) {
	db.local[p.EndpointID] = p
	if p.IP.IsValid() {
		db.addLocalClaim(db.claimFor(ip4(p.IP), sub), p)
	}
	if p.IPv6.IsValid() {
		db.addLocalClaim(db.claimFor6(p.IPv6, sub), p)
	}

	fi := db.fdbFor(sub, p.MAC)
	db.noteFDB(fi, sub, p.MAC)
	db.fdbs[fi].local++
	db.recomputeFDB(fi)
}

// addLocalClaim adds local entry p to claim ci, one of its addresses'.
func (db *DB) addLocalClaim(ci int32, p Peer) {
	db.noteNeigh(ci)
	c := &db.claims[ci]
	old := c.contrib()
	if c.x == nil {
		c.x = new(claimExtra)
	}
	ls := append(c.x.locals, p)
	if last := len(ls) - 1; last > 0 && p.EndpointID < ls[0].EndpointID {
		ls[0], ls[last] = ls[last], ls[0]
	}
	c.x.locals = ls
	db.refreshClaim(ci, old)
}

func (db *DB) removeLocal(p Peer) {
	delete(db.local, p.EndpointID)
	sub := -1
	if p.IP.IsValid() {
		ci, ok := db.byIP.get(uint64(ip4(p.IP)))
		if !ok {
			panic(fmt.Sprintf("peerdb: internal error: local %v has no claim", p))
		}
		sub = db.removeLocalClaim(ci, p)
	}
	if p.IPv6.IsValid() {
		ci, ok := db.byIP6[p.IPv6]
		if !ok {
			panic(fmt.Sprintf("peerdb: internal error: local %v has no IPv6 claim", p))
		}
		sub = db.removeLocalClaim(ci, p)
	}

	fi, ok := db.fdbIdx[sub].get(macKey(p.MAC))
	if !ok {
		panic(fmt.Sprintf("peerdb: internal error: local %v has no FDB record", p))
	}
	db.noteFDB(fi, sub, p.MAC)
	db.fdbs[fi].local--
	db.recomputeFDB(fi)
}

// removeLocalClaim removes local entry p from claim ci, one of its
// addresses', and returns the claim's segment.
func (db *DB) removeLocalClaim(ci int32, p Peer) int {
	db.noteNeigh(ci)
	c := &db.claims[ci]
	old := c.contrib()
	ls := c.x.locals
	i := slices.IndexFunc(ls, func(q Peer) bool { return q.EndpointID == p.EndpointID })
	if i < 0 {
		panic(fmt.Sprintf("peerdb: internal error: %v missing from its claim", p))
	}
	ls = swapRemove(ls, i)
	if i == 0 && len(ls) > 1 {
		best := 0
		for j := 1; j < len(ls); j++ {
			if ls[j].EndpointID < ls[best].EndpointID {
				best = j
			}
		}
		ls[0], ls[best] = ls[best], ls[0]
	}
	c.x.locals = ls
	c.tidy()
	db.refreshClaim(ci, old)
	return int(c.sub)
}
