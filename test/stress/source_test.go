//go:build testhooks

package stress

import (
	"cmp"
	"fmt"
	"maps"
	"math/rand"
	"net/netip"
	"slices"
	"strings"

	"github.com/overlayd/overlayd/internal/lockorder"
	"github.com/overlayd/overlayd/peerdb"
)

// source is the harness's control plane: the one owner of remote records
// (driver.PeerSource), an in-memory map Key → Peer that the workers mutate
// and then notify the driver about (PeersChanged with the keys they
// touched), as internal/cluster does. Its lock is at LevelCluster like the
// cluster's: the driver calls Peer and Peers with a network lock held.
//
// It holds whatever the workers put there, invalid records included: the
// driver must refuse what does not fit (and list it in Status), never
// trust the source.
//
// When recording (traced runs), it also remembers what each pull read, per
// VNI, until the driver's TracePull event for that VNI takes it (see
// recorder.trace): the replay re-creates the records a pull saw. A VNI is
// pulled only by the network that has it, under that network's lock, so
// the reads of one VNI between two of its TracePull events are one pull's.
type source struct {
	mu     *lockorder.Mutex
	recs   map[uint32]map[peerdb.Key]peerdb.Peer // guarded by mu
	record bool                                  // immutable after newSource
	reads  map[uint32]*pullReads                 // guarded by mu
	// lost counts mutations never notified (see gen.lostOp); guarded by mu.
	lost int
}

// pullReads is what one pull read from the source: every record of the
// VNI (full, Peers) or the keys it asked for (Peer), found or not.
type pullReads struct {
	full bool
	read []srcRead
}

// srcRead is one record a pull read; Peer is nil when the source had none
// for Key.
type srcRead struct {
	Key  peerdb.Key
	Peer *peerdb.Peer `json:",omitempty"`
}

func newSource(record bool) *source {
	return &source{mu: lockorder.New(lockorder.LevelCluster), recs: map[uint32]map[peerdb.Key]peerdb.Peer{}, record: record,
		reads: map[uint32]*pullReads{}}
}

// Peer implements driver.PeerSource.
func (s *source) Peer(k peerdb.Key) (peerdb.Peer, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.peerLocked(k)
}

// PeersOf implements driver.PeerSource, as the cluster does: the
// driver's pulls of many keys take this path.
func (s *source) PeersOf(keys []peerdb.Key, found []peerdb.Found) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, k := range keys {
		found[i].Peer, found[i].OK = s.peerLocked(k)
	}
}

// peerLocked looks k up and records the read. Expects s.mu held.
func (s *source) peerLocked(k peerdb.Key) (peerdb.Peer, bool) {
	p, ok := s.recs[k.VNI][k]
	if s.record {
		r := s.reads[k.VNI]
		if r == nil {
			r = &pullReads{}
			s.reads[k.VNI] = r
		}
		rd := srcRead{Key: k}
		if ok {
			q := p
			rd.Peer = &q
		}
		r.read = append(r.read, rd)
	}
	return p, ok
}

// Peers implements driver.PeerSource.
func (s *source) Peers(vni uint32) map[peerdb.Key]peerdb.Peer {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := maps.Clone(s.recs[vni])
	if out == nil {
		out = map[peerdb.Key]peerdb.Peer{}
	}
	if s.record {
		r := &pullReads{full: true}
		for _, k := range sortedKeys(out) {
			p := out[k]
			r.read = append(r.read, srcRead{Key: k, Peer: &p})
		}
		s.reads[vni] = r
	}
	return out
}

// takeReads returns (and forgets) what the pull of vni that just ended read.
func (s *source) takeReads(vni uint32) (full bool, read []srcRead) {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.reads[vni]
	delete(s.reads, vni)
	if r == nil {
		return false, nil
	}
	return r.full, r.read
}

// set and del change one record; expect mu held.
func (s *source) setLocked(k peerdb.Key, p peerdb.Peer) {
	m := s.recs[k.VNI]
	if m == nil {
		m = map[peerdb.Key]peerdb.Peer{}
		s.recs[k.VNI] = m
	}
	m[k] = p
}

func (s *source) delLocked(k peerdb.Key) {
	if m := s.recs[k.VNI]; m != nil {
		delete(m, k)
		if len(m) == 0 {
			delete(s.recs, k.VNI)
		}
	}
}

// keysLocked returns the keys of vni, sorted (so that a worker's draw
// depends only on its seed and the records, not on map order).
func (s *source) keysLocked(vni uint32) []peerdb.Key { return sortedKeys(s.recs[vni]) }

// mutate runs fn with the source locked: the workers' changes, each made
// in one critical section (as a gossip message is applied by the cluster).
func (s *source) mutate(fn func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	fn()
}

// snapshot returns every record, by key.
func (s *source) snapshot() map[peerdb.Key]peerdb.Peer {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[peerdb.Key]peerdb.Peer{}
	for _, m := range s.recs {
		maps.Copy(out, m)
	}
	return out
}

// takeLost returns how many mutations were never notified since the last
// call.
func (s *source) takeLost() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := s.lost
	s.lost = 0
	return n
}

func sortedKeys[V any](m map[peerdb.Key]V) []peerdb.Key {
	return slices.SortedFunc(maps.Keys(m), compareKey)
}

func compareKey(a, b peerdb.Key) int {
	return cmp.Or(cmp.Compare(a.VNI, b.VNI), strings.Compare(a.Origin, b.Origin), strings.Compare(a.EndpointID, b.EndpointID))
}

// origin is a remote host as the source names it: one origin per remote
// VTEP; valid records of an origin carry its VTEP.
type origin struct {
	name string
	vtep netip.Addr
}

func originOf(vtep netip.Addr) origin { return origin{name: "host-" + vtep.String(), vtep: vtep} }

// staleSelf is the origin of a member that had this host's address (it
// failed and its records stay in force for the cluster's FailedGrace):
// its records claim the local VTEP, which must never become an encryption
// pair.
func staleSelf(local netip.Addr) origin { return origin{name: "stale-" + local.String(), vtep: local} }

// notification is one PeersChanged call.
type notification struct {
	vni  uint32
	keys []peerdb.Key // nil: every record of vni
}

func (n notification) String() string {
	if n.keys == nil {
		return fmt.Sprintf("PeersChanged(vni=%d, all)", n.vni)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "PeersChanged(vni=%d, [", n.vni)
	for i, k := range n.keys {
		if i > 0 {
			b.WriteString(" ")
		}
		b.WriteString(fmtKey(k))
	}
	b.WriteString("])")
	return b.String()
}

func fmtKey(k peerdb.Key) string { return fmt.Sprintf("%d/%s/%s", k.VNI, k.Origin, k.EndpointID) }

// byVNI groups keys into one notification per VNI, in order of first
// appearance, keys in the order given (duplicates kept: a notification may
// repeat a key).
func byVNI(keys []peerdb.Key) []notification {
	var out []notification
	idx := map[uint32]int{}
	for _, k := range keys {
		i, ok := idx[k.VNI]
		if !ok {
			i = len(out)
			idx[k.VNI] = i
			out = append(out, notification{vni: k.VNI, keys: []peerdb.Key{}})
		}
		out[i].keys = append(out[i].keys, k)
	}
	return out
}

// shuffled returns ns in a random order (notifications of different VNIs
// come from different delivery shards, in no particular order).
func shuffled(rng *rand.Rand, ns []notification) []notification {
	rng.Shuffle(len(ns), func(i, j int) { ns[i], ns[j] = ns[j], ns[i] })
	return ns
}
