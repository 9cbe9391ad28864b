package ipam

import (
	"slices"
	"sort"

	"github.com/overlayd/overlayd/internal/logkeys"
)

// checkConflictsLocked finds allocations of this host in ranges it does not own
// (a broken invariant or a wrong reclaim: never expected), logs each once
// at ERROR and keeps them for Status. before: this host's spans before the
// change (nil: check everything); an unchanged ownership is not scanned.
func (p *pool) checkConflictsLocked(a *Allocator, before []span) {
	if before != nil && slices.Equal(before, p.ring.owned(a.self)) {
		return
	}
	for _, x := range p.allocs.sorted {
		owner := p.ring.ownerOf(x)
		if owner == a.self {
			delete(p.conflicts, x)
			continue
		}
		if prev, ok := p.conflicts[x]; ok && prev == owner {
			continue
		}
		p.conflicts[x] = owner
		a.log.Error("ipam: this host holds an allocation in a range another host owns: the address may be handed out twice",
			logkeys.Event, logkeys.IPAMConflict, logkeys.Pool, p.id, logkeys.Address, addrOf(x).String(), logkeys.Owner, owner.String())
	}
}

// Status returns the allocator's state for `overlayd status`.
func (a *Allocator) Status() Status {
	a.mu.Lock()
	st := Status{Node: a.self.Name, HostID: a.self.hexID(), DroppedMessages: a.dropped.Load()}
	for id := range a.reclaimed {
		st.Reclaimed = append(st.Reclaimed, id.String())
	}
	peers := make(map[string]Identity, len(a.peers))
	for k, v := range a.peers {
		peers[k] = v
	}
	reclaimed := make(map[Identity]bool, len(a.reclaimed))
	for id := range a.reclaimed {
		reclaimed[id] = true
	}
	a.mu.Unlock()
	sort.Strings(st.Reclaimed)
	states := a.memberStates()
	st.Pools = []PoolStatus{}
	for _, p := range a.allPools() {
		st.Pools = append(st.Pools, a.poolStatus(p, states, peers, reclaimed))
	}
	return st
}

func (a *Allocator) poolStatus(p *pool, states map[string]MemberState, peers map[string]Identity, reclaimed map[Identity]bool) PoolStatus {
	p.mu.Lock()
	defer p.mu.Unlock()
	ps := PoolStatus{
		PoolID:  p.id,
		Prefix:  p.spec.prefix.String(),
		Range:   formatRange(span{p.spec.lo, p.spec.hi}),
		Gateway: p.spec.gatewayAddr().String(),
		InUse:   p.refs,
		Size:    p.spec.size(),
		Ranges:  []RangeStatus{},
		Owners:  []OwnerStatus{},
	}
	switch {
	case p.claim != nil:
		ps.PendingClaim = "this host claims the pool's ring (" + p.claim.id.String() + ")"
	case p.vote != nil && p.ring == nil:
		ps.PendingClaim = "this host accepted " + p.vote.proposer.Name + "'s claim (" + p.vote.String() + ") and awaits its outcome"
	}
	for x, owner := range p.conflicts {
		ps.Conflicts = append(ps.Conflicts, addrOf(x).String()+" is allocated here but owned by "+owner.String())
	}
	sort.Strings(ps.Conflicts)
	if p.ring == nil {
		return ps
	}
	mine := a.statsLocked(p)
	ps.LocalOwned, ps.LocalFree, ps.LocalUsed = mine.owned, mine.free, mine.used
	for _, sp := range p.ring.owned(a.self) {
		used := p.allocs.countIn(sp)
		ps.Ranges = append(ps.Ranges, RangeStatus{First: addrOf(sp.first).String(), Last: addrOf(sp.last).String(),
			Size: sp.size(), Used: used, Free: sp.size() - used})
	}
	for id, n := range p.ring.owners() {
		o := OwnerStatus{Node: id.Name, HostID: id.hexID(), Owned: n}
		switch {
		case id == a.self:
			o.State, o.Reported, o.Free, o.Used = "self", true, mine.free, mine.used
		case reclaimed[id]:
			o.State = "reclaimed"
		default:
			if s, ok := states[id.Name]; !ok {
				o.State = "gone"
			} else if cur, known := peers[id.Name]; known && cur != id {
				o.State = "gone" // the name runs as another identity now
			} else {
				o.State = s.String()
			}
			if r, ok := p.reports[id]; ok {
				o.Reported, o.Free, o.Used, o.Since = true, r.stats.free, r.stats.used, r.at
			}
		}
		if o.Reported {
			ps.ClusterFree += o.Free
			ps.ClusterUsed += o.Used
		} else {
			ps.Unreported += o.Owned
		}
		ps.Owners = append(ps.Owners, o)
	}
	sort.Slice(ps.Owners, func(i, j int) bool {
		if ps.Owners[i].Node != ps.Owners[j].Node {
			return ps.Owners[i].Node < ps.Owners[j].Node
		}
		return ps.Owners[i].HostID < ps.Owners[j].HostID
	})
	return ps
}
