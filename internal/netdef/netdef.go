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

// Subnet is one subnet of a network with its VNI.
type Subnet struct {
	VNI  uint32
	Pool netip.Prefix // IPv4, masked
	// Gateway is the gateway address with the pool's length; invalid if
	// the network has none.
	Gateway netip.Prefix
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
	for i, s := range d.Subnets {
		switch {
		case s.VNI == 0 || s.VNI > 1<<24-1:
			return fmt.Errorf("subnet %d: VNI %d is outside 1..16777215", i, s.VNI)
		case !s.Pool.IsValid() || !s.Pool.Addr().Is4() || s.Pool.Masked() != s.Pool || s.Pool.Bits() > 30:
			return fmt.Errorf("subnet %d: pool %v is not a masked IPv4 prefix of length at most 30", i, s.Pool)
		case s.Gateway.IsValid() && (s.Gateway.Bits() != s.Pool.Bits() || !s.Pool.Contains(s.Gateway.Addr())):
			return fmt.Errorf("subnet %d: gateway %v is not an address of pool %v", i, s.Gateway, s.Pool)
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
	return a.MTU == b.MTU && a.Encrypted == b.Encrypted && a.Internal == b.Internal && slices.Equal(a.Subnets, b.Subnets)
}

// Diff lists what differs between ours (this host's) and theirs (another
// host's), each item as "what: ours here, theirs there"; nil if they are
// equal.
func Diff(ours, theirs *Definition) []string {
	var out []string
	if !slices.Equal(ours.Subnets, theirs.Subnets) {
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

// FormatSubnets renders subnets as "VNI 5000 192.0.2.0/24 gw 192.0.2.1, …".
func FormatSubnets(subs []Subnet) string {
	parts := make([]string, len(subs))
	for i, s := range subs {
		gw := "none"
		if s.Gateway.IsValid() {
			gw = s.Gateway.Addr().String()
		}
		parts[i] = fmt.Sprintf("VNI %d %v gw %s", s.VNI, s.Pool, gw)
	}
	return "[" + strings.Join(parts, ", ") + "]"
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}
