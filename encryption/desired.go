package encryption

import (
	"errors"
	"fmt"
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

	// DefaultMark and DefaultMarkMask are the firewall mark nftables puts on
	// outbound VXLAN packets of encrypted VNIs and that selects the outbound
	// policies ("ovld" again; Docker's overlay uses 0xd0c4e3, so both can
	// coexist). The mark only selects the policy: the fail-closed drop does
	// not depend on it, so another program rewriting marks can break
	// encryption (traffic is then dropped) but never leak clear text.
	DefaultMark     = 0x6f766c64
	DefaultMarkMask = 0xffffffff

	// ReplayWindow is the anti-replay window of inbound SAs, in packets.
	// SAs use extended (64-bit) sequence numbers, so a busy SA does not
	// exhaust its 32-bit sequence space between rotations.
	ReplayWindow = 128

	// PolicyPriority is the priority of overlayd's outbound policies (lower
	// wins). Their selectors are host-to-host and port-specific.
	PolicyPriority = 1000
)

// Desired is the whole encryption state one host wants in its host
// namespace (where the VXLAN UDP socket lives). It is a pure description;
// Programmer.Apply makes the kernel match it.
type Desired struct {
	Local    netip.Addr   // local VTEP address
	Port     int          // VXLAN UDP destination port
	Mark     uint32       // firewall mark of encrypted VXLAN packets (0: DefaultMark)
	MarkMask uint32       // bits of the mark overlayd owns (0: DefaultMarkMask)
	VNIs     []uint32     // VNIs of encrypted networks
	Remotes  []netip.Addr // remote VTEPs that share at least one encrypted network
	Accept   []uint32     // epochs accepted inbound (NodeKeys.Accept)
	Send     uint32       // epoch used outbound (NodeKeys.Send)
	Secret   []byte       // cluster secret that keys and SPIs derive from
}

// Empty reports whether d wants nothing at all in the kernel (no encrypted
// VNI): then Apply removes everything overlayd installed.
func (d *Desired) Empty() bool { return len(d.VNIs) == 0 }

func (d *Desired) mark() (uint32, uint32) {
	m, mask := d.Mark, d.MarkMask
	if mask == 0 {
		mask = DefaultMarkMask
	}
	if m == 0 {
		m = DefaultMark
	}
	return m, mask
}

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
	m, mask := d.mark()
	if m&^mask != 0 {
		errs = append(errs, fmt.Errorf("mark %#x has bits outside mask %#x", m, mask))
	}
	for _, v := range d.VNIs {
		if v == 0 || v > 1<<24-1 {
			errs = append(errs, fmt.Errorf("invalid VNI %d", v))
		}
	}
	local := d.Local.Unmap()
	for _, r := range d.Remotes {
		switch {
		case !r.IsValid() || r.IsUnspecified() || r.Zone() != "":
			errs = append(errs, fmt.Errorf("invalid remote VTEP address %v", r))
		case r.Unmap() == local:
			errs = append(errs, fmt.Errorf("remote VTEP %v is the local VTEP", r))
		case r.Unmap().Is4() != local.Is4():
			errs = append(errs, fmt.Errorf("remote VTEP %v is not of the local VTEP's (%v) address family", r, d.Local))
		}
	}
	if len(d.Remotes) > 0 {
		if len(d.Secret) < MinSecretLen {
			errs = append(errs, ErrBadSecret)
		}
		if d.Send == 0 {
			errs = append(errs, errors.New("no send epoch"))
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
	remote   netip.Addr // the other end
	outbound bool
	aeadKey  []byte
}

// wantPolicy is the outbound policy for one remote.
type wantPolicy struct {
	remote netip.Addr
	spi    uint32 // template SPI: the outbound SA of the Send epoch
	epoch  uint32
}

// polKey identifies an outbound policy: its selector and mark (direction is
// always out).
type polKey struct {
	src, dst netip.Prefix
	dport    int
	mark     uint32
	mask     uint32
}

func (k polKey) String() string {
	return fmt.Sprintf("policy out src %v dst %v udp dport %d mark %#x/%#x", k.src, k.dst, k.dport, k.mark, k.mask)
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

// xfrmOf derives the SAs and policies d asks for.
func xfrmOf(d *Desired) (*desiredXfrm, error) {
	x := &desiredXfrm{states: map[stateKey]*wantState{}, policies: map[polKey]*wantPolicy{}}
	if d.Empty() || len(d.Remotes) == 0 {
		return x, nil
	}
	local := d.Local.Unmap()
	mark, mask := d.mark()
	remotes := slices.Clone(d.Remotes)
	for i := range remotes {
		remotes[i] = remotes[i].Unmap()
	}
	slices.SortFunc(remotes, func(a, b netip.Addr) int { return a.Compare(b) })
	remotes = slices.Compact(remotes)
	accept := normAccept(d.Accept)

	add := func(w *wantState) {
		if prev, ok := x.states[w.key]; ok {
			// Deterministic: keep the lower (source, epoch); report the other.
			keep, drop := prev, w
			if c := w.src.Compare(prev.src); c < 0 || (c == 0 && w.epoch < prev.epoch) {
				keep, drop = w, prev
			}
			x.states[w.key] = keep
			x.collisions = append(x.collisions, fmt.Errorf("SPI collision: SA src %v dst %v epoch %d has spi 0x%08x like SA src %v epoch %d; it is not installed (traffic of that pair and epoch is dropped, never sent in clear; the next key rotation re-derives every SPI)",
				drop.src, drop.key.dst, drop.epoch, drop.key.spi, keep.src, keep.epoch))
			return
		}
		x.states[w.key] = w
	}
	for _, r := range remotes {
		for _, e := range accept {
			spi, err := SPI(d.Secret, r, local, e)
			if err != nil {
				return nil, err
			}
			k, err := SAKey(d.Secret, r, local, e)
			if err != nil {
				return nil, err
			}
			add(&wantState{key: stateKey{local, spi}, src: r, epoch: e, remote: r, aeadKey: k})
		}
		spi, err := SPI(d.Secret, local, r, d.Send)
		if err != nil {
			return nil, err
		}
		k, err := SAKey(d.Secret, local, r, d.Send)
		if err != nil {
			return nil, err
		}
		add(&wantState{key: stateKey{r, spi}, src: local, epoch: d.Send, remote: r, outbound: true, aeadKey: k})
		pk := polKey{src: hostPrefix(local), dst: hostPrefix(r), dport: d.Port, mark: mark, mask: mask}
		x.policies[pk] = &wantPolicy{remote: r, spi: spi, epoch: d.Send}
	}
	return x, nil
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
		// packet, so an SA cannot deliver anything else.
		Selector: &netlink.XfrmPolicy{
			Src:     ipNet(hostPrefix(src)),
			Dst:     ipNet(hostPrefix(dst)),
			Proto:   netlink.Proto(17), // UDP
			DstPort: port,
		},
	}
}

func (k polKey) netlink(spi uint32) *netlink.XfrmPolicy {
	return &netlink.XfrmPolicy{
		Src:      ipNet(k.src),
		Dst:      ipNet(k.dst),
		Proto:    netlink.Proto(17),
		DstPort:  k.dport,
		Dir:      netlink.XFRM_DIR_OUT,
		Priority: PolicyPriority,
		Mark:     &netlink.XfrmMark{Value: k.mark, Mask: k.mask},
		Tmpls: []netlink.XfrmPolicyTmpl{{
			Src:   k.src.Addr().AsSlice(),
			Dst:   k.dst.Addr().AsSlice(),
			Proto: netlink.XFRM_PROTO_ESP,
			Mode:  netlink.XFRM_MODE_TRANSPORT,
			Spi:   int(spi),
			Reqid: ReqID,
		}},
	}
}
