package peerdb

import (
	"cmp"
	"net/netip"
	"slices"
)

// txn records, for one mutation (one call of SetRemotes, applyEvents, AddLocal or
// RemoveLocal), the desired value of every neighbour and FDB key it touched
// as it was before the first touch, so the net Delta can be computed at the
// end in time proportional to the touched keys. A claim or FDB record is
// noted once per transaction (its mark is the transaction's id).
//
// Claims, FDB records and interned VTEPs that become unused are only freed
// when the transaction ends, so the indexes noted stay valid throughout.
//
// Its slices, and those of the Delta it returns (out), are scratch space
// reused by the next transaction: bulk changes that come one after another
// (a host's records arriving, going, coming back) allocate nothing. A
// transaction that changes nothing (the owner's periodic full pull of a
// network at rest) releases them, so a network at rest keeps no scratch.
// Likewise the room of a table that empties is kept for one transaction
// and released by the next if the table is still empty.
type txn struct {
	id    uint32
	neigh []note
	fdb   []note
	out   Delta
	// has6: a claim of an IPv6 address was noted (its notes need the
	// slower sort, see DB.sortNeigh).
	has6 bool
	// emptied: the last transaction left the table empty (its room is
	// released if the next one does too).
	emptied bool
}

// note records a neighbour or FDB key touched by a transaction and its
// value before the transaction; finish replaces the value with the one to
// report.
type note struct {
	// key orders the Delta: subnet<<33 | IPv4 for a neighbour of an IPv4
	// address, subnet<<33 | 1<<32 | its slot in DB.addr6 for an IPv6
	// address (see neighNoteKey); for an FDB key subnet<<48 | MAC, or just
	// the subnet when subnet indexes do not fit in 16 bits (see
	// DB.fdbNoteKey).
	key  uint64
	idx  int32  // the claim or FDB record
	vtep uint32 // FDB: the value (interned VTEP)
	mac  MAC    // neighbour: the value; FDB: the MAC of the key
	ok   bool   // the value is valid
	set  bool   // set by finish: the key is Set (rather than Del)
}

func (db *DB) begin() {
	t := &db.tx
	t.id++
	if t.id == 0 { // wrapped: forget every mark
		for i := range db.claims {
			db.claims[i].mark = 0
		}
		for i := range db.fdbs {
			db.fdbs[i].mark = 0
		}
		t.id = 1
	}
	t.neigh = t.neigh[:0]
	t.fdb = t.fdb[:0]
	t.has6 = false
}

// ipv6Note tags the note keys of IPv6 neighbours.
const ipv6Note = 1 << 32

func neighNoteKey(c *claim) uint64 {
	k := uint64(c.sub)<<33 | uint64(c.ip)
	if c.v6 {
		k |= ipv6Note
	}
	return k
}

// neighOfNote returns the segment and address of a neighbour note.
func (db *DB) neighOfNote(key uint64) (int, netip.Addr) {
	if key&ipv6Note != 0 {
		return int(key >> 33), db.addr6[uint32(key)]
	}
	return int(key >> 33), addr4(uint32(key))
}

// sortNeigh sorts the neighbour notes by segment, then address. IPv4
// keys sort as numbers (sortNotes); the keys of IPv6 notes sort after
// the IPv4 ones of their segment but hold slots, not addresses, so a
// transaction that noted any is sorted by comparing addresses.
func (db *DB) sortNeigh(s []note) {
	if !db.tx.has6 {
		sortNotes(s)
		return
	}
	slices.SortFunc(s, func(a, b note) int {
		if c := cmp.Compare(a.key>>32, b.key>>32); c != 0 || a.key&ipv6Note == 0 {
			return cmp.Or(c, cmp.Compare(a.key, b.key))
		}
		return db.addr6[uint32(a.key)].Compare(db.addr6[uint32(b.key)])
	})
}

func (db *DB) noteNeigh(ci int32) {
	c := &db.claims[ci]
	if c.mark == db.tx.id {
		return
	}
	c.mark = db.tx.id
	k := c.contrib()
	db.tx.has6 = db.tx.has6 || c.v6
	db.tx.neigh = append(db.tx.neigh, note{key: neighNoteKey(c), idx: ci, mac: k.mac, ok: k.ok})
}

func (db *DB) noteFDB(fi int32, sub int, mac MAC) {
	r := &db.fdbs[fi]
	if r.mark == db.tx.id {
		return
	}
	r.mark = db.tx.id
	db.tx.fdb = append(db.tx.fdb, note{key: db.fdbNoteKey(sub, mac), idx: fi, mac: mac, vtep: r.cur, ok: r.ok})
}

// fdbNoteKey returns the sort key of the note of FDB key (sub, mac): the
// whole order when subnet indexes fit in 16 bits, else only the subnet.
func (db *DB) fdbNoteKey(sub int, mac MAC) uint64 {
	if db.wideSubnets {
		return uint64(sub)
	}
	return uint64(sub)<<48 | macKey(mac)
}

// fdbNoteSubnet returns the subnet of an FDB note.
func (db *DB) fdbNoteSubnet(n *note) int {
	if db.wideSubnets {
		return int(n.key)
	}
	return int(n.key >> 48)
}

// finish ends the transaction and returns its Delta. It compares each noted
// key with its current value, keeping only the changed ones, and frees the
// claims and FDB records left unused (in note order, which is mostly the
// order in which they were allocated); then it sorts what changed and
// builds the Delta.
func (db *DB) finish() Delta {
	t := &db.tx
	// When no entry is left, everything is cleared at once below.
	keep := db.nRemote != 0 || len(db.local) != 0

	var nSet, nDel int
	var moved []Neigh
	out := t.neigh[:0]
	for _, n := range t.neigh {
		c := &db.claims[n.idx]
		k := c.contrib()
		switch {
		case k.ok && (!n.ok || n.mac != k.mac):
			if !n.ok {
				db.nNeigh++
			}
			if n.ok { // valid with another MAC before: Delta.NeighMoved
				sub, ip := db.neighOfNote(n.key)
				moved = append(moved, Neigh{Subnet: sub, IP: ip, MAC: k.mac})
			}
			n.mac, n.set = k.mac, true
			out = append(out, n)
			nSet++
		case !k.ok && n.ok:
			db.nNeigh--
			out = append(out, n)
			nDel++
		}
		if keep && c.empty() {
			if c.v6 {
				delete(db.byIP6, db.addr6[c.ip])
				db.free6 = append(db.free6, c.ip)
			} else {
				db.byIP.del(uint64(c.ip))
			}
			*c = claim{}
			db.freeClaims = append(db.freeClaims, n.idx)
		}
	}
	t.neigh = out

	var fSet, fDel int
	fout := t.fdb[:0]
	for _, f := range t.fdb {
		r := &db.fdbs[f.idx]
		switch {
		case r.ok && (!f.ok || f.vtep != r.cur):
			if !f.ok {
				db.nFDB++
			}
			f.vtep, f.set = r.cur, true
			fout = append(fout, f)
			fSet++
		case !r.ok && f.ok:
			db.nFDB--
			fout = append(fout, f)
			fDel++
		}
		if keep && r.one < 0 && r.local == 0 {
			db.fdbIdx[db.fdbNoteSubnet(&f)].del(macKey(f.mac))
			*r = fdbRec{}
			db.freeFDB = append(db.freeFDB, f.idx)
		}
	}
	t.fdb = fout

	d := Delta{NeighMoved: moved}
	if nSet+nDel > 0 {
		db.sortNeigh(t.neigh)
		if nSet > 0 {
			d.NeighSet = slices.Grow(t.out.NeighSet[:0], nSet)
		}
		if nDel > 0 {
			d.NeighDel = slices.Grow(t.out.NeighDel[:0], nDel)
		}
		for i := range t.neigh {
			n := &t.neigh[i]
			sub, ip := db.neighOfNote(n.key)
			e := Neigh{Subnet: sub, IP: ip, MAC: n.mac}
			if n.set {
				d.NeighSet = append(d.NeighSet, e)
			} else {
				d.NeighDel = append(d.NeighDel, e)
			}
		}
	}
	if fSet+fDel > 0 {
		if db.wideSubnets {
			slices.SortFunc(t.fdb, func(a, b note) int {
				return cmp.Or(cmp.Compare(a.key, b.key), cmp.Compare(macKey(a.mac), macKey(b.mac)))
			})
		} else {
			sortNotes(t.fdb)
		}
		if fSet > 0 {
			d.FDBSet = slices.Grow(t.out.FDBSet[:0], fSet)
		}
		if fDel > 0 {
			d.FDBDel = slices.Grow(t.out.FDBDel[:0], fDel)
		}
		vt := db.vteps.vals
		for i := range t.fdb {
			f := &t.fdb[i]
			e := FDB{Subnet: db.fdbNoteSubnet(f), MAC: f.mac, VTEP: vt[f.vtep]}
			if f.set {
				d.FDBSet = append(d.FDBSet, e)
			} else {
				d.FDBDel = append(d.FDBDel, e)
			}
		}
	}

	if keep {
		db.vteps.sweep()
	} else {
		// Clear everything at once; release the room only if the table
		// was left empty before too.
		db.reset(t.emptied)
	}
	t.emptied = !keep
	if nSet+nDel+fSet+fDel == 0 && len(moved) == 0 {
		t.release()
	} else {
		t.out.NeighSet = used(d.NeighSet, t.out.NeighSet)
		t.out.NeighDel = used(d.NeighDel, t.out.NeighDel)
		t.out.FDBSet = used(d.FDBSet, t.out.FDBSet)
		t.out.FDBDel = used(d.FDBDel, t.out.FDBDel)
	}
	return d
}

// used returns the slice a Delta used, or the one kept before if it used
// none.
func used[T any](s, before []T) []T {
	if s == nil {
		return before
	}
	return s
}

// release drops the scratch space beyond a few thousand entries.
func (t *txn) release() {
	const small = 4096
	if cap(t.neigh) > small {
		t.neigh = nil
	}
	if cap(t.fdb) > small {
		t.fdb = nil
	}
	if cap(t.out.NeighSet)+cap(t.out.NeighDel)+cap(t.out.FDBSet)+cap(t.out.FDBDel) > small {
		t.out = Delta{}
	}
}

// reset empties the indexes and slabs of a DB that holds no entry,
// keeping their room unless release.
func (db *DB) reset(release bool) {
	db.byIP.reset(release)
	clear(db.byIP6)
	clear(db.addr6)
	db.addr6, db.free6 = db.addr6[:0], db.free6[:0]
	for s := range db.fdbIdx {
		db.fdbIdx[s].reset(release)
	}
	clear(db.claims)
	clear(db.fdbs)
	db.claims, db.freeClaims = db.claims[:0], db.freeClaims[:0]
	db.fdbs, db.freeFDB = db.fdbs[:0], db.freeFDB[:0]
	const small = 256
	if release && cap(db.claims) > small {
		db.claims, db.freeClaims = nil, nil
	}
	if release && cap(db.fdbs) > small {
		db.fdbs, db.freeFDB = nil, nil
	}
	db.held.reset(release)
	db.fdbMore = nil
	db.vteps.reset()
	db.nNeigh, db.nFDB = 0, 0
}
