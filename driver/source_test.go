package driver

import (
	"errors"
	"fmt"
	"sync"

	"github.com/overlayd/overlayd/peerdb"
)

// memSource is the control plane's part in driver tests: an in-memory
// owner of remote records that notifies the driver as the cluster does
// (records first, then PeersChanged with their keys). It is not a kernel
// fake: the cluster has its own tests; here only the pull contract between
// a source and the networks matters.
type memSource struct {
	mu   sync.Mutex
	recs map[peerdb.Key]peerdb.Peer
	// Lookups, as the cluster counts none: Peer calls, PeersOf calls and
	// the keys these asked for.
	peerCalls, batchCalls, batchKeys int
}

func newMemSource() *memSource { return &memSource{recs: map[peerdb.Key]peerdb.Peer{}} }

func (s *memSource) Peer(k peerdb.Key) (peerdb.Peer, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.peerCalls++
	p, ok := s.recs[k]
	return p, ok
}

// PeersOf implements PeerSource, counting the batches and their keys.
func (s *memSource) PeersOf(keys []peerdb.Key, found []peerdb.Found) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.batchCalls++
	s.batchKeys += len(keys)
	for i, k := range keys {
		found[i].Peer, found[i].OK = s.recs[k]
	}
}

// lookups returns the counts of Peer calls, PeersOf calls and keys asked
// by PeersOf.
func (s *memSource) lookups() (peer, batches, batchKeys int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.peerCalls, s.batchCalls, s.batchKeys
}

func (s *memSource) Peers(vni uint32) map[peerdb.Key]peerdb.Peer {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[peerdb.Key]peerdb.Peer{}
	for k, p := range s.recs {
		if k.VNI == vni {
			out[k] = p
		}
	}
	return out
}

// PeerEvent is a remote change as tests describe it: create (nil, Next),
// update (Prev, Next) or delete (Prev, nil) of the record of an endpoint
// owned by the host whose VTEP the record names.
type PeerEvent struct {
	VNI  uint32
	Prev *peerdb.Peer
	Next *peerdb.Peer
}

// keyOf is the source key of a test record: one origin per VTEP.
func keyOf(vni uint32, p *peerdb.Peer) peerdb.Key {
	return peerdb.Key{VNI: vni, Origin: "host-" + p.VTEP.String(), EndpointID: p.EndpointID}
}

// apply changes the records as evs say and returns the keys touched, per
// VNI in order of first touch.
func (s *memSource) apply(evs []PeerEvent) (vnis []uint32, keys map[uint32][]peerdb.Key) {
	s.mu.Lock()
	defer s.mu.Unlock()
	keys = map[uint32][]peerdb.Key{}
	for _, ev := range evs {
		if _, ok := keys[ev.VNI]; !ok {
			vnis = append(vnis, ev.VNI)
		}
		if ev.Prev != nil {
			k := keyOf(ev.VNI, ev.Prev)
			if cur, ok := s.recs[k]; ok && cur == *ev.Prev {
				delete(s.recs, k)
			}
			keys[ev.VNI] = append(keys[ev.VNI], k)
		}
		if ev.Next != nil {
			k := keyOf(ev.VNI, ev.Next)
			s.recs[k] = *ev.Next
			keys[ev.VNI] = append(keys[ev.VNI], k)
		}
	}
	return vnis, keys
}

// source returns the memSource every test driver is made with.
func source(d *Driver) *memSource { return d.cfg.Peers.(*memSource) }

// applyPeerEvents changes the source's records and notifies the driver,
// as the control plane does. It returns an error naming the records the
// network refused (they stay at the source), like the push API the pull
// path replaced did for invalid events.
func applyPeerEvents(d *Driver, evs ...PeerEvent) error {
	vnis, keys := source(d).apply(evs)
	var errs []error
	for _, vni := range vnis {
		d.PeersChanged(vni, keys[vni])
		if n := d.lockNetworkByVNI(vni); n != nil {
			for _, r := range n.peers.Rejected() {
				for _, k := range keys[vni] {
					if r.Key == k {
						errs = append(errs, fmt.Errorf("record %s refused: %w", k, r.Err))
					}
				}
			}
			n.mu.Unlock()
		}
	}
	return errors.Join(errs...)
}

// applyPeerEvent is applyPeerEvents for one event.
func applyPeerEvent(d *Driver, ev PeerEvent) error { return applyPeerEvents(d, ev) }
