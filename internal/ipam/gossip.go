package ipam

import (
	"math/rand/v2"
	"sort"

	"github.com/overlayd/overlayd/internal/logkeys"
)

// Anti-entropy: a ring this host changed (a claim won, a donation given,
// a reclaim, a pool's use on this host) goes to every alive member; every
// gossip interval one random alive member gets all rings; a member that
// appears (joins or returns) gets all rings; a member that sends a view
// older than this host's gets this host's back. Each rings message carries
// the sender's own figures per pool (owned, free, used, in use) and every
// reclaimed identity the sender knows. Nothing leaves this host before it
// is on disk (sendMsg waits for the journal).

// statsLocked returns this host's figures for p.
func (a *Allocator) statsLocked(p *pool) ownerStats {
	st := ownerStats{inUse: p.refs > 0}
	if p.ring == nil {
		return st
	}
	for _, sp := range p.ring.owned(a.self) {
		st.owned += sp.size()
		st.used += p.allocs.countIn(sp)
	}
	st.free = st.owned - st.used
	return st
}

// ringsMessages packs the views of pools into messages of at most about
// packTarget bytes each; the first carries the reclaimed identities. The
// messages are numbered as their figures are read, under announceMu: of two
// rings messages, the one with the higher number has the newer figures,
// whichever is sent or arrives first.
func (a *Allocator) ringsMessages(pools []*pool) []*message {
	a.announceMu.Lock()
	defer a.announceMu.Unlock()
	a.mu.Lock()
	var recl []reclaimEntry
	for id, by := range a.reclaimed {
		recl = append(recl, reclaimEntry{id: id, by: by})
	}
	a.mu.Unlock()
	sort.Slice(recl, func(i, j int) bool { return recl[i].id.compare(recl[j].id) < 0 })
	if len(recl) > maxWireIdents {
		recl = recl[:maxWireIdents]
	}
	cur := &message{kind: kindRings, reclaimed: recl}
	size := 64 + len(recl)*2*(maxNameLen/4+9)
	out := []*message{cur}
	for _, p := range pools {
		p.mu.Lock()
		v := poolView{pool: p.id, stats: a.statsLocked(p)}
		if p.ring != nil {
			v.ring = p.ring.clone()
		}
		p.mu.Unlock()
		est := len(p.id) + 32
		if v.ring != nil {
			est += 10*len(v.ring.tokens) + 8*len(v.ring.owners())*8
		}
		if len(cur.pools) > 0 && (size+est > packTarget || len(cur.pools) >= maxWirePools) {
			cur = &message{kind: kindRings}
			out = append(out, cur)
			size = 64
		}
		cur.pools = append(cur.pools, v)
		size += est
	}
	for _, m := range out {
		m.seq = a.seq.Add(1)
	}
	return out
}

// sendRings sends the views of pools to one member.
func (a *Allocator) sendRings(to string, pools []*pool) {
	for _, m := range a.ringsMessages(pools) {
		a.sendMsg(to, m)
	}
}

// broadcastPools sends the views of pools to every alive member.
func (a *Allocator) broadcastPools(pools []*pool) {
	members := a.aliveMembers()
	if len(members) == 0 {
		return
	}
	for _, m := range a.ringsMessages(pools) {
		if !a.durable() {
			return
		}
		b, err := a.encode(m)
		if err != nil {
			a.log.Warn("ipam: failed to encode a rings message", logkeys.Error, err)
			return
		}
		for _, n := range members {
			a.enqueue(n, b)
		}
	}
}

// durable writes everything marked so far; false if that failed (then
// nothing may leave this host: it could tell others of a change its disk
// does not hold).
func (a *Allocator) durable() bool {
	if err := a.journal.sync(); err != nil {
		a.log.Warn("ipam: state not written; sending nothing until it is", logkeys.Error, err)
		return false
	}
	return true
}

// antiEntropy sends all rings to one random alive member, the pools whose
// figures changed since the last tick to every alive member (so status
// totals lag by one interval, not by the time a random pick takes to reach
// everyone), and asks about votes left waiting.
func (a *Allocator) antiEntropy() {
	a.queryStaleVotes()
	members := a.aliveMembers()
	if len(members) == 0 {
		return
	}
	pools := a.allPools()
	var changed []*pool
	for _, p := range pools {
		p.mu.Lock()
		if st := a.statsLocked(p); st != p.announced {
			p.announced = st
			changed = append(changed, p)
		}
		p.mu.Unlock()
	}
	if len(changed) > 0 {
		a.broadcastPools(changed)
	}
	a.sendRings(members[rand.IntN(len(members))], pools)
}

// membersChanged sends all rings to members that appeared alive.
func (a *Allocator) membersChanged() {
	alive := a.aliveMembers()
	now := map[string]bool{}
	var fresh []string
	a.mu.Lock()
	for _, n := range alive {
		now[n] = true
		if !a.alive[n] {
			fresh = append(fresh, n)
		}
	}
	a.alive = now
	a.mu.Unlock()
	if len(fresh) == 0 {
		return
	}
	pools := a.allPools()
	for _, n := range fresh {
		a.sendRings(n, pools)
	}
}

// handleRings merges a rings message and answers with this host's views
// where they are newer than the sender's.
func (a *Allocator) handleRings(m *message) {
	a.applyReclaimed(m.reclaimed)
	back := a.mergeRings(m.from, m.seq, m.pools, true)
	a.mu.Lock()
	theirs := make(map[Identity]bool, len(m.reclaimed))
	for _, r := range m.reclaimed {
		theirs[r.id] = true
	}
	missing := false
	for id := range a.reclaimed {
		missing = missing || !theirs[id]
	}
	a.mu.Unlock()
	if len(back) > 0 || missing {
		a.sendRings(m.from.Name, back)
	}
}

// mergeRings folds views from the member from into this host's, records
// its figures (withStats: views from a rings message, sequence number seq),
// and returns the pools where this host knows more than the view.
func (a *Allocator) mergeRings(from Identity, seq uint64, views []poolView, withStats bool) (newer []*pool) {
	for _, v := range views {
		spec, err := parsePoolID(v.pool)
		if err != nil {
			continue // the decoder validated it
		}
		p := a.poolFor(spec)
		if p == nil {
			continue
		}
		puts := map[string][]byte{}
		p.mu.Lock()
		var before []span
		if p.ring != nil {
			before = p.ring.owned(a.self)
		}
		if v.ring != nil {
			a.adoptRingLocked(p, v.ring, puts)
		}
		if p.ring != nil && (v.ring == nil || !v.ring.covers(p.ring)) {
			newer = append(newer, p)
		}
		if withStats {
			if r, ok := p.reports[from]; !ok || r.seq < seq {
				p.reports[from] = report{stats: v.stats, seq: seq, at: a.now()}
			}
		}
		var gained []span
		if p.ring != nil {
			gained = subtract(p.ring.owned(a.self), before)
		}
		if len(puts) > 0 {
			a.journal.mark(puts)
		}
		p.mu.Unlock()
		for _, g := range gained {
			a.log.Info("ipam: received address space from another host", logkeys.Event, logkeys.IPAMSpaceMoved,
				logkeys.Pool, p.id, logkeys.From, from.String(), logkeys.To, a.self.String(),
				logkeys.Range, formatRange(g), logkeys.Count, g.size())
		}
	}
	return newer
}

// subtract returns the parts of spans a not in spans b (both sorted,
// disjoint).
func subtract(a, b []span) []span {
	var out []span
	j := 0
	for _, s := range a {
		cur := s
		for j < len(b) && b[j].last < cur.first {
			j++
		}
		k := j
		for k < len(b) && b[k].first <= cur.last {
			if b[k].first > cur.first {
				out = append(out, span{cur.first, b[k].first - 1})
			}
			if b[k].last >= cur.last {
				cur.first, cur.last = 1, 0 // consumed
				break
			}
			cur.first = b[k].last + 1
			k++
		}
		if cur.first <= cur.last {
			out = append(out, cur)
		}
	}
	return out
}
