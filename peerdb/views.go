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
			s.Neigh[NeighKey{Subnet: int(c.sub), IP: addr4(c.ip)}] = k.mac
		}
	}
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
				s.FDB[FDBKey{Subnet: sub, MAC: macOfKey(slot.key())}] = db.vteps.vals[r.cur]
			}
		}
	}
	return s
}

func (db *DB) peer(ip uint32, r remote) Peer {
	return Peer{EndpointID: r.id, IP: addr4(ip), MAC: r.mac, VTEP: db.vteps.vals[r.vtep]}
}

// Remote returns all remote entries, sorted by IP, then EndpointID, MAC and
// VTEP.
func (db *DB) Remote() []Peer {
	out := make([]Peer, 0, db.nRemote)
	for i := range db.claims {
		c := &db.claims[i]
		if c.id != "" {
			out = append(out, db.peer(c.ip, c.head()))
		}
		if c.x != nil {
			for _, r := range c.x.remotes {
				out = append(out, db.peer(c.ip, r))
			}
		}
	}
	slices.SortFunc(out, func(a, b Peer) int {
		return cmp.Or(a.IP.Compare(b.IP), compareRemote(a, b))
	})
	return out
}

// Local returns the local entries, sorted by IP then EndpointID.
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

// Active returns the winning claimant of ip and whether it is a local entry;
// ok is false if no entry claims ip.
func (db *DB) Active(ip netip.Addr) (p Peer, local bool, ok bool) {
	if !ip.Is4() {
		return Peer{}, false, false
	}
	ci, ok := db.byIP.get(uint64(ip4(ip)))
	if !ok {
		return Peer{}, false, false
	}
	c := &db.claims[ci]
	switch {
	case c.hasLocal():
		return c.x.locals[0], true, true
	case c.id != "":
		return db.peer(c.ip, c.head()), false, true
	}
	return Peer{}, false, false
}

// Conflicts returns the IPs claimed by more than one entry, sorted by IP, each
// with its winner and the shadowed claimants in precedence order.
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
			all = append(all, db.peer(c.ip, c.head()))
			for _, r := range c.x.remotes {
				all = append(all, db.peer(c.ip, r))
			}
			slices.SortFunc(all[nLocal:], compareRemote)
		}
		out = append(out, Conflict{
			IP:          addr4(c.ip),
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
