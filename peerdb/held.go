package peerdb

import "hash/maphash"

// heldTable is the table's record of what it holds for each source key: a
// slab of compact records found through an index by a hash of their key.
//
// It replaces a map[Key]Peer, whose entries (two strings in the key, a
// whole Peer as the value: 112 bytes) cost a hash of both strings on every
// lookup and insert and were most of the Go heap a peer takes. Here a
// record is 48 bytes: the origin is interned (a network's records come
// from few hosts), the IPv4 address is held as a number, the IPv6 address
// as its claim (which lives as long as the record: a held record is in the
// claims of its addresses) and the VTEP is interned in the DB's vtepTable;
// only the endpoint id is hashed.
//
// The index maps the 64-bit hash of a key to its record; keys whose hashes
// are equal (possible, if improbable) are chained through next, so a
// lookup always compares the whole key.
type heldTable struct {
	seed    maphash.Seed // random per table: ids cannot be chosen to collide
	seeded  bool
	idx     index
	recs    []heldRec
	free    []int32
	n       int
	origins nameTable
}

type heldRec struct {
	id     string // the key's EndpointID, which is also the record's
	vni    uint32
	origin uint32 // in heldTable.origins
	next   int32  // the next record whose key has the same hash, or -1
	ip     uint32 // IPv4, when has4
	vtep   uint32 // interned in DB.vteps (a reference of its own)
	ip6    int32  // the claim of the IPv6 address, when has6
	mac    MAC
	has4   bool
	has6   bool
}

const noRec = -1

// heldHashMask narrows the hashes of keys: tests set it to make them
// collide.
var heldHashMask = ^uint64(0)

func (t *heldTable) hash(vni, origin uint32, id string) uint64 {
	if !t.seeded {
		t.seed, t.seeded = maphash.MakeSeed(), true
	}
	h := maphash.String(t.seed, id) ^ (uint64(origin)<<32|uint64(vni))*0x9e3779b97f4a7c15
	return h & heldHashMask
}

// find returns the record of k, or noRec. h is the hash of k when the
// origin of k is known (ok); it is what insert needs.
func (t *heldTable) find(k Key) (ri int32, h uint64, ok bool) {
	o, ok := t.origins.lookup(k.Origin)
	if !ok {
		return noRec, 0, false
	}
	h = t.hash(k.VNI, o, k.EndpointID)
	ri, found := t.idx.get(h)
	if !found {
		return noRec, h, true
	}
	for ; ri != noRec; ri = t.recs[ri].next {
		r := &t.recs[ri]
		if r.vni == k.VNI && r.origin == o && r.id == k.EndpointID {
			return ri, h, true
		}
	}
	return noRec, h, true
}

// insert adds the record of k, which the table does not hold, and returns
// it for the caller to fill in (ip, vtep, mac). h is the hash of k if
// known (find found its origin), else hashed is false.
func (t *heldTable) insert(k Key, h uint64, hashed bool) *heldRec {
	o := t.origins.ref(k.Origin)
	if !hashed {
		h = t.hash(k.VNI, o, k.EndpointID)
	}
	var ri int32
	if n := len(t.free); n > 0 {
		ri = t.free[n-1]
		t.free = t.free[:n-1]
	} else {
		ri = int32(len(t.recs))
		t.recs = append(t.recs, heldRec{})
	}
	r := &t.recs[ri]
	*r = heldRec{id: k.EndpointID, vni: k.VNI, origin: o, next: noRec}
	slot, found := t.idx.slot(h)
	if found {
		r.next = t.idx.at(slot)
		t.idx.put(slot, ri)
	} else {
		t.idx.set(slot, h, ri)
	}
	t.n++
	return r
}

// remove drops record ri, whose key has hash h.
func (t *heldTable) remove(ri int32, h uint64) {
	head, _ := t.idx.get(h)
	next := t.recs[ri].next
	if head == ri {
		if next == noRec {
			t.idx.del(h)
		} else {
			slot, _ := t.idx.find(h)
			t.idx.put(slot, next)
		}
	} else {
		for p := head; p != noRec; p = t.recs[p].next {
			if t.recs[p].next == ri {
				t.recs[p].next = next
				break
			}
		}
	}
	t.origins.unref(t.recs[ri].origin)
	t.recs[ri] = heldRec{}
	t.free = append(t.free, ri)
	t.n--
}

// reserve makes room for n records in all.
func (t *heldTable) reserve(n int) {
	t.idx.reserve(n)
	if cap(t.recs) < n {
		recs := make([]heldRec, len(t.recs), n)
		copy(recs, t.recs)
		t.recs = recs
	}
}

// reset empties the table (which holds no record: DB.reset), keeping its
// room unless release.
func (t *heldTable) reset(release bool) {
	t.idx.reset(release)
	clear(t.recs)
	t.recs, t.free = t.recs[:0], t.free[:0]
	if release && cap(t.recs) > 1024 {
		t.recs, t.free = nil, nil
	}
	t.n = 0
}

// key returns the key of record r.
func (t *heldTable) key(r *heldRec) Key {
	return Key{VNI: r.vni, Origin: t.origins.vals[r.origin], EndpointID: r.id}
}

// heldPeer returns the record r holds.
func (db *DB) heldPeer(r *heldRec) Peer {
	p := Peer{EndpointID: r.id, MAC: r.mac, VTEP: db.vteps.vals[r.vtep]}
	if r.has4 {
		p.IP = addr4(r.ip)
	}
	if r.has6 {
		p.IPv6 = db.addr(&db.claims[r.ip6])
	}
	return p
}

// heldIs reports whether r holds p (a valid record: IP is IPv4 or absent).
func (db *DB) heldIs(r *heldRec, p *Peer) bool {
	if r.has4 != p.IP.IsValid() || r.has4 && r.ip != ip4(p.IP) {
		return false
	}
	if r.has6 != p.IPv6.IsValid() || r.has6 && db.addr(&db.claims[r.ip6]) != p.IPv6 {
		return false
	}
	return r.mac == p.MAC && r.id == p.EndpointID && db.vteps.vals[r.vtep] == p.VTEP
}

// nameTable interns strings (the origins of records), counting their
// users; a name is released with its last user.
type nameTable struct {
	interned[string]
	// last is the most recently used name and its index: the records of a
	// batch mostly come from one host.
	last    string
	lastIdx uint32
	lastOK  bool
}

func (t *nameTable) lookup(s string) (uint32, bool) {
	if t.lastOK && s == t.last {
		return t.lastIdx, true
	}
	i, ok := t.interned.lookup(s)
	if ok {
		t.last, t.lastIdx, t.lastOK = s, i, true
	}
	return i, ok
}

func (t *nameTable) ref(s string) uint32 {
	i, ok := t.lookup(s)
	if !ok {
		i = t.intern(s)
		t.last, t.lastIdx, t.lastOK = s, i, true
	}
	t.refs[i]++
	return i
}

func (t *nameTable) unref(i uint32) {
	if t.refs[i]--; t.refs[i] > 0 {
		return
	}
	if t.lastOK && t.lastIdx == i {
		t.last, t.lastOK = "", false
	}
	t.release(i)
}
