package cluster

import (
	"net/netip"
	"sync/atomic"
	"time"

	"github.com/overlayd/overlayd/internal/lockorder"
	"github.com/overlayd/overlayd/internal/netdef"
	"github.com/overlayd/overlayd/peerdb"
)

// localStore holds the records this node owns (its local endpoints) and
// what its metadata advertises (VTEP, application state). Its lock is at
// LevelClusterLocal: below it only leaf locks may be taken (none is), and
// nothing is called out while it is held, so PublishLocalPeer can be
// called under a network lock or under Cluster.mu.
type localStore struct {
	mu   *lockorder.Mutex // LevelClusterLocal; guards every field below but name, inc, now
	name string
	inc  uint64
	now  func() time.Time

	vtep netip.Addr // this node's VTEP: local records must carry it
	// protoMax is the highest protocol version advertised: ProtocolVersion
	// (the tests lower it to play a node of an earlier version).
	protoMax byte
	// interestFlag: advertise interest (Config.Interest; metaInterest).
	interestFlag bool
	app          []byte // application state (SetAppState)
	// ipv6: every alive member speaks ProtocolIPv6, so records go out
	// with their IPv6 addresses; while not, they are withheld (see
	// lrec.full and wire.go, "IPv6"). withheld counts the records
	// concerned.
	ipv6     bool
	withheld int
	// names: every alive member speaks ProtocolNames, so records go out
	// with their names; while not, without them (see wire.go, "Names").
	names bool
	// wantNames: the names the driver gave each key (PublishLocalNames,
	// SyncLocal), packed; put into its record whenever it is published,
	// also when they came before the record. A key's entry goes when its
	// record is deleted.
	wantNames map[recKey]string
	clock     uint64 // last version issued
	recs      map[recKey]*lrec
	live      int
	hash      uint64
	// byVNI: live and hash per VNI, so a digest of the VNIs one member
	// wants costs a lookup per VNI (interest.go); a VNI without live
	// records has no entry.
	byVNI map[uint32]vniSum
	dirty map[recKey]struct{} // changed since the publisher last ran
	// defs: this node's network definitions by VNI (defs.go); defsVer is
	// the clock value of their last change.
	defs    map[uint32]netdef.Definition
	defsVer uint64
	// defChanged: the version of each VNI's last definition change, for
	// VNIs changed after the last syncDefs' mark.
	defChanged map[uint32]uint64
	// metaBytes: metaLocked() encoded, replaced with mu held whenever the
	// VTEP or the application state change; read without the lock
	// (memberlist's NodeMeta).
	metaBytes atomic.Pointer[[]byte]
}

type lrec struct {
	rec record    // as published: on the wire, in snapshots and digests
	at  time.Time // deletion time of a tombstone
	// full is the record as the driver published it when rec is not it:
	// its IPv6 address is withheld from a member of an older protocol
	// (rec lacks it; an IPv6-only record is withdrawn: rec is a
	// tombstone). nil otherwise.
	full *record
	// v6held: full is set because its IPv6 address is withheld (counted
	// in localStore.withheld).
	v6held bool
}

// wanted returns the record the driver has in force for this key (live is
// false for a withdrawal).
func (x *lrec) wanted() (r *record, live bool) {
	if x.full != nil {
		return x.full, true
	}
	return &x.rec, !x.rec.Deleted
}

func newLocalStore(name string, inc uint64, vtep netip.Addr, now func() time.Time) *localStore {
	l := &localStore{
		mu:   lockorder.New(lockorder.LevelClusterLocal),
		name: name, inc: inc, vtep: vtep, now: now, protoMax: ProtocolVersion, ipv6: true, names: true,
		recs:       make(map[recKey]*lrec),
		wantNames:  make(map[recKey]string),
		byVNI:      make(map[uint32]vniSum),
		dirty:      make(map[recKey]struct{}),
		defs:       make(map[uint32]netdef.Definition),
		defChanged: make(map[uint32]uint64),
	}
	b := encodeMeta(l.metaLocked())
	l.metaBytes.Store(&b)
	return l
}

// tickLocked issues the next version: max(last+1, wall clock in ns). Versions
// order every change of one incarnation even if the clock steps back; a
// restart gets a new incarnation, so versions never need to outlive one.
func (l *localStore) tickLocked() uint64 {
	v := uint64(l.now().UnixNano())
	if v <= l.clock {
		v = l.clock + 1
	}
	l.clock = v
	return v
}

// publish records a local change. It returns the reason next was refused
// (it is then withdrawn: its key is published as deleted, so no stale
// value stays in force elsewhere) and whether anything changed. A next
// without a VTEP gets this node's current one.
func (l *localStore) publish(vni uint32, prev, next *peerdb.Peer) (DropReason, bool) {
	if vni == 0 || vni > MaxVNI {
		return DropInvalidVNI, false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.publishLocked(vni, prev, next)
}

// publishLocked is publish.
func (l *localStore) publishLocked(vni uint32, prev, next *peerdb.Peer) (DropReason, bool) {
	if next != nil && !next.VTEP.IsValid() {
		stamped := *next
		stamped.VTEP = l.vtep
		next = &stamped
	}
	var reason DropReason
	changed := false
	if next != nil {
		r := record{VNI: vni, EndpointID: next.EndpointID, IP: next.IP, MAC: next.MAC, VTEP: next.VTEP, IPv6: next.IPv6, Version: 1}
		reason = validRecord(&r)
		if reason == "" && next.VTEP != l.vtep {
			reason = DropVTEPMatch
		}
		if reason != "" {
			if validEndpointID(next.EndpointID) {
				changed = l.deleteLocked(recKey{vni, next.EndpointID}) || changed
			}
			next = nil
		}
	}
	if prev != nil && (next == nil || prev.EndpointID != next.EndpointID) && validEndpointID(prev.EndpointID) {
		changed = l.deleteLocked(recKey{vni, prev.EndpointID}) || changed
	}
	if next != nil {
		k := recKey{vni, next.EndpointID}
		cur := l.recs[k]
		var want *record
		live := false
		if cur != nil {
			want, live = cur.wanted()
		}
		if !live || want.peer() != *next || want.Names != l.wantNames[k] {
			r := record{VNI: vni, EndpointID: next.EndpointID, IP: next.IP, MAC: next.MAC, VTEP: next.VTEP, IPv6: next.IPv6,
				Names: l.wantNames[k], Version: l.tickLocked()}
			l.setLocked(k, r)
			changed = true
		}
	}
	return reason, changed
}

// setLocked makes r (live, with a new version) the record of k, published
// as the members' protocols allow, and marks k dirty.
func (l *localStore) setLocked(k recKey, r record) {
	if cur := l.recs[k]; cur != nil {
		if !cur.rec.Deleted {
			l.countLocked(&cur.rec, -1)
		}
		if cur.v6held {
			l.withheld--
		}
	}
	x := &lrec{rec: r}
	if !l.names && r.Names != "" {
		x.rec.Names = ""
	}
	if !l.ipv6 && r.IPv6.IsValid() {
		x.v6held = true
		l.withheld++
		if r.IP.IsValid() {
			x.rec.IPv6 = netip.Addr{}
		} else {
			x.rec = record{VNI: r.VNI, EndpointID: r.EndpointID, Deleted: true, Version: r.Version}
			x.at = l.now()
		}
	}
	if x.rec != r {
		full := r
		x.full = &full
	}
	if !x.rec.Deleted {
		l.countLocked(&x.rec, 1)
	}
	l.recs[k] = x
	l.dirty[k] = struct{}{}
}

// setIPv6 says whether every alive member speaks ProtocolIPv6. When that
// changes, every record with an IPv6 address is published anew (new
// version) in the form now allowed: with it, or without it (IPv6-only
// records withdrawn), so every member replaces what it holds. It returns
// whether it changed and the records with an IPv6 address.
func (l *localStore) setIPv6(ok bool) (changed bool, n int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.ipv6 != ok {
		l.ipv6, changed = ok, true
	}
	for k, cur := range l.recs {
		if want, live := cur.wanted(); live && want.IPv6.IsValid() {
			n++
			if changed {
				r := *want
				r.Version = l.tickLocked()
				l.setLocked(k, r)
			}
		}
	}
	return changed, n
}

// setNames says whether every alive member speaks ProtocolNames. When
// that changes, every record with names is published anew (new version)
// with or without them, so every member replaces what it holds. It
// returns whether it changed and the records with names.
func (l *localStore) setNames(ok bool) (changed bool, n int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.names != ok {
		l.names, changed = ok, true
	}
	for k, cur := range l.recs {
		if want, live := cur.wanted(); live && want.Names != "" {
			n++
			if changed {
				r := *want
				r.Version = l.tickLocked()
				l.setLocked(k, r)
			}
		}
	}
	return changed, n
}

// setWantNames makes packed (dnsname.Pack's form) the names of k and
// publishes its live record anew if they differ from its own. It reports
// whether anything was published.
func (l *localStore) setWantNames(k recKey, packed string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.setWantNamesLocked(k, packed)
}

// setWantNamesLocked is setWantNames.
func (l *localStore) setWantNamesLocked(k recKey, packed string) bool {
	if packed == "" {
		delete(l.wantNames, k)
	} else {
		l.wantNames[k] = packed
	}
	cur := l.recs[k]
	if cur == nil {
		return false
	}
	want, live := cur.wanted()
	if !live || want.Names == packed {
		return false
	}
	r := *want
	r.Names, r.Version = packed, l.tickLocked()
	l.setLocked(k, r)
	return true
}

// ipv6State returns whether records go out with their IPv6 addresses and
// how many are withheld.
func (l *localStore) ipv6State() (ok bool, withheld int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.ipv6, l.withheld
}

// LocalRecord is one record of this node's own endpoints.
type LocalRecord struct {
	VNI  uint32
	Peer peerdb.Peer // a zero VTEP means this node's current one
	// Names: the endpoint's DNS names, packed (dnsname.Pack); "" for none.
	Names string
}

// mark returns the last version issued: every later change has a greater
// version.
func (l *localStore) mark() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.clock
}

// sync makes the live local records exactly recs, a list taken after
// mark: each is published (a no-op when unchanged) and every live record
// whose key recs lacks is withdrawn; keys changed after mark are left as
// they are (a publication newer than the list wins). It returns the
// refusals and whether anything changed.
func (l *localStore) sync(mark uint64, recs []LocalRecord) ([]localErr, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	want := make(map[recKey]bool, len(recs))
	var errs []localErr
	changed := false
	for i := range recs {
		r := &recs[i]
		if r.VNI == 0 || r.VNI > MaxVNI {
			errs = append(errs, localErr{vni: r.VNI, reason: DropInvalidVNI, rec: r.Peer.String()})
			continue
		}
		k := recKey{r.VNI, r.Peer.EndpointID}
		want[k] = true
		if cur := l.recs[k]; cur != nil && cur.rec.Version > mark {
			continue
		}
		if r.Names == "" {
			delete(l.wantNames, k)
		} else {
			l.wantNames[k] = r.Names
		}
		reason, ch := l.publishLocked(r.VNI, nil, &r.Peer)
		changed = changed || ch
		if reason != "" {
			errs = append(errs, localErr{vni: r.VNI, reason: reason, rec: r.Peer.String()})
		}
	}
	for k, cur := range l.recs {
		if _, live := cur.wanted(); live && !want[k] && cur.rec.Version <= mark {
			changed = l.deleteLocked(k) || changed
		}
	}
	return errs, changed
}

// countLocked adds (sign 1) or removes (sign -1) the live record r from
// the totals and its VNI's sum.
func (l *localStore) countLocked(r *record, sign int) {
	h := recordHash(r)
	sum := l.byVNI[r.VNI]
	if sign > 0 {
		l.live++
		l.hash += h
		sum.live++
		sum.hash += h
	} else {
		l.live--
		l.hash -= h
		sum.live--
		sum.hash -= h
	}
	if sum.live == 0 {
		delete(l.byVNI, r.VNI)
	} else {
		l.byVNI[r.VNI] = sum
	}
}

// deleteLocked turns k's live record into a tombstone.
func (l *localStore) deleteLocked(k recKey) bool {
	cur := l.recs[k]
	if cur == nil {
		return false
	}
	if _, live := cur.wanted(); !live {
		return false
	}
	if !cur.rec.Deleted {
		l.countLocked(&cur.rec, -1)
	}
	if cur.v6held {
		l.withheld--
	}
	delete(l.wantNames, k)
	l.recs[k] = &lrec{rec: record{VNI: k.VNI, EndpointID: k.EndpointID, Deleted: true, Version: l.tickLocked()}, at: l.now()}
	l.dirty[k] = struct{}{}
	return true
}

// takeDirty returns the current value (record or tombstone) of every key
// changed since the last call: changes in between are coalesced.
func (l *localStore) takeDirty() []record {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.dirty) == 0 {
		return nil
	}
	out := make([]record, 0, len(l.dirty))
	for k := range l.dirty {
		if r := l.recs[k]; r != nil {
			out = append(out, r.rec)
		}
	}
	clear(l.dirty)
	return out
}

// snapshot returns the complete live set as of the current clock.
func (l *localStore) snapshot() *message {
	l.mu.Lock()
	defer l.mu.Unlock()
	m := &message{Type: msgSnapshot, Origin: l.name, Incarnation: l.inc, AsOf: l.clock,
		Records: make([]record, 0, l.live)}
	for _, r := range l.recs {
		if !r.rec.Deleted {
			m.Records = append(m.Records, r.rec)
		}
	}
	return m
}

// digest summarises the live set as of the current clock.
func (l *localStore) digest() *message {
	l.mu.Lock()
	defer l.mu.Unlock()
	return &message{Type: msgDigest, Origin: l.name, Incarnation: l.inc, AsOf: l.clock,
		Count: uint64(l.live), Hash: l.hash}
}

// reap forgets tombstones older than ttl that were published.
func (l *localStore) reap(now time.Time, ttl time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for k, r := range l.recs {
		if _, pending := l.dirty[k]; r.rec.Deleted && r.full == nil && !pending && now.Sub(r.at) >= ttl {
			delete(l.recs, k)
		}
	}
}

// counts returns per-VNI live record counts.
func (l *localStore) counts() map[uint32]int {
	l.mu.Lock()
	defer l.mu.Unlock()
	c := make(map[uint32]int)
	for k, r := range l.recs {
		if !r.rec.Deleted {
			c[k.VNI]++
		}
	}
	return c
}

// meta returns this node's metadata (VTEP and application state as set).
func (l *localStore) meta() nodeMeta {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.metaLocked()
}

func (l *localStore) metaLocked() nodeMeta {
	return nodeMeta{ProtoMin: protocolVersionMin, ProtoMax: l.protoMax, Incarnation: l.inc, VTEP: l.vtep, App: l.app,
		Interest: l.interestFlag}
}

// currentVTEP returns this node's VTEP.
func (l *localStore) currentVTEP() netip.Addr {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.vtep
}

// advertiseInterest sets the metaInterest flag of the metadata (before
// the node joins: New).
func (l *localStore) advertiseInterest(on bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.interestFlag = on
	b := encodeMeta(l.metaLocked())
	l.metaBytes.Store(&b)
}

// setApp sets the application state (and the metadata).
func (l *localStore) setApp(app []byte) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.app = app
	b := encodeMeta(l.metaLocked())
	l.metaBytes.Store(&b)
}

// setVTEP makes v this node's VTEP and re-publishes every live record
// with it (new versions), so every member replaces them; the metadata
// follows. It returns the former VTEP and the number of records
// re-published.
func (l *localStore) setVTEP(v netip.Addr) (old netip.Addr, n int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	old = l.vtep
	if l.vtep != v {
		l.vtep = v
		b := encodeMeta(l.metaLocked())
		l.metaBytes.Store(&b)
		for k, cur := range l.recs {
			want, live := cur.wanted()
			if !live || want.VTEP == v {
				continue
			}
			r := *want
			r.VTEP, r.Version = v, l.tickLocked()
			l.setLocked(k, r)
			n++
		}
	}
	return old, n
}
