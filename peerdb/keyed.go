package peerdb

import (
	"cmp"
	"fmt"
	"slices"
	"strings"

	"github.com/overlayd/overlayd/countmap"
)

// Update says which record the source (the control plane, which owns the
// records) has in force for Key: Peer, or none when Peer is nil.
type Update struct {
	Key  Key
	Peer *Peer
}

// Rejection is a record the source has in force that the table does not
// hold, and why. It stays at the source: the table takes it as soon as an
// update makes it valid (or the network changes), and it is reported until
// then.
type Rejection struct {
	Key  Key
	Peer Peer
	Err  error
}

// keyed is the table's record of what it holds for each source key. Several
// keys may carry equal records (two origins advertising the same VTEP): the
// entry below stays while any key holds it, so dups counts, per record
// value, the keys beyond the first that hold it (empty but for that rare
// case, so the common path pays no hashing of whole records).
type keyed struct {
	held     heldTable
	dups     countmap.Map[Peer]
	rejected map[Key]Rejection
	// vnis[i] is the VNI of subnet i, whose records must lie in it; nil
	// when the DB was made without VNIs (then any subnet of the network
	// will do). A network has a handful: a scan beats a map.
	vnis []uint32
}

// SetRemotes makes the table hold, for each update's key, the record the
// source has in force for it, or nothing. The previous record of a key is
// replaced (an update carries no previous value: the table knows what it
// holds), so replayed, reordered or coalesced notifications converge. A
// record that is invalid or lies outside the subnet of its VNI is not held
// (the key's previous record goes too: it is no longer in force) and is
// returned as a Rejection; it is also listed by Rejected until a later
// update of its key. The Delta is the net change of desired state, as for
// every mutation. Cost: proportional to the updates.
func (db *DB) SetRemotes(ups []Update) (Delta, []Rejection) {
	db.begin()
	if len(ups) > 1 {
		db.reserve(len(ups), func(yield func(*Peer) bool) {
			for i := range ups {
				if p := ups[i].Peer; p != nil && !yield(p) {
					return
				}
			}
		})
	}
	var rej []Rejection
	for i := range ups {
		if r, ok := db.setRemote(ups[i].Key, ups[i].Peer); !ok {
			rej = append(rej, r)
		}
	}
	return db.finish(), rej
}

// Pull is SetRemotes for the keys of vni among keys, each set to what
// get(i) returns for keys[i] (the record in force at the source, or ok
// false for none); keys of other VNIs are left as they are and get is not
// called for them. get is called in order of i, so a caller may look
// records up ahead in batches. It is the pull path's form: the records go
// from the source into the table without being gathered first. get must
// not call into the DB.
func (db *DB) Pull(vni uint32, keys []Key, get func(i int) (p Peer, ok bool)) (Delta, []Rejection) {
	db.begin()
	if len(keys) > 1 {
		db.reserveVNI(vni, len(keys))
	}
	var rej []Rejection
	var p Peer
	for i, k := range keys {
		if k.VNI != vni {
			continue
		}
		var next *Peer
		var ok bool
		if p, ok = get(i); ok {
			next = &p
		}
		if r, ok := db.setRemote(k, next); !ok {
			rej = append(rej, r)
		}
	}
	return db.finish(), rej
}

// SyncVNI makes the table's records of vni exactly all (the source's
// complete set for vni, by key): keys it holds or rejected that all lacks
// are dropped, the others set as SetRemotes does. It is the level-triggered
// repair of everything notifications may have missed. Cost: proportional
// to len(all) plus the records the table holds.
func (db *DB) SyncVNI(vni uint32, all map[Key]Peer) (Delta, []Rejection) {
	ups := make([]Update, 0, len(all))
	vals := make([]Peer, 0, len(all))
	for k, p := range all {
		if k.VNI != vni {
			continue
		}
		vals = append(vals, p)
		ups = append(ups, Update{Key: k, Peer: &vals[len(vals)-1]})
	}
	t := &db.held
	for i := range t.recs {
		if r := &t.recs[i]; r.id != "" && r.vni == vni {
			if k := t.key(r); !hasKey(all, k) {
				ups = append(ups, Update{Key: k})
			}
		}
	}
	for k := range db.rejected {
		if _, ok := all[k]; !ok && k.VNI == vni {
			delete(db.rejected, k)
		}
	}
	d, rej := db.SetRemotes(ups)
	// The Delta does not depend on the order of ups; the rejections are
	// sorted so that the result does not depend on map order.
	slices.SortFunc(rej, func(a, b Rejection) int { return compareKey(a.Key, b.Key) })
	return d, rej
}

func hasKey(m map[Key]Peer, k Key) bool {
	_, ok := m[k]
	return ok
}

// setRemote is one update inside a transaction.
func (db *DB) setRemote(k Key, p *Peer) (Rejection, bool) {
	t := &db.held
	ri, h, hashed := t.find(k)
	if p == nil {
		delete(db.rejected, k)
		if ri != noRec {
			db.dropKey(ri, h)
		}
		return Rejection{}, true
	}
	sub, err := db.validateKeyed(k, p)
	if err != nil {
		if ri != noRec {
			db.dropKey(ri, h)
		}
		r := Rejection{Key: k, Peer: *p, Err: err}
		if db.rejected == nil {
			db.rejected = make(map[Key]Rejection)
		}
		db.rejected[k] = r
		return r, false
	}
	if len(db.rejected) > 0 {
		delete(db.rejected, k)
	}
	if ri != noRec {
		if db.heldIs(&t.recs[ri], p) {
			return Rejection{}, true
		}
		db.dropKey(ri, h)
		hashed = false // its origin may have been released and interned anew
	}
	r := t.insert(k, h, hashed)
	r.mac, r.vtep = p.MAC, db.vteps.ref(p.VTEP)
	if p.IP.IsValid() {
		r.ip, r.has4 = ip4(p.IP), true
	}
	if !db.addRemote(p, sub) {
		db.dups.Add(*p, 1) // another key holds an equal record
	}
	if p.IPv6.IsValid() {
		r.ip6, r.has6 = db.byIP6[p.IPv6], true // claimed by addRemote or an equal record
	}
	return Rejection{}, true
}

// dropKey removes held record ri, whose key has hash h.
func (db *DB) dropKey(ri int32, h uint64) {
	t := &db.held
	p := db.heldPeer(&t.recs[ri])
	db.vteps.unref(t.recs[ri].vtep)
	t.remove(ri, h)
	if db.dups.Len() > 0 && db.dups.Get(p) > 0 {
		db.dups.Add(p, -1) // another key still holds it
		return
	}
	db.removeRemote(&p)
}

// validateKeyed validates p as a record of k: the record itself (Validate),
// its endpoint (the key's), and, when the DB knows its VNIs, that its IP is
// in the subnet of k's VNI.
func (db *DB) validateKeyed(k Key, p *Peer) (int, error) {
	sub, err := db.validate(p, true)
	if err != nil {
		return 0, err
	}
	if p.EndpointID != k.EndpointID {
		return 0, &InvalidPeerError{EndpointID: p.EndpointID, Field: "EndpointID",
			Reason: fmt.Sprintf("EndpointID %q differs from the record's key (%s)", shortID(p.EndpointID), k)}
	}
	if db.vnis != nil {
		want := slices.Index(db.vnis, k.VNI)
		ok := want >= 0
		switch {
		case !ok:
			return 0, &InvalidPeerError{EndpointID: p.EndpointID, Field: "VNI",
				Reason: fmt.Sprintf("VNI %d is not a VNI of this network", k.VNI)}
		case want != sub:
			field, ip := "IP", p.IP
			if !ip.IsValid() {
				field, ip = "IPv6", p.IPv6
			}
			return 0, &InvalidPeerError{EndpointID: p.EndpointID, Field: field,
				Reason: fmt.Sprintf("%s %s is in subnet %s, but VNI %d carries subnet %s", field, ip, db.segString(sub), k.VNI, db.segString(want))}
		}
	}
	return sub, nil
}

// Held returns the remote records the table holds, by key, as a fresh map.
func (db *DB) Held() map[Key]Peer {
	t := &db.held
	out := make(map[Key]Peer, t.n)
	for i := range t.recs {
		if r := &t.recs[i]; r.id != "" {
			out[t.key(r)] = db.heldPeer(r)
		}
	}
	return out
}

// Rejected returns the records in force at the source that the table does
// not hold, sorted by key.
func (db *DB) Rejected() []Rejection {
	out := make([]Rejection, 0, len(db.rejected))
	for _, r := range db.rejected {
		out = append(out, r)
	}
	slices.SortFunc(out, func(a, b Rejection) int { return compareKey(a.Key, b.Key) })
	return out
}

func compareKey(a, b Key) int {
	return cmp.Or(cmp.Compare(a.VNI, b.VNI), strings.Compare(a.Origin, b.Origin), strings.Compare(a.EndpointID, b.EndpointID))
}
