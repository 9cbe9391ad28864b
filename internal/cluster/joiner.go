package cluster

import (
	"log/slog"
	"math/rand/v2"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"time"

	"github.com/overlayd/overlayd/internal/lockorder"
	"github.com/overlayd/overlayd/internal/logkeys"
)

// joiner joins seeds and re-joins failed members in the background.
//
// A seed is retried with exponential backoff (0.5 s doubling to 30 s,
// jittered) until a join through it succeeds, or until it is the address
// of an alive member. When this node finds itself alone, every seed is
// armed again. Every ReconnectInterval it also tries to join one random
// failed (or left) member seen within ReconnectTimeout: memberlist does
// not probe dead nodes, so this is what heals a partition.
//
// After a successful join, it pushes/pulls state with a member every
// second for up to confirmWindow while some alive member has not sent this
// process any message yet (each member that accepts this incarnation asks
// it for its snapshot at once): a member that refused this node's alive
// message because it still had this node's former process alive at
// another address accepts it at the first push/pull after that address is
// declared dead. The first two go to a random member if every member has
// sent something, catching alive broadcasts that raced with the join.
//
// The other side of a restart at a new address: when memberlist refuses a
// member's alive message for its different address (NotifyConflict), the
// joiner remembers the claim and, once the member is declared dead here
// (plus deadNodeReclaimTime), joins the new address, retrying every
// claimRetry up to claimTries times or until the member is alive there.
type joiner struct {
	c      *Cluster
	mu     *lockorder.Mutex      // LevelLeaf; guards seed and claims (nothing is called with it held)
	seed   map[string]*seedState // guarded by mu
	claims map[string]*claim     // by member name; guarded by mu
	wake   chan struct{}
}

type seedState struct {
	joined  bool
	next    time.Time
	backoff time.Duration
}

// claim is a member's alive message for another address than the one
// this node knows it at.
type claim struct {
	addr  string
	seen  time.Time // last notification
	next  time.Time // next join attempt not before
	tries int
}

const (
	seedBackoffMin = 500 * time.Millisecond
	seedBackoffMax = 30 * time.Second
	// confirmWindow bounds the follow-up push/pulls after a join;
	// followInterval spaces them.
	confirmWindow  = 30 * time.Second
	followInterval = time.Second
	// claimTTL: a claim not acted upon for this long is forgotten.
	claimTTL    = time.Minute
	claimRetry  = 500 * time.Millisecond
	claimTries  = 10
	claimMargin = 50 * time.Millisecond // beyond deadNodeReclaimTime
)

func newJoiner(c *Cluster, seeds []string) *joiner {
	j := &joiner{c: c, mu: lockorder.New(lockorder.LevelLeaf), seed: make(map[string]*seedState),
		claims: make(map[string]*claim), wake: make(chan struct{}, 1)}
	j.add(seeds...)
	return j
}

func (j *joiner) wakeUp() {
	select {
	case j.wake <- struct{}{}:
	default:
	}
}

func (j *joiner) add(addrs ...string) {
	j.mu.Lock()
	for _, a := range addrs {
		if a == "" || j.self(a) {
			continue
		}
		if s := j.seed[a]; s != nil {
			if s.joined { // announced again: make sure
				s.joined, s.next = false, time.Time{}
			}
			continue
		}
		j.seed[a] = &seedState{backoff: seedBackoffMin}
	}
	j.mu.Unlock()
	j.wakeUp()
}

// claim records that member name announced itself at addr. It reports
// whether the claim is new (to log it once).
func (j *joiner) claim(name, addr string, now time.Time) bool {
	j.mu.Lock()
	cl := j.claims[name]
	fresh := cl == nil || cl.addr != addr
	if fresh {
		cl = &claim{addr: addr}
		j.claims[name] = cl
	}
	cl.seen = now
	j.mu.Unlock()
	j.wakeUp()
	return fresh
}

// self reports whether a is this node's own advertised address.
func (j *joiner) self(a string) bool {
	ap, ok := parseSeed(a, j.c.cfg.BindPort)
	return ok && ap == netip.AddrPortFrom(j.c.cfg.AdvertiseAddr, uint16(j.c.cfg.AdvertisePort))
}

// parseSeed parses "ip[:port]" (no host names) with defPort.
func parseSeed(a string, defPort int) (netip.AddrPort, bool) {
	if ap, err := netip.ParseAddrPort(a); err == nil {
		return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), true
	}
	if ip, err := netip.ParseAddr(a); err == nil {
		return netip.AddrPortFrom(ip.Unmap(), uint16(defPort)), true
	}
	return netip.AddrPort{}, false
}

func (j *joiner) run() {
	c := j.c
	nextReconnect := c.now().Add(c.cfg.ReconnectInterval)
	// Follow-ups after a join: two to random members, then to members
	// that have not accepted this incarnation yet, until confirmUntil.
	followUps, nextFollow, confirmUntil := 0, time.Time{}, time.Time{}
	for {
		if c.leaving.Load() || c.closed.Load() {
			return
		}
		now := c.now()
		alone := c.ml.NumMembers() <= 1
		members := c.memberAddrs()
		var due []string
		wait := nextReconnect.Sub(now)
		following := followUps > 0 || now.Before(confirmUntil)
		if following {
			wait = min(wait, nextFollow.Sub(now))
		}
		j.mu.Lock()
		for a, s := range j.seed {
			if ap, ok := parseSeed(a, c.cfg.BindPort); ok && members[ap] {
				s.joined = true
			} else if alone {
				s.joined = false
			}
			if s.joined {
				continue
			}
			if !s.next.After(now) {
				due = append(due, a)
			} else {
				wait = min(wait, s.next.Sub(now))
			}
		}
		j.mu.Unlock()
		for _, a := range due {
			if c.leaving.Load() || c.closed.Load() {
				return
			}
			// An earlier join of this batch may have brought this seed
			// in already (seeds are often several hosts of one cluster,
			// or one host under two spellings).
			if ap, ok := parseSeed(a, c.cfg.BindPort); ok && c.memberAddrs()[ap] {
				j.mu.Lock()
				j.seed[a].joined, j.seed[a].backoff = true, seedBackoffMin
				j.mu.Unlock()
				continue
			}
			wasAlone := c.ml.NumMembers() <= 1
			n, err := c.ml.Join([]string{a})
			j.mu.Lock()
			s := j.seed[a]
			retry := s.backoff
			if n > 0 {
				s.joined, s.backoff = true, seedBackoffMin
			} else {
				s.next = c.now().Add(s.backoff + rand.N(s.backoff/2))
				s.backoff = min(2*s.backoff, seedBackoffMax)
			}
			j.mu.Unlock()
			if n > 0 {
				followUps, nextFollow, confirmUntil = 2, c.now().Add(followInterval), c.now().Add(confirmWindow)
				// Once per joining: a further seed joined while already
				// in the cluster is no news.
				if wasAlone {
					c.log.Info("joined the cluster", logkeys.Event, logkeys.ClusterJoined, logkeys.Addr, a, logkeys.Count, c.ml.NumMembers())
				} else {
					c.log.Debug("joined a seed while already in the cluster", "seed", a)
				}
			} else {
				c.logLimited(slog.LevelWarn, "join:"+a, "cannot join seed, retrying", "seed", a, "retry_in", retry, "error", err)
			}
		}
		if len(due) > 0 {
			continue // recompute waits
		}
		if joins, claimWait := j.dueClaims(now); len(joins) > 0 {
			for _, jn := range joins {
				if c.leaving.Load() || c.closed.Load() {
					return
				}
				n, err := c.ml.Join([]string{jn.addr})
				c.logLimited(slog.LevelInfo, "claimjoin:"+jn.name, "joined a member at the address it announced",
					logkeys.Member, jn.name, logkeys.Addr, jn.addr, "ok", n > 0, "error", err)
			}
			continue
		} else if claimWait > 0 {
			wait = min(wait, claimWait)
		}
		if following && !now.Before(nextFollow) {
			nextFollow = now.Add(followInterval)
			a, ok := c.unconfirmedMember()
			if !ok && followUps > 0 {
				a, ok = c.randomMember()
			}
			if followUps > 0 {
				followUps--
			}
			if !ok {
				confirmUntil = time.Time{} // every member has accepted us
			} else {
				_, _ = c.ml.Join([]string{a})
			}
			continue
		}
		if !now.Before(nextReconnect) {
			nextReconnect = now.Add(c.cfg.ReconnectInterval)
			if a, ok := c.reconnectCandidate(); ok {
				if n, _ := c.ml.Join([]string{a}); n > 0 {
					c.log.Info("re-joined a failed member", "addr", a)
				}
			}
			continue
		}
		t := time.NewTimer(max(wait, 10*time.Millisecond))
		select {
		case <-t.C:
		case <-j.wake:
			t.Stop()
		case <-c.stop:
			t.Stop()
			return
		}
	}
}

type claimJoin struct{ name, addr string }

// dueClaims returns the claims to join now (marking the attempt) and how
// long until the next one may be due (0: none pending on a timer).
func (j *joiner) dueClaims(now time.Time) ([]claimJoin, time.Duration) {
	j.mu.Lock()
	pending := make(map[string]claim, len(j.claims))
	for name, cl := range j.claims {
		pending[name] = *cl
	}
	j.mu.Unlock()
	if len(pending) == 0 {
		return nil, 0
	}
	var joins []claimJoin
	var drop []string
	var wait time.Duration
	for name, cl := range pending {
		state, since, addr := j.c.memberInfo(name)
		switch {
		case now.Sub(cl.seen) > claimTTL || cl.tries >= claimTries || state == "":
			drop = append(drop, name)
		case state == StateAlive && addr == cl.addr:
			drop = append(drop, name) // accepted there
		case state == StateDead || state == StateLeft:
			at := since.Add(deadNodeReclaimTime + claimMargin)
			if cl.next.After(at) {
				at = cl.next
			}
			if at.After(now) {
				if d := at.Sub(now); wait == 0 || d < wait {
					wait = d
				}
				continue
			}
			joins = append(joins, claimJoin{name, cl.addr})
		}
		// Alive (or suspect) at its old address: memberGone wakes us.
	}
	j.mu.Lock()
	for _, name := range drop {
		delete(j.claims, name)
	}
	for _, jn := range joins {
		if cl := j.claims[jn.name]; cl != nil {
			cl.tries++
			cl.next = now.Add(claimRetry)
		}
	}
	j.mu.Unlock()
	return joins, wait
}

// memberAddrs returns the addresses of the alive members.
func (c *Cluster) memberAddrs() map[netip.AddrPort]bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[netip.AddrPort]bool)
	for _, m := range c.replica.members {
		if m.state == StateAlive {
			if ip, ok := netip.AddrFromSlice(m.node.Addr); ok {
				out[netip.AddrPortFrom(ip.Unmap(), m.node.Port)] = true
			}
		}
	}
	return out
}

// SeedAddrs returns where another node joins this cluster: this node's
// advertised gossip address first, then the alive members' in order.
func (c *Cluster) SeedAddrs() []netip.AddrPort {
	self := c.ml.LocalNode()
	ip, _ := netip.AddrFromSlice(self.Addr)
	own := netip.AddrPortFrom(ip.Unmap(), self.Port)
	out := []netip.AddrPort{own}
	var others []netip.AddrPort
	for a := range c.memberAddrs() {
		if a != own {
			others = append(others, a)
		}
	}
	slices.SortFunc(others, func(a, b netip.AddrPort) int { return a.Compare(b) })
	return append(out, others...)
}

// randomMember picks a random alive member other than this node.
func (c *Cluster) randomMember() (string, bool) {
	return c.pickMember(func(*member) bool { return true })
}

// unconfirmedMember picks a random alive member other than this node, with
// usable metadata, that has sent this process no message yet (it has not
// accepted this incarnation, or has not learnt it yet).
func (c *Cluster) unconfirmedMember() (string, bool) {
	return c.pickMember(func(m *member) bool { return m.metaErr == nil && m.lastHeard.Before(c.started) })
}

func (c *Cluster) pickMember(ok func(*member) bool) (string, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	var cands []string
	for name, m := range c.replica.members {
		if name != c.cfg.NodeName && m.state == StateAlive && ok(m) {
			cands = append(cands, net.JoinHostPort(net.IP(m.node.Addr).String(), strconv.Itoa(int(m.node.Port))))
		}
	}
	if len(cands) == 0 {
		return "", false
	}
	return cands[rand.N(len(cands))], true
}

// reconnectCandidate picks a random member that failed or left within
// ReconnectTimeout: a member that left is usually restarting (an upgrade, a
// dockerd restart), and swarm does not announce it again when it returns.
func (c *Cluster) reconnectCandidate() (string, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	var cands []string
	now := c.now()
	for name, m := range c.replica.members {
		if name == c.cfg.NodeName || (m.state != StateDead && m.state != StateLeft) || now.Sub(m.since) > c.cfg.ReconnectTimeout {
			continue
		}
		cands = append(cands, net.JoinHostPort(net.IP(m.node.Addr).String(), strconv.Itoa(int(m.node.Port))))
	}
	if len(cands) == 0 {
		return "", false
	}
	return cands[rand.N(len(cands))], true
}
