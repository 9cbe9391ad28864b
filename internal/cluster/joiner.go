package cluster

import (
	"log/slog"
	"math/rand/v2"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"time"
)

// joiner joins seeds and re-joins failed members in the background.
//
// A seed is retried with exponential backoff (0.5 s doubling to 30 s,
// jittered) until a join through it succeeds, or until it is the address
// of an alive member. When this node finds itself alone, every seed is
// armed again. Every ReconnectInterval it also tries to join one random
// failed (not left) member seen within ReconnectTimeout: memberlist does
// not probe dead nodes, so this is what heals a partition.
type joiner struct {
	c    *Cluster
	mu   sync.Mutex
	seed map[string]*seedState
	wake chan struct{}
}

type seedState struct {
	joined  bool
	next    time.Time
	backoff time.Duration
}

const (
	seedBackoffMin = 500 * time.Millisecond
	seedBackoffMax = 30 * time.Second
)

func newJoiner(c *Cluster, seeds []string) *joiner {
	j := &joiner{c: c, seed: make(map[string]*seedState), wake: make(chan struct{}, 1)}
	j.add(seeds...)
	return j
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
	select {
	case j.wake <- struct{}{}:
	default:
	}
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
	followUps, nextFollow := 0, time.Time{}
	for {
		if c.leaving.Load() || c.closed.Load() {
			return
		}
		now := c.now()
		alone := c.ml.NumMembers() <= 1
		members := j.c.memberAddrs()
		var due []string
		wait := nextReconnect.Sub(now)
		if followUps > 0 {
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
			n, err := c.ml.Join([]string{a})
			j.mu.Lock()
			s := j.seed[a]
			if n > 0 {
				s.joined, s.backoff = true, seedBackoffMin
				followUps, nextFollow = 2, c.now().Add(time.Second)
				c.log.Info("joined the cluster", "seed", a)
			} else {
				s.next = c.now().Add(s.backoff + rand.N(s.backoff/2))
				c.logLimited(slog.LevelWarn, "join:"+a, "cannot join seed, retrying", "seed", a, "retry_in", s.backoff, "error", err)
				s.backoff = min(2*s.backoff, seedBackoffMax)
			}
			j.mu.Unlock()
		}
		if len(due) > 0 {
			continue // recompute waits
		}
		if followUps > 0 && !now.Before(nextFollow) {
			followUps--
			nextFollow = now.Add(2 * time.Second)
			if a, ok := c.randomMember(); ok {
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

// memberAddrs returns the addresses of the alive members.
func (c *Cluster) memberAddrs() map[netip.AddrPort]bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := make(map[netip.AddrPort]bool)
	for _, m := range c.store.members {
		if m.state == StateAlive {
			if ip, ok := netip.AddrFromSlice(m.node.Addr); ok {
				out[netip.AddrPortFrom(ip.Unmap(), m.node.Port)] = true
			}
		}
	}
	return out
}

// randomMember picks a random alive member other than this node.
func (c *Cluster) randomMember() (string, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	var cands []string
	for name, m := range c.store.members {
		if name != c.cfg.NodeName && m.state == StateAlive {
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
	for name, m := range c.store.members {
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
