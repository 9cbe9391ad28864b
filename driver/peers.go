package driver

import (
	"errors"
	"fmt"

	"github.com/overlayd/overlayd/peerdb"
)

// PeerEvent is a change of one remote peer record of the network that has
// VNI as one of its VNIs: create (nil, Next), update (Prev, Next) or delete
// (Prev, nil). An update removes what Prev programmed, then programs Next.
type PeerEvent struct {
	VNI  uint32
	Prev *peerdb.Peer
	Next *peerdb.Peer
}

// ApplyPeerEvent applies one remote peer event under the network's lock.
// Events for a network this host does not have are kept and applied when it
// is created. It blocks on the network's lock: the control plane calls it
// from its own ordered per-network delivery, never from a gossip callback.
func (d *Driver) ApplyPeerEvent(ev PeerEvent) error {
	return d.ApplyPeerEvents([]PeerEvent{ev})
}

// ApplyPeerEvents applies events in order, grouping consecutive events of one
// network so that their kernel programming is batched. Invalid events are
// skipped and reported in the returned error; the others are applied.
func (d *Driver) ApplyPeerEvents(evs []PeerEvent) error {
	var errs []error
	for start := 0; start < len(evs); {
		end := start + 1
		for end < len(evs) && evs[end].VNI == evs[start].VNI {
			end++
		}
		if err := d.applyForVNI(evs[start].VNI, evs[start:end]); err != nil {
			errs = append(errs, err)
		}
		start = end
	}
	return errors.Join(errs...)
}

func (d *Driver) applyForVNI(vni uint32, evs []PeerEvent) error {
	for _, ev := range evs {
		if ev.Prev == nil && ev.Next == nil {
			return fmt.Errorf("peer event for VNI %d has neither a previous nor a next record", vni)
		}
	}
	var n *network
	for {
		var unlock func()
		n, unlock = d.lockNetworkByVNI(vni)
		if n != nil {
			defer unlock()
			break
		}
		if stored, err := d.addPending(vni, evs); stored {
			return err
		}
		// A network with this VNI was created meanwhile: apply to it.
	}
	pevs := make([]peerdb.Event, len(evs))
	for i, ev := range evs {
		pevs[i] = peerdb.Event{Prev: ev.Prev, Next: ev.Next}
	}
	delta, perrs := n.peers.ApplyAll(pevs)
	var errs []error
	applied := pevs
	if perrs != nil {
		applied = make([]peerdb.Event, 0, len(pevs))
	}
	for i, e := range perrs {
		if e != nil {
			errs = append(errs, fmt.Errorf("peer event %d for network %q (VNI %d): %w", i, n.id, vni, e))
		} else {
			applied = append(applied, pevs[i])
		}
	}
	d.trace(TraceEvent{Kind: TracePeerEvents, Network: n.id, VNI: vni, Events: applied})
	if faultActive(FaultDropPeerDeletes) {
		delta.NeighDel, delta.FDBDel = nil, nil
	}
	if n.sb != nil && n.encrypted && !delta.Empty() {
		// SAs and policies for new VTEPs before traffic is sent to them.
		if err := d.syncEnc(n, true); err != nil {
			errs = append(errs, err)
		}
		defer func() {
			if err := d.syncEnc(n, false); err != nil {
				d.log.Warn("encryption state after peer events", "network", n.id, "error", err)
			}
		}()
	}
	if n.sb != nil {
		if err := n.sb.ApplyDelta(delta); err != nil {
			// The peer DB is the truth: fall back to the level-triggered path.
			d.log.Warn("peer programming failed, reconciling the network", "network", n.id, "error", err)
			if _, rerr := n.sb.Reconcile(n.peers.Desired()); rerr != nil {
				errs = append(errs, fmt.Errorf("network %q: %w", n.id, rerr))
			}
		}
	}
	return errors.Join(errs...)
}

// addPending keeps events for a VNI no network has (yet). It stores nothing
// and returns false if a network with the VNI exists by now.
func (d *Driver) addPending(vni uint32, evs []PeerEvent) (bool, error) {
	var errs []error
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.byVNI[vni] != nil {
		return false, nil
	}
	var applied []peerdb.Event
	defer func() { d.trace(TraceEvent{Kind: TracePending, VNI: vni, Events: applied}) }()
	for i, ev := range evs {
		if ev.Next != nil {
			if err := checkPeer(*ev.Next); err != nil {
				errs = append(errs, fmt.Errorf("peer event %d for VNI %d: %w", i, vni, err))
				continue
			}
		}
		applied = append(applied, peerdb.Event{Prev: ev.Prev, Next: ev.Next})
		if ev.Prev != nil {
			if set := d.pending[vni]; set != nil {
				delete(set, *ev.Prev)
				if len(set) == 0 {
					delete(d.pending, vni)
				}
			}
		}
		if ev.Next != nil {
			d.addPendingLocked(vni, *ev.Next)
		}
	}
	return true, errors.Join(errs...)
}

// addPendingLocked expects d.mu held.
func (d *Driver) addPendingLocked(vni uint32, p peerdb.Peer) {
	set := d.pending[vni]
	if set == nil {
		set = map[peerdb.Peer]struct{}{}
		d.pending[vni] = set
	}
	set[p] = struct{}{}
}

// checkPeer validates the fields of a record that can be checked without
// knowing its network's subnets.
func checkPeer(p peerdb.Peer) error {
	switch {
	case p.EndpointID == "":
		return errors.New("peer record: EndpointID is empty")
	case !p.IP.Is4():
		return fmt.Errorf("peer %q: IP %v is not an IPv4 address", p.EndpointID, p.IP)
	case !p.MAC.IsUnicast():
		return fmt.Errorf("peer %q: MAC %s is not a unicast address", p.EndpointID, p.MAC)
	case !p.VTEP.IsValid() || p.VTEP.IsUnspecified() || p.VTEP.IsMulticast():
		return fmt.Errorf("peer %q: VTEP %v is not a unicast IP address", p.EndpointID, p.VTEP)
	}
	return nil
}
