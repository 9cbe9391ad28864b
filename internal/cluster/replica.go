package cluster

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"net/netip"
	"slices"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/overlayd/overlayd/internal/netdef"
	"github.com/overlayd/overlayd/peerdb"
)

// MemberState is a member's state as this node sees it.
type MemberState string

// Member states. Memberlist does not report its "suspect" state through
// its API; Status reports StateSuspect for an alive member whose last
// probe by this node failed (memberlist suspects it) and that has shown no
// sign of life since (an ack, a message), within the maximum suspicion
// time. Suspicions this node only learns from others are not visible.
const (
	StateAlive   MemberState = "alive"
	StateSuspect MemberState = "suspect"
	StateDead    MemberState = "dead"
	StateLeft    MemberState = "left"
)

// member is a node of the memberlist cluster (including this one).
type member struct {
	name      string
	node      memberlist.Node // copy, Meta copied
	state     MemberState     // alive, dead or left
	leaving   bool            // it announced a leave (msgLeave)
	meta      nodeMeta
	metaErr   error
	since     time.Time // last state change
	lastHeard time.Time // last accepted control-plane message from it
	// suspectSince: this node's probe of it failed (memberlist then
	// suspects it); cleared by any sign of life.
	suspectSince time.Time
	rtt          time.Duration // last direct probe round trip
	// failedGrace: it was declared dead (not left) while its records were
	// in force; they stay in force until failedUntil (FailedGrace after
	// the death), its return, or a leave.
	failedGrace bool
	failedUntil time.Time
}

// rrec is a stored remote record.
type rrec struct {
	rec record
	at  time.Time // when stored (tombstone reaping)
}

// origin is what this node holds of one remote node's records, for one
// incarnation of that node.
type origin struct {
	inc uint64
	// floor: this node's view of the origin was complete as of the
	// origin's clock value floor (a snapshot or a matching digest). A
	// record with version <= floor whose key is not stored is stale.
	floor    uint64
	complete bool   // floor was set by a complete view of this incarnation
	maxVer   uint64 // highest version ever stored (or floor)
	recs     map[recKey]*rrec
	live     int    // non-deleted records
	hash     uint64 // sum of recordHash of the live records
	// prev: the records that were in force before the origin restarted
	// (the previous incarnation's) or changed its VTEP (the records of the
	// former VTEP). A key of prev is in force where recs has no record of
	// it valid under the origin's current VTEP, until this incarnation's
	// next complete view or graceUntil, so a restart or a VTEP change does
	// not flap the origin's peers on every other node.
	prev        map[recKey]record
	graceUntil  time.Time
	lastSyncReq time.Time
	// awaiting: a snapshot was asked for and no complete view (snapshot
	// or matching digest) came since; the request is repeated.
	awaiting bool
	// defs: the origin's network definitions by VNI, as of its clock
	// defsVer (0: carried over from its previous incarnation, replaced by
	// the first set of this one). See defs.go.
	defs    map[uint32]netdef.Definition
	defsVer uint64
}

func newOrigin(inc uint64) *origin {
	return &origin{inc: inc, recs: make(map[recKey]*rrec)}
}

// holds reports whether o stores anything (record, tombstone or previous
// record) under k.
func (o *origin) holds(k recKey) bool {
	if o == nil {
		return false
	}
	if _, ok := o.recs[k]; ok {
		return true
	}
	_, ok := o.prev[k]
	return ok
}

// value returns what o puts in force for k when its member advertises
// vtep: its live record if valid under vtep, nothing if it deleted k,
// else the previous record (restart or VTEP change) if any.
func (o *origin) value(k recKey, vtep netip.Addr) (peerdb.Peer, bool) {
	r, ok := o.valueRecord(k, vtep)
	if !ok {
		return peerdb.Peer{}, false
	}
	return r.peer(), true
}

// valueRecord is value with the whole record (its names too).
func (o *origin) valueRecord(k recKey, vtep netip.Addr) (record, bool) {
	if r := o.recs[k]; r != nil {
		if r.rec.Deleted {
			return record{}, false
		}
		if r.rec.VTEP == vtep {
			return r.rec, true
		}
		// A record of a former VTEP: the previous value stands until the
		// record of the new VTEP arrives.
	}
	r, ok := o.prev[k]
	return r, ok
}

// pkey identifies a remote record within a VNI.
type pkey struct {
	Origin     string
	EndpointID string
}

// storeStats counts what merging did (not drops: those are DropReasons).
type storeStats struct {
	Deltas, Snapshots, StaleSnapshots, Digests     uint64
	DigestMatches, DigestMismatches, StaleRecords  uint64
	SyncRequests, IncarnationChanges, GraceExpired uint64
	MemberFailures, MemberReturns                  uint64
	FailedGraceExpired                             uint64
	Defs, StaleDefs                                uint64 // definition sets applied, and older than held
	Records                                        uint64 // records received in deltas and snapshots
}

// replica is the replicated remote state: membership as memberlist reports
// it and the records of every origin. It is not safe for concurrent use:
// the Cluster calls it with Cluster.mu held. Its hooks are called with that
// lock held and must not block.
type replica struct {
	self            string
	members         map[string]*member
	origins         map[string]*origin
	grace           time.Duration // RestartGrace
	failedGrace     time.Duration // FailedGrace (0: none)
	syncMinInterval time.Duration // between two sync requests to one origin
	stats           storeStats
	// byVNI indexes every key the origins hold (records, tombstones,
	// previous records) by VNI, so the records of one VNI are found
	// without visiting the others': key (vni, k) is here iff
	// origins[k.Origin].holds({vni, k.EndpointID}).
	byVNI map[uint32]map[pkey]struct{}

	// dirty reports that the effective value of (vni, k) may have changed.
	dirty func(vni uint32, k pkey)
	// dirtyVNI reports that the definitions in force for vni may have
	// changed.
	dirtyVNI func(vni uint32)
	// requestSync asks origin for its snapshot.
	requestSync func(origin string)
	// sendSnapshot sends this node's snapshot to the member requester.
	sendSnapshot func(requester string)
	// interest: this node advertises interest (Config.Interest), so it
	// sends members that do too only what they want (interest.go).
	interest bool
	// interestGained reports that member name's set gained vnis (sorted).
	interestGained func(name string, vnis []uint32)
}

func newReplica(self string) *replica {
	return &replica{
		self:            self,
		members:         make(map[string]*member),
		origins:         make(map[string]*origin),
		byVNI:           make(map[uint32]map[pkey]struct{}),
		syncMinInterval: 500 * time.Millisecond,
		dirty:           func(uint32, pkey) {},
		dirtyVNI:        func(uint32) {},
		requestSync:     func(string) {},
		sendSnapshot:    func(string) {},
		interestGained:  func(string, []uint32) {},
	}
}

// index notes that the origin of k holds (vni, k).
func (s *replica) index(vni uint32, k pkey) {
	set := s.byVNI[vni]
	if set == nil {
		set = make(map[pkey]struct{})
		s.byVNI[vni] = set
	}
	set[k] = struct{}{}
}

// unindex removes (vni, {name, k}) from the index unless the current
// origin of name still holds it.
func (s *replica) unindex(name string, k recKey) {
	if s.origins[name].holds(k) {
		return
	}
	if set := s.byVNI[k.VNI]; set != nil {
		delete(set, pkey{name, k.EndpointID})
		if len(set) == 0 {
			delete(s.byVNI, k.VNI)
		}
	}
}

// setOrigin makes nu (nil: none) the origin of name in place of its
// current one. Keys the old origin held and nu does not are marked dirty
// and leave the index; nu's keys are indexed. A key nu holds in prev keeps
// its value (prev is the set that was in force).
func (s *replica) setOrigin(name string, nu *origin) {
	old := s.origins[name]
	if nu == nil {
		delete(s.origins, name)
	} else {
		s.origins[name] = nu
		for k := range nu.recs {
			s.index(k.VNI, pkey{name, k.EndpointID})
		}
		for k := range nu.prev {
			s.index(k.VNI, pkey{name, k.EndpointID})
		}
	}
	if old == nil {
		return
	}
	s.markDefs(old)
	if nu != nil {
		s.markDefs(nu)
	}
	gone := func(k recKey) {
		if !nu.holds(k) {
			s.dirty(k.VNI, pkey{name, k.EndpointID})
			s.unindex(name, k)
		}
	}
	for k := range old.recs {
		gone(k)
	}
	for k := range old.prev {
		gone(k)
	}
}

// recordHash is the digest contribution of a live record. It must be the
// same function on every node (FNV-1a over a fixed layout).
func recordHash(r *record) uint64 {
	var b [4 + 1 + maxEndpointIDLen + 8 + 4 + 6 + 16 + 16]byte
	p := binary.BigEndian.AppendUint32(b[:0], r.VNI)
	p = append(p, byte(len(r.EndpointID)))
	p = append(p, r.EndpointID...)
	p = binary.BigEndian.AppendUint64(p, r.Version)
	var ip [4]byte // 0.0.0.0, which no live record has, for none
	if r.IP.IsValid() {
		ip = r.IP.As4()
	}
	p = append(p, ip[:]...)
	p = append(p, r.MAC[:]...)
	v := r.VTEP.As16()
	p = append(p, v[:]...)
	if r.IPv6.IsValid() { // a record without one hashes as in protocol 3
		v6 := r.IPv6.As16()
		p = append(p, v6[:]...)
	}
	h := fnv.New64a()
	h.Write(p)
	if r.Names != "" { // a record without names hashes as in protocol 4
		h.Write([]byte{0})
		h.Write([]byte(r.Names))
	}
	return h.Sum64()
}

// olderThanIPv6 returns, sorted, the alive members (other than this node,
// with usable metadata) that speak a protocol below ProtocolIPv6.
func (s *replica) olderThanIPv6() []string { return s.olderThan(ProtocolIPv6) }

// olderThan returns, sorted, the alive members (other than this node,
// with usable metadata) that speak a protocol below proto.
func (s *replica) olderThan(proto byte) []string {
	var out []string
	for name, m := range s.members {
		if name != s.self && m.state == StateAlive && m.metaErr == nil && m.meta.ProtoMax < proto {
			out = append(out, name)
		}
	}
	slices.Sort(out)
	return out
}

// inForce reports whether the records of member m (named name) are in
// force: it is alive with usable metadata, or dead within FailedGrace.
func (s *replica) inForce(name string, m *member) bool {
	return m != nil && name != s.self && m.metaErr == nil &&
		(m.state == StateAlive || m.state == StateDead && m.failedGrace)
}

// memberAlive records that memberlist considers n alive (join, update, or
// back from dead), reading its metadata.
func (s *replica) memberAlive(n *memberlist.Node, now time.Time) {
	meta, err := decodeMeta(n.Meta)
	m := s.members[n.Name]
	if m == nil {
		m = &member{name: n.Name}
		s.members[n.Name] = m
	}
	wasAlive := m.state == StateAlive
	wasInForce := s.inForce(n.Name, m)
	if m.state == StateDead && m.failedGrace {
		s.stats.MemberReturns++
	}
	oldMeta, oldErr := m.meta, m.metaErr
	m.node = *n
	m.node.Meta = append([]byte(nil), n.Meta...)
	m.meta, m.metaErr = meta, err
	if !wasAlive {
		m.since = now
		m.leaving = false
	}
	m.state = StateAlive
	m.failedGrace, m.failedUntil = false, time.Time{}
	m.suspectSince = time.Time{}
	if n.Name == s.self {
		return
	}
	o := s.origins[n.Name]
	if err != nil {
		if o != nil && wasInForce {
			s.markOrigin(n.Name, o) // no longer in force
		}
		return
	}
	changed := oldErr != nil || !sameMeta(oldMeta, meta)
	switch {
	case o == nil:
		s.setOrigin(n.Name, newOrigin(meta.Incarnation))
		s.syncFrom(n.Name, nil, now)
	case o.inc == meta.Incarnation:
		// Same incarnation: back from dead (a false detection, a healed
		// partition), metadata fixed, or a new VTEP. Within FailedGrace
		// with the same metadata nothing changes for the consumers.
		switch {
		case wasInForce && oldMeta.VTEP != meta.VTEP && s.grace > 0:
			// New VTEP: the records of the former one stay in force until
			// the origin's records of the new one arrive (its next
			// complete view), at most RestartGrace.
			o.prev = s.effectiveSet(o, oldMeta)
			o.graceUntil = now.Add(s.grace)
			o.complete = false
			o.lastSyncReq = time.Time{} // ask now, whatever the rate limit
			for k := range o.prev {
				s.index(k.VNI, pkey{n.Name, k.EndpointID})
			}
		case !wasInForce || changed:
			s.markOrigin(n.Name, o)
		}
		if oldErr == nil && oldMeta.Interest && !meta.Interest {
			// It no longer advertises interest: it wants every record now.
			s.sendSnapshot(n.Name)
		}
		if !wasAlive || changed {
			s.syncFrom(n.Name, o, now)
		}
	default:
		// The node restarted: records of the old incarnation are void. If
		// they were in force (a restart seen while alive, or within
		// FailedGrace), they stay so until the new incarnation's first
		// complete view, at most RestartGrace.
		s.stats.IncarnationChanges++
		no := newOrigin(meta.Incarnation)
		if wasInForce && o.inc == oldMeta.Incarnation && s.grace > 0 {
			no.prev = s.effectiveSet(o, oldMeta)
			no.graceUntil = now.Add(s.grace)
		}
		if wasInForce && meta.ProtoMax >= protoDefs {
			// Its definitions stay until the new incarnation sends its
			// set (it answers our sync request with it): a restart must
			// not make a contradiction vanish and reappear.
			no.defs = o.defs
		}
		s.setOrigin(n.Name, no)
		s.syncFrom(n.Name, nil, now)
	}
}

// memberGone records that memberlist declared the node dead, or that it
// left. A node that left (it sent msgLeave first) is forgotten: its
// records stop being in force at once. A dead node's records stay in force
// for FailedGrace (its return within it changes nothing), then stop being
// in force but are kept, so a healed partition restores them at once.
func (s *replica) memberGone(n *memberlist.Node, now time.Time) MemberState {
	m := s.members[n.Name]
	if m == nil {
		m = &member{name: n.Name, node: *n}
		m.node.Meta = append([]byte(nil), n.Meta...)
		m.meta, m.metaErr = decodeMeta(n.Meta)
		s.members[n.Name] = m
	}
	wasInForce := s.inForce(n.Name, m)
	state := StateDead
	if m.leaving {
		state = StateLeft
	} else if m.state == StateAlive {
		s.stats.MemberFailures++
	}
	m.state = state
	m.since = now
	m.failedGrace, m.failedUntil = false, time.Time{}
	if n.Name == s.self {
		return state
	}
	o := s.origins[n.Name]
	switch {
	case state == StateLeft:
		s.setOrigin(n.Name, nil)
	case wasInForce && s.failedGrace > 0:
		m.failedGrace, m.failedUntil = true, now.Add(s.failedGrace)
	case wasInForce && o != nil:
		s.markOrigin(n.Name, o)
	}
	return state
}

// memberLeft handles a leave announced by a member memberlist already
// declared dead (its msgLeave arrived after the death): it is forgotten
// at once, as if the leave had come first.
func (s *replica) memberLeft(m *member, now time.Time) {
	m.state, m.since, m.leaving = StateLeft, now, true
	m.failedGrace, m.failedUntil = false, time.Time{}
	s.setOrigin(m.name, nil)
}

// markOrigin marks every key o holds or shadows dirty, and every VNI it
// defines.
func (s *replica) markOrigin(name string, o *origin) {
	s.markDefs(o)
	for k := range o.recs {
		s.dirty(k.VNI, pkey{name, k.EndpointID})
	}
	for k := range o.prev {
		s.dirty(k.VNI, pkey{name, k.EndpointID})
	}
}

// effectiveSet returns o's records in force under meta.
func (s *replica) effectiveSet(o *origin, meta nodeMeta) map[recKey]record {
	set := make(map[recKey]record, o.live+len(o.prev))
	for k := range o.prev {
		if r, ok := o.valueRecord(k, meta.VTEP); ok {
			set[k] = r
		}
	}
	for k := range o.recs {
		if r, ok := o.valueRecord(k, meta.VTEP); ok {
			set[k] = r
		}
	}
	return set
}

func (s *replica) syncFrom(name string, o *origin, now time.Time) {
	if o == nil {
		o = s.origins[name]
	}
	if o != nil {
		o.awaiting = true
		if now.Sub(o.lastSyncReq) < s.syncMinInterval {
			return
		}
		o.lastSyncReq = now
	}
	s.stats.SyncRequests++
	s.requestSync(name)
}

// effective returns the peer that is in force for (vni, k): a live record
// of the current incarnation of an origin whose records are in force (see
// inForce) and whose VTEP is the origin's, or else a previous record
// (restart or VTEP change) during its grace. Never one of ours.
func (s *replica) effective(vni uint32, k pkey) (peerdb.Peer, bool) {
	m := s.members[k.Origin]
	if !s.inForce(k.Origin, m) {
		return peerdb.Peer{}, false
	}
	o := s.origins[k.Origin]
	if o == nil || o.inc != m.meta.Incarnation {
		return peerdb.Peer{}, false
	}
	return o.value(recKey{VNI: vni, EndpointID: k.EndpointID}, m.meta.VTEP)
}

// effectiveRecord is effective with the whole record (its names too).
func (s *replica) effectiveRecord(vni uint32, k pkey) (record, bool) {
	m := s.members[k.Origin]
	if !s.inForce(k.Origin, m) {
		return record{}, false
	}
	o := s.origins[k.Origin]
	if o == nil || o.inc != m.meta.Incarnation {
		return record{}, false
	}
	return o.valueRecord(recKey{VNI: vni, EndpointID: k.EndpointID}, m.meta.VTEP)
}

// peers returns every peer in force for vni (visiting only the keys of
// vni).
func (s *replica) peers(vni uint32) map[pkey]peerdb.Peer {
	keys := s.byVNI[vni]
	out := make(map[pkey]peerdb.Peer, len(keys))
	for k := range keys {
		if p, ok := s.effective(vni, k); ok {
			out[k] = p
		}
	}
	return out
}

// apply validates m against the membership and merges it. It returns a
// drop reason (and detail) if m is refused; then nothing of it was applied.
func (s *replica) apply(m *message, now time.Time) (DropReason, string) {
	if m.Origin == s.self {
		return DropSelfOrigin, "message claims to come from this node"
	}
	mem := s.members[m.Origin]
	// A leave may arrive after memberlist declared the member dead.
	leaveOfDead := m.Type == msgLeave && mem != nil && mem.state == StateDead
	switch {
	case mem == nil:
		return DropUnknownOrig, fmt.Sprintf("origin %q is not a member", m.Origin)
	case mem.state != StateAlive && !leaveOfDead:
		return DropUnknownOrig, fmt.Sprintf("origin %q is %s", m.Origin, mem.state)
	case mem.metaErr != nil:
		return DropBadMeta, fmt.Sprintf("origin %q: %v", m.Origin, mem.metaErr)
	case m.Incarnation != mem.meta.Incarnation:
		return DropIncarnation, fmt.Sprintf("origin %q incarnation %d, member advertises %d",
			m.Origin, m.Incarnation, mem.meta.Incarnation)
	case m.Type == msgApp && mem.meta.ProtoMax < ProtocolApp:
		return DropProtocol, fmt.Sprintf("origin %q sent an application message but advertises protocol %d (application messages need %d)",
			m.Origin, mem.meta.ProtoMax, ProtocolApp)
	}
	for i := range m.Records {
		r := &m.Records[i]
		if !r.Deleted && r.VTEP != mem.meta.VTEP {
			return DropVTEPMatch, fmt.Sprintf("origin %q record VNI %d endpoint %q has VTEP %v, origin advertises %v",
				m.Origin, r.VNI, r.EndpointID, r.VTEP, mem.meta.VTEP)
		}
		if !r.Deleted && r.Names != "" && mem.meta.ProtoMax < ProtocolNames {
			return DropProtocol, fmt.Sprintf("origin %q record VNI %d endpoint %q has names but the origin advertises protocol %d (names need %d)",
				m.Origin, r.VNI, r.EndpointID, mem.meta.ProtoMax, ProtocolNames)
		}
		if r.hasIPv6() && mem.meta.ProtoMax < ProtocolIPv6 {
			return DropProtocol, fmt.Sprintf("origin %q record VNI %d endpoint %q has an IPv6 address but the origin advertises protocol %d (IPv6 records need %d)",
				m.Origin, r.VNI, r.EndpointID, mem.meta.ProtoMax, ProtocolIPv6)
		}
	}
	// Everything is valid: apply.
	first := mem.lastHeard.Before(mem.since) // first message since it came alive here
	mem.lastHeard = now
	mem.suspectSince = time.Time{}
	if o := s.origins[m.Origin]; first && m.Type == msgSyncRequest && o != nil && o.awaiting &&
		now.Sub(o.lastSyncReq) >= resyncAfterLearnt {
		// It has just learnt our incarnation, well after we asked it for
		// its snapshot: our request reached it before it knew us (we
		// restarted and it still had our former process), so it was
		// refused. Ask again now rather than at the retry.
		o.lastSyncReq = time.Time{}
		s.syncFrom(m.Origin, o, now)
	}
	switch m.Type {
	case msgSyncRequest:
		s.sendSnapshot(m.Origin)
		return "", ""
	case msgApp:
		return "", "" // delivered by the Cluster, outside its lock
	case msgLeave:
		mem.leaving = true
		if leaveOfDead {
			s.memberLeft(mem, now)
		}
		return "", ""
	}
	o := s.origins[m.Origin]
	if o == nil || o.inc != m.Incarnation {
		// memberAlive keeps origins in step with the metadata; be safe.
		o = newOrigin(m.Incarnation)
		s.setOrigin(m.Origin, o)
	}
	switch m.Type {
	case msgDelta:
		s.stats.Deltas++
		s.stats.Records += uint64(len(m.Records))
		for i := range m.Records {
			s.mergeRecord(m.Origin, o, &m.Records[i], now, false)
		}
	case msgSnapshot:
		s.applySnapshot(m.Origin, o, m, now)
	case msgDigest:
		s.applyDigest(m.Origin, o, m, now)
	case msgDefs:
		s.applyDefs(m.Origin, o, m)
	}
	return "", ""
}

// mergeRecord keeps r if it is newer than what o has for its key. The
// merge is a last-writer-wins register per key ordered by the origin's
// version: idempotent, commutative and associative, so reordered,
// duplicated or coalesced messages converge.
func (s *replica) mergeRecord(name string, o *origin, r *record, now time.Time, fromSnapshot bool) {
	k := r.key()
	cur := o.recs[k]
	if cur != nil && r.Version <= cur.rec.Version || cur == nil && r.Version <= o.floor && !fromSnapshot {
		s.stats.StaleRecords++
		return
	}
	pk := pkey{name, k.EndpointID}
	before, had := s.effective(k.VNI, pk)
	if cur != nil && !cur.rec.Deleted {
		o.live--
		o.hash -= recordHash(&cur.rec)
	}
	o.recs[k] = &rrec{rec: *r, at: now}
	if !r.Deleted {
		o.live++
		o.hash += recordHash(r)
	}
	o.maxVer = max(o.maxVer, r.Version)
	s.index(k.VNI, pk)
	if after, has := s.effective(k.VNI, pk); has != had || after != before {
		s.dirty(k.VNI, pk) // a new version of the same value changes nothing
	}
}

// applySnapshot merges the origin's complete live set as of its clock
// m.AsOf: records it lacks whose version is <= AsOf were deleted at the
// origin (their tombstones may be reaped there), so they go; newer ones
// stay.
func (s *replica) applySnapshot(name string, o *origin, m *message, now time.Time) {
	if m.AsOf < o.floor {
		s.stats.StaleSnapshots++
		return
	}
	s.stats.Snapshots++
	s.stats.Records += uint64(len(m.Records))
	in := make(map[recKey]struct{}, len(m.Records))
	for i := range m.Records {
		r := &m.Records[i]
		in[r.key()] = struct{}{}
		s.mergeRecord(name, o, r, now, true)
	}
	for k, r := range o.recs {
		if r.rec.Version > m.AsOf {
			continue
		}
		if _, ok := in[k]; ok {
			continue
		}
		pk := pkey{name, k.EndpointID}
		before, had := s.effective(k.VNI, pk)
		if !r.rec.Deleted {
			o.live--
			o.hash -= recordHash(&r.rec)
		}
		delete(o.recs, k)
		s.unindex(name, k)
		if after, has := s.effective(k.VNI, pk); has != had || after != before {
			s.dirty(k.VNI, pk)
		}
	}
	o.floor = m.AsOf
	o.maxVer = max(o.maxVer, m.AsOf)
	s.setComplete(name, o)
}

// applyDigest compares the origin's summary with ours. A match makes our
// view complete as of the digest's clock; a mismatch asks for a snapshot.
func (s *replica) applyDigest(name string, o *origin, m *message, now time.Time) {
	s.stats.Digests++
	if o.maxVer > m.AsOf {
		return // older than what we hold; the next one will tell
	}
	if uint64(o.live) == m.Count && o.hash == m.Hash {
		s.stats.DigestMatches++
		if m.AsOf > o.floor {
			o.floor = m.AsOf
			o.maxVer = max(o.maxVer, m.AsOf)
			for k, r := range o.recs {
				if r.rec.Deleted && r.rec.Version <= o.floor {
					delete(o.recs, k)  // the floor now rejects what it guarded against
					s.unindex(name, k) // prev may hold k: setComplete drops it below
				}
			}
		}
		s.setComplete(name, o)
		return
	}
	s.stats.DigestMismatches++
	s.syncFrom(name, o, now)
}

func (s *replica) setComplete(name string, o *origin) {
	o.complete = true
	o.awaiting = false
	s.dropPrev(name, o)
}

// dropPrev ends o's previous records (restart or VTEP change). Keys whose
// value changes are marked dirty; a key whose current record has the same
// value as the previous one is not (nothing changes for it).
func (s *replica) dropPrev(name string, o *origin) {
	if o.prev == nil {
		return
	}
	var vtep netip.Addr
	if m := s.members[name]; m != nil {
		vtep = m.meta.VTEP
	}
	prev := o.prev
	o.prev = nil
	for k, p := range prev {
		if r := o.recs[k]; r == nil || r.rec.Deleted || r.rec.VTEP != vtep || r.rec.peer() != p.peer() || r.rec.Names != p.Names {
			s.dirty(k.VNI, pkey{name, k.EndpointID})
		}
		s.unindex(name, k)
	}
}

// resyncAfterLearnt: a member whose first message is a sync request (it
// has just learnt our incarnation) arriving this long after our own
// request to it is asked again at once: our request most likely reached
// it before it knew us. In a normal join both learn each other within a
// round trip, so this does not double the snapshots of every join.
const resyncAfterLearnt = 50 * time.Millisecond

// syncRetry is how long a sync request waits for its answer (a snapshot
// or a matching digest) before it is repeated: requests and small
// snapshots travel as UDP packets.
const syncRetry = time.Second

// wantsDefs reports whether o's member speaks definitions but none of
// its sets has arrived: its records may wait for them (see definitions),
// and push/pull, which may have brought its records, does not carry them,
// so it is asked (a sync request is answered with the set) until one
// arrives.
func (s *replica) wantsDefs(m *member, o *origin) bool {
	return m != nil && o.defsVer == 0 && m.meta.ProtoMax >= protoDefs
}

// tick ends expired restart graces and failed graces, and repeats
// unanswered sync requests (and asks members whose definitions have not
// arrived). It visits no record unless a grace ends, and
// runs often. It returns the members whose FailedGrace ended (their
// records are no longer in force).
func (s *replica) tick(now time.Time) (expired []string) {
	for name, m := range s.members {
		if m.failedGrace && !now.Before(m.failedUntil) {
			m.failedGrace, m.failedUntil = false, time.Time{}
			s.stats.FailedGraceExpired++
			if o := s.origins[name]; o != nil {
				s.markOrigin(name, o)
			}
			expired = append(expired, name)
		}
	}
	for name, o := range s.origins {
		if o.prev != nil && !now.Before(o.graceUntil) {
			s.stats.GraceExpired++
			s.dropPrev(name, o)
		}
		if m := s.members[name]; (o.awaiting || s.wantsDefs(m, o)) && now.Sub(o.lastSyncReq) >= syncRetry {
			if m != nil && m.state == StateAlive && m.metaErr == nil {
				s.syncFrom(name, o, now)
			}
		}
	}
	return expired
}

// reap removes tombstones older than ttl and forgets members gone for
// longer than retention. It visits every record: the Cluster runs it a few
// times per TombstoneTTL.
func (s *replica) reap(now time.Time, ttl, retention time.Duration) (expired []string) {
	expired = s.tick(now)
	for name, o := range s.origins {
		for k, r := range o.recs {
			if _, shadows := o.prev[k]; r.rec.Deleted && !shadows && now.Sub(r.at) >= ttl {
				delete(o.recs, k)
				s.unindex(name, k)
			}
		}
	}
	for name, m := range s.members {
		if name == s.self || m.state == StateAlive || m.failedGrace || now.Sub(m.since) < retention {
			continue
		}
		s.setOrigin(name, nil)
		delete(s.members, name)
	}
	return expired
}

// eachEffective calls f for every remote record in force.
func (s *replica) eachEffective(f func(vni uint32, k pkey, p peerdb.Peer)) {
	for vni := range s.byVNI {
		for k, p := range s.peers(vni) {
			f(vni, k, p)
		}
	}
}

// sameMeta reports whether two metadata carry the same replication-relevant
// fields (the application state does not concern the records).
func sameMeta(a, b nodeMeta) bool {
	return a.ProtoMin == b.ProtoMin && a.ProtoMax == b.ProtoMax && a.Incarnation == b.Incarnation && a.VTEP == b.VTEP &&
		a.Interest == b.Interest
}
