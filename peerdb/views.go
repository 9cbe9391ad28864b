package peerdb

import (
	"bytes"
	"cmp"
	"net/netip"
	"slices"
	"strings"
)

// Sort sorts the slices of d: neighbours by Subnet then IP, FDB entries by
// Subnet then MAC bytes. Deltas returned by a DB are already sorted.
func (d *Delta) Sort() {
	slices.SortFunc(d.NeighSet, compareNeigh)
	slices.SortFunc(d.NeighDel, compareNeigh)
	slices.SortFunc(d.FDBSet, compareFDB)
	slices.SortFunc(d.FDBDel, compareFDB)
}

func compareNeigh(a, b Neigh) int {
	return cmp.Or(cmp.Compare(a.Subnet, b.Subnet), a.IP.Compare(b.IP))
}

func compareFDB(a, b FDB) int {
	return cmp.Or(cmp.Compare(a.Subnet, b.Subnet), bytes.Compare(a.MAC[:], b.MAC[:]))
}

// Desired returns the complete desired kernel state, in fresh maps the caller
// owns (never nil).
func (db *DB) Desired() State {
	s := State{
		Neigh: make(map[NeighKey]MAC, db.nNeigh),
		FDB:   make(map[FDBKey]netip.Addr, db.nFDB),
	}
	for i := range db.claims {
		c := &db.claims[i]
		if k := c.contrib(); k.ok {
			s.Neigh[NeighKey{Subnet: int(c.sub), IP: db.addr(c)}] = k.mac
		}
	}
	db.eachDesiredFDB(func(sub int, mac uint64, r *fdbRec) {
		s.FDB[FDBKey{Subnet: sub, MAC: macOfKey(mac)}] = db.vteps.vals[r.cur]
	})
	return s
}

// eachDesiredFDB calls f for each FDB record with a desired entry: its
// segment, MAC key and record.
func (db *DB) eachDesiredFDB(f func(sub int, mac uint64, r *fdbRec)) {
	for sub := range db.fdbIdx {
		x := &db.fdbIdx[sub]
		if x.len() == 0 {
			continue
		}
		for _, slot := range x.slots {
			if slot.val == 0 {
				continue
			}
			if r := &db.fdbs[slot.val-1]; r.ok {
				f(sub, slot.key(), r)
			}
		}
	}
}

// peer returns the whole record of remote claimant r of claim c.
func (db *DB) peer(c *claim, r remote) Peer {
	p := Peer{EndpointID: r.id, MAC: r.mac, VTEP: db.vteps.vals[r.vtep]}
	var other netip.Addr
	if r.hasOther {
		other = db.addr(&db.claims[r.other])
	}
	if c.v6 {
		p.IP, p.IPv6 = other, db.addr6[c.ip]
	} else {
		p.IP, p.IPv6 = addr4(c.ip), other
	}
	return p
}

// Remote returns all remote entries, sorted by IP (IPv6-only entries,
// which have none, first), then EndpointID, MAC, VTEP and IPv6.
func (db *DB) Remote() []Peer {
	out := make([]Peer, 0, db.nRemote)
	for i := range db.claims {
		c := &db.claims[i]
		// A dual-stack entry is listed from the claim of its IPv4 address.
		if c.id != "" && !(c.v6 && c.hasOther) {
			out = append(out, db.peer(c, c.head()))
		}
		if c.x != nil {
			for _, r := range c.x.remotes {
				if !(c.v6 && r.hasOther) {
					out = append(out, db.peer(c, r))
				}
			}
		}
	}
	slices.SortFunc(out, func(a, b Peer) int {
		return cmp.Or(a.IP.Compare(b.IP), compareRemote(a, b))
	})
	return out
}

// Local returns the local entries, sorted by IP (IPv6-only entries first),
// then EndpointID.
func (db *DB) Local() []Peer {
	out := make([]Peer, 0, len(db.local))
	for _, p := range db.local {
		out = append(out, p)
	}
	slices.SortFunc(out, func(a, b Peer) int {
		return cmp.Or(a.IP.Compare(b.IP), strings.Compare(a.EndpointID, b.EndpointID))
	})
	return out
}

// Active returns the winning claimant of ip (IPv4 or IPv6) and whether it
// is a local entry; ok is false if no entry claims ip.
func (db *DB) Active(ip netip.Addr) (p Peer, local bool, ok bool) {
	var ci int32
	switch {
	case ip.Is4():
		ci, ok = db.byIP.get(uint64(ip4(ip)))
	case ip.Is6():
		ci, ok = db.byIP6[ip]
	}
	if !ok {
		return Peer{}, false, false
	}
	c := &db.claims[ci]
	switch {
	case c.hasLocal():
		return c.x.locals[0], true, true
	case c.id != "":
		return db.peer(c, c.head()), false, true
	}
	return Peer{}, false, false
}

// Conflicts returns the IPs (IPv4 and IPv6) claimed by more than one entry,
// sorted by IP, each with its winner and the shadowed claimants in
// precedence order.
func (db *DB) Conflicts() []Conflict {
	var out []Conflict
	for i := range db.claims {
		c := &db.claims[i]
		if c.claimants() < 2 {
			continue
		}
		all := slices.SortedFunc(slices.Values(c.x.locals), func(a, b Peer) int {
			return strings.Compare(a.EndpointID, b.EndpointID)
		})
		nLocal := len(all)
		if c.id != "" {
			all = append(all, db.peer(c, c.head()))
			for _, r := range c.x.remotes {
				all = append(all, db.peer(c, r))
			}
			slices.SortFunc(all[nLocal:], compareRemote)
		}
		out = append(out, Conflict{
			IP:          db.addr(c),
			Active:      all[0],
			ActiveLocal: nLocal > 0,
			Shadowed:    all[1:],
		})
	}
	slices.SortFunc(out, func(a, b Conflict) int { return a.IP.Compare(b.IP) })
	return out
}

// Len returns the number of local and remote entries.
func (db *DB) Len() (local, remote int) {
	return len(db.local), db.nRemote
}

// VTEPs appends to dst the distinct VTEPs of the desired FDB entries (the
// remote hosts the network sends to), in ascending order, and returns it.
// It is what Desired().FDB's values would give, without building the
// state: a pass over the FDB index and a mark per interned VTEP (few), so
// an encrypted network's change does not cost two maps of every peer.
func (db *DB) VTEPs(dst []netip.Addr) []netip.Addr {
	if db.nFDB == 0 {
		return dst
	}
	seen := make([]bool, len(db.vteps.vals))
	start := len(dst)
	db.eachDesiredFDB(func(_ int, _ uint64, r *fdbRec) {
		if !seen[r.cur] {
			seen[r.cur] = true
			dst = append(dst, db.vteps.vals[r.cur])
		}
	})
	slices.SortFunc(dst[start:], func(a, b netip.Addr) int { return a.Compare(b) })
	return dst
}
