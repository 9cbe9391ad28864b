package encryption

import (
	"cmp"
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"

	"github.com/google/nftables"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/nlbatch"
	"github.com/overlayd/overlayd/internal/nlwrap"
)

// Stats counts the kernel requests a Programmer made.
type Stats struct {
	XfrmDumps int // state and policy dumps asked (an interrupted one is retried within, by nlwrap)
	// XfrmSends counts the datagrams that carried the xfrm requests
	// below (each one netlink round trip).
	XfrmSends     int
	StateAdds     int
	StateDels     int
	PolicyAdds    int
	PolicyUpdates int
	PolicyDels    int
	NftDumps      int // nftables list requests
	NftBatches    int // nftables transactions (each atomic)
	NftRebuilds   int // transactions that (re)built the whole table
	NftElements   int // VNI set elements added or removed
	// Deltas counts the Owner's applies planned against its tracker's
	// record of the kernel (no dump); DeltaFailures those of them that
	// failed (the Owner then resyncs at once).
	Deltas        int
	DeltaFailures int
	// RemoteDeltas counts the deltas planned for their dirty remotes only
	// (keys, generation and VTEP unchanged).
	RemoteDeltas int
}

// Changes is the number of requests that changed the kernel (dumps excluded).
func (s Stats) Changes() int {
	return s.StateAdds + s.StateDels + s.PolicyAdds + s.PolicyUpdates + s.PolicyDels + s.NftBatches
}

// Sub returns s - o.
func (s Stats) Sub(o Stats) Stats {
	return Stats{
		XfrmDumps: s.XfrmDumps - o.XfrmDumps, XfrmSends: s.XfrmSends - o.XfrmSends, StateAdds: s.StateAdds - o.StateAdds, StateDels: s.StateDels - o.StateDels,
		PolicyAdds: s.PolicyAdds - o.PolicyAdds, PolicyUpdates: s.PolicyUpdates - o.PolicyUpdates, PolicyDels: s.PolicyDels - o.PolicyDels,
		NftDumps: s.NftDumps - o.NftDumps, NftBatches: s.NftBatches - o.NftBatches, NftRebuilds: s.NftRebuilds - o.NftRebuilds,
		NftElements: s.NftElements - o.NftElements, Deltas: s.Deltas - o.Deltas, DeltaFailures: s.DeltaFailures - o.DeltaFailures,
		RemoteDeltas: s.RemoteDeltas - o.RemoteDeltas,
	}
}

func (s Stats) String() string {
	return fmt.Sprintf("%d changes (SA +%d -%d, policy +%d ~%d -%d, nft batches %d) and %d dumps (xfrm %d, nft %d)",
		s.Changes(), s.StateAdds, s.StateDels, s.PolicyAdds, s.PolicyUpdates, s.PolicyDels, s.NftBatches,
		s.XfrmDumps+s.NftDumps, s.XfrmDumps, s.NftDumps)
}

// Programmer makes the encryption state of one network namespace (the host
// namespace, where the VXLAN sockets live) match a Desired. It talks to the
// kernel only through sockets bound to that namespace.
//
// A Programmer is not safe for concurrent use: its owner (Owner, under its
// lock) serialises calls.
type Programmer struct {
	nsfd int            // our own duplicate of the namespace handle
	nl   *nlwrap.Handle // dumps
	// xb sends the xfrm changes, batch by batch; pending holds the
	// bookkeeping of the requests queued in batch (see flush).
	xb      *nlbatch.Conn
	batch   nlbatch.XfrmBatch
	pending []func(error)
	// espWorks: the kernel accepted an SA (it has ESP and the AEAD), so
	// SA adds no longer go alone (see execute).
	espWorks bool
	nft      *nftables.Conn
	stats    Stats
	// changed counts the requests that succeeded in changing the kernel
	// (Stats counts attempts).
	changed int
	// derived caches the SPIs and keys of the SAs it programs.
	derived *deriveCache
	// journal records the xfrm changes of the program in progress that
	// the kernel accepted, for the Owner's tracker.
	journal []journalEntry
}

// NewProgrammer returns a Programmer for namespace ns. It keeps its own
// reference to ns; the caller may close ns afterwards.
func NewProgrammer(ns netns.NsHandle) (*Programmer, error) {
	fd, err := unix.FcntlInt(uintptr(ns), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("failed to duplicate namespace handle: %w", err)
	}
	nl, err := nlwrap.NewHandleAt(netns.NsHandle(fd), unix.NETLINK_XFRM)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("failed to open xfrm netlink socket: %w", err)
	}
	xb, err := nlbatch.OpenXfrm(netns.NsHandle(fd))
	if err != nil {
		nl.Close()
		unix.Close(fd)
		return nil, err
	}
	nft, err := newNftConn(fd)
	if err != nil {
		xb.Close()
		nl.Close()
		unix.Close(fd)
		return nil, fmt.Errorf("failed to open nftables connection: %w", err)
	}
	return &Programmer{nsfd: fd, nl: nl, xb: xb, nft: nft, derived: &deriveCache{}}, nil
}

// Close releases the Programmer's sockets. It leaves the kernel state as it
// is: encryption stays in force (and fails closed) while overlayd is down.
func (p *Programmer) Close() error {
	if p == nil || p.nl == nil {
		return nil
	}
	p.nl.Close()
	p.nl = nil
	p.xb.Close()
	p.nft.CloseLasting()
	return unix.Close(p.nsfd)
}

// newNftConn opens one nftables socket in the namespace, kept for every
// request (a new socket per request costs a namespace switch each: most of
// a reconcile's time on a slow machine).
func newNftConn(nsfd int) (*nftables.Conn, error) {
	return nftables.New(nftables.WithNetNSFd(nsfd), nftables.AsLasting())
}

// nftFailed replaces the nftables socket after a failed request, so that
// nothing a failure left unread on it confuses the next request.
func (p *Programmer) nftFailed() {
	if c, err := newNftConn(p.nsfd); err == nil {
		p.nft.CloseLasting()
		p.nft = c
	}
}

// Stats returns the cumulative kernel request counters.
func (p *Programmer) Stats() Stats { return p.stats }

// Apply makes the kernel hold exactly what d describes: it dumps overlayd's
// SAs (by reqid), policies (by template reqid, or the clear mark) and
// nftables table, diffs them against d and applies the difference. It is
// level-triggered: the same call reconciles at start-up, after a crash
// half-way, or after someone edited the state. (The Owner plans against
// its tracker's record instead of dumping when it can; the order below is
// the same, see program.)
//
// Order, chosen so that no step ever lets an encrypted VNI's VXLAN packet
// leave or enter in clear (fail closed), and so that a rotation drops no
// packet (hitless):
//
//  1. nftables first, widening only: the table, its rules, every desired
//     encrypted VNI in encrypted_vnis (VNIs no longer desired stay for now)
//     and the clear VNIs in clear_vnis, in one atomic transaction.
//  2. The clear policy (mark ClearMark: allow, no transform), so that
//     clear VNIs keep leaving in clear once a remote's policy exists.
//  3. Inbound SAs for every accepted epoch: we can decrypt before anyone
//     sends with a new epoch (the cluster waits for our Accept).
//  4. Per remote, the outbound SA of the Send epoch, then the outbound
//     policy pointing at it (an add, or an atomic XfrmPolicyUpdate of the
//     template SPI: switching epochs or generations swaps one pointer, no
//     gap). SAs exist before policies point at them. If the new outbound
//     SA cannot be added and the policy points at an SA that still
//     exists, the remote is left as it was; a new remote's policy is
//     installed anyway: with no SA it drops. Then kept outbound SAs.
//  5. Policies no longer desired (remote gone), the clear policy last.
//  6. SAs no longer desired: old outbound SAs (no policy points at them
//     any more), retired inbound epochs, removed remotes, old generations —
//     only when every step before succeeded, so that the previous state
//     can be re-applied without re-creating an SA. Removing an SA only
//     ever drops, never leaks.
//  7. nftables narrowing last: VNIs no longer encrypted or clear leave
//     their sets, or the table goes when no VNI is encrypted.
//
// On a kernel that cannot install ESP states, Apply still does everything
// but the SAs and returns an error wrapping ErrKernelUnsupported: the
// encrypted VNIs are then dropped both ways (policies without SAs drop,
// nftables drops what xfrm does not transform), which is the only safe
// state. Other errors are collected (each names its object); Apply carries
// on with the other objects and returns them joined. A caller must not
// advertise new keys until Apply returned nil.
func (p *Programmer) Apply(d Desired) error {
	if err := p.check(&d); err != nil {
		return err
	}
	ax, err := p.xfrmDump()
	if err != nil {
		return err
	}
	defer p.derived.endRound()
	res, _, err := p.program(&d, nil, nil, ax, nil)
	return errors.Join(append([]error{err}, res.collisions...)...)
}

// check returns why d cannot be programmed: the Programmer is closed, or d
// is invalid.
func (p *Programmer) check(d *Desired) error {
	if p == nil || p.nl == nil {
		return errors.New("encryption: Apply on a closed Programmer")
	}
	if err := d.Validate(); err != nil {
		return fmt.Errorf("invalid desired encryption state: %w", err)
	}
	return nil
}

// program makes the kernel go from a (overlayd's xfrm state, or the part
// of it concerning the remotes in only) and an (its table; nil: dumped
// here) to d, in Apply's order; with only (sorted, d normalized), just
// those remotes' SAs and policies and the clear policy are derived,
// compared and changed. dx is the xfrm state d wants for them when the
// caller derived it (nil: derived here). The requests the kernel accepted
// are in journal, in order, when it returns; an is returned as it is now.
// SPI collisions are returned in the result, not in the error.
func (p *Programmer) program(d *Desired, dx *desiredXfrm, only []netip.Addr, a *actualXfrm, an *nftActual) (res execResult, _ *nftActual, err error) {
	p.journal = p.journal[:0]
	if err := p.check(d); err != nil {
		return execResult{failClosed: []error{err}}, nil, err
	}
	if dx == nil {
		if dx, err = xfrmOfRemotes(d, p.derived, only); err != nil {
			return execResult{failClosed: []error{err}}, nil, err
		}
	}
	dn := nftOf(d)
	if an == nil {
		if an, err = p.nftDump(dn); err != nil {
			p.nftFailed()
			return execResult{failClosed: []error{err}}, nil, err
		}
	}
	// 1.
	if err := p.nftWiden(dn, an); err != nil {
		// Without the fail-closed rules nothing else may change.
		p.nftFailed()
		return execResult{failClosed: []error{err}}, nil, err
	}
	// 2.-6.
	res, err = p.execute(planXfrm(dx, a, d.Port, d.Local), a, d.Port, d.Local)
	res.collisions = dx.collisions
	// 7.
	nerr := p.nftNarrow(dn, an)
	if nerr != nil {
		p.nftFailed()
	}
	return res, an, errors.Join(err, nerr)
}

// Audit returns the differences between the kernel and d, one line each;
// empty means the kernel holds exactly d.
func (p *Programmer) Audit(d Desired) []string {
	if p == nil || p.nl == nil {
		return []string{"encryption: Audit on a closed Programmer"}
	}
	if err := d.Validate(); err != nil {
		return []string{"invalid desired encryption state: " + err.Error()}
	}
	dx, err := xfrmOfCached(&d, p.derived)
	if err != nil {
		return []string{err.Error()}
	}
	dn := nftOf(&d)
	an, err := p.nftDump(dn)
	if err != nil {
		p.nftFailed()
		return []string{err.Error()}
	}
	ax, err := p.xfrmDump()
	if err != nil {
		return []string{err.Error()}
	}
	out := nftAudit(dn, an)
	out = append(out, xfrmAudit(dx, ax, d.Port, d.Local)...)
	slices.Sort(out)
	return out
}

// PairStatus is what `overlayd status` shows for one remote: the epochs
// (key tags) and generations in use and SA counters, never key bytes.
type PairStatus struct {
	Remote netip.Addr `json:"remote"`
	// RemoteGen is the remote's advertised send generation (0: unknown, no
	// inbound SA yet).
	RemoteGen uint64 `json:"remote_gen,string"`
	// Shares is how many shares need this remote (0: only its outbound SA
	// is kept, for when it comes back).
	Shares      int        `json:"shares"`
	SendEpoch   uint32     `json:"send_epoch"` // epoch of the SA the outbound policy points at (0: none)
	SendSA      SAStatus   `json:"send_sa"`
	Inbound     []SAStatus `json:"inbound"` // one per accepted epoch, by epoch
	PolicyFound bool       `json:"policy_found"`
}

// SAStatus describes one SA.
type SAStatus struct {
	Epoch            uint32 `json:"epoch"`
	Gen              uint64 `json:"gen,string"` // the sender's send generation
	SPI              uint32 `json:"spi"`
	Installed        bool   `json:"installed"`
	Packets          uint64 `json:"packets"`
	Bytes            uint64 `json:"bytes"`
	IntegrityFailed  uint32 `json:"integrity_failed"`
	ReplayDropped    uint32 `json:"replay_dropped"`
	ReplayWindowDrop uint32 `json:"replay_window_dropped"`
}

// Status reports, for every remote of d, the SAs and policy the kernel
// holds, with their counters.
func (p *Programmer) Status(d Desired) ([]PairStatus, error) {
	if p == nil || p.nl == nil {
		return nil, errors.New("encryption: Status on a closed Programmer")
	}
	if err := d.Validate(); err != nil {
		return nil, err
	}
	dx, err := xfrmOfCached(&d, p.derived)
	if err != nil {
		return nil, err
	}
	ax, err := p.xfrmDump()
	if err != nil {
		return nil, err
	}
	byRemote := map[netip.Addr]*PairStatus{}
	get := func(r netip.Addr) *PairStatus {
		if ps, ok := byRemote[r]; ok {
			return ps
		}
		ps := &PairStatus{Remote: r, RemoteGen: d.RemoteGens[r]}
		byRemote[r] = ps
		return ps
	}
	for _, r := range d.Remotes {
		get(r.Unmap())
	}
	for k, w := range dx.states {
		st := SAStatus{Epoch: w.epoch, Gen: w.gen, SPI: k.spi}
		if got, ok := ax.states[k]; ok && got.Aead != nil {
			st.Installed = true
			st.Packets, st.Bytes = got.Statistics.Packets, got.Statistics.Bytes
			st.IntegrityFailed = got.Statistics.Failed
			st.ReplayDropped = got.Statistics.Replay
			st.ReplayWindowDrop = got.Statistics.ReplayWindow
		}
		ps := get(w.remote)
		if w.outbound {
			ps.SendSA = st
		} else {
			ps.Inbound = append(ps.Inbound, st)
		}
	}
	for k, w := range dx.policies {
		if w.clear {
			continue
		}
		ps := get(w.remote)
		if got, ok := ax.policies[k]; ok && len(got.Tmpls) == 1 {
			ps.PolicyFound = true
			if uint32(got.Tmpls[0].Spi) == w.spi {
				ps.SendEpoch = w.epoch
			}
		}
	}
	out := make([]PairStatus, 0, len(byRemote))
	for _, r := range slices.SortedFunc(maps.Keys(byRemote), netip.Addr.Compare) {
		ps := byRemote[r]
		slices.SortFunc(ps.Inbound, func(a, b SAStatus) int { return cmp.Compare(a.Epoch, b.Epoch) })
		out = append(out, *ps)
	}
	return out, nil
}

// Counters returns the packet counters of the nftables rules by chain name
// (ChainMark: clear VNIs' packets marked, ChainOutDrop: clear text of
// encrypted VNIs dropped on the way out, ChainInDrop: clear text of
// encrypted VNIs dropped on the way in).
func (p *Programmer) Counters(d Desired) (map[string]uint64, error) {
	a, err := p.nftDump(nftOf(&d))
	if err != nil {
		return nil, err
	}
	out := map[string]uint64{}
	for name, c := range a.counters {
		out[name] = c.Packets
	}
	return out, nil
}
