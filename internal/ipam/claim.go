package ipam

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sort"
	"strings"
	"time"

	"github.com/overlayd/overlayd/internal/logkeys"
)

// The claim protocol creates a pool's ring once (invariant 5). The
// proposer writes its claim and its own vote, asks every voter (this host
// and every member not left and not reclaimed), and wins with a majority
// of accepting votes. A voter writes its acceptance before answering and
// accepts at most one claim per pool until that claim is committed or
// aborted; one that knows the ring answers with it. The winner writes the
// ring (and drops its claim) in one write, then commits; a loser aborts,
// pauses a random while and tries again within the request's deadline.
// A voter left waiting by a proposer that went quiet asks it what became
// of its claim: the proposer answers with the ring, or with an abort when
// it has no such claim pending (a restarted proposer never won: the win
// and the ring are one write).

// claimState is this host's claim of a pool while it runs.
type claimState struct {
	id     claimID
	voters []string          // the other voters asked
	votes  map[string]bool   // voter → accepted
	why    map[string]string // voter → why it did not accept
	ring   *ring             // the ring a voter answered with
	done   chan struct{}     // closed when the outcome is known
	closed bool
}

// majority of the voters (the other voters and this host).
func (c *claimState) majority() int { return (len(c.voters)+1)/2 + 1 }

func (c *claimState) accepts() int {
	n := 1 // this host's own vote
	for _, ok := range c.votes {
		if ok {
			n++
		}
	}
	return n
}

// settle closes done once the outcome cannot change any more.
func (c *claimState) settle() {
	if c.closed {
		return
	}
	rejects := len(c.votes) + 1 - c.accepts()
	total := len(c.voters) + 1
	if c.ring != nil || c.accepts() >= c.majority() || total-rejects < c.majority() || len(c.votes) == len(c.voters) {
		c.closed = true
		close(c.done)
	}
}

// failure says why the claim did not win.
func (c *claimState) failure(pool string) error {
	var lines []string
	for _, v := range c.voters {
		switch ok, answered := c.votes[v]; {
		case !answered:
			lines = append(lines, v+": no answer")
		case !ok:
			lines = append(lines, v+": "+c.why[v])
		}
	}
	sort.Strings(lines)
	return refuse(ReasonNoMajority, fmt.Errorf("could not create the address ring of pool %s: a majority of the %d hosts of the cluster (%d) must agree, and %d did (%s)",
		pool, len(c.voters)+1, c.majority(), c.accepts(), strings.Join(lines, "; ")))
}

// voters returns the other members that vote: every member listed (alive,
// suspect or dead; left members are not listed) whose identity is not
// reclaimed.
func (a *Allocator) voters(ms []Member) []string {
	a.mu.Lock()
	defer a.mu.Unlock()
	var out []string
	for _, m := range ms {
		if m.Name == a.self.Name {
			continue
		}
		if id, ok := a.peers[m.Name]; ok {
			if _, gone := a.reclaimed[id]; gone {
				continue
			}
		}
		out = append(out, m.Name)
	}
	sort.Strings(out)
	return out
}

// ensureRing makes sure this host knows p's ring: claims it, or learns it
// from a voter that knows it.
func (a *Allocator) ensureRing(ctx context.Context, p *pool) error {
	p.mu.Lock()
	known := p.ring != nil
	p.mu.Unlock()
	if known {
		return nil
	}
	// Bounded by the request's deadline and by the request budget: a
	// claim that found no majority in that time will not find one by
	// trying longer, and dockerd's caller waits.
	ctx, cancel := context.WithTimeout(ctx, a.timing.request)
	defer cancel()
	var last error
	for attempt := 0; ; attempt++ {
		if attempt > 0 {
			pause := time.Duration(rand.Int64N(int64(a.timing.backoff))) + a.timing.backoff/4
			select {
			case <-ctx.Done():
			case <-time.After(pause):
			case <-a.reclaimedC:
			}
		}
		// Learnt meanwhile that this host's space was reclaimed: the
		// others drop its claims, so no round can end otherwise.
		if err := a.refuseIfReclaimed(); err != nil {
			return err
		}
		if ctx.Err() != nil {
			if last == nil {
				last = refuse(ReasonNoMajority, fmt.Errorf("could not create the address ring of pool %s in time", p.id))
			}
			return last
		}
		t := a.getTransport()
		if t == nil {
			return refuse(ReasonNotJoined, fmt.Errorf("pool %s: overlayd's cluster has not started yet, and the pool's address ring must be agreed with it; try again in a moment", p.id))
		}
		if !t.Joined() {
			return refuse(ReasonNotJoined, fmt.Errorf("pool %s: this host has not joined its cluster yet (it has seeds, and none answered), and it does not create a pool's address ring alone: it waits to join", p.id))
		}
		done, err := a.claimRound(ctx, p, t)
		if rerr := a.refuseIfReclaimed(); rerr != nil {
			return rerr
		}
		if done || err == nil {
			return err
		}
		if ctx.Err() != nil && last != nil {
			// The deadline cut this round short: its voters had no
			// time to answer ("no answer" even from hosts known to be
			// unreachable). The previous round ran to its end and
			// says why each one did not agree.
			return last
		}
		last = err
	}
}

// claimRound runs one claim of p's ring. done: stop (err says how it
// ended); otherwise err is why this round failed and another may follow.
func (a *Allocator) claimRound(ctx context.Context, p *pool, t Transport) (done bool, err error) {
	voters := a.voters(t.Members())
	p.mu.Lock()
	if p.ring != nil {
		p.mu.Unlock()
		return true, nil
	}
	if p.vote != nil {
		other := *p.vote
		p.mu.Unlock()
		// This host accepted another host's claim: ask what became of it.
		a.sendMsg(other.proposer.Name, &message{kind: kindQuery, pool: p.id, claim: other})
		return false, refuse(ReasonNoMajority, fmt.Errorf("could not create the address ring of pool %s: this host accepted %s's claim of it and awaits its outcome (%s is %s); "+
			"if %s is gone for good, run `overlayd ipam reclaim %s`", p.id, other.proposer.Name, other.proposer.Name,
			describeState(a.memberState(other.proposer.Name)), other.proposer.Name, other.proposer.Name))
	}
	c := &claimState{id: claimID{proposer: a.self, nonce: randomUint64()}, voters: voters,
		votes: map[string]bool{}, why: map[string]string{}, done: make(chan struct{})}
	p.claim = c
	p.vote, p.voteAt = &c.id, a.now()
	seq := a.journal.mark(map[string][]byte{prefixClaim + p.id: encodeClaim(c.id), prefixVote + p.id: encodeClaim(c.id)})
	c.settle()
	p.mu.Unlock()
	if err := a.journal.wait(seq); err != nil {
		p.mu.Lock()
		p.claim, p.vote = nil, nil
		a.journal.mark(map[string][]byte{prefixClaim + p.id: nil, prefixVote + p.id: nil})
		p.mu.Unlock()
		return true, fmt.Errorf("failed to record the claim of pool %s in the state file: %w", p.id, err)
	}
	if len(voters) > 0 {
		b, err := a.encode(&message{kind: kindPropose, pool: p.id, claim: c.id})
		if err != nil {
			return true, err
		}
		for _, v := range voters {
			// Not tracked by a.wg: Close may be waiting already; a send
			// ends within the transport's timeout.
			go func() {
				if err := t.Send(v, b); err != nil {
					a.recordVote(p, c.id, v, false, "unreachable: "+err.Error(), nil)
				}
			}()
		}
	}
	timer := time.NewTimer(a.timing.vote)
	select {
	case <-c.done:
	case <-timer.C:
	case <-ctx.Done():
	case <-a.stop:
	case <-a.reclaimedC:
	}
	timer.Stop()

	p.mu.Lock()
	p.claim = nil
	p.vote = nil
	won := p.ring == nil && c.accepts() >= c.majority()
	puts := map[string][]byte{prefixClaim + p.id: nil, prefixVote + p.id: nil}
	switch {
	case won:
		p.ring = newRing(p.spec.lo, p.spec.hi, a.self)
		puts[prefixPool+p.id] = encodePoolRecord(p.refs, p.ring)
	case c.ring != nil:
		a.adoptRingLocked(p, c.ring, puts)
	}
	var ring *ring
	if p.ring != nil {
		ring = p.ring.clone()
	}
	seq = a.journal.mark(puts)
	p.mu.Unlock()
	werr := a.journal.wait(seq)
	if won {
		// Committed only once the ring is on disk; if the write failed,
		// the ring is kept in memory and written with the next write, and
		// voters asking get it then.
		if werr != nil {
			return true, fmt.Errorf("failed to record the address ring of pool %s in the state file: %w", p.id, werr)
		}
		a.log.Info("ipam: created the address ring of a pool", logkeys.Event, logkeys.IPAMRingCreated,
			logkeys.Pool, p.id, logkeys.Voters, len(voters)+1)
		for _, v := range voters {
			a.sendMsg(v, &message{kind: kindCommit, pool: p.id, claim: c.id, ring: ring})
		}
		a.broadcastPools([]*pool{p})
		return true, nil
	}
	for _, v := range voters {
		a.sendMsg(v, &message{kind: kindAbort, pool: p.id, claim: c.id})
	}
	if ring != nil {
		return true, werr
	}
	p.mu.Lock()
	err = c.failure(p.id)
	p.mu.Unlock()
	return false, err
}

// adoptRingLocked takes r as p's ring (or merges it in), marking the
// change in puts. A ring that exists ends any vote this host
// holds for the pool.
func (a *Allocator) adoptRingLocked(p *pool, r *ring, puts map[string][]byte) bool {
	var before []span
	changed := false
	if p.ring == nil {
		p.ring = r.clone()
		changed = true
	} else {
		before = p.ring.owned(a.self)
		changed = p.ring.merge(r)
	}
	if p.vote != nil && p.claim == nil {
		p.vote = nil
		puts[prefixVote+p.id] = nil
	}
	if changed {
		puts[prefixPool+p.id] = encodePoolRecord(p.refs, p.ring)
		p.checkConflictsLocked(a, before)
	}
	return changed
}

// recordVote records a voter's answer to the claim id, if it still runs.
func (a *Allocator) recordVote(p *pool, id claimID, voter string, accept bool, why string, r *ring) {
	p.mu.Lock()
	defer p.mu.Unlock()
	c := p.claim
	if c == nil || c.id != id {
		return
	}
	if _, answered := c.votes[voter]; answered && !accept {
		return // a failed send after the answer
	}
	c.votes[voter] = accept
	if !accept {
		c.why[voter] = why
	}
	if r != nil {
		if c.ring == nil {
			c.ring = r.clone()
		} else {
			c.ring.merge(r)
		}
	}
	c.settle()
}

func (a *Allocator) memberState(name string) (MemberState, bool) {
	st, ok := a.memberStates()[name]
	return st, ok
}

// handlePropose answers a claim as a voter.
func (a *Allocator) handlePropose(m *message) {
	if m.claim.proposer != m.from {
		return // a host proposes only its own claims
	}
	spec, _ := parsePoolID(m.pool) // validated by the decoder
	p := a.poolFor(spec)
	if p == nil {
		return
	}
	reply := &message{kind: kindVote, pool: m.pool, claim: m.claim}
	p.mu.Lock()
	var query *claimID
	switch {
	case p.ring != nil:
		reply.reason = "it knows the pool's ring already"
		reply.ring = p.ring.clone()
	case p.vote != nil && *p.vote != m.claim:
		o := *p.vote
		reply.other = &o
		reply.reason = fmt.Sprintf("it accepted %s's claim", o.proposer.Name)
		if o.proposer != a.self && a.now().Sub(p.voteAt) >= a.timing.query {
			query = &o
		}
	case p.vote != nil:
		reply.accept = true // a repeated proposal: the same answer
	default:
		p.vote, p.voteAt = &m.claim, a.now()
		seq := a.journal.mark1(prefixVote+p.id, encodeClaim(m.claim))
		p.mu.Unlock()
		err := a.journal.wait(seq)
		p.mu.Lock()
		if err != nil {
			if p.vote != nil && *p.vote == m.claim {
				p.vote = nil
				a.journal.mark1(prefixVote+p.id, nil)
			}
			reply.reason = "it failed to record its vote"
		} else {
			reply.accept = p.vote != nil && *p.vote == m.claim
			if !reply.accept {
				reply.reason = "the claim ended while it voted"
			}
		}
	}
	p.mu.Unlock()
	a.sendMsg(m.from.Name, reply)
	if query != nil {
		a.sendMsg(query.proposer.Name, &message{kind: kindQuery, pool: m.pool, claim: *query})
	}
}

// handleVote takes a voter's answer to one of this host's claims.
func (a *Allocator) handleVote(m *message) {
	p := a.lookupPool(m.pool)
	if p == nil {
		return
	}
	p.mu.Lock()
	current := p.claim != nil && p.claim.id == m.claim
	p.mu.Unlock()
	if !current {
		if m.accept && m.claim.proposer == a.self {
			// An acceptance of a claim this host gave up: release it.
			a.sendMsg(m.from.Name, &message{kind: kindAbort, pool: m.pool, claim: m.claim})
		}
		if m.ring != nil {
			a.mergeRings(m.from, m.seq, []poolView{{pool: m.pool, ring: m.ring}}, false)
		}
		return
	}
	a.recordVote(p, m.claim, m.from.Name, m.accept, m.reason, m.ring)
}

// handleCommit takes a won claim's ring.
func (a *Allocator) handleCommit(m *message) {
	if m.claim.proposer != m.from {
		return // only the proposer commits its claim
	}
	a.mergeRings(m.from, m.seq, []poolView{{pool: m.pool, ring: m.ring}}, false)
}

// handleAbort ends this host's vote for an aborted claim.
func (a *Allocator) handleAbort(m *message) {
	if m.claim.proposer != m.from {
		return
	}
	p := a.lookupPool(m.pool)
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.vote != nil && *p.vote == m.claim {
		p.vote = nil
		a.journal.mark1(prefixVote+p.id, nil)
	}
}

// handleQuery answers a voter asking what became of this host's claim.
func (a *Allocator) handleQuery(m *message) {
	if m.claim.proposer != a.self {
		return
	}
	p := a.lookupPool(m.pool)
	if p == nil {
		a.sendMsg(m.from.Name, &message{kind: kindAbort, pool: m.pool, claim: m.claim})
		return
	}
	p.mu.Lock()
	var reply *message
	switch {
	case p.ring != nil:
		reply = &message{kind: kindCommit, pool: m.pool, claim: m.claim, ring: p.ring.clone()}
	case p.claim != nil && p.claim.id == m.claim:
		// Still running: the outcome follows.
	default:
		reply = &message{kind: kindAbort, pool: m.pool, claim: m.claim}
	}
	p.mu.Unlock()
	if reply != nil {
		a.sendMsg(m.from.Name, reply)
	}
}

// queryStaleVotes asks the proposers of claims this host accepted long ago
// what became of them.
func (a *Allocator) queryStaleVotes() {
	for _, p := range a.allPools() {
		p.mu.Lock()
		var q *claimID
		if p.vote != nil && p.claim == nil && p.ring == nil && a.now().Sub(p.voteAt) >= a.timing.query {
			v := *p.vote
			q = &v
		}
		p.mu.Unlock()
		if q != nil {
			a.sendMsg(q.proposer.Name, &message{kind: kindQuery, pool: p.id, claim: *q})
		}
	}
}
