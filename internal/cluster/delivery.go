package cluster

import (
	"cmp"
	"slices"

	"github.com/overlayd/overlayd/peerdb"
)

// shard is one delivery goroutine's work: per VNI, the keys whose record
// in force may have changed since the Watcher was last told. A VNI always
// maps to one shard, so the Watcher's calls for it are ordered and never
// concurrent.
type shard struct {
	dirty map[uint32]map[pkey]struct{} // guarded by Cluster.mu
	// all: VNIs whose every record may have changed (their definitions
	// in force did); reported with keys nil. Guarded by Cluster.mu.
	all  map[uint32]struct{}
	wake chan struct{}
}

func (c *Cluster) shardOf(vni uint32) *shard {
	return c.shards[int(vni%uint32(len(c.shards)))]
}

// markDirtyLocked notes that (vni, k) may have changed and wakes its
// shard. It never blocks.
func (c *Cluster) markDirtyLocked(vni uint32, k pkey) {
	sh := c.shardOf(vni)
	set := sh.dirty[vni]
	if set == nil {
		set = make(map[pkey]struct{})
		sh.dirty[vni] = set
	}
	set[k] = struct{}{}
	select {
	case sh.wake <- struct{}{}:
	default:
	}
}

// markVNILocked notes that the definitions in force for vni may have
// changed: the Watcher is told PeersChanged(vni, nil). It never blocks.
func (c *Cluster) markVNILocked(vni uint32) {
	sh := c.shardOf(vni)
	if sh.all == nil {
		sh.all = make(map[uint32]struct{})
	}
	sh.all[vni] = struct{}{}
	select {
	case sh.wake <- struct{}{}:
	default:
	}
}

// change is one Watcher call: the dirty keys of one VNI.
type change struct {
	vni  uint32
	keys []peerdb.Key
}

// deliveryLoop tells the Watcher which keys of its shard's VNIs may have
// changed: everything marked since its previous run, one call per VNI in
// VNI order, keys sorted. Any number of changes between two runs coalesce
// into one call per VNI. The Watcher is called without any cluster lock
// (it pulls with Peer/Peers, which take Cluster.mu).
func (c *Cluster) deliveryLoop(sh *shard) {
	for {
		select {
		case <-sh.wake:
		case <-c.stop:
			return
		}
		for _, ch := range c.takeDirty(sh) {
			if c.closed.Load() {
				return
			}
			c.changeCalls.Add(1)
			c.changedKeys.Add(uint64(len(ch.keys)))
			c.cfg.Watcher.PeersChanged(ch.vni, ch.keys)
		}
	}
}

// takeDirty takes the shard's dirty keys and returns them as calls, by VNI
// with sorted keys.
func (c *Cluster) takeDirty(sh *shard) []change {
	c.mu.Lock()
	if len(sh.dirty) == 0 && len(sh.all) == 0 {
		c.mu.Unlock()
		return nil
	}
	dirty, all := sh.dirty, sh.all
	sh.dirty, sh.all = make(map[uint32]map[pkey]struct{}), nil
	c.mu.Unlock()
	out := make([]change, 0, len(dirty)+len(all))
	for vni := range all {
		out = append(out, change{vni: vni}) // keys nil: pull everything
	}
	for vni, set := range dirty {
		if _, ok := all[vni]; ok {
			continue
		}
		keys := make([]peerdb.Key, 0, len(set))
		for k := range set {
			keys = append(keys, peerdb.Key{VNI: vni, Origin: k.Origin, EndpointID: k.EndpointID})
		}
		slices.SortFunc(keys, compareKeys)
		out = append(out, change{vni: vni, keys: keys})
	}
	slices.SortFunc(out, func(a, b change) int { return cmp.Compare(a.vni, b.vni) })
	return out
}

// compareKeys orders keys by VNI, origin, endpoint id.
func compareKeys(a, b peerdb.Key) int {
	return cmp.Or(cmp.Compare(a.VNI, b.VNI), cmp.Compare(a.Origin, b.Origin), cmp.Compare(a.EndpointID, b.EndpointID))
}

// Peer returns the record in force for k (never one of this node's own):
// a live record of an alive member's current incarnation whose VTEP is
// the one the member advertises, or its previous record during a restart
// or VTEP-change grace, or the record of a member declared dead (not
// left) within FailedGrace after its death. Safe for concurrent use; it
// takes only Cluster.mu, briefly (callers may hold a network lock), never
// blocks otherwise and never calls out.
func (c *Cluster) Peer(k peerdb.Key) (peerdb.Peer, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.peerLocked(k)
}

// peerLocked is Peer's rule, for Peer and PeersOf.
func (c *Cluster) peerLocked(k peerdb.Key) (peerdb.Peer, bool) {
	if k.Origin == c.cfg.NodeName {
		return peerdb.Peer{}, false
	}
	return c.replica.effective(k.VNI, pkey{k.Origin, k.EndpointID})
}

// PeersOf sets found[i] to what Peer(keys[i]) returns, for every i
// (len(found) == len(keys)), under one acquisition of Cluster.mu: a
// receiver's pull of a burst takes the lock once per batch, not once per
// record against the receive path, which takes it once per message. The
// caller bounds the batch, and with it how long the lock is held.
func (c *Cluster) PeersOf(keys []peerdb.Key, found []peerdb.Found) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i, k := range keys {
		found[i].Peer, found[i].OK = c.peerLocked(k)
	}
}

// Peers returns every record in force for vni, by key (an empty map if
// none). Same rules as Peer. Its cost is proportional to the records the
// cluster holds for vni (a per-VNI index), not to all records.
func (c *Cluster) Peers(vni uint32) map[peerdb.Key]peerdb.Peer {
	c.mu.Lock()
	defer c.mu.Unlock()
	keys := c.replica.byVNI[vni]
	out := make(map[peerdb.Key]peerdb.Peer, len(keys))
	for k := range keys {
		if p, ok := c.replica.effective(vni, k); ok {
			out[peerdb.Key{VNI: vni, Origin: k.Origin, EndpointID: k.EndpointID}] = p
		}
	}
	return out
}
