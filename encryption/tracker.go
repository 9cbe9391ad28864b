package encryption

import (
	"net/netip"
	"slices"

	"github.com/vishvananda/netlink"
)

// tracker keeps the desired encryption state and the kernel's apart, the
// way a dataplane manager does: what the kernel holds of ours as far as
// overlayd knows (the record: the dumps of the last resync, with every
// request the kernel accepted since applied to them), the Desired last
// applied, and what may differ since — the remotes marked dirty, all of
// them (the keys, the generation or the VTEP changed), or the record itself
// (resync: it is not trusted, the next apply dumps). Every change of an
// input only marks; one apply (Owner.applyLocked, through apply here) then
// programs what is marked: a change of one remote costs that remote, not
// the number of remotes of the host.
//
// It belongs to the Owner and is guarded by the Owner's lock: its methods
// expect it held.
type tracker struct {
	// kernel is the record of the kernel (nil: unknown — never dumped, or
	// a request failed since). It can be wrong only by what changed behind
	// overlayd's back since the last resync, which the next resync (every
	// tick and on kernel notifications) repairs.
	kernel *knownState
	// last is the Desired last applied without error (nil: none),
	// normalized and the tracker's own copy: an apply of some remotes
	// patches it for them. It survives a failure (the dirty marks stay
	// relative to it).
	last *Desired
	// resync: the next apply dumps the kernel and compares everything.
	resync bool
	// all: the next apply compares every remote (against the record, or
	// the dumps).
	all bool
	// dirty are the remotes whose desired state may differ from last's.
	dirty map[netip.Addr]struct{}
}

// markDirty marks remotes whose desired state may have changed.
func (t *tracker) markDirty(rs ...netip.Addr) {
	if t.dirty == nil {
		t.dirty = map[netip.Addr]struct{}{}
	}
	for _, r := range rs {
		t.dirty[r] = struct{}{}
	}
}

// markAll asks the next apply to compare every remote.
func (t *tracker) markAll() { t.all = true }

// markResync asks the next apply to dump the kernel and compare everything.
func (t *tracker) markResync() { t.resync = true }

// clean reports whether nothing the desired state depends on was marked
// since the last apply and basis (a Desired without remotes) has its
// epochs, generation, VTEP and VNIs: the desired state is the one last
// applied.
func (t *tracker) clean(basis *Desired) bool {
	return t.last != nil && !t.all && len(t.dirty) == 0 && sameXfrmBasis(t.last, basis) &&
		slices.Equal(t.last.VNIs, basis.VNIs) && slices.Equal(t.last.ClearVNIs, basis.ClearVNIs)
}

// scope returns the remotes the next apply must compare, sorted, or whole
// when it must compare all of them: on a resync, without a record, when
// marked (all, or force), after an SPI collision (only a whole comparison
// resolves and reports it), or when basis derives the SAs differently from
// the last apply. VNIs changing alone do not make it whole: they change the
// table, which every apply compares.
func (t *tracker) scope(basis *Desired, force bool) (scope []netip.Addr, whole bool) {
	if force || t.resync || t.all || t.kernel == nil || t.last == nil || t.kernel.collided || basis.Empty() || t.last.Empty() ||
		!sameXfrmBasis(t.last, basis) {
		return nil, true
	}
	scope = make([]netip.Addr, 0, len(t.dirty))
	for r := range t.dirty {
		scope = append(scope, r)
	}
	slices.SortFunc(scope, netip.Addr.Compare)
	return scope, false
}

// view returns the kernel's xfrm state to plan against, and its table (nil:
// to be dumped): the record, or the dumps when it is not trusted (dumped).
func (t *tracker) view(p *Programmer) (ax *actualXfrm, an *nftActual, dumped bool, err error) {
	if !t.resync && t.kernel != nil {
		return t.kernel.x, t.kernel.n, false, nil
	}
	ax, err = p.xfrmDump()
	return ax, nil, true, err
}

// fits returns the xfrm state d wants for the remotes in scope when it can
// be planned against the record remote by remote (see remotesFit).
func (t *tracker) fits(d *Desired, cache *deriveCache, scope []netip.Addr) (*desiredXfrm, bool) {
	return t.kernel.remotesFit(d, cache, scope)
}

// apply has p make the kernel go from ax and an (what view returned) to d:
// every remote's state when whole (d is the whole desired state), else the
// remotes in scope alone (d may hold only those: its lists and generations
// are read for them) and the table. dx is the xfrm state d wants for them
// when the caller derived it (nil: derived here). On success the record
// gets every request the kernel accepted, last becomes d (patched for the
// scope), and the marks are cleared but for d's blocked remotes, tried
// again by the next apply. Any failure forgets the record: the next apply
// resyncs, so a refused request never leaves the kernel half-programmed.
func (t *tracker) apply(p *Programmer, d *Desired, dx *desiredXfrm, scope []netip.Addr, whole bool, ax *actualXfrm, an *nftActual, dumped bool) (execResult, error) {
	prev := t.kernel
	t.kernel = nil
	only, view := scope, ax
	if whole {
		only = nil
		// A round of the derivation cache is a whole desired state.
		defer p.derived.endRound()
	} else {
		if only == nil {
			// A nil only derives every remote, and d holds those in scope
			// alone: that would delete the others' SAs and policies. No
			// remote in scope is a plan of the clear policy alone.
			only = []netip.Addr{}
		}
		view = prev.view(only)
	}
	if !dumped {
		p.stats.Deltas++
		if !whole {
			p.stats.RemoteDeltas++
		}
	}
	res, an, err := p.program(d, dx, only, view, an)
	if err != nil {
		if !dumped {
			p.stats.DeltaFailures++
		}
		t.resync = true
		return res, err
	}
	k := &knownState{local: d.Local.Unmap(), port: d.Port, x: ax, n: an, collided: len(res.collisions) > 0}
	if whole {
		k.index()
	} else {
		k.byRemote = prev.byRemote
	}
	k.replay(p.journal)
	t.kernel = k
	switch {
	case !whole:
		t.last.setBasis(d)
		t.last.patchRemotes(d, scope)
	case d.normalized():
		// Its own copy: a later apply patches it in place.
		t.last = d.cloneLists()
	default:
		t.last = nil // planned whole from now on
	}
	t.resync, t.all = false, false
	clear(t.dirty)
	t.markDirty(d.Blocked...)
	return res, nil
}

// knownState is the tracker's record of the kernel: for one local VTEP and
// VXLAN port, our xfrm state and nftables table.
type knownState struct {
	local netip.Addr
	port  int
	x     *actualXfrm
	n     *nftActual
	// byRemote indexes x.states by remote VTEP (the destination of an
	// outbound SA, the source of an inbound one).
	byRemote map[netip.Addr][]stateKey
	// collided: the SAs of the apply that made it had an SPI collision
	// (which only a whole comparison resolves and reports).
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

// remotesFit reports whether the SAs d wants for the remotes in touched
// can be planned against the record remote by remote: no SPI collision
// among them, and none has the SPI of an SA of another remote (that would
// need the whole comparison, which decides and reports it). When they
// can, it returns that xfrm state (xfrmOfRemotes), so that the plan does
// not derive it again.
func (k *knownState) remotesFit(d *Desired, cache *deriveCache, touched []netip.Addr) (*desiredXfrm, bool) {
	if touched == nil {
		touched = []netip.Addr{}
	}
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

// replay applies the journal of a successful apply (the requests the kernel
// accepted, in order) to the record.
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
