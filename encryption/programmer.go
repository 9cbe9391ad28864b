package encryption

import (
	"errors"
	"fmt"
	"net/netip"
	"slices"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Stats counts the kernel requests a Programmer made.
type Stats struct {
	XfrmDumps     int // state and policy dumps (one request each, retries included)
	StateAdds     int
	StateDels     int
	PolicyAdds    int
	PolicyUpdates int
	PolicyDels    int
	NftDumps      int // nftables list requests
	NftBatches    int // nftables transactions (each atomic)
	NftRebuilds   int // transactions that (re)built the whole table
	NftElements   int // VNI set elements added or removed
}

// Changes is the number of requests that changed the kernel (dumps excluded).
func (s Stats) Changes() int {
	return s.StateAdds + s.StateDels + s.PolicyAdds + s.PolicyUpdates + s.PolicyDels + s.NftBatches
}

// Sub returns s - o.
func (s Stats) Sub(o Stats) Stats {
	return Stats{
		XfrmDumps: s.XfrmDumps - o.XfrmDumps, StateAdds: s.StateAdds - o.StateAdds, StateDels: s.StateDels - o.StateDels,
		PolicyAdds: s.PolicyAdds - o.PolicyAdds, PolicyUpdates: s.PolicyUpdates - o.PolicyUpdates, PolicyDels: s.PolicyDels - o.PolicyDels,
		NftDumps: s.NftDumps - o.NftDumps, NftBatches: s.NftBatches - o.NftBatches, NftRebuilds: s.NftRebuilds - o.NftRebuilds,
		NftElements: s.NftElements - o.NftElements,
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
// A Programmer is not safe for concurrent use: its owner (the driver, under
// the encryption lock) serialises calls.
type Programmer struct {
	nsfd  int // our own duplicate of the namespace handle
	nl    *netlink.Handle
	nft   *nftables.Conn
	stats Stats
}

// NewProgrammer returns a Programmer for namespace ns. It keeps its own
// reference to ns; the caller may close ns afterwards.
func NewProgrammer(ns netns.NsHandle) (*Programmer, error) {
	fd, err := unix.FcntlInt(uintptr(ns), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("failed to duplicate namespace handle: %w", err)
	}
	nl, err := netlink.NewHandleAt(netns.NsHandle(fd), unix.NETLINK_XFRM)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("failed to open xfrm netlink socket: %w", err)
	}
	nft, err := nftables.New(nftables.WithNetNSFd(fd))
	if err != nil {
		nl.Close()
		unix.Close(fd)
		return nil, fmt.Errorf("failed to open nftables connection: %w", err)
	}
	return &Programmer{nsfd: fd, nl: nl, nft: nft}, nil
}

// Close releases the Programmer's sockets. It leaves the kernel state as it
// is: encryption stays in force (and fails closed) while overlayd is down.
func (p *Programmer) Close() error {
	if p == nil || p.nl == nil {
		return nil
	}
	p.nl.Close()
	p.nl = nil
	return unix.Close(p.nsfd)
}

// Stats returns the cumulative kernel request counters.
func (p *Programmer) Stats() Stats { return p.stats }

// Apply makes the kernel hold exactly what d describes: it dumps overlayd's
// SAs (by reqid), policies (by template reqid) and nftables table, diffs
// them against d and applies the difference. It is level-triggered: the same
// call reconciles at start-up, after a crash half-way, or after someone
// edited the state.
//
// Order, chosen so that no step ever lets an encrypted VNI's VXLAN packet
// leave or enter in clear (fail closed), and so that a rotation drops no
// packet (hitless):
//
//  1. nftables first, widening only: the table, its mark and drop rules, and
//     every desired VNI in the set, in one atomic transaction (VNIs no
//     longer desired stay for now). From here on, encrypted VXLAN without an
//     xfrm transform is dropped on the way out, and without ESP on the way
//     in, whatever xfrm holds.
//  2. Inbound SAs for every accepted epoch: we can decrypt before anyone
//     sends with a new epoch (the cluster waits for our Accept).
//  3. Per remote, the outbound SA of the Send epoch, then the outbound
//     policy pointing at it (an add, or an atomic XfrmPolicyUpdate of the
//     template SPI: switching epochs swaps one pointer, no gap). SAs exist
//     before policies point at them. If the new outbound SA cannot be added
//     and the policy points at an SA that still exists, the remote is left
//     as it was (old epoch, still accepted everywhere); a new remote's
//     policy is installed anyway: with no SA it drops.
//  4. Policies no longer desired (remote gone): marked packets to that
//     remote now have no transform and are dropped by step 1's rule.
//  5. SAs no longer desired: old outbound SAs (no policy points at them
//     any more), retired inbound epochs (everyone sends newer), removed
//     remotes. Removing an SA only ever drops, never leaks.
//  6. nftables narrowing last: VNIs no longer encrypted leave the set, or
//     the table goes when no VNI is encrypted (nothing of ours is left).
//
// On a kernel that cannot install ESP states, Apply still does steps 1, 3
// (policies), 4 and 6, skips the SAs and returns an error wrapping
// ErrKernelUnsupported: the encrypted VNIs are then dropped both ways
// (policies without SAs drop, nftables drops what xfrm does not transform),
// which is the only safe state, and Audit lists the missing SAs. Other
// errors are collected (each names its object); Apply carries on with the
// other objects and returns them joined. A caller must not advertise the
// new NodeKeys until Apply returned nil.
func (p *Programmer) Apply(d Desired) error {
	if p == nil || p.nl == nil {
		return errors.New("encryption: Apply on a closed Programmer")
	}
	if err := d.Validate(); err != nil {
		return fmt.Errorf("invalid desired encryption state: %w", err)
	}
	dx, err := xfrmOf(&d)
	if err != nil {
		return err
	}
	dn := nftOf(&d)
	an, err := p.nftDump(dn)
	if err != nil {
		return err
	}
	ax, err := p.xfrmDump()
	if err != nil {
		return err
	}
	// 1.
	if err := p.nftWiden(dn, an); err != nil {
		// Without the fail-closed rules nothing else may change.
		return err
	}
	// 2.-5.
	errs := []error{p.execute(planXfrm(dx, ax, d.Port), ax, d.Port)}
	errs = append(errs, dx.collisions...)
	// 6.
	errs = append(errs, p.nftNarrow(dn, an))
	return errors.Join(errs...)
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
	dx, err := xfrmOf(&d)
	if err != nil {
		return []string{err.Error()}
	}
	dn := nftOf(&d)
	an, err := p.nftDump(dn)
	if err != nil {
		return []string{err.Error()}
	}
	ax, err := p.xfrmDump()
	if err != nil {
		return []string{err.Error()}
	}
	out := nftAudit(dn, an)
	out = append(out, xfrmAudit(dx, ax, d.Port)...)
	slices.Sort(out)
	return out
}

// PairStatus is what `overlayd status` shows for one remote: the epochs
// (key tags) in use and SA counters, never key bytes.
type PairStatus struct {
	Remote      netip.Addr
	SendEpoch   uint32 // epoch of the SA the outbound policy points at (0: none)
	SendSA      SAStatus
	Inbound     []SAStatus // one per accepted epoch, by epoch
	PolicyFound bool
}

// SAStatus describes one SA.
type SAStatus struct {
	Epoch            uint32
	SPI              uint32
	Installed        bool
	Packets, Bytes   uint64
	IntegrityFailed  uint32
	ReplayDropped    uint32
	ReplayWindowDrop uint32
}

// Status reports, for every remote of d, the SAs and policy the kernel
// holds, with their counters.
func (p *Programmer) Status(d Desired) ([]PairStatus, error) {
	if err := d.Validate(); err != nil {
		return nil, err
	}
	dx, err := xfrmOf(&d)
	if err != nil {
		return nil, err
	}
	ax, err := p.xfrmDump()
	if err != nil {
		return nil, err
	}
	byRemote := map[netip.Addr]*PairStatus{}
	var order []netip.Addr
	get := func(r netip.Addr) *PairStatus {
		if ps, ok := byRemote[r]; ok {
			return ps
		}
		ps := &PairStatus{Remote: r}
		byRemote[r] = ps
		order = append(order, r)
		return ps
	}
	for k, w := range dx.states {
		st := SAStatus{Epoch: w.epoch, SPI: k.spi}
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
		ps := get(w.remote)
		if got, ok := ax.policies[k]; ok && len(got.Tmpls) == 1 {
			ps.PolicyFound = true
			if uint32(got.Tmpls[0].Spi) == w.spi {
				ps.SendEpoch = w.epoch
			}
		}
	}
	slices.SortFunc(order, func(a, b netip.Addr) int { return a.Compare(b) })
	out := make([]PairStatus, 0, len(order))
	for _, r := range order {
		ps := byRemote[r]
		slices.SortFunc(ps.Inbound, func(a, b SAStatus) int { return int(int64(a.Epoch) - int64(b.Epoch)) })
		out = append(out, *ps)
	}
	return out, nil
}

// Counters returns the packet counters of the nftables rules by chain name
// (ChainMark: marked packets, ChainOutDrop: clear text dropped on the way
// out, ChainInDrop: clear text dropped on the way in).
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
