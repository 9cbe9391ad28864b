package ipam

import (
	"context"
	"fmt"
	"sort"

	"github.com/overlayd/overlayd/internal/logkeys"
)

// Reclaim makes this host the owner of every range owned by node's
// identities and marks them reclaimed cluster-wide (invariant 6). node must
// be gone for good: its containers' addresses become free here. It is
// refused while a member named node is alive or suspect, unless the
// identities to reclaim are earlier installations of it (the running one
// is never reclaimed). Run it on one host only: two hosts reclaiming the
// same node at once would both own its space (reported as a conflict).
func (a *Allocator) Reclaim(ctx context.Context, node string) (ReclaimResult, error) {
	if err := a.refuseIfReclaimed(); err != nil {
		return ReclaimResult{}, err
	}
	if err := checkName(node); err != nil {
		return ReclaimResult{}, fmt.Errorf("node: %w", err)
	}
	if node == a.self.Name {
		return ReclaimResult{}, fmt.Errorf("node %q is this host: reclaim a gone host's space from another host", node)
	}
	st, member := a.memberState(node)
	a.mu.Lock()
	current, knownCurrent := a.peers[node]
	a.mu.Unlock()
	live := member && (st == Alive || st == Suspect)
	if live && !knownCurrent {
		return ReclaimResult{}, fmt.Errorf("node %s is %s, and its identity is not known here yet: reclaim is for a host gone for good", node, describeState(st, true))
	}
	// Every identity of that name this host knows of.
	ids := map[Identity]bool{}
	for _, p := range a.allPools() {
		p.mu.Lock()
		if p.ring != nil {
			for id := range p.ring.owners() {
				if id.Name == node {
					ids[id] = true
				}
			}
		}
		p.mu.Unlock()
	}
	if knownCurrent {
		ids[current] = true
	}
	if live {
		delete(ids, current)
	}
	a.mu.Lock()
	for id := range ids {
		if _, done := a.reclaimed[id]; done {
			delete(ids, id)
		}
	}
	a.mu.Unlock()
	if len(ids) == 0 {
		if live {
			return ReclaimResult{}, fmt.Errorf("node %s is %s (identity %s): reclaim is for a host gone for good; stop it first", node, describeState(st, true), current)
		}
		return ReclaimResult{}, fmt.Errorf("node %s owns no address space this host knows of (nothing to reclaim)", node)
	}
	res := ReclaimResult{Node: node}
	var entries []reclaimEntry
	for id := range ids {
		res.Identities = append(res.Identities, id.hexID())
		entries = append(entries, reclaimEntry{id: id, by: a.self})
	}
	sort.Strings(res.Identities)
	puts := map[string][]byte{}
	a.mu.Lock()
	for _, e := range entries {
		a.reclaimed[e.id] = e.by
		puts[prefixReclaimed+e.id.String()] = mustJSON(reclaimRecord{By: e.by.String(), At: a.now().Unix()})
	}
	a.mu.Unlock()
	for _, p := range a.allPools() {
		p.mu.Lock()
		a.dropVotesLocked(p, ids, puts)
		if p.ring != nil {
			if n := p.ring.reclaim(ids, a.self); n > 0 {
				puts[prefixPool+p.id] = encodePoolRecord(p.refs, p.ring)
				res.Pools = append(res.Pools, ReclaimedPool{PoolID: p.id, Addresses: n})
				for id := range ids {
					a.log.Info("ipam: reclaimed the address space of a gone host", logkeys.Event, logkeys.IPAMReclaimed,
						logkeys.Pool, p.id, logkeys.Member, node, logkeys.HostID, id.hexID(), logkeys.Count, n)
				}
			}
		}
		p.mu.Unlock()
	}
	if err := a.journal.wait(a.journal.mark(puts)); err != nil {
		return res, fmt.Errorf("failed to record the reclaim of %s in the state file: %w", node, err)
	}
	a.broadcastPools(a.allPools())
	return res, nil
}

// dropVotesLocked ends this host's votes for claims of gone identities.
func (a *Allocator) dropVotesLocked(p *pool, gone map[Identity]bool, puts map[string][]byte) {
	if p.vote != nil && gone[p.vote.proposer] && p.claim == nil {
		p.vote = nil
		puts[prefixVote+p.id] = nil
	}
}

// applyReclaimed takes reclaimed identities another host sent.
func (a *Allocator) applyReclaimed(entries []reclaimEntry) {
	if len(entries) == 0 {
		return
	}
	puts := map[string][]byte{}
	gone := map[Identity]bool{}
	a.mu.Lock()
	for _, e := range entries {
		if _, ok := a.reclaimed[e.id]; ok {
			continue
		}
		a.reclaimed[e.id] = e.by
		gone[e.id] = true
		puts[prefixReclaimed+e.id.String()] = mustJSON(reclaimRecord{By: e.by.String(), At: a.now().Unix()})
		if e.id == a.self && a.reclaimedBy == nil {
			a.setReclaimedByLocked(e.by)
			a.log.Error("ipam: another host reclaimed this host's address space: refusing every request from now on",
				logkeys.Event, logkeys.IPAMIdentityReclaimed, logkeys.Member, e.by.Name)
		}
	}
	a.mu.Unlock()
	if len(gone) == 0 {
		return
	}
	for _, p := range a.allPools() {
		p.mu.Lock()
		a.dropVotesLocked(p, gone, puts)
		p.mu.Unlock()
	}
	a.journal.mark(puts)
}
