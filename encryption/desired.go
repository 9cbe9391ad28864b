package encryption

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"slices"

	"github.com/vishvananda/netlink"
)

const (
	// ReqID is the reqid of every SA and policy template overlayd installs
	// ("ovld" in ASCII, like the interface group of its links). It is how
	// Programmer recognises its own xfrm state: a state, or a policy whose
	// template, carries this reqid is overlayd's, and anything overlayd's
	// that is not desired is removed.
	ReqID = 0x6f766c64

	// ClearMark and ClearMarkMask are the firewall mark nftables puts on
	// outbound VXLAN packets of UNencrypted VNIs ("ovlc"), and that selects
	// the clear policy: the one way a VXLAN packet to a remote that shares
	// an encrypted network leaves without ESP. Whatever removes the mark
	// (the table flushed, the rule or a set element gone, another program
	// rewriting marks) makes such packets encrypted or dropped, never
	// clear. The whole 32 bits are compared, so a foreign mark matches only
	// if it is exactly this value. Docker's overlay uses 0xd0c4e3, so both
	// can coexist.
	ClearMark     = 0x6f766c63
	ClearMarkMask = 0xffffffff

	// ReplayWindow is the anti-replay window of inbound SAs, in packets.
	// SAs use extended (64-bit) sequence numbers, so a busy SA does not
	// exhaust its 32-bit sequence space between rotations.
	ReplayWindow = 128

	// PolicyPriority is the priority of the per-remote outbound policies
	// and ClearPolicyPriority that of the clear policy (lower wins, so a
	// packet marked ClearMark takes the clear policy).
	PolicyPriority      = 1000
	ClearPolicyPriority = 900

	// blockSPI is the template SPI of a remote's policy while no key is
	// established (Send 0): in the reserved range, so no SA ever has it and
	// the policy drops everything it selects.
	blockSPI = 0xff
)

// Desired is the whole encryption state one host wants in its host
// namespace (where the VXLAN UDP socket lives). It is a pure description;
// Programmer.Apply makes the kernel match it. Owner builds it; tests may
// build it directly.
type Desired struct {
	Local netip.Addr // local VTEP address
	Port  int        // VXLAN UDP destination port
	// VNIs are the encrypted VNIs: dropped by nftables when they would
	// leave or arrive without ESP.
	VNIs []uint32
	// ClearVNIs are the host's unencrypted VNIs: nftables marks their
	// packets ClearMark so the clear policy lets them out in clear. A VNI
	// may not be in both.
	ClearVNIs []uint32
	// Remotes share at least one encrypted network with this host: each
	// gets an outbound policy (no mark: every VXLAN packet to it is
	// encrypted unless marked clear), an outbound SA for Send and inbound
	// SAs for every accepted epoch under its RemoteGens generation.
	Remotes []netip.Addr
	// RemoteGens are the remotes' advertised send generations; a remote
	// without one (or 0) gets no inbound SA yet.
	RemoteGens map[netip.Addr]uint64
	// KeepOutbound are remotes no longer needed whose outbound SA for
	// (Send, Gen) stays installed (no policy, no inbound SA), so that a
	// remote coming back reuses it instead of a second SA with its key.
	KeepOutbound []netip.Addr
	// Blocked are remotes (of Remotes) whose outbound SA must not be
	// installed now (its reservation could not be persisted): their policy
	// is left pointing at the SA it points at if that SA exists (traffic
	// goes on with the previous keys), else at no SA (dropped).
	Blocked []netip.Addr
	Accept  []uint32 // epochs accepted inbound (NodeKeys.Accept)
	// Send is the epoch used outbound (NodeKeys.Send); 0 while keys are not
	// established: policies are installed but point at no SA (drop).
	Send uint32
	// Gen is this host's send generation (Advert.Gen), part of the key and
	// SPI of every outbound SA.
	Gen    uint64
	Secret []byte // cluster secret that keys and SPIs derive from
	// NoSAs leaves SAs out (the kernel cannot install them): rules and
	// policies only, which drops every encrypted VNI's packet.
	NoSAs bool
}

// Empty reports whether d wants nothing at all in the kernel (no encrypted
// VNI): then Apply removes everything overlayd installed.
func (d *Desired) Empty() bool { return len(d.VNIs) == 0 }

// Validate checks d. A Desired with no VNI is valid whatever else it holds
// (it means "remove everything").
func (d *Desired) Validate() error {
	if d.Empty() {
		return nil
	}
	var errs []error
	if !d.Local.IsValid() || d.Local.IsUnspecified() || d.Local.Zone() != "" {
		errs = append(errs, fmt.Errorf("invalid local VTEP address %v", d.Local))
	}
	if d.Port <= 0 || d.Port > 65535 {
		errs = append(errs, fmt.Errorf("invalid VXLAN port %d", d.Port))
	}
	for _, v := range slices.Concat(d.VNIs, d.ClearVNIs) {
		if v == 0 || v > 1<<24-1 {
			errs = append(errs, fmt.Errorf("invalid VNI %d", v))
		}
	}
	for _, v := range d.ClearVNIs {
		if slices.Contains(d.VNIs, v) {
			errs = append(errs, fmt.Errorf("VNI %d is both encrypted and clear", v))
		}
	}
	local := d.Local.Unmap()
	for _, r := range slices.Concat(d.Remotes, d.KeepOutbound) {
		switch {
		case !r.IsValid() || r.IsUnspecified() || r.Zone() != "":
			errs = append(errs, fmt.Errorf("invalid remote VTEP address %v", r))
		case r.Unmap() == local:
			errs = append(errs, fmt.Errorf("remote VTEP %v is the local VTEP", r))
		case r.Unmap().Is4() != local.Is4():
			errs = append(errs, fmt.Errorf("remote VTEP %v is not of the local VTEP's (%v) address family", r, d.Local))
		}
	}
	if len(d.Remotes)+len(d.KeepOutbound) > 0 && d.Send != 0 {
		if len(d.Secret) < MinSecretLen {
			errs = append(errs, ErrBadSecret)
		}
		if d.Gen == 0 {
			errs = append(errs, errors.New("no send generation"))
		}
		if !slices.Contains(d.Accept, d.Send) {
			errs = append(errs, fmt.Errorf("send epoch %d is not accepted (accept %v)", d.Send, d.Accept))
		}
		for _, e := range d.Accept {
			if e == 0 {
				errs = append(errs, errors.New("epoch 0 in accept set"))
			}
		}
	}
	return errors.Join(errs...)
}

// stateKey identifies an SA in the kernel: destination, SPI (protocol is
// always ESP here).
type stateKey struct {
	dst netip.Addr
	spi uint32
}

func (k stateKey) String() string { return fmt.Sprintf("spi 0x%08x dst %v", k.spi, k.dst) }

// wantState is one SA overlayd wants.
type wantState struct {
	key      stateKey
	src      netip.Addr
	epoch    uint32
	gen      uint64 // the sender's send generation
	remote   netip.Addr
	outbound bool
	aeadKey  []byte
}

func (w *wantState) dir() string {
	if w.outbound {
		return "outbound"
	}
	return "inbound"
}

// wantPolicy is one outbound policy overlayd wants: a remote's (template
// to the outbound SA) or the clear policy (no template).
type wantPolicy struct {
	remote netip.Addr // invalid for the clear policy
	spi    uint32     // template SPI: the outbound SA of the Send epoch
	epoch  uint32
	clear  bool
	// blocked: the outbound SA may not be installed now; an existing
	// policy pointing at an existing SA is left alone.
	blocked bool
}

// polKey identifies an outbound policy: its selector and mark (direction is
// always out, protocol always UDP).
type polKey struct {
	src, dst netip.Prefix
	dport    int
	mark     uint32
	mask     uint32
}

func (k polKey) String() string {
	if k.mark == ClearMark && k.mask == ClearMarkMask {
		return fmt.Sprintf("clear policy out src %v dst %v udp dport %d mark %#x/%#x", k.src, k.dst, k.dport, k.mark, k.mask)
	}
	return fmt.Sprintf("policy out src %v dst %v udp dport %d", k.src, k.dst, k.dport)
}

// desiredXfrm is the xfrm part of a Desired, with SPIs and keys derived.
type desiredXfrm struct {
	states   map[stateKey]*wantState
	policies map[polKey]*wantPolicy
	// collisions are SAs left out because their SPI collides with another
	// desired SA of the same destination.
	collisions []error
}

func hostPrefix(a netip.Addr) netip.Prefix {
	a = a.Unmap()
	return netip.PrefixFrom(a, a.BitLen())
}

// anyPrefix is 0.0.0.0/0 or ::/0, of a's family.
func anyPrefix(a netip.Addr) netip.Prefix {
	if a.Unmap().Is4() {
		return netip.PrefixFrom(netip.IPv4Unspecified(), 0)
	}
	return netip.PrefixFrom(netip.IPv6Unspecified(), 0)
}

func remoteKey(local, r netip.Addr, port int) polKey {
	return polKey{src: anyPrefix(local), dst: hostPrefix(r), dport: port}
}

func clearKey(local netip.Addr, port int) polKey {
	return polKey{src: anyPrefix(local), dst: anyPrefix(local), dport: port, mark: ClearMark, mask: ClearMarkMask}
}

func sortedAddrs(in []netip.Addr) []netip.Addr {
	out := make([]netip.Addr, 0, len(in))
	for _, a := range in {
		out = append(out, a.Unmap())
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return slices.Compact(out)
}

// xfrmOf derives the SAs and policies d asks for.
func xfrmOf(d *Desired) (*desiredXfrm, error) { return xfrmOfCached(d, nil) }

// xfrmOfCached is xfrmOf with SPIs and keys from cache (nil: derived).
func xfrmOfCached(d *Desired, cache *deriveCache) (*desiredXfrm, error) {
	return xfrmOfRemotes(d, cache, nil)
}

// xfrmOfRemotes is xfrmOfCached limited to the remotes in only (sorted;
// nil: all of them) and the clear policy. With only, d must be normalized
// (see normalized).
func xfrmOfRemotes(d *Desired, cache *deriveCache, only []netip.Addr) (*desiredXfrm, error) {
	x := &desiredXfrm{states: map[stateKey]*wantState{}, policies: map[polKey]*wantPolicy{}}
	if d.Empty() {
		return x, nil
	}
	local := d.Local.Unmap()
	x.policies[clearKey(local, d.Port)] = &wantPolicy{clear: true}
	accept := normAccept(d.Accept)
	var remotes, keepOut []netip.Addr
	var gens map[netip.Addr]uint64
	if only == nil {
		remotes, keepOut = sortedAddrs(d.Remotes), sortedAddrs(d.KeepOutbound)
		gens = map[netip.Addr]uint64{}
		for a, g := range d.RemoteGens {
			gens[a.Unmap()] = g
		}
	} else {
		for _, r := range only {
			if _, ok := slices.BinarySearchFunc(d.Remotes, r, netip.Addr.Compare); ok {
				remotes = append(remotes, r)
			} else if _, ok := slices.BinarySearchFunc(d.KeepOutbound, r, netip.Addr.Compare); ok {
				keepOut = append(keepOut, r)
			}
		}
		gens = d.RemoteGens // normalized: keys unmapped
	}

	add := func(w *wantState) {
		if prev, ok := x.states[w.key]; ok {
			// Deterministic: keep the lower (source, epoch); report the other.
			keep, drop := prev, w
			if c := w.src.Compare(prev.src); c < 0 || (c == 0 && w.epoch < prev.epoch) {
				keep, drop = w, prev
			}
			x.states[w.key] = keep
			x.collisions = append(x.collisions, fmt.Errorf("SPI collision: SA src %v dst %v epoch %d has spi 0x%08x like SA src %v epoch %d; it is not installed (traffic of that pair and epoch is dropped, never sent in clear; the next key rotation or send generation re-derives the SPIs)",
				drop.src, drop.key.dst, drop.epoch, drop.key.spi, keep.src, keep.epoch))
			return
		}
		x.states[w.key] = w
	}
	derive := func(src, dst, remote netip.Addr, e uint32, gen uint64, outbound bool) (*wantState, error) {
		spi, k, err := cache.derive(d.Secret, src, dst, e, gen)
		if err != nil {
			return nil, err
		}
		return &wantState{key: stateKey{dst, spi}, src: src, epoch: e, gen: gen, remote: remote, outbound: outbound, aeadKey: k}, nil
	}
	for _, r := range remotes {
		if d.Send != 0 && !d.NoSAs {
			if g := gens[r]; g != 0 {
				for _, e := range accept {
					w, err := derive(r, local, r, e, g, false)
					if err != nil {
						return nil, err
					}
					add(w)
				}
			}
		}
		wp := &wantPolicy{remote: r, spi: blockSPI, blocked: slices.Contains(d.Blocked, r)}
		if d.Send != 0 && !wp.blocked {
			w, err := derive(local, r, r, d.Send, d.Gen, true)
			if err != nil {
				return nil, err
			}
			if !d.NoSAs {
				add(w)
			}
			wp.spi, wp.epoch = w.key.spi, d.Send
		}
		x.policies[remoteKey(local, r, d.Port)] = wp
	}
	if d.Send != 0 && !d.NoSAs {
		for _, r := range keepOut {
			if _, ok := slices.BinarySearchFunc(remotes, r, netip.Addr.Compare); ok {
				continue
			}
			w, err := derive(local, r, r, d.Send, d.Gen, true)
			if err != nil {
				return nil, err
			}
			add(w)
		}
	}
	return x, nil
}

// normalized reports whether d's address lists are sorted, without
// duplicates and unmapped, and its RemoteGens keys unmapped (what Owner
// builds): then membership is a binary search, and a change can be
// planned for the remotes it touches only.
func (d *Desired) normalized() bool {
	for _, l := range [][]netip.Addr{d.Remotes, d.KeepOutbound, d.Blocked} {
		for i, a := range l {
			if a.Is4In6() || (i > 0 && l[i-1].Compare(a) >= 0) {
				return false
			}
		}
	}
	for a := range d.RemoteGens {
		if a.Is4In6() {
			return false
		}
	}
	return true
}

// sameXfrmBasis reports whether a and b derive every remote's SAs and
// policy the same way: same VTEP, port, epochs, generation, secret and SA
// support. Then their xfrm states differ only in the remotes whose lists
// or generation differ (touchedRemotes).
func sameXfrmBasis(a, b *Desired) bool {
	return a.Local == b.Local && a.Port == b.Port && a.Send == b.Send && a.Gen == b.Gen && a.NoSAs == b.NoSAs &&
		(slices.Equal(a.Accept, b.Accept) || slices.Equal(normAccept(a.Accept), normAccept(b.Accept))) && bytes.Equal(a.Secret, b.Secret)
}

// setBasis makes d (a record of its own, see cloneLists) hold b's basis:
// everything but the remotes' lists and generations.
func (d *Desired) setBasis(b *Desired) {
	d.Local, d.Port, d.VNIs, d.ClearVNIs = b.Local, b.Port, b.VNIs, b.ClearVNIs
	d.Accept, d.Send, d.Gen, d.Secret, d.NoSAs = b.Accept, b.Send, b.Gen, b.Secret, b.NoSAs
}

// cloneLists returns a copy of d that shares none of its lists or maps
// (the Programmer's record patches its own copy in place).
func (d *Desired) cloneLists() *Desired {
	c := *d
	c.Remotes = withRoom(d.Remotes)
	c.KeepOutbound = slices.Clone(d.KeepOutbound)
	c.Blocked = slices.Clone(d.Blocked)
	c.RemoteGens = maps.Clone(d.RemoteGens)
	if c.RemoteGens == nil {
		c.RemoteGens = map[netip.Addr]uint64{}
	}
	return &c
}

// withRoom returns a copy of l with room to grow by an eighth: a sorted
// list patched in place one remote at a time (setMember, patchRemotes)
// then rarely reallocates, which with a thousand remotes cost more than
// the rest of adding one (a 24 KiB copy, and the garbage collection it
// causes).
func withRoom(l []netip.Addr) []netip.Addr {
	return append(make([]netip.Addr, 0, len(l)+len(l)/8+4), l...)
}

// setMember inserts r into the sorted list l (in) or deletes it (!in).
func setMember(l []netip.Addr, r netip.Addr, in bool) []netip.Addr {
	i, found := slices.BinarySearchFunc(l, r, netip.Addr.Compare)
	switch {
	case in && !found:
		return slices.Insert(l, i, r)
	case !in && found:
		return slices.Delete(l, i, i+1)
	}
	return l
}

// patchRemotes makes d (a normalized record of its own, see cloneLists)
// hold, for the remotes in touched, what m holds; m describes those
// remotes only (a change of the remotes alone).
func (d *Desired) patchRemotes(m *Desired, touched []netip.Addr) {
	has := func(l []netip.Addr, r netip.Addr) bool {
		_, ok := slices.BinarySearchFunc(l, r, netip.Addr.Compare)
		return ok
	}
	for _, r := range touched {
		d.Remotes = setMember(d.Remotes, r, has(m.Remotes, r))
		d.KeepOutbound = setMember(d.KeepOutbound, r, has(m.KeepOutbound, r))
		d.Blocked = setMember(d.Blocked, r, has(m.Blocked, r))
		if g, ok := m.RemoteGens[r]; ok {
			d.RemoteGens[r] = g
		} else {
			delete(d.RemoteGens, r)
		}
	}
}

// netlink object construction.

func ipNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

func (w *wantState) netlink(port int) *netlink.XfrmState {
	src, dst := w.src, w.key.dst
	return &netlink.XfrmState{
		Src:          src.AsSlice(),
		Dst:          dst.AsSlice(),
		Proto:        netlink.XFRM_PROTO_ESP,
		Mode:         netlink.XFRM_MODE_TRANSPORT,
		Spi:          int(w.key.spi),
		Reqid:        ReqID,
		ReplayWindow: ReplayWindow,
		ESN:          true,
		Aead:         &netlink.XfrmStateAlgo{Name: AEADName, Key: w.aeadKey, ICVLen: ICVBits},
		// The selector restricts what the SA may carry: VXLAN from src to
		// dst. For inbound SAs the kernel checks it on every decrypted
		// packet, so an SA cannot deliver anything else; for outbound SAs
		// it keeps packets from another source address (the policy
		// selects any source) from using it.
		Selector: &netlink.XfrmPolicy{
			Src:     ipNet(hostPrefix(src)),
			Dst:     ipNet(hostPrefix(dst)),
			Proto:   netlink.Proto(17), // UDP
			DstPort: port,
		},
	}
}

// netlink returns the kernel policy for k; local is the local VTEP (the
// template's source).
func (k polKey) netlink(w *wantPolicy, local netip.Addr) *netlink.XfrmPolicy {
	pol := &netlink.XfrmPolicy{
		Src:      ipNet(k.src),
		Dst:      ipNet(k.dst),
		Proto:    netlink.Proto(17),
		DstPort:  k.dport,
		Dir:      netlink.XFRM_DIR_OUT,
		Priority: PolicyPriority,
		Action:   netlink.XFRM_POLICY_ALLOW,
	}
	if w.clear {
		pol.Priority = ClearPolicyPriority
		pol.Mark = &netlink.XfrmMark{Value: k.mark, Mask: k.mask}
		return pol
	}
	pol.Tmpls = []netlink.XfrmPolicyTmpl{{
		Src:   local.Unmap().AsSlice(),
		Dst:   k.dst.Addr().AsSlice(),
		Proto: netlink.XFRM_PROTO_ESP,
		Mode:  netlink.XFRM_MODE_TRANSPORT,
		Spi:   int(w.spi),
		Reqid: ReqID,
	}}
	return pol
}
