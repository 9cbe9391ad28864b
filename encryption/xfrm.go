package encryption

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// ErrKernelUnsupported is wrapped by errors caused by a kernel that cannot
// install ESP/AEAD states (no esp4/esp6 module, no GCM, no crypto RNG).
var ErrKernelUnsupported = errors.New("kernel cannot install ESP/AEAD states (" + AEADName + ")")

// unsupported reports whether err from an SA add means the kernel lacks ESP
// or the AEAD rather than a problem with this one SA.
func unsupported(err error) bool {
	for _, e := range []error{unix.ENOSYS, unix.EPROTONOSUPPORT, unix.EOPNOTSUPP, unix.ENOENT, unix.EAFNOSUPPORT} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

func addrOf(ip net.IP) netip.Addr {
	a, _ := netip.AddrFromSlice(ip)
	return a.Unmap()
}

func prefixOf(n *net.IPNet) netip.Prefix {
	if n == nil {
		return netip.Prefix{}
	}
	ones, _ := n.Mask.Size()
	return netip.PrefixFrom(addrOf(n.IP), ones)
}

// actualXfrm is what the kernel holds of ours.
type actualXfrm struct {
	states   map[stateKey]netlink.XfrmState
	policies map[polKey]netlink.XfrmPolicy
	strays   []netlink.XfrmPolicy // ours, but not of a shape we install (removed)
}

func (a *actualXfrm) has(k stateKey) bool {
	_, ok := a.states[k]
	return ok
}

// ours reports whether pol is overlayd's: a template with our reqid, or the
// clear policy's mark.
func ours(pol *netlink.XfrmPolicy) bool {
	for _, t := range pol.Tmpls {
		if t.Reqid == ReqID {
			return true
		}
	}
	return len(pol.Tmpls) == 0 && pol.Mark != nil && pol.Mark.Value == ClearMark && pol.Mark.Mask == ClearMarkMask
}

func polKeyOf(pol *netlink.XfrmPolicy) polKey {
	k := polKey{src: prefixOf(pol.Src), dst: prefixOf(pol.Dst), dport: pol.DstPort}
	if pol.Mark != nil {
		k.mark, k.mask = pol.Mark.Value, pol.Mark.Mask
	}
	return k
}

func (p *Programmer) xfrmDump() (*actualXfrm, error) {
	a := &actualXfrm{states: map[stateKey]netlink.XfrmState{}, policies: map[polKey]netlink.XfrmPolicy{}}
	var states []netlink.XfrmState
	var err error
	p.stats.XfrmDumps++
	states, err = p.nl.XfrmStateList(netlink.FAMILY_ALL) // retried on interruption (nlwrap)
	if err != nil {
		return nil, fmt.Errorf("failed to dump xfrm states: %w", err)
	}
	for _, s := range states {
		if s.Reqid != ReqID || s.Proto != netlink.XFRM_PROTO_ESP {
			continue
		}
		a.states[stateKey{addrOf(s.Dst), uint32(s.Spi)}] = s
	}
	// One dump per family: the library cannot tell 0.0.0.0/0 from ::/0 in
	// a dump of all families, and our policies select "any source".
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		p.stats.XfrmDumps++
		pols, err := p.nl.XfrmPolicyList(fam)
		if err != nil {
			return nil, fmt.Errorf("failed to dump xfrm policies: %w", err)
		}
		for _, pol := range pols {
			if !ours(&pol) {
				continue
			}
			if pol.Dir != netlink.XFRM_DIR_OUT || pol.Proto != netlink.Proto(unix.IPPROTO_UDP) || len(pol.Tmpls) > 1 ||
				(len(pol.Tmpls) == 1 && pol.Mark != nil && (pol.Mark.Value != 0 || pol.Mark.Mask != 0)) {
				a.strays = append(a.strays, pol)
				continue
			}
			a.policies[polKeyOf(&pol)] = pol
		}
	}
	return a, nil
}

// stateDiff describes how an existing state differs from the wanted one
// ("" when it matches).
func stateDiff(got *netlink.XfrmState, w *wantState, port int) string {
	switch {
	case got.Aead == nil:
		if got.Crypt == nil && got.Auth == nil {
			return "larval (acquire) state"
		}
		return "not an AEAD state"
	case addrOf(got.Src) != w.src:
		return fmt.Sprintf("source %v, want %v", addrOf(got.Src), w.src)
	case got.Mode != netlink.XFRM_MODE_TRANSPORT:
		return "not transport mode"
	case got.Aead.Name != AEADName || got.Aead.ICVLen != ICVBits:
		return fmt.Sprintf("algorithm %s/%d, want %s/%d", got.Aead.Name, got.Aead.ICVLen, AEADName, ICVBits)
	case !bytes.Equal(got.Aead.Key, w.aeadKey):
		return "key differs"
	case got.Mark != nil && (got.Mark.Value != 0 || got.Mark.Mask != 0):
		return fmt.Sprintf("mark %#x/%#x, want none", got.Mark.Value, got.Mark.Mask)
	}
	if sel := got.Selector; sel != nil {
		if prefixOf(sel.Src) != hostPrefix(w.src) || prefixOf(sel.Dst) != hostPrefix(w.key.dst) || sel.Proto != netlink.Proto(unix.IPPROTO_UDP) || sel.DstPort != port {
			return fmt.Sprintf("selector %v -> %v proto %d dport %d", prefixOf(sel.Src), prefixOf(sel.Dst), sel.Proto, sel.DstPort)
		}
	}
	return ""
}

// policyDiff describes how an existing outbound policy differs from the
// wanted one ("" when it matches).
func policyDiff(got *netlink.XfrmPolicy, k polKey, w *wantPolicy, local netip.Addr) string {
	switch {
	case got.Action != netlink.XFRM_POLICY_ALLOW:
		return "action is not allow"
	case got.Ifindex != 0 || got.Ifid != 0 || got.SrcPort != 0:
		return "selector has interface or source port"
	}
	if w.clear {
		switch {
		case len(got.Tmpls) != 0:
			return fmt.Sprintf("%d templates, want none", len(got.Tmpls))
		case got.Priority != ClearPolicyPriority:
			return fmt.Sprintf("priority %d, want %d", got.Priority, ClearPolicyPriority)
		}
		return ""
	}
	if len(got.Tmpls) != 1 {
		return fmt.Sprintf("%d templates, want 1", len(got.Tmpls))
	}
	t := got.Tmpls[0]
	switch {
	case uint32(t.Spi) != w.spi:
		return fmt.Sprintf("template spi 0x%08x, want 0x%08x", uint32(t.Spi), w.spi)
	case t.Proto != netlink.XFRM_PROTO_ESP || t.Mode != netlink.XFRM_MODE_TRANSPORT || t.Reqid != ReqID:
		return "template is not ESP transport with our reqid"
	case addrOf(t.Src) != local.Unmap() || addrOf(t.Dst) != k.dst.Addr():
		return fmt.Sprintf("template %v -> %v", addrOf(t.Src), addrOf(t.Dst))
	case got.Priority != PolicyPriority:
		return fmt.Sprintf("priority %d, want %d", got.Priority, PolicyPriority)
	}
	return ""
}

// xfrmPlan is the ordered set of xfrm changes that turns actual into
// desired. It is computed without touching the kernel, which makes the
// number of kernel operations of any transition testable on any kernel.
type xfrmPlan struct {
	clear    *policyChange  // the clear policy to add or update, first
	inbound  []stateChange  // inbound SAs to add or replace
	remotes  []remoteChange // per remote: outbound SA then policy
	kept     []stateChange  // kept outbound SAs (no policy) to replace
	polDel   []netlink.XfrmPolicy
	stateDel []netlink.XfrmState // not desired; deleted last
}

type stateChange struct {
	want    *wantState
	replace bool   // delete the existing state of that key first
	why     string // why it is replaced
}

type policyChange struct {
	key  polKey
	want *wantPolicy
	op   int // polAdd or polUpdate
}

type remoteChange struct {
	key    polKey
	want   *wantPolicy
	sa     *stateChange // outbound SA to add/replace first, or nil
	policy int          // 0 none, 1 add, 2 update
	// oldSPI is the SPI the existing policy points at (when policy == 2).
	oldSPI uint32
}

const (
	polNone = iota
	polAdd
	polUpdate
)

// Ops counts the kernel requests a plan makes (without dumps).
func (pl *xfrmPlan) Ops() (states, policies int) {
	count := func(c *stateChange) {
		states++
		if c.replace {
			states++
		}
	}
	if pl.clear != nil {
		policies++
	}
	for i := range pl.inbound {
		count(&pl.inbound[i])
	}
	for i := range pl.kept {
		count(&pl.kept[i])
	}
	for _, r := range pl.remotes {
		if r.sa != nil {
			count(r.sa)
		}
		if r.policy != polNone {
			policies++
		}
	}
	return states + len(pl.stateDel), policies + len(pl.polDel)
}

func planXfrm(d *desiredXfrm, a *actualXfrm, port int, local netip.Addr) *xfrmPlan {
	pl := &xfrmPlan{}
	wanted := map[stateKey]bool{} // desired, or kept for a blocked remote
	keys := slices.SortedFunc(func(yield func(stateKey) bool) {
		for k := range d.states {
			if !yield(k) {
				return
			}
		}
	}, func(x, y stateKey) int {
		if c := x.dst.Compare(y.dst); c != 0 {
			return c
		}
		return int(int64(x.spi) - int64(y.spi))
	})
	outbound := map[netip.Addr]*stateChange{}
	for _, k := range keys {
		w := d.states[k]
		wanted[k] = true
		var ch *stateChange
		if got, ok := a.states[k]; !ok {
			ch = &stateChange{want: w}
		} else if why := stateDiff(&got, w, port); why != "" {
			ch = &stateChange{want: w, replace: true, why: why}
		}
		if ch == nil {
			continue
		}
		switch {
		case !w.outbound:
			pl.inbound = append(pl.inbound, *ch)
		case d.policies[remoteKey(local, w.remote, port)] != nil:
			outbound[w.remote] = ch
		default:
			pl.kept = append(pl.kept, *ch)
		}
	}
	pkeys := slices.SortedFunc(func(yield func(polKey) bool) {
		for k := range d.policies {
			if !yield(k) {
				return
			}
		}
	}, func(x, y polKey) int { return x.dst.Addr().Compare(y.dst.Addr()) })
	for _, k := range pkeys {
		w := d.policies[k]
		op := polNone
		var oldSPI uint32
		if got, ok := a.policies[k]; !ok {
			op = polAdd
		} else if why := policyDiff(&got, k, w, local); why != "" {
			op = polUpdate
			if len(got.Tmpls) > 0 {
				oldSPI = uint32(got.Tmpls[0].Spi)
			}
			if w.blocked && len(got.Tmpls) == 1 && a.has(stateKey{k.dst.Addr(), oldSPI}) {
				// Keep the previous keys rather than drop.
				op = polNone
				wanted[stateKey{k.dst.Addr(), oldSPI}] = true
			}
		}
		if w.clear {
			if op != polNone {
				pl.clear = &policyChange{key: k, want: w, op: op}
			}
			continue
		}
		rc := remoteChange{key: k, want: w, sa: outbound[w.remote], policy: op, oldSPI: oldSPI}
		if rc.sa != nil || rc.policy != polNone {
			pl.remotes = append(pl.remotes, rc)
		}
	}
	for k, pol := range a.policies {
		if _, ok := d.policies[k]; !ok {
			pl.polDel = append(pl.polDel, pol)
		}
	}
	pl.polDel = append(pl.polDel, a.strays...)
	// Per-remote policies go before the clear policy: while a remote's
	// policy exists, the clear policy is what lets clear VNIs out.
	slices.SortStableFunc(pl.polDel, func(x, y netlink.XfrmPolicy) int { return len(y.Tmpls) - len(x.Tmpls) })
	for k, s := range a.states {
		if !wanted[k] {
			pl.stateDel = append(pl.stateDel, s)
		}
	}
	slices.SortFunc(pl.stateDel, func(x, y netlink.XfrmState) int { return x.Spi - y.Spi })
	return pl
}

// xfrm operations, each counted and each error naming its object. They are
// queued into the Programmer's batch and sent together by flush (one
// netlink datagram per nlbatch.XfrmBatchSize requests); then, in the
// order they were queued, each request's outcome is recorded (journal) and
// passed to its then (nil: applied).

// queue adds the bookkeeping of the request just queued.
func (p *Programmer) queue(done func(error)) { p.pending = append(p.pending, done) }

// flush sends the queued requests and runs their bookkeeping in order.
func (p *Programmer) flush() {
	if p.batch.Len() == 0 {
		return
	}
	errs, sent := p.xb.Send(&p.batch)
	p.stats.XfrmSends += sent
	pending := p.pending
	p.pending = p.pending[:0]
	p.batch.Reset()
	for i, done := range pending {
		done(errs[i])
	}
}

func (p *Programmer) addState(w *wantState, port int, then func(error)) {
	p.stats.StateAdds++
	st := w.netlink(port)
	fail := func(err error) error {
		return fmt.Errorf("failed to add %s SA spi 0x%08x src %v dst %v (epoch %d, generation %016x): %w", w.dir(), w.key.spi, w.src, w.key.dst, w.epoch, w.gen, err)
	}
	if err := p.batch.AddState(st); err != nil {
		then(fail(err))
		return
	}
	p.queue(func(err error) {
		if err != nil {
			then(fail(err))
			return
		}
		p.journal = append(p.journal, journalEntry{op: journalSetState, sk: w.key, state: *st})
		p.changed++
		then(nil)
	})
}

func (p *Programmer) delState(s *netlink.XfrmState, then func(error)) {
	p.stats.StateDels++
	p.batch.DelState(&netlink.XfrmState{Src: s.Src, Dst: s.Dst, Proto: s.Proto, Spi: s.Spi, Mark: s.Mark})
	p.queue(func(err error) {
		if err != nil && !errors.Is(err, unix.ESRCH) && !errors.Is(err, unix.ENOENT) {
			then(fmt.Errorf("failed to delete SA spi 0x%08x src %v dst %v: %w", uint32(s.Spi), addrOf(s.Src), addrOf(s.Dst), err))
			return
		}
		p.journal = append(p.journal, journalEntry{op: journalDelState, sk: stateKey{addrOf(s.Dst), uint32(s.Spi)}})
		p.changed++
		then(nil)
	})
}

// setPolicy queues the add (op polAdd) or update of k's policy. An add
// the kernel refuses because the policy exists is retried as an update
// with the next flush; then gets the final outcome.
func (p *Programmer) setPolicy(k polKey, w *wantPolicy, local netip.Addr, op int, then func(error)) {
	pol := k.netlink(w, local)
	if op == polAdd {
		p.stats.PolicyAdds++
	} else {
		p.stats.PolicyUpdates++
	}
	fail := func(err error) error {
		if w.clear {
			return fmt.Errorf("failed to set %v: %w", k, err)
		}
		return fmt.Errorf("failed to set %v -> spi 0x%08x: %w", k, w.spi, err)
	}
	if err := p.batch.SetPolicy(pol, op != polAdd); err != nil {
		then(fail(err))
		return
	}
	p.queue(func(err error) {
		switch {
		case op == polAdd && errors.Is(err, unix.EEXIST):
			p.setPolicy(k, w, local, polUpdate, then)
		case err != nil:
			then(fail(err))
		default:
			p.journal = append(p.journal, journalEntry{op: journalSetPolicy, pk: k, policy: *pol})
			p.changed++
			then(nil)
		}
	})
}

func (p *Programmer) delPolicy(pol *netlink.XfrmPolicy, then func(error)) {
	p.stats.PolicyDels++
	p.batch.DelPolicy(&netlink.XfrmPolicy{Src: pol.Src, Dst: pol.Dst, Proto: pol.Proto, DstPort: pol.DstPort, SrcPort: pol.SrcPort, Dir: pol.Dir, Mark: pol.Mark, Ifindex: pol.Ifindex, Ifid: pol.Ifid})
	p.queue(func(err error) {
		if err != nil && !errors.Is(err, unix.ENOENT) {
			then(fmt.Errorf("failed to delete policy dir %v src %v dst %v dport %d: %w", pol.Dir, pol.Src, pol.Dst, pol.DstPort, err))
			return
		}
		p.journal = append(p.journal, journalEntry{op: journalDelPolicy, pk: polKeyOf(pol), policy: *pol})
		p.changed++
		then(nil)
	})
}

// execResult is what an execution did that its caller must know.
type execResult struct {
	// failedOut are remotes whose outbound SA could not be added: the
	// kernel never held it, so its key was never used.
	failedOut []netip.Addr
	// unsupported: the kernel cannot install ESP states at all.
	unsupported bool
	// collisions are SAs left out because of an SPI collision.
	collisions []error
	// failClosed are the errors that leave traffic able to cross in clear
	// (a policy that could not be installed); the rest only drop traffic.
	// The owner reports every error in its status, but fails a share's
	// update only on these.
	failClosed []error
}

// execute applies pl. See Apply for the order and why it never opens a
// clear-text window.
//
// The requests go to the kernel in at most three rounds (each one netlink
// datagram per nlbatch.XfrmBatchSize requests), the kernel processing
// every round in order: (A) the clear policy, SAs, and the policies that
// do not depend on an SA's outcome, then the policies no longer desired;
// (B) the policy updates that must not happen when their remote's new SA
// was refused (the remote then stays on its old SA), adds retried as
// updates, and the deletions of policies if (B) has updates; (C) only when
// everything before succeeded, the SAs no longer desired. Adding a remote
// is one round, removing one two.
func (p *Programmer) execute(pl *xfrmPlan, a *actualXfrm, port int, local netip.Addr) (execResult, error) {
	var res execResult
	var errs []error
	var unsupportedErr error
	p.batch.Reset()
	p.pending = p.pending[:0]
	// stateErr records a refused SA request; outbound ones are reported in
	// failedOut.
	stateErr := func(err error, out *wantState) {
		if out != nil {
			res.failedOut = append(res.failedOut, out.remote)
		}
		if unsupported(err) {
			if unsupportedErr == nil {
				unsupportedErr = fmt.Errorf("%w: %w", ErrKernelUnsupported, err)
			}
			return
		}
		errs = append(errs, err)
	}
	policyErr := func(err error) {
		if err != nil {
			errs = append(errs, err)
			res.failClosed = append(res.failClosed, err)
		}
	}
	// apply queues a state change: the existing SA of that key deleted
	// first when it is replaced. failed (may be nil) learns whether the
	// add was refused.
	probed := false
	apply := func(c *stateChange, outbound bool, failed *bool) {
		var out *wantState
		if outbound {
			out = c.want
		}
		if unsupportedErr != nil {
			// The kernel said it cannot: no further SA is tried.
			if failed != nil {
				*failed = true
			}
			if out != nil {
				res.failedOut = append(res.failedOut, out.remote)
			}
			return
		}
		if c.replace {
			old := a.states[c.want.key]
			p.delState(&old, func(err error) {
				if err != nil {
					errs = append(errs, err)
				}
			})
		}
		p.addState(c.want, port, func(err error) {
			if err == nil {
				p.espWorks = true
				return
			}
			if failed != nil {
				*failed = true
			}
			stateErr(err, out)
		})
		if !p.espWorks && !probed {
			// Until the kernel accepted an SA, the first one goes alone:
			// a kernel without ESP refuses it, and nothing more is tried.
			probed = true
			p.flush()
		}
	}
	// (A) 1. The clear policy, before any remote's policy needs it.
	if pl.clear != nil {
		p.setPolicy(pl.clear.key, pl.clear.want, local, pl.clear.op, policyErr)
	}
	// 2. Inbound SAs of every accepted epoch.
	for i := range pl.inbound {
		apply(&pl.inbound[i], false, nil)
	}
	// 3. Per remote: the outbound SA, then the policy that points at it.
	type deferred struct {
		rc     *remoteChange
		failed bool
	}
	var later []*deferred
	keep := map[stateKey]bool{}
	for i := range pl.remotes {
		rc := &pl.remotes[i]
		if rc.sa == nil {
			if rc.policy != polNone {
				p.setPolicy(rc.key, rc.want, local, rc.policy, policyErr)
			}
			continue
		}
		if rc.policy == polUpdate && a.has(stateKey{rc.key.dst.Addr(), rc.oldSPI}) {
			// Keep the remote as it was when its new SA is refused:
			// traffic continues with the old SA. Decided after (A).
			d := &deferred{rc: rc}
			apply(rc.sa, true, &d.failed)
			later = append(later, d)
			continue
		}
		// Otherwise the policy is installed even if the SA is refused:
		// with no SA it drops.
		apply(rc.sa, true, nil)
		if rc.policy != polNone {
			p.setPolicy(rc.key, rc.want, local, rc.policy, policyErr)
		}
	}
	for i := range pl.kept {
		apply(&pl.kept[i], true, nil)
	}
	// 4. Policies no longer desired (per remote first, the clear policy
	// last), after every policy set.
	delPolicies := func() {
		for i := range pl.polDel {
			p.delPolicy(&pl.polDel[i], func(err error) {
				if err != nil {
					errs = append(errs, err)
				}
			})
		}
	}
	if len(later) == 0 {
		delPolicies()
	}
	p.flush()
	// (B)
	for _, d := range later {
		if d.failed {
			keep[stateKey{d.rc.key.dst.Addr(), d.rc.oldSPI}] = true
			continue
		}
		p.setPolicy(d.rc.key, d.rc.want, local, d.rc.policy, policyErr)
	}
	if len(later) > 0 {
		delPolicies()
	}
	p.flush()
	// (C) 5. SAs no longer desired: retired epochs, old outbound SAs,
	// removed remotes, old generations. Only when everything above
	// succeeded: after a failure the caller may go back to the previous
	// state, whose SAs must still be there (re-creating one would reuse
	// its key).
	if len(errs) == 0 && unsupportedErr == nil {
		for i := range pl.stateDel {
			s := &pl.stateDel[i]
			if keep[stateKey{addrOf(s.Dst), uint32(s.Spi)}] {
				continue
			}
			p.delState(s, func(err error) {
				if err != nil {
					errs = append(errs, err)
				}
			})
		}
		p.flush()
	}
	// Whatever a round's outcomes queued (an add refused because the
	// policy exists, retried as an update) is sent too.
	for p.batch.Len() > 0 {
		p.flush()
	}
	if unsupportedErr != nil {
		res.unsupported = true
		errs = append([]error{unsupportedErr}, errs...)
	}
	return res, errors.Join(errs...)
}

// xfrmAudit lists the differences between the kernel's xfrm state and d.
func xfrmAudit(d *desiredXfrm, a *actualXfrm, port int, local netip.Addr) []string {
	var out []string
	for k, w := range d.states {
		got, ok := a.states[k]
		if !ok {
			out = append(out, fmt.Sprintf("xfrm: %s SA %v src %v (epoch %d) missing", w.dir(), k, w.src, w.epoch))
		} else if why := stateDiff(&got, w, port); why != "" {
			out = append(out, fmt.Sprintf("xfrm: %s SA %v src %v (epoch %d): %s", w.dir(), k, w.src, w.epoch, why))
		}
	}
	for k, s := range a.states {
		if _, ok := d.states[k]; !ok {
			out = append(out, fmt.Sprintf("xfrm: SA %v src %v is ours but not desired", k, addrOf(s.Src)))
		}
	}
	for k, w := range d.policies {
		got, ok := a.policies[k]
		if !ok {
			out = append(out, fmt.Sprintf("xfrm: %v missing", k))
		} else if why := policyDiff(&got, k, w, local); why != "" {
			out = append(out, fmt.Sprintf("xfrm: %v: %s", k, why))
		}
	}
	for k := range a.policies {
		if _, ok := d.policies[k]; !ok {
			out = append(out, fmt.Sprintf("xfrm: %v is ours but not desired", k))
		}
	}
	for _, s := range a.strays {
		out = append(out, fmt.Sprintf("xfrm: policy dir %v src %v dst %v has our reqid or mark but is not one we install", s.Dir, s.Src, s.Dst))
	}
	out = append(out, errStrings(d.collisions)...)
	return out
}

func errStrings(errs []error) []string {
	var out []string
	for _, e := range errs {
		out = append(out, "xfrm: "+e.Error())
	}
	return out
}
