package ipam

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/overlayd/overlayd/internal/logkeys"
)

// Donations move free space to a host that has none (invariant 3): the
// requester asks the owners it can reach, most free first (as they last
// reported), one at a time, each for donate timing (2 s); an owner gives
// half of its largest free run (all of it when that is one address) by
// writing the ring with the range under the requester's name, and sends
// the ring back. A request for one address goes to its owner, which gives
// exactly that address when it is free. Requests for any space on one pool
// share one exchange: the rest wait for it.

// obtainCall is a request for space in flight; the others needing space on
// the pool wait for it.
type obtainCall struct {
	done chan struct{}
	err  error // set before done closes
}

// candidate is an owner that might give space.
type candidate struct {
	owner    Identity
	owned    uint64
	reported bool
	free     uint64
}

// obtain gets free space (want == nil) or the address *want from another
// host. nil means: try allocating again.
func (a *Allocator) obtain(ctx context.Context, p *pool, want *uint32) error {
	if want != nil {
		return a.obtainAddress(ctx, p, *want)
	}
	p.mu.Lock()
	if oc := p.obtaining; oc != nil {
		p.mu.Unlock()
		select {
		case <-oc.done:
			return oc.err
		case <-a.reclaimedC:
			return a.refuseIfReclaimed()
		case <-ctx.Done():
			return refuse(ReasonNoSpaceReachable, fmt.Errorf("no free address in pool %s in time: %w", p.id, ctx.Err()))
		}
	}
	oc := &obtainCall{done: make(chan struct{})}
	p.obtaining = oc
	cands := a.candidatesLocked(p)
	ownedHere := p.ring.ownedSize(a.self)
	p.mu.Unlock()
	oc.err = a.requestSpace(ctx, p, cands, ownedHere)
	p.mu.Lock()
	p.obtaining = nil
	p.mu.Unlock()
	close(oc.done)
	return oc.err
}

// candidatesLocked lists the other owners of p's ring, most free first (as
// they reported; an owner that never reported counts with all it owns).
func (a *Allocator) candidatesLocked(p *pool) []candidate {
	var out []candidate
	for id, n := range p.ring.owners() {
		if id == a.self {
			continue
		}
		c := candidate{owner: id, owned: n}
		if r, ok := p.reports[id]; ok {
			c.reported, c.free = true, r.stats.free
		}
		out = append(out, c)
	}
	guess := func(c candidate) uint64 {
		if c.reported {
			return c.free
		}
		return c.owned
	}
	sort.Slice(out, func(i, j int) bool {
		if gi, gj := guess(out[i]), guess(out[j]); gi != gj {
			return gi > gj
		}
		return out[i].owner.compare(out[j].owner) < 0
	})
	return out
}

// requestSpace asks the candidates in turn until one gives space.
func (a *Allocator) requestSpace(ctx context.Context, p *pool, cands []candidate, ownedHere uint64) error {
	t := a.getTransport()
	states := a.memberStates()
	a.mu.Lock()
	peers := make(map[string]Identity, len(a.peers)+1)
	for k, v := range a.peers {
		peers[k] = v
	}
	a.mu.Unlock()
	peers[a.self.Name] = a.self
	var notes []string
	full := true   // every owner says (or reported) it has none free
	retry := false // an alive owner did not answer
	for _, c := range cands {
		label := fmt.Sprintf("%s (owns %d", c.owner.Name, c.owned)
		if c.reported {
			label += fmt.Sprintf(", %d free as last reported", c.free)
		}
		label += ")"
		st, member := states[c.owner.Name]
		if cur, ok := peers[c.owner.Name]; ok && cur != c.owner {
			// The name came back as another identity (a reinstall): the
			// old identity's space waits for a reclaim.
			notes = append(notes, fmt.Sprintf("%s: an earlier installation of %s, which is not running any more (reclaim it with `overlayd ipam reclaim %s`)", label, c.owner.Name, c.owner.Name))
			full = full && c.reported && c.free == 0
			continue
		}
		if t == nil || !member || st != Alive {
			notes = append(notes, fmt.Sprintf("%s: %s", label, describeState(st, member && t != nil)))
			full = full && c.reported && c.free == 0
			continue
		}
		if ctx.Err() != nil {
			notes = append(notes, label+": not asked (out of time)")
			full = false
			continue
		}
		res, err := a.askDonor(ctx, t, p, c.owner.Name, nil)
		switch {
		case err != nil:
			notes = append(notes, fmt.Sprintf("%s: %v", label, err))
			full = false
			// An alive owner that did not answer may answer the next time
			// (a lost message); one that refused or is gone will not.
			retry = true
		case res.result == donateOK:
			// Space moved to this host; the requests waiting take it, and
			// any left without ask again (each round moves space, so this
			// ends when the pool is full).
			return nil
		case res.result == donateNoneFree:
			notes = append(notes, label+": has none free")
		default:
			notes = append(notes, fmt.Sprintf("%s: %s", label, res.reason))
			full = false
		}
	}
	if full {
		return refuse(ReasonPoolFull, fmt.Errorf("pool %s is full: all %d addresses are in use (this host has %d of them)", p.id, p.spec.size(), ownedHere))
	}
	err := refuse(ReasonNoSpaceReachable, fmt.Errorf("no free address in pool %s: the %d addresses this host owns are in use, and no other host gave any: %s",
		p.id, ownedHere, strings.Join(notes, "; ")))
	if retry {
		return &retryableError{err}
	}
	return err
}

// retryableError: asking again may help (an alive owner did not answer).
type retryableError struct{ error }

func (e *retryableError) Unwrap() error { return e.error }

// obtainAddress asks the owner of x to give x, following the owners the
// answers name.
func (a *Allocator) obtainAddress(ctx context.Context, p *pool, x uint32) error {
	t := a.getTransport()
	for range maxRedirect {
		p.mu.Lock()
		owner := p.ring.ownerOf(x)
		p.mu.Unlock()
		if owner == a.self {
			return nil
		}
		st, member := a.memberState(owner.Name)
		if t == nil || !member || st != Alive {
			return refuse(ReasonOwnerUnreachable, fmt.Errorf("%s is owned by %s, which is %s: overlayd cannot tell whether it is free; try again when %s is back, or pick another address",
				addrOf(x), owner.Name, describeState(st, member && t != nil), owner.Name))
		}
		res, err := a.askDonor(ctx, t, p, owner.Name, &x)
		if err != nil {
			return refuse(ReasonOwnerUnreachable, fmt.Errorf("%s is owned by %s, which did not give it: %v", addrOf(x), owner.Name, err))
		}
		switch res.result {
		case donateOK:
			return nil
		case donateInUse:
			return refuse(ReasonInUse, fmt.Errorf("%s is in use on %s", addrOf(x), owner.Name))
		case donateNotOwner:
			continue // its ring (merged by the handler) names the owner
		default:
			return refuse(ReasonOwnerUnreachable, fmt.Errorf("%s is owned by %s, which did not give it: %s", addrOf(x), owner.Name, res.reason))
		}
	}
	return fmt.Errorf("%s: its owner could not be found (the hosts asked each named another)", addrOf(x))
}

// askDonor sends one donation request and waits for its answer.
func (a *Allocator) askDonor(ctx context.Context, t Transport, p *pool, to string, want *uint32) (*message, error) {
	w := &waiter{to: to, reply: make(chan *message, 1)}
	a.mu.Lock()
	if a.closed {
		a.mu.Unlock()
		return nil, errors.New("shutting down")
	}
	a.nextReq++
	id := a.nextReq
	a.waiters[id] = w
	a.mu.Unlock()
	defer func() {
		a.mu.Lock()
		delete(a.waiters, id)
		a.mu.Unlock()
	}()
	b, err := a.encode(&message{kind: kindDonateReq, reqID: id, pool: p.id, wantAddr: want})
	if err != nil {
		return nil, err
	}
	if err := t.Send(to, b); err != nil {
		return nil, fmt.Errorf("unreachable: %v", err)
	}
	timer := time.NewTimer(a.timing.donate)
	defer timer.Stop()
	select {
	case m, ok := <-w.reply:
		if !ok {
			return nil, errors.New("shutting down")
		}
		return m, nil
	case <-timer.C:
		return nil, fmt.Errorf("did not answer within %s", a.timing.donate)
	case <-a.reclaimedC:
		return nil, a.refuseIfReclaimed()
	case <-ctx.Done():
		return nil, fmt.Errorf("no answer before the request's deadline")
	}
}

// handleDonateRequest answers a request for space as a possible donor.
func (a *Allocator) handleDonateRequest(m *message) {
	reply := &message{kind: kindDonateReply, reqID: m.reqID, pool: m.pool}
	p := a.lookupPool(m.pool)
	if err := a.refuseIfReclaimed(); err != nil {
		reply.result, reply.reason = donateRefused, "its own identity was reclaimed"
		a.sendMsg(m.from.Name, reply)
		return
	}
	if p == nil {
		reply.result, reply.reason = donateUnknownPool, "it does not know the pool"
		a.sendMsg(m.from.Name, reply)
		return
	}
	p.mu.Lock()
	if p.ring == nil {
		p.mu.Unlock()
		reply.result, reply.reason = donateUnknownPool, "it does not know the pool's ring yet"
		a.sendMsg(m.from.Name, reply)
		return
	}
	var give span
	switch {
	case m.wantAddr != nil:
		x := *m.wantAddr
		switch owner := p.ring.ownerOf(x); {
		case owner != a.self:
			reply.result, reply.reason = donateNotOwner, fmt.Sprintf("%s owns it", owner.Name)
		case p.hasAlloc(x):
			reply.result, reply.reason = donateInUse, fmt.Sprintf("%s is in use on %s", addrOf(x), a.self.Name)
		default:
			give = span{x, x}
		}
	default:
		best, ok := p.allocs.largestFree(p.ring.owned(a.self))
		if !ok {
			reply.result, reply.reason = donateNoneFree, "it has none free"
			break
		}
		n := max(best.size()/2, 1)
		give = span{best.last - uint32(n-1), best.last}
	}
	if reply.result == 0 {
		if err := p.ring.donate(a.self, m.from, give); err != nil {
			reply.result, reply.reason = donateRefused, err.Error()
		} else {
			reply.result = donateOK
			a.journal.mark1(prefixPool+p.id, encodePoolRecord(p.refs, p.ring))
			a.log.Info("ipam: gave address space to another host", logkeys.Event, logkeys.IPAMSpaceMoved,
				logkeys.Pool, p.id, logkeys.From, a.self.String(), logkeys.To, m.from.String(),
				logkeys.Range, formatRange(give), logkeys.Count, give.size())
		}
	}
	reply.ring = p.ring.clone()
	p.mu.Unlock()
	// sendMsg writes the donation to disk before the ring leaves.
	a.sendMsg(m.from.Name, reply)
	if reply.result == donateOK {
		a.broadcastPools([]*pool{p})
	}
}

func (p *pool) hasAlloc(x uint32) bool { _, ok := p.allocs.get(x); return ok }

// handleDonateReply merges the donor's ring (on disk before any allocation
// from it) and hands the answer to the request waiting for it.
func (a *Allocator) handleDonateReply(m *message) {
	if m.ring != nil {
		a.mergeRings(m.from, m.seq, []poolView{{pool: m.pool, ring: m.ring}}, false)
	}
	a.mu.Lock()
	w := a.waiters[m.reqID]
	if w != nil && w.to == m.from.Name {
		delete(a.waiters, m.reqID)
		w.reply <- m // buffered, one answer per request
	}
	a.mu.Unlock()
}
