package cluster

import (
	"cmp"
	"log/slog"
	"slices"

	"github.com/overlayd/overlayd/peerdb"
)

// shard is one delivery goroutine's work: the keys whose effective value
// may differ from what was delivered. A VNI always maps to one shard, so
// its events are ordered and never delivered concurrently.
type shard struct {
	dirty map[uint32]map[pkey]struct{} // guarded by Cluster.mu
	wake  chan struct{}
}

func (c *Cluster) shardOf(vni uint32) *shard {
	return c.shards[int(vni%uint32(len(c.shards)))]
}

// markDirtyLocked notes that (vni, k) may have changed and wakes its
// shard. Expects c.mu held; never blocks.
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

// deliveryLoop turns the shard's dirty keys into events: for each, prev is
// what was delivered and next is what is in force now; equal pairs are
// skipped, so any number of changes between two runs coalesce into one
// event per key (level-triggered). The Sink is called without any lock.
func (c *Cluster) deliveryLoop(sh *shard) {
	for {
		select {
		case <-sh.wake:
		case <-c.stop:
			return
		}
		evs := c.collect(sh)
		if len(evs) == 0 {
			continue
		}
		c.eventsOut.Add(uint64(len(evs)))
		if err := c.cfg.Sink.ApplyPeerEvents(evs); err != nil {
			// The Sink applied the valid events and reported the others;
			// blind redelivery would repeat the rejected ones with a prev
			// the Sink never had. Count, log, go on.
			c.sinkErrors.Add(1)
			c.logLimited(slog.LevelError, "sink", "applying peer events failed", "events", len(evs), "error", err)
		}
	}
}

func (c *Cluster) collect(sh *shard) []Event {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(sh.dirty) == 0 {
		return nil
	}
	dirty := sh.dirty
	sh.dirty = make(map[uint32]map[pkey]struct{})
	var evs []Event
	for vni, keys := range dirty {
		del := c.delivered[vni]
		for k := range keys {
			next, ok := c.store.effective(vni, k)
			prev, had := del[k]
			switch {
			case ok && had && prev == next, !ok && !had:
				continue
			}
			ev := Event{VNI: vni, Origin: k.Origin}
			if had {
				p := prev
				ev.Prev = &p
			}
			if ok {
				n := next
				ev.Next = &n
				if del == nil {
					del = make(map[pkey]peerdb.Peer)
					c.delivered[vni] = del
				}
				del[k] = next
			} else {
				delete(del, k)
			}
			evs = append(evs, ev)
		}
		if len(del) == 0 {
			delete(c.delivered, vni)
		}
	}
	sortEvents(evs)
	return evs
}

// sortEvents orders events by VNI (the Sink batches consecutive events of
// one network), deletes first, then updates, then creates (so an IP that
// moves is freed before it is claimed again), then by origin and endpoint
// (deterministic).
func sortEvents(evs []Event) {
	kind := func(e *Event) int {
		switch {
		case e.Next == nil:
			return 0
		case e.Prev != nil:
			return 1
		}
		return 2
	}
	id := func(e *Event) string {
		if e.Next != nil {
			return e.Next.EndpointID
		}
		return e.Prev.EndpointID
	}
	slices.SortFunc(evs, func(a, b Event) int {
		return cmp.Or(cmp.Compare(a.VNI, b.VNI), cmp.Compare(kind(&a), kind(&b)),
			cmp.Compare(a.Origin, b.Origin), cmp.Compare(id(&a), id(&b)))
	})
}

// resync marks every delivered and every effective key dirty: the
// delivery then repairs any difference (there should be none).
func (c *Cluster) resync() {
	c.mu.Lock()
	defer c.mu.Unlock()
	for vni, del := range c.delivered {
		for k := range del {
			c.markDirtyLocked(vni, k)
		}
	}
	c.store.eachEffective(func(vni uint32, k pkey, _ peerdb.Peer) {
		c.markDirtyLocked(vni, k)
	})
}
