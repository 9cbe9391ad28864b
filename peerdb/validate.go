package peerdb

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
)

// MaxEndpointIDLen is the longest EndpointID a record may carry, in bytes.
const MaxEndpointIDLen = 128

// InvalidPeerError reports one bad field of a peer record. Validate returns
// one InvalidPeerError per bad field (joined with errors.Join when there are
// several); find them with errors.As.
type InvalidPeerError struct {
	EndpointID string // as given (may be empty or over-long)
	Field      string // "EndpointID", "IP", "IPv6", "MAC", "VTEP" or "VNI"
	Reason     string // names the field and its value and says what is allowed
}

func (e *InvalidPeerError) Error() string {
	return fmt.Sprintf("peer %q: %s", shortID(e.EndpointID), e.Reason)
}

// shortID keeps error messages readable when an id is absurdly long.
func shortID(id string) string {
	const max = 40
	if len(id) <= max {
		return id
	}
	return id[:max] + "..."
}

// Subnets returns the first prefix of each segment (for a DB made by New,
// its subnets); the index of a subnet is the Subnet of the kernel entries
// derived from addresses inside it. See Segments for all prefixes.
func (db *DB) Subnets() []netip.Prefix {
	out := make([]netip.Prefix, len(db.segs))
	for i, s := range db.segs {
		if len(s.Prefixes) > 0 {
			out[i] = s.Prefixes[0]
		}
	}
	return out
}

// Segments returns a copy of the network's segments; the index of a
// segment is the Subnet of the kernel entries derived from addresses
// inside its prefixes.
func (db *DB) Segments() []Segment {
	out := make([]Segment, len(db.segs))
	for i, s := range db.segs {
		out[i] = Segment{Prefixes: append([]netip.Prefix(nil), s.Prefixes...), VNI: s.VNI}
	}
	return out
}

// SubnetOf returns the index of the segment with a prefix that contains ip,
// an IPv4 or IPv6 address (IPv4-mapped IPv6 addresses are in none).
func (db *DB) SubnetOf(ip netip.Addr) (int, bool) {
	switch {
	case ip.Is4():
		return db.subnet4(ip4(ip))
	case ip.Is6() && !ip.Is4In6():
		return db.subnet6(ip)
	}
	return 0, false
}

// Validate checks a remote record:
//   - EndpointID is non-empty and at most MaxEndpointIDLen bytes;
//   - IP and IPv6 are not both missing;
//   - IP, if present, is an IPv4 address (not IPv4-mapped IPv6) inside one
//     of the network's IPv4 subnets;
//   - IPv6, if present, is an IPv6 address (not IPv4-mapped, no zone)
//     inside one of the network's IPv6 subnets, and on the same segment as
//     IP if both are present;
//   - MAC is a non-zero unicast address;
//   - VTEP is a valid address that is neither unspecified nor multicast.
//
// The error (nil if p is valid) has one *InvalidPeerError per bad field and
// names the endpoint, the field and its value, and what is allowed.
func (db *DB) Validate(p Peer) error {
	_, err := db.validate(&p, true)
	return err
}

// validate is the one validator of records: it returns the index of the
// segment holding p's addresses, or the error Validate describes. VTEP is checked
// only with checkVTEP (local entries may have none). A valid record costs
// no allocation: errors are built only for bad fields.
func (db *DB) validate(p *Peer, checkVTEP bool) (int, error) {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, &InvalidPeerError{EndpointID: p.EndpointID, Field: field, Reason: fmt.Sprintf(format, args...)})
	}

	switch n := len(p.EndpointID); {
	case n == 0:
		bad("EndpointID", "EndpointID is empty; a non-empty id of at most %d bytes is required", MaxEndpointIDLen)
	case n > MaxEndpointIDLen:
		bad("EndpointID", "EndpointID is %d bytes long; at most %d bytes are allowed", n, MaxEndpointIDLen)
	}

	sub := -1
	switch {
	case p.IP.Is4(): // also rejects IPv4-mapped addresses
		if s, ok := db.subnet4(ip4(p.IP)); ok {
			sub = s
		} else {
			bad("IP", "IP %s is not in any subnet of this network (%s)", p.IP, db.subnetList())
		}
	case !p.IP.IsValid():
		if !p.IPv6.IsValid() {
			bad("IP", "IP is missing and so is IPv6; an IPv4 or an IPv6 address (or both) in a subnet of this network (%s) is required", db.subnetList())
		}
	case p.IP.Is4In6():
		bad("IP", "IP %s is an IPv4-mapped IPv6 address; a plain IPv4 address in a subnet of this network (%s) is required", p.IP, db.subnetList())
	default:
		bad("IP", "IP %s is not an IPv4 address; IP holds the IPv4 address (in a subnet of this network: %s), IPv6 the IPv6 one", p.IP, db.subnetList())
	}

	switch a := p.IPv6; {
	case !a.IsValid():
	case a.Is4():
		bad("IPv6", "IPv6 %s is an IPv4 address; IPv6 holds the IPv6 address (in a subnet of this network: %s), IP the IPv4 one", a, db.subnetList())
	case a.Is4In6():
		bad("IPv6", "IPv6 %s is an IPv4-mapped IPv6 address; a plain IPv6 address in a subnet of this network (%s) is required", a, db.subnetList())
	case a.Zone() != "":
		bad("IPv6", "IPv6 %s has a zone; an address without zone in a subnet of this network (%s) is required", a, db.subnetList())
	default:
		s, ok := db.subnet6(a)
		switch {
		case !ok:
			bad("IPv6", "IPv6 %s is not in any subnet of this network (%s)", a, db.subnetList())
		case sub >= 0 && s != sub:
			bad("IPv6", "IPv6 %s is in subnet %s but IP %s is in subnet %s: both addresses of an endpoint must be on one segment", a, db.segString(s), p.IP, db.segString(sub))
		default:
			sub = s
		}
	}

	if !p.MAC.IsUnicast() {
		if p.MAC.IsZero() {
			bad("MAC", "MAC %s is the zero address; a non-zero unicast MAC is required", p.MAC)
		} else {
			bad("MAC", "MAC %s is a multicast/broadcast address (group bit set); a unicast MAC is required", p.MAC)
		}
	}

	if checkVTEP && (!p.VTEP.IsValid() || p.VTEP.IsUnspecified() || p.VTEP.IsMulticast()) {
		const want = "a unicast address of the remote host is required"
		switch {
		case !p.VTEP.IsValid():
			bad("VTEP", "VTEP is missing; %s", want)
		case p.VTEP.IsUnspecified():
			bad("VTEP", "VTEP %s is unspecified; %s", p.VTEP, want)
		default:
			bad("VTEP", "VTEP %s is a multicast address; %s", p.VTEP, want)
		}
	}

	switch len(errs) {
	case 0:
		return sub, nil // sub >= 0: at least one address is valid
	case 1:
		return 0, errs[0]
	default:
		return 0, errors.Join(errs...)
	}
}

func (db *DB) subnetList() string {
	var s []string
	for _, seg := range db.segs {
		for _, p := range seg.Prefixes {
			s = append(s, p.String())
		}
	}
	if len(s) == 0 {
		return "none"
	}
	return strings.Join(s, ", ")
}

// segString names segment i by its prefixes.
func (db *DB) segString(i int) string {
	s := make([]string, len(db.segs[i].Prefixes))
	for j, p := range db.segs[i].Prefixes {
		s[j] = p.String()
	}
	return strings.Join(s, " + ")
}
