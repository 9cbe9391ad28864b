package ipam

import (
	"encoding/binary"
	"fmt"
	"net/netip"
	"strings"
)

// minPoolBits is the longest prefix a pool may have: a /30 has one address
// besides the network, gateway and broadcast addresses.
const minPoolBits = 30

// poolSpec is a pool as every host names it: the subnet and the range of it
// that containers get addresses from. lo..hi is the ring: the range minus
// the network, gateway and broadcast addresses (which all lie at the ends
// of the subnet, so the ring is one interval).
type poolSpec struct {
	prefix netip.Prefix // masked IPv4 subnet (--subnet)
	rng    netip.Prefix // masked, inside prefix (--ip-range); == prefix without one
	lo, hi uint32       // the ring, inclusive
}

// u32 and addrOf convert between IPv4 addresses and numbers.
func u32(a netip.Addr) uint32 { b := a.As4(); return binary.BigEndian.Uint32(b[:]) }

func addrOf(v uint32) netip.Addr {
	var b [4]byte
	binary.BigEndian.PutUint32(b[:], v)
	return netip.AddrFrom4(b)
}

// bounds returns a prefix's first and last address as numbers.
func bounds(p netip.Prefix) (first, last uint32) {
	first = u32(p.Addr())
	return first, first | (1<<(32-p.Bits()) - 1)
}

func (s poolSpec) id() string {
	if s.rng == s.prefix {
		return PoolIDPrefix + s.prefix.String()
	}
	return PoolIDPrefix + s.prefix.String() + ":" + s.rng.String()
}

func (s poolSpec) network() uint32   { f, _ := bounds(s.prefix); return f }
func (s poolSpec) broadcast() uint32 { _, l := bounds(s.prefix); return l }

// gatewayAddr is the prefix's first address after the network address: the
// same on every host, never handed to a container.
func (s poolSpec) gatewayAddr() netip.Addr { return addrOf(s.network() + 1) }

// gateway returns the gateway with the pool's prefix length.
func (s poolSpec) gateway() netip.Prefix {
	return netip.PrefixFrom(s.gatewayAddr(), s.prefix.Bits())
}

func (s poolSpec) size() uint64 { return uint64(s.hi) - uint64(s.lo) + 1 }

func (s poolSpec) withBits(v uint32) netip.Prefix {
	return netip.PrefixFrom(addrOf(v), s.prefix.Bits())
}

// newPoolSpec validates a subnet and range and computes the ring. field
// names what the caller calls them in errors ("Pool"/"SubPool" for
// RequestPool, "PoolID" for the rest).
func newPoolSpec(prefix, rng netip.Prefix, poolField, rangeField string) (poolSpec, error) {
	if !prefix.Addr().Is4() {
		return poolSpec{}, fmt.Errorf("%s %s is not IPv4: overlayd's address management serves IPv4 pools only (use the default IPAM driver for IPv6)", poolField, prefix)
	}
	if prefix.Masked() != prefix {
		return poolSpec{}, fmt.Errorf("%s %s has host bits set: write it as %s", poolField, prefix, prefix.Masked())
	}
	if prefix.Bits() > minPoolBits {
		return poolSpec{}, fmt.Errorf("%s %s is too small: a pool needs at least a /%d (network, gateway, broadcast and one address)", poolField, prefix, minPoolBits)
	}
	if !rng.Addr().Is4() {
		return poolSpec{}, fmt.Errorf("%s %s is not IPv4", rangeField, rng)
	}
	if rng.Masked() != rng {
		return poolSpec{}, fmt.Errorf("%s %s has host bits set: write it as %s", rangeField, rng, rng.Masked())
	}
	if rng.Bits() < prefix.Bits() || !prefix.Contains(rng.Addr()) {
		return poolSpec{}, fmt.Errorf("%s %s is not inside %s %s", rangeField, rng, poolField, prefix)
	}
	s := poolSpec{prefix: prefix, rng: rng}
	s.lo, s.hi = bounds(rng)
	if s.lo <= s.network()+1 {
		s.lo = s.network() + 2
	}
	if s.hi == s.broadcast() {
		s.hi--
	}
	if s.lo > s.hi {
		return poolSpec{}, fmt.Errorf("%s %s has no address to hand out besides %s's network, gateway (%s) and broadcast addresses", rangeField, rng, prefix, s.gatewayAddr())
	}
	return s, nil
}

// parsePoolID parses and validates a PoolID in its canonical form (the one
// RequestPool returned).
func parsePoolID(id string) (poolSpec, error) {
	bad := func(why string) (poolSpec, error) {
		return poolSpec{}, fmt.Errorf("PoolID %q is not one of overlayd's (want %sSUBNET or %sSUBNET:RANGE, e.g. %s198.51.100.0/24): %s", id, PoolIDPrefix, PoolIDPrefix, PoolIDPrefix, why)
	}
	rest, ok := strings.CutPrefix(id, PoolIDPrefix)
	if !ok {
		return bad("it does not start with " + PoolIDPrefix)
	}
	subnet, rngText, hasRange := strings.Cut(rest, ":")
	prefix, err := netip.ParsePrefix(subnet)
	if err != nil {
		return bad("the subnet does not parse")
	}
	rng := prefix
	if hasRange {
		if rng, err = netip.ParsePrefix(rngText); err != nil {
			return bad("the range does not parse")
		}
		if rng == prefix {
			return bad("the range equals the subnet (the canonical form leaves it out)")
		}
	}
	s, err := newPoolSpec(prefix, rng, "PoolID's subnet", "PoolID's range")
	if err != nil {
		return poolSpec{}, err
	}
	if s.id() != id {
		return bad("it is not in canonical form")
	}
	return s, nil
}

// overlaps reports whether two pools share an address.
func (s poolSpec) overlaps(o poolSpec) bool { return s.prefix.Overlaps(o.prefix) }
