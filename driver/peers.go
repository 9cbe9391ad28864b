package driver

import (
	"errors"
	"fmt"

	"github.com/overlayd/overlayd/peerdb"
)

// pullLookahead is how many keys a keyed pull looks up with
// PeerSource.PeersOf in one call: the source's lock is held for as many
// lookups (tens of microseconds), and the network keeps room for as many
// answers (about 13 KB).
const pullLookahead = 128

// PeersChanged tells the driver that the source's records for keys of vni
// may have changed (keys nil: any record of vni). The network that has vni
// pulls their current values under its lock and programs the difference;
// a VNI no network has is ignored (a network created later pulls
// everything). It never fails: what cannot be applied is reported in
// Status and retried by the periodic reconcile.
//
// It blocks on the network's lock: the control plane calls it from its own
// delivery goroutines, never from a gossip callback. Calls may come in any
// order and be repeated: the network always pulls the current values.
func (d *Driver) PeersChanged(vni uint32, keys []peerdb.Key) {
	n := d.lockNetworkByVNI(vni)
	if n == nil {
		return
	}
	defer n.mu.Unlock()
	if err := d.pullLocked(n, vni, keys); err != nil {
		d.log.Warn("programming remote peers failed; the periodic reconcile retries", "network", n.id, "vni", vni, "error", err)
	}
}

// pullLocked brings n's records of vni in line with the source: the
// records of keys, or all of them when keys is nil; then programs the
// kernel.
func (d *Driver) pullLocked(n *network, vni uint32, keys []peerdb.Key) error {
	src := d.cfg.Peers
	var delta peerdb.Delta
	var rej []peerdb.Rejection
	// The records of hosts whose definition of vni contradicts n's (or
	// has not arrived) are refused: taken as absent, so they are removed
	// if programmed. A keyed pull asks only about the origins of its
	// records; a full pull (keys nil) compares and logs every host's
	// definition.
	if keys == nil {
		bad := d.checkRemoteDefinitionsLocked(n, vni)
		delta, rej = n.peers.SyncVNI(vni, withoutHosts(src.Peers(vni), bad))
	} else {
		check := originCheck{look: d.cfg.Definitions, n: n, vni: vni}
		lookup := n.lookupAheadLocked(src, keys)
		delta, rej = n.peers.Pull(vni, keys, func(i int) (peerdb.Peer, bool) {
			if check.refuses(keys[i].Origin) {
				return peerdb.Peer{}, false
			}
			return lookup(i)
		})
	}
	n.noteRejectionsLocked(d, rej)
	d.trace(TraceEvent{Kind: TracePull, Network: n.id, VNI: vni})
	if faultActive(FaultDropPeerDeletes) {
		delta.NeighDel, delta.FDBDel = nil, nil
	}
	return d.programLocked(n, delta)
}

// lookupAheadLocked returns the lookup of keys[i] at src for a keyed
// pull, which asks in order of i: with PeersOf, pullLookahead keys at a
// time into n.found; a single key with one Peer call. n.mu stays held
// until the pull is done (n.found is reused).
func (n *network) lookupAheadLocked(src PeerSource, keys []peerdb.Key) func(i int) (peerdb.Peer, bool) {
	if len(keys) < 2 {
		return func(i int) (peerdb.Peer, bool) { return src.Peer(keys[i]) }
	}
	if n.found == nil {
		n.found = make([]peerdb.Found, pullLookahead)
	}
	from, to := 0, 0 // n.found holds the answers for keys[from:to]
	return func(i int) (peerdb.Peer, bool) {
		if i < from || i >= to {
			from, to = i, min(i+pullLookahead, len(keys))
			src.PeersOf(keys[from:to], n.found[:to-from])
		}
		f := &n.found[i-from]
		return f.Peer, f.OK
	}
}

// pullAllLocked pulls every VNI of n.
func (d *Driver) pullAllLocked(n *network) error {
	var errs []error
	for _, s := range n.subnets {
		if err := d.pullLocked(n, s.vni, nil); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// programLocked writes a change of n's desired peer state to its sandbox, with
// the encryption state of new VTEPs in place before their peers and the
// state of VTEPs gone removed after.
func (d *Driver) programLocked(n *network, delta peerdb.Delta) error {
	if n.sb == nil || delta.Empty() {
		return nil
	}
	var errs []error
	if n.encrypted {
		if err := d.widenEncLocked(n, delta); err != nil {
			errs = append(errs, err)
		}
	}
	if err := n.sb.ApplyDelta(delta); err == nil {
		d.counts.peerChanges.Add(uint64(len(delta.NeighSet) + len(delta.NeighDel) + len(delta.FDBSet) + len(delta.FDBDel)))
	} else {
		// The peer table is the truth: fall back to the level-triggered path.
		d.log.Warn("peer programming failed, reconciling the network", "network", n.id, "error", err)
		if _, rerr := n.sb.Reconcile(n.peers.Desired()); rerr != nil {
			errs = append(errs, fmt.Errorf("network %q: %w", n.id, rerr))
		}
	}
	if n.encrypted {
		if err := d.syncEncLocked(n, false); err != nil {
			errs = append(errs, err)
		}
	}
	err := errors.Join(errs...)
	n.lastErr = err
	return err
}

// noteRejectionsLocked logs records that n newly refuses (once per key and
// reason), so a misconfigured peer is visible where the operator looks; all
// current ones are listed by Status.
func (n *network) noteRejectionsLocked(d *Driver, rej []peerdb.Rejection) {
	for _, r := range rej {
		msg := r.Err.Error()
		if n.logged[r.Key] == msg {
			continue
		}
		if n.logged == nil {
			n.logged = map[peerdb.Key]string{}
		}
		n.logged[r.Key] = msg
		d.log.Warn("refusing a remote peer record (it stays with the control plane and is taken when valid)",
			"network", n.id, "vni", r.Key.VNI, "origin", r.Key.Origin, "endpoint", r.Key.EndpointID, "error", r.Err)
	}
	if len(n.logged) > 0 {
		// Forget logged keys that are no longer rejected, so a relapse is
		// logged again.
		still := map[peerdb.Key]bool{}
		for _, r := range n.peers.Rejected() {
			still[r.Key] = true
		}
		for k := range n.logged {
			if !still[k] {
				delete(n.logged, k)
			}
		}
	}
}
