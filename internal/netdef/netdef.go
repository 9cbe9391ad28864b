// Package netdef is the definition of an overlay network as every host must
// agree on it: its subnets with their VNIs and gateways, its MTU, and
// whether it is encrypted and internal. Hosts gossip the definition they
// have for each of their VNIs (the control plane owns the remote ones);
// the driver refuses a network that contradicts another host's definition
// of one of its VNIs, and refuses the remote peers of a host whose
// definition contradicts its own.
//
// Everything must match, because each difference breaks the network
// silently rather than loudly:
//   - subnets and their VNIs: a record whose IP lies outside the subnet of
//     its VNI is refused, and a subnet one host lacks is not on-link there;
//   - gateway: each host answers for the gateway address on its own
//     bridge, so another gateway on another host is an address this host's
//     IPAM may hand to a container (a duplicate IP), and containers there
//     use a router address that does not exist here;
//   - MTU: frames larger than the smaller side's MTU are dropped there
//     (black holes for large packets only, the hardest kind to find);
//   - encrypted: one side sends in clear what the other promises to
//     encrypt (and drops as clear text on arrival);
//   - internal: one side would give its containers a way out that the
//     other's users were promised they do not have.
package netdef

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"
)

// Subnet is one L2 segment of a network with its VNI: its IPv4 subnet
// (if any) and its IPv6 subnets. A network without IPv6 has one segment
// per IPv4 subnet; a network with IPv6 has exactly one segment carrying
// every subnet of both families (a container has one interface per
// network, on one bridge, and both its addresses must reach it there).
type Subnet struct {
	VNI  uint32
	Pool netip.Prefix // IPv4, masked; invalid when the segment has IPv6 subnets only
	// Gateway is the gateway address with the pool's length; invalid if
	// the network has none.
	Gateway netip.Prefix
	// IPv6 lists the segment's IPv6 subnets in the network's order.
	IPv6 []Subnet6
}

// Subnet6 is one IPv6 subnet of a segment.
type Subnet6 struct {
	Pool netip.Prefix // IPv6, masked, at most MaxPrefix6 long
	// Gateway is the gateway address with the pool's length; invalid if
	// the network has none.
	Gateway netip.Prefix
}

// MaxPrefix6 is the longest IPv6 prefix a network may have: /120 leaves
// 256 addresses, room for a gateway and containers; longer ones are too
// small to be worth a network and are refused so the limit is one stated
// number.
const MaxPrefix6 = 120

// MinMTU6 is the smallest MTU of a network with IPv6 (RFC 8200: every link
// carries 1280-byte packets; the kernel turns IPv6 off on smaller links).
const MinMTU6 = 1280

// CheckPool6 says what is wrong with p as an IPv6 subnet of a network, or
// nil: it must be a plain IPv6 prefix (not an IPv4-mapped one), masked or
// not, at most MaxPrefix6 long, and a global or unique-local unicast range
// (not link-local, multicast, loopback or unspecified).
func CheckPool6(p netip.Prefix) error {
	a := p.Addr()
	switch {
	case !p.IsValid() || !a.Is6():
		return fmt.Errorf("%v is not an IPv6 prefix (like 2001:db8:1::/64)", p)
	case a.Is4In6():
		return fmt.Errorf("%v is an IPv4-mapped IPv6 prefix: give IPv4 subnets as IPv4 (like 192.0.2.0/24)", p)
	case a.Zone() != "":
		return fmt.Errorf("%v has a zone: a subnet has none", p)
	case p.Bits() > MaxPrefix6:
		return fmt.Errorf("%v is too small: the prefix length must be at most %d", p, MaxPrefix6)
	case p.Bits() < 8:
		return fmt.Errorf("%v is too large: the prefix length must be at least 8", p)
	}
	m := p.Masked().Addr()
	switch {
	case m.IsLinkLocalUnicast():
		return fmt.Errorf("%v is link-local (fe80::/10): every link has its own, a network needs a global or unique-local subnet", p)
	case m.IsMulticast():
		return fmt.Errorf("%v is multicast (ff00::/8): a network needs a unicast subnet", p)
	case m.IsLoopback() || m.IsUnspecified():
		return fmt.Errorf("%v is the loopback or unspecified address: a network needs a global or unique-local subnet", p)
	}
	return nil
}

// HasIPv6 reports whether the definition has IPv6 subnets.
func (d *Definition) HasIPv6() bool {
	for _, s := range d.Subnets {
		if len(s.IPv6) > 0 {
			return true
		}
	}
	return false
}

// Prefixes returns the segment's subnets of both families, IPv4 first.
func (s *Subnet) Prefixes() []netip.Prefix {
	var out []netip.Prefix
	if s.Pool.IsValid() {
		out = append(out, s.Pool)
	}
	for _, v := range s.IPv6 {
		out = append(out, v.Pool)
	}
	return out
}

// Equal reports whether a and b are the same segment.
func (s *Subnet) Equal(o *Subnet) bool {
	return s.VNI == o.VNI && s.Pool == o.Pool && s.Gateway == o.Gateway && slices.Equal(s.IPv6, o.IPv6)
}

func equalSubnets(a, b []Subnet) bool {
	return slices.EqualFunc(a, b, func(x, y Subnet) bool { return x.Equal(&y) })
}

// Definition is a network's definition. Subnets are in the network's order
// (which is also the order of its VNIs).
type Definition struct {
	Subnets   []Subnet
	MTU       int
	Encrypted bool
	Internal  bool
}

// Remote is another host's definition of a VNI.
type Remote struct {
	Host string     // the host's node name
	VTEP netip.Addr // its VTEP
	Def  Definition // zero if Pending
	// Pending: the host gossips definitions but none of this VNI has
	// arrived (yet): its records of the VNI must wait for it, or they
	// could be used against a definition that contradicts ours.
	Pending bool
}

// MaxSubnets bounds the subnets of one definition (on the wire: a u8).
const MaxSubnets = 255

// Has reports whether d defines vni.
func (d *Definition) Has(vni uint32) bool {
	for _, s := range d.Subnets {
		if s.VNI == vni {
			return true
		}
	}
	return false
}

// Validate checks every field; the error names the field and what is
// allowed.
func (d *Definition) Validate() error {
	if len(d.Subnets) == 0 || len(d.Subnets) > MaxSubnets {
		return fmt.Errorf("%d subnets: a definition has 1..%d", len(d.Subnets), MaxSubnets)
	}
	if d.MTU < 68 || d.MTU > 65535 {
		return fmt.Errorf("MTU %d is outside 68..65535", d.MTU)
	}
	if d.HasIPv6() {
		if len(d.Subnets) != 1 {
			return fmt.Errorf("%d segments with IPv6 subnets: a network with IPv6 has exactly one segment (one VNI)", len(d.Subnets))
		}
		if d.MTU < MinMTU6 {
			return fmt.Errorf("MTU %d is below %d, the IPv6 minimum", d.MTU, MinMTU6)
		}
	}
	for i, s := range d.Subnets {
		switch {
		case s.VNI == 0 || s.VNI > 1<<24-1:
			return fmt.Errorf("subnet %d: VNI %d is outside 1..16777215", i, s.VNI)
		case !s.Pool.IsValid() && len(s.IPv6) == 0:
			return fmt.Errorf("subnet %d: no IPv4 pool and no IPv6 subnet: a segment has at least one subnet", i)
		case s.Pool.IsValid() && (!s.Pool.Addr().Is4() || s.Pool.Masked() != s.Pool || s.Pool.Bits() > 30):
			return fmt.Errorf("subnet %d: pool %v is not a masked IPv4 prefix of length at most 30", i, s.Pool)
		case s.Gateway.IsValid() && (s.Gateway.Bits() != s.Pool.Bits() || !s.Pool.Contains(s.Gateway.Addr())):
			return fmt.Errorf("subnet %d: gateway %v is not an address of pool %v", i, s.Gateway, s.Pool)
		case len(s.IPv6) > MaxSubnets:
			return fmt.Errorf("subnet %d: %d IPv6 subnets: a segment has at most %d", i, len(s.IPv6), MaxSubnets)
		}
		for k, v := range s.IPv6 {
			if err := CheckPool6(v.Pool); err != nil {
				return fmt.Errorf("subnet %d: IPv6 subnet %d: %w", i, k, err)
			}
			if v.Pool.Masked() != v.Pool {
				return fmt.Errorf("subnet %d: IPv6 subnet %d: pool %v is not masked", i, k, v.Pool)
			}
			if v.Gateway.IsValid() && (v.Gateway.Bits() != v.Pool.Bits() || !v.Pool.Contains(v.Gateway.Addr())) {
				return fmt.Errorf("subnet %d: IPv6 subnet %d: gateway %v is not an address of pool %v", i, k, v.Gateway, v.Pool)
			}
			for l := range k {
				if s.IPv6[l].Pool.Overlaps(v.Pool) {
					return fmt.Errorf("subnet %d: IPv6 pool %v overlaps IPv6 pool %v", i, v.Pool, s.IPv6[l].Pool)
				}
			}
		}
		for j := range i {
			if d.Subnets[j].VNI == s.VNI {
				return fmt.Errorf("subnet %d: VNI %d is given twice", i, s.VNI)
			}
			if d.Subnets[j].Pool.Overlaps(s.Pool) {
				return fmt.Errorf("subnet %d: pool %v overlaps pool %v", i, s.Pool, d.Subnets[j].Pool)
			}
		}
	}
	return nil
}

// Equal reports whether a and b are the same definition.
func Equal(a, b *Definition) bool {
	return a.MTU == b.MTU && a.Encrypted == b.Encrypted && a.Internal == b.Internal && equalSubnets(a.Subnets, b.Subnets)
}

// Diff lists what differs between ours (this host's) and theirs (another
// host's), each item as "what: ours here, theirs there"; nil if they are
// equal.
func Diff(ours, theirs *Definition) []string {
	var out []string
	if !equalSubnets(ours.Subnets, theirs.Subnets) {
		out = append(out, fmt.Sprintf("subnets: %s here, %s there", FormatSubnets(ours.Subnets), FormatSubnets(theirs.Subnets)))
	}
	if ours.MTU != theirs.MTU {
		out = append(out, fmt.Sprintf("MTU: %d here, %d there", ours.MTU, theirs.MTU))
	}
	if ours.Encrypted != theirs.Encrypted {
		out = append(out, fmt.Sprintf("encrypted: %s here, %s there", yesNo(ours.Encrypted), yesNo(theirs.Encrypted)))
	}
	if ours.Internal != theirs.Internal {
		out = append(out, fmt.Sprintf("internal: %s here, %s there", yesNo(ours.Internal), yesNo(theirs.Internal)))
	}
	return out
}

// FormatSubnets renders subnets as "VNI 5000 192.0.2.0/24 gw 192.0.2.1, …",
// a segment's IPv6 subnets after its IPv4 one ("VNI 5000 192.0.2.0/24 gw
// 192.0.2.1 2001:db8::/64 gw 2001:db8::1").
func FormatSubnets(subs []Subnet) string {
	parts := make([]string, len(subs))
	for i, s := range subs {
		var b strings.Builder
		fmt.Fprintf(&b, "VNI %d", s.VNI)
		if s.Pool.IsValid() {
			fmt.Fprintf(&b, " %v gw %s", s.Pool, formatGateway(s.Gateway))
		}
		for _, v := range s.IPv6 {
			fmt.Fprintf(&b, " %v gw %s", v.Pool, formatGateway(v.Gateway))
		}
		parts[i] = b.String()
	}
	return "[" + strings.Join(parts, ", ") + "]"
}

func formatGateway(gw netip.Prefix) string {
	if gw.IsValid() {
		return gw.Addr().String()
	}
	return "none"
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}
