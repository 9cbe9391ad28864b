package cluster

import (
	"slices"

	"github.com/overlayd/overlayd/internal/netdef"
)

// Interest: a record change goes only to the members that have its VNI.
//
// A node's interest is the set of VNIs it has a network definition of
// (defs.go): the driver publishes one per VNI of every local network, for
// as long as the network exists, and a host needs the records of exactly
// those VNIs. The set already travels as a record kind of its own (the
// defs message: the node's complete set, versioned by its clock, sent on
// change, with every snapshot and every digest, a last-writer-wins
// register per origin), so interest needs no message, no metadata beyond
// one flag, and no anti-entropy of its own: what a node holds as a
// member's definitions is what it holds as that member's interest. Node
// metadata (512 bytes in memberlist) could not hold a list or bitmap of
// thousands of VNIs; the defs set has no such limit.
//
// A node advertises with the metaInterest flag (Config.Interest; the
// daemon sets it) that its definitions are its interest. Between two
// nodes that both advertise it, the origin O sends a member R:
//
//   - deltas with only the records of the VNIs of R's set (the batch is
//     encoded once per distinct selection, not once per member);
//   - digests over those VNIs only: (O's clock, live count and hash of
//     O's records of them; localStore keeps them per VNI, so a digest
//     costs one lookup per VNI); and in the digest rounds that follow a
//     change, a digest that would tell R what the previous one did (O
//     sent R no record since, its own definitions did not change) is
//     skipped; the idle round (DigestMaxInterval) goes to every member
//     as before, and so does a digest once DigestMaxInterval passed
//     since the previous one: a change of a 5-host network costs 4
//     deltas and 4 digests, not a digest to every member;
//   - snapshots with only those VNIs' records: R drops what it held of O
//     outside them (a lost interest stops costing anything), and its
//     floor and tombstones work as before, per origin.
//
// When R's set gains VNIs (a defs message with VNIs the previous one of
// the same incarnation lacked) and O has live records of any of them, O
// sends R its snapshot (pull by the origin: it acts once it knows, so the
// order in which R's set and R's requests arrive does not matter); in any
// case O digests R soon, which repairs a lost snapshot and removes what R
// may have kept of those VNIs from before it left them. Until O holds a set of R's
// current incarnation (a restart, a join: the set follows the sync
// request), O sends R everything, as to a member that does not advertise
// interest: never less than R wants, and the next snapshot trims it.
//
// Memberlist's push/pull state (LocalState) does not know its receiver
// and stays O's complete snapshot; R applies it filtered by its own
// definitions when both advertise interest, so push/pull does not undo
// the filtering. R's and O's view of R's set differ only until R's
// latest set reaches O (it goes out at once, and again with every
// digest); a digest mismatch meanwhile costs one sync request (rate
// limited as always) and converges when the views do.
//
// Members that do not advertise interest (older overlayd, or Interest
// off) get everything and are sent their digests and snapshots whole,
// exactly as before; definitions and application messages still go to
// every member.

// interest is the VNIs a member wants records of: the key set of its
// definitions as the replica holds them. The replica replaces an origin's
// definitions as a whole and never modifies them in place, so an interest
// may be read after Cluster.mu is released. nil means every VNI.
type interest map[uint32]netdef.Definition

// wants reports whether vni is in the set (always for nil).
func (in interest) wants(vni uint32) bool {
	if in == nil {
		return true
	}
	_, ok := in[vni]
	return ok
}

// vniSum is the live count and hash of one VNI's local records.
type vniSum struct {
	live int
	hash uint64
}

// interestOf returns what member name wants: its definitions if both it
// and this node advertise interest and a set of its current incarnation
// has arrived, else nil (everything).
func (s *replica) interestOf(name string) interest {
	if !s.interest {
		return nil
	}
	m := s.members[name]
	if m == nil || m.metaErr != nil || !m.meta.Interest {
		return nil
	}
	o := s.origins[name]
	if o == nil || o.inc != m.meta.Incarnation || o.defsVer == 0 {
		return nil
	}
	if o.defs == nil {
		return interest{}
	}
	return interest(o.defs)
}

// filtersFrom reports whether this node applies origin name's push/pull
// snapshots filtered by its own interest: both advertise interest.
func (s *replica) filtersFrom(name string) bool {
	m := s.members[name]
	return s.interest && m != nil && m.metaErr == nil && m.meta.Interest
}

// gained reports to interestGained the VNIs of nu that member name's
// known set o.defs lacks, if both advertise interest. A set carried over
// from a previous incarnation (defsVer 0) was not known: that member was
// sent everything, nothing is gained.
func (s *replica) gained(name string, o *origin, nu map[uint32]netdef.Definition) {
	if !s.interest || o.defsVer == 0 {
		return
	}
	if m := s.members[name]; m == nil || m.metaErr != nil || !m.meta.Interest || m.meta.Incarnation != o.inc {
		return
	}
	var added []uint32
	for vni := range nu {
		if _, ok := o.defs[vni]; !ok {
			added = append(added, vni)
		}
	}
	if len(added) > 0 {
		slices.Sort(added)
		s.interestGained(name, added)
	}
}

// digestFor summarises the live records of the VNIs of want as of the
// current clock (all of them for nil).
func (l *localStore) digestFor(want interest) *message {
	l.mu.Lock()
	defer l.mu.Unlock()
	m := &message{Type: msgDigest, Origin: l.name, Incarnation: l.inc, AsOf: l.clock}
	if want == nil {
		m.Count, m.Hash = uint64(l.live), l.hash
		return m
	}
	add := func(s vniSum) {
		m.Count += uint64(s.live)
		m.Hash += s.hash
	}
	if len(want) < len(l.byVNI) {
		for vni := range want {
			if s, ok := l.byVNI[vni]; ok {
				add(s)
			}
		}
	} else {
		for vni, s := range l.byVNI {
			if want.wants(vni) {
				add(s)
			}
		}
	}
	return m
}

// snapshotFor returns the live records of the VNIs of want as of the
// current clock (all of them for nil).
func (l *localStore) snapshotFor(want interest) *message {
	if want == nil {
		return l.snapshot()
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for vni := range want {
		n += l.byVNI[vni].live
	}
	m := &message{Type: msgSnapshot, Origin: l.name, Incarnation: l.inc, AsOf: l.clock,
		Records: make([]record, 0, n)}
	if n == 0 {
		return m
	}
	for _, r := range l.recs {
		if !r.rec.Deleted && want.wants(r.rec.VNI) {
			m.Records = append(m.Records, r.rec)
		}
	}
	return m
}

// hasLive reports whether this node has a live record of any of vnis.
func (l *localStore) hasLive(vnis []uint32) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, vni := range vnis {
		if l.byVNI[vni].live > 0 {
			return true
		}
	}
	return false
}

// defines reports whether this node has a definition of vni (its own
// interest).
func (l *localStore) defines(vni uint32) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, ok := l.defs[vni]
	return ok
}

// defsVersion returns the clock value of this node's last definition
// change.
func (l *localStore) defsVersion() uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.defsVer
}

// deltaSets encodes one publisher batch for members of different
// interests: once per distinct selection of the batch's VNIs, so members
// with the same networks share the encoding (and the bytes).
type deltaSets struct {
	c     *Cluster
	recs  []record
	vnis  []uint32 // the batch's distinct VNIs, sorted
	all   *deltaSet
	byKey map[string]*deltaSet
}

// deltaSet is one selection's deltas, and whether a record of it has an
// IPv6 address (a member of an older protocol gets a snapshot instead).
type deltaSet struct {
	msgs  [][]byte
	needs byte // the lowest protocol that decodes every record of msgs
}

func newDeltaSets(c *Cluster, recs []record) *deltaSets {
	s := &deltaSets{c: c, recs: recs}
	for i := range recs {
		s.vnis = append(s.vnis, recs[i].VNI)
	}
	slices.Sort(s.vnis)
	s.vnis = slices.Compact(s.vnis)
	return s
}

func (s *deltaSets) encode(sel []record) *deltaSet {
	needs := protocolVersionMin
	for i := range sel {
		needs = max(needs, sel[i].needs())
	}
	return &deltaSet{msgs: s.c.encodeDeltas(sel), needs: needs}
}

// forInterest returns the batch's deltas for a member that wants want
// (none when none of the batch concerns it), and whether a record of them
// has an IPv6 address.
func (s *deltaSets) forInterest(want interest) ([][]byte, byte) {
	if want != nil {
		key := make([]byte, (len(s.vnis)+7)/8)
		n := 0
		for i, vni := range s.vnis {
			if want.wants(vni) {
				key[i/8] |= 1 << (i % 8)
				n++
			}
		}
		switch n {
		case 0:
			return nil, protocolVersionMin
		case len(s.vnis):
			// Every VNI of the batch: the whole batch.
		default:
			set, ok := s.byKey[string(key)]
			if !ok {
				var sel []record
				for i := range s.recs {
					if want.wants(s.recs[i].VNI) {
						sel = append(sel, s.recs[i])
					}
				}
				set = s.encode(sel)
				if s.byKey == nil {
					s.byKey = make(map[string]*deltaSet)
				}
				s.byKey[string(key)] = set
			}
			return set.msgs, set.needs
		}
	}
	if s.all == nil {
		s.all = s.encode(s.recs)
	}
	return s.all.msgs, s.all.needs
}

// filterOwnInterestLocked drops from a push/pull snapshot of origin name the
// records of VNIs this node has no definition of, when both advertise
// interest (see the top of this file).
func (c *Cluster) filterOwnInterestLocked(m *message) {
	if m.Type != msgSnapshot || !c.replica.filtersFrom(m.Origin) {
		return
	}
	kept := m.Records[:0]
	for _, r := range m.Records {
		if c.local.defines(r.VNI) {
			kept = append(kept, r)
		}
	}
	m.Records = kept
}
