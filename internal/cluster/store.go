package cluster

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"time"

	"github.com/hashicorp/memberlist"
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
	lastHeard time.Time // last accepted message from it
	// suspectSince: this node's probe of it failed (memberlist then
	// suspects it); cleared by any sign of life.
	suspectSince time.Time
	rtt          time.Duration // last direct probe round trip
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
	// prev: the previous incarnation's effective records, kept effective
	// (where recs has no entry) until this incarnation's first complete
	// view or graceUntil, so a quick restart of a node does not flap its
	// peers on every other node.
	prev        map[recKey]peerdb.Peer
	graceUntil  time.Time
	lastSyncReq time.Time
	// awaiting: a snapshot was asked for and no complete view (snapshot
	// or matching digest) came since; the request is repeated.
	awaiting bool
}

func newOrigin(inc uint64) *origin {
	return &origin{inc: inc, recs: make(map[recKey]*rrec)}
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
	MemberFailures                                 uint64
}

// store is the replicated remote state: membership as memberlist reports
// it and the records of every origin. It is not safe for concurrent use:
// the Cluster calls it with Cluster.mu held. Its hooks are called with that
// lock held and must not block.
type store struct {
	self            string
	members         map[string]*member
	origins         map[string]*origin
	grace           time.Duration // RestartGrace
	syncMinInterval time.Duration // between two sync requests to one origin
	stats           storeStats

	// dirty reports that the effective value of (vni, k) may have changed.
	dirty func(vni uint32, k pkey)
	// requestSync asks origin for its snapshot.
	requestSync func(origin string)
	// sendSnapshot sends this node's snapshot to the member requester.
	sendSnapshot func(requester string)
}

func newStore(self string) *store {
	return &store{
		self:            self,
		members:         make(map[string]*member),
		origins:         make(map[string]*origin),
		syncMinInterval: 500 * time.Millisecond,
		dirty:           func(uint32, pkey) {},
		requestSync:     func(string) {},
		sendSnapshot:    func(string) {},
	}
}

// recordHash is the digest contribution of a live record. It must be the
// same function on every node (FNV-1a over a fixed layout).
func recordHash(r *record) uint64 {
	var b [4 + 1 + maxEndpointIDLen + 8 + 4 + 6 + 16]byte
	p := binary.BigEndian.AppendUint32(b[:0], r.VNI)
	p = append(p, byte(len(r.EndpointID)))
	p = append(p, r.EndpointID...)
	p = binary.BigEndian.AppendUint64(p, r.Version)
	ip := r.IP.As4()
	p = append(p, ip[:]...)
	p = append(p, r.MAC[:]...)
	v := r.VTEP.As16()
	p = append(p, v[:]...)
	h := fnv.New64a()
	h.Write(p)
	return h.Sum64()
}

// memberAlive records that memberlist considers n alive (join, update, or
// back from dead), reading its metadata.
func (s *store) memberAlive(n *memberlist.Node, now time.Time) {
	meta, err := decodeMeta(n.Meta)
	m := s.members[n.Name]
	if m == nil {
		m = &member{name: n.Name}
		s.members[n.Name] = m
	}
	wasAlive := m.state == StateAlive
	oldMeta, oldErr := m.meta, m.metaErr
	m.node = *n
	m.node.Meta = append([]byte(nil), n.Meta...)
	m.meta, m.metaErr = meta, err
	if !wasAlive {
		m.since = now
		m.leaving = false
	}
	m.state = StateAlive
	m.lastHeard = now
	m.suspectSince = time.Time{}
	if n.Name == s.self {
		return
	}
	o := s.origins[n.Name]
	if err != nil {
		if o != nil {
			s.markOrigin(n.Name, o) // no longer effective
		}
		return
	}
	switch {
	case o == nil:
		s.origins[n.Name] = newOrigin(meta.Incarnation)
		s.syncFrom(n.Name, nil, now)
	case o.inc == meta.Incarnation:
		// Same incarnation: back from dead (a false positive or a healed
		// partition) or metadata fixed. Its stored records are effective
		// again; ask for what changed meanwhile.
		s.markOrigin(n.Name, o)
		if !wasAlive || oldErr != nil || !sameMeta(oldMeta, meta) {
			s.syncFrom(n.Name, o, now)
		}
	default:
		// The node restarted: records of the old incarnation are void.
		s.stats.IncarnationChanges++
		no := newOrigin(meta.Incarnation)
		if wasAlive && oldErr == nil && o.inc == oldMeta.Incarnation && s.grace > 0 {
			no.prev = s.effectiveSet(o, oldMeta)
			no.graceUntil = now.Add(s.grace)
		}
		s.markOrigin(n.Name, o)
		s.origins[n.Name] = no
		s.syncFrom(n.Name, nil, now)
	}
}

// memberGone records that memberlist declared the node dead, or that it
// left. Its records stop being effective (the delivery turns them into
// deletes). A dead node's records are kept (not effective) so a healed
// partition restores them at once; a node that left is forgotten.
func (s *store) memberGone(n *memberlist.Node, now time.Time) MemberState {
	m := s.members[n.Name]
	if m == nil {
		m = &member{name: n.Name, node: *n}
		m.node.Meta = append([]byte(nil), n.Meta...)
		m.meta, m.metaErr = decodeMeta(n.Meta)
		s.members[n.Name] = m
	}
	state := StateDead
	if m.leaving {
		state = StateLeft
	} else if m.state == StateAlive {
		s.stats.MemberFailures++
	}
	m.state = state
	m.since = now
	if n.Name == s.self {
		return state
	}
	if o := s.origins[n.Name]; o != nil {
		s.markOrigin(n.Name, o)
		o.prev = nil
		if state == StateLeft {
			delete(s.origins, n.Name)
		}
	}
	return state
}

// markOrigin marks every key o holds or shadows dirty.
func (s *store) markOrigin(name string, o *origin) {
	for k := range o.recs {
		s.dirty(k.VNI, pkey{name, k.EndpointID})
	}
	for k := range o.prev {
		s.dirty(k.VNI, pkey{name, k.EndpointID})
	}
}

// effectiveSet returns o's currently effective peers under meta.
func (s *store) effectiveSet(o *origin, meta nodeMeta) map[recKey]peerdb.Peer {
	set := make(map[recKey]peerdb.Peer, o.live+len(o.prev))
	for k, p := range o.prev {
		if _, ok := o.recs[k]; !ok {
			set[k] = p
		}
	}
	for k, r := range o.recs {
		if !r.rec.Deleted && r.rec.VTEP == meta.VTEP {
			set[k] = r.rec.peer()
		}
	}
	return set
}

func (s *store) syncFrom(name string, o *origin, now time.Time) {
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
// of an alive origin's current incarnation whose VTEP is the origin's, or
// the previous incarnation's during a restart grace. Never one of ours.
func (s *store) effective(vni uint32, k pkey) (peerdb.Peer, bool) {
	m := s.members[k.Origin]
	if m == nil || m.state != StateAlive || m.metaErr != nil || k.Origin == s.self {
		return peerdb.Peer{}, false
	}
	o := s.origins[k.Origin]
	if o == nil || o.inc != m.meta.Incarnation {
		return peerdb.Peer{}, false
	}
	rk := recKey{VNI: vni, EndpointID: k.EndpointID}
	if r := o.recs[rk]; r != nil {
		if r.rec.Deleted || r.rec.VTEP != m.meta.VTEP {
			return peerdb.Peer{}, false
		}
		return r.rec.peer(), true
	}
	if p, ok := o.prev[rk]; ok {
		return p, true
	}
	return peerdb.Peer{}, false
}

// apply validates m against the membership and merges it. It returns a
// drop reason (and detail) if m is refused; then nothing of it was applied.
func (s *store) apply(m *message, now time.Time) (DropReason, string) {
	if m.Origin == s.self {
		return DropSelfOrigin, "message claims to come from this node"
	}
	mem := s.members[m.Origin]
	switch {
	case mem == nil:
		return DropUnknownOrig, fmt.Sprintf("origin %q is not a member", m.Origin)
	case mem.state != StateAlive:
		return DropUnknownOrig, fmt.Sprintf("origin %q is %s", m.Origin, mem.state)
	case mem.metaErr != nil:
		return DropBadMeta, fmt.Sprintf("origin %q: %v", m.Origin, mem.metaErr)
	case m.Incarnation != mem.meta.Incarnation:
		return DropIncarnation, fmt.Sprintf("origin %q incarnation %d, member advertises %d",
			m.Origin, m.Incarnation, mem.meta.Incarnation)
	}
	for i := range m.Records {
		r := &m.Records[i]
		if !r.Deleted && r.VTEP != mem.meta.VTEP {
			return DropVTEPMatch, fmt.Sprintf("origin %q record VNI %d endpoint %q has VTEP %v, origin advertises %v",
				m.Origin, r.VNI, r.EndpointID, r.VTEP, mem.meta.VTEP)
		}
	}
	// Everything is valid: apply.
	mem.lastHeard = now
	mem.suspectSince = time.Time{}
	switch m.Type {
	case msgSyncRequest:
		s.sendSnapshot(m.Origin)
		return "", ""
	case msgLeave:
		mem.leaving = true
		return "", ""
	}
	o := s.origins[m.Origin]
	if o == nil || o.inc != m.Incarnation {
		// memberAlive keeps origins in step with the metadata; be safe.
		if o != nil {
			s.markOrigin(m.Origin, o)
		}
		o = newOrigin(m.Incarnation)
		s.origins[m.Origin] = o
	}
	switch m.Type {
	case msgDelta:
		s.stats.Deltas++
		for i := range m.Records {
			s.mergeRecord(m.Origin, o, &m.Records[i], now, false)
		}
	case msgSnapshot:
		s.applySnapshot(m.Origin, o, m, now)
	case msgDigest:
		s.applyDigest(m.Origin, o, m, now)
	}
	return "", ""
}

// mergeRecord keeps r if it is newer than what o has for its key. The
// merge is a last-writer-wins register per key ordered by the origin's
// version: idempotent, commutative and associative, so reordered,
// duplicated or coalesced messages converge.
func (s *store) mergeRecord(name string, o *origin, r *record, now time.Time, fromSnapshot bool) {
	k := r.key()
	cur := o.recs[k]
	if cur != nil && r.Version <= cur.rec.Version || cur == nil && r.Version <= o.floor && !fromSnapshot {
		s.stats.StaleRecords++
		return
	}
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
	s.dirty(k.VNI, pkey{name, k.EndpointID})
}

// applySnapshot merges the origin's complete live set as of its clock
// m.AsOf: records it lacks whose version is <= AsOf were deleted at the
// origin (their tombstones may be reaped there), so they go; newer ones
// stay.
func (s *store) applySnapshot(name string, o *origin, m *message, now time.Time) {
	if m.AsOf < o.floor {
		s.stats.StaleSnapshots++
		return
	}
	s.stats.Snapshots++
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
		if !r.rec.Deleted {
			o.live--
			o.hash -= recordHash(&r.rec)
			s.dirty(k.VNI, pkey{name, k.EndpointID})
		}
		delete(o.recs, k)
	}
	o.floor = m.AsOf
	o.maxVer = max(o.maxVer, m.AsOf)
	s.setComplete(name, o)
}

// applyDigest compares the origin's summary with ours. A match makes our
// view complete as of the digest's clock; a mismatch asks for a snapshot.
func (s *store) applyDigest(name string, o *origin, m *message, now time.Time) {
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
					delete(o.recs, k) // the floor now rejects what it guarded against
				}
			}
		}
		s.setComplete(name, o)
		return
	}
	s.stats.DigestMismatches++
	s.syncFrom(name, o, now)
}

func (s *store) setComplete(name string, o *origin) {
	o.complete = true
	o.awaiting = false
	if o.prev != nil {
		for k := range o.prev {
			s.dirty(k.VNI, pkey{name, k.EndpointID})
		}
		o.prev = nil
	}
}

// syncRetry is how long a sync request waits for its answer (a snapshot
// or a matching digest) before it is repeated: requests and small
// snapshots travel as UDP packets.
const syncRetry = time.Second

// tick ends expired restart graces and repeats unanswered sync requests.
// It is cheap (no record is visited) and runs often.
func (s *store) tick(now time.Time) {
	for name, o := range s.origins {
		if o.prev != nil && !now.Before(o.graceUntil) {
			s.stats.GraceExpired++
			for k := range o.prev {
				s.dirty(k.VNI, pkey{name, k.EndpointID})
			}
			o.prev = nil
		}
		if o.awaiting && now.Sub(o.lastSyncReq) >= syncRetry {
			if m := s.members[name]; m != nil && m.state == StateAlive && m.metaErr == nil {
				s.syncFrom(name, o, now)
			}
		}
	}
}

// reap removes tombstones older than ttl and forgets members gone for
// longer than retention. It visits every record: the Cluster runs it a few
// times per TombstoneTTL.
func (s *store) reap(now time.Time, ttl, retention time.Duration) {
	s.tick(now)
	for _, o := range s.origins {
		for k, r := range o.recs {
			if r.rec.Deleted && now.Sub(r.at) >= ttl {
				delete(o.recs, k)
			}
		}
	}
	for name, m := range s.members {
		if name == s.self || m.state == StateAlive || now.Sub(m.since) < retention {
			continue
		}
		if o := s.origins[name]; o != nil {
			s.markOrigin(name, o)
			delete(s.origins, name)
		}
		delete(s.members, name)
	}
}

// eachEffective calls f for every effective remote record.
func (s *store) eachEffective(f func(vni uint32, k pkey, p peerdb.Peer)) {
	for name, o := range s.origins {
		m := s.members[name]
		if m == nil || m.state != StateAlive || m.metaErr != nil || o.inc != m.meta.Incarnation {
			continue
		}
		for rk, p := range s.effectiveSet(o, m.meta) {
			f(rk.VNI, pkey{name, rk.EndpointID}, p)
		}
	}
}

// sameMeta reports whether two metadata carry the same replication-relevant
// fields (the application state does not concern the records).
func sameMeta(a, b nodeMeta) bool {
	return a.ProtoMin == b.ProtoMin && a.ProtoMax == b.ProtoMax && a.Incarnation == b.Incarnation && a.VTEP == b.VTEP
}
