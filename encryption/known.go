package encryption

import (
	"net/netip"
	"slices"

	"github.com/vishvananda/netlink"
)

// knownState is the Programmer's record of the kernel: for one local VTEP
// and VXLAN port, our xfrm state and nftables table, and the Desired that
// made them.
type knownState struct {
	local netip.Addr
	port  int
	x     *actualXfrm
	n     *nftActual
	// byRemote indexes x.states by remote VTEP (the destination of an
	// outbound SA, the source of an inbound one).
	byRemote map[netip.Addr][]stateKey
	// last is the Desired applied (nil: not normalized, so no remote-wise
	// delta); collided: its SAs had an SPI collision (which only a whole
	// comparison resolves and reports).
	last     *Desired
	collided bool
}

// remoteOf is the remote VTEP of an SA of ours.
func (k *knownState) remoteOf(s *netlink.XfrmState) netip.Addr {
	if src := addrOf(s.Src); src != k.local {
		return src
	}
	return addrOf(s.Dst)
}

// index builds byRemote from x.
func (k *knownState) index() {
	k.byRemote = make(map[netip.Addr][]stateKey, len(k.x.states))
	for sk, s := range k.x.states {
		r := k.remoteOf(&s)
		k.byRemote[r] = append(k.byRemote[r], sk)
	}
}

// touched returns the remotes a change to d touches, when the change can
// be planned remote by remote: the record comes from a normalized Desired
// with the same keys, generation and VTEP, without SPI collision, and no
// SA d wants for a touched remote has the SPI of an SA of another remote
// (that would need the whole comparison, which decides and reports it).
// It returns the xfrm state d wants for them too (see remotesFit).
func (k *knownState) touched(d *Desired, cache *deriveCache) ([]netip.Addr, *desiredXfrm, bool) {
	if k.last == nil || k.collided || !d.normalized() || !sameXfrmBasis(k.last, d) {
		return nil, nil, false
	}
	touched := touchedRemotes(k.last, d)
	if touched == nil {
		touched = []netip.Addr{}
	}
	dx, ok := k.remotesFit(d, cache, touched)
	return touched, dx, ok
}

// remotesFit reports whether the SAs d wants for the remotes in touched
// can be planned against the record remote by remote: no SPI collision
// among them, and none has the SPI of an SA of another remote. When they
// can, it returns that xfrm state (xfrmOfRemotes), so that the plan does
// not derive it again.
func (k *knownState) remotesFit(d *Desired, cache *deriveCache, touched []netip.Addr) (*desiredXfrm, bool) {
	dx, err := xfrmOfRemotes(d, cache, touched)
	if err != nil || len(dx.collisions) > 0 {
		return nil, false
	}
	for sk, w := range dx.states {
		if s, ok := k.x.states[sk]; ok && k.remoteOf(&s) != w.remote {
			return nil, false
		}
	}
	return dx, true
}

// changedRemotes returns the remotes of base whose xfrm state may differ
// from the record's (see touchedRemotes; the record's blocked remotes
// included), when base has the record's keys, generation and VTEP: the
// others' SAs were checked against this record by the apply that made it.
func (p *Programmer) changedRemotes(base *Desired) ([]netip.Addr, bool) {
	k := p.known
	if k == nil || k.last == nil || k.collided || !base.normalized() || !sameXfrmBasis(k.last, base) {
		return nil, false
	}
	var out []netip.Addr
	for _, r := range touchedRemotes(k.last, base) {
		if _, ok := slices.BinarySearchFunc(base.Remotes, r, netip.Addr.Compare); ok {
			out = append(out, r)
		}
	}
	return out, true
}

// view is the part of the record that concerns the remotes in touched:
// their SAs and policies, and the clear policy.
func (k *knownState) view(touched []netip.Addr) *actualXfrm {
	v := &actualXfrm{states: map[stateKey]netlink.XfrmState{}, policies: map[polKey]netlink.XfrmPolicy{}}
	for _, r := range touched {
		for _, sk := range k.byRemote[r] {
			v.states[sk] = k.x.states[sk]
		}
		pk := remoteKey(k.local, r, k.port)
		if pol, ok := k.x.policies[pk]; ok {
			v.policies[pk] = pol
		}
	}
	ck := clearKey(k.local, k.port)
	if pol, ok := k.x.policies[ck]; ok {
		v.policies[ck] = pol
	}
	return v
}

// journalEntry is one accepted xfrm change: a state or policy set (added
// or replaced) or deleted.
type journalEntry struct {
	op     int // journalSetState, journalDelState, journalSetPolicy, journalDelPolicy
	sk     stateKey
	state  netlink.XfrmState
	pk     polKey
	policy netlink.XfrmPolicy
}

const (
	journalSetState = iota
	journalDelState
	journalSetPolicy
	journalDelPolicy
)

// replay applies the journal of a successful apply to the record.
func (k *knownState) replay(journal []journalEntry) {
	a := k.x
	for i := range journal {
		j := &journal[i]
		switch j.op {
		case journalSetState:
			if _, ok := a.states[j.sk]; !ok {
				r := k.remoteOf(&j.state)
				k.byRemote[r] = append(k.byRemote[r], j.sk)
			}
			a.states[j.sk] = j.state
		case journalDelState:
			if s, ok := a.states[j.sk]; ok {
				r := k.remoteOf(&s)
				keys := slices.DeleteFunc(k.byRemote[r], func(x stateKey) bool { return x == j.sk })
				if len(keys) == 0 {
					delete(k.byRemote, r)
				} else {
					k.byRemote[r] = keys
				}
				delete(a.states, j.sk)
			}
		case journalSetPolicy:
			a.policies[j.pk] = j.policy
		case journalDelPolicy:
			// A stray (ours, of another shape) may share a key with a
			// policy we install: only forget the one deleted.
			if got, ok := a.policies[j.pk]; ok && samePolicyID(&got, &j.policy) {
				delete(a.policies, j.pk)
			}
		}
	}
	// Every stray was deleted (a journal is replayed only after success).
	a.strays = nil
}

// samePolicyID reports whether a and b are the same kernel policy: the
// kernel tells policies apart by selector (polKey), direction and mark.
func samePolicyID(a, b *netlink.XfrmPolicy) bool {
	if a.Dir != b.Dir || a.Proto != b.Proto || a.Ifindex != b.Ifindex || a.Ifid != b.Ifid {
		return false
	}
	ma, mb := netlink.XfrmMark{}, netlink.XfrmMark{}
	if a.Mark != nil {
		ma = *a.Mark
	}
	if b.Mark != nil {
		mb = *b.Mark
	}
	return ma == mb
}
