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
	Field      string // "EndpointID", "IP", "MAC" or "VTEP"
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
//   - IP is a valid IPv4 address (not IPv4-mapped IPv6) inside one of the
//     network's subnets;
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
// subnet holding p.IP, or the error Validate describes. VTEP is checked
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

	sub, inSubnet := 0, false
	switch {
	case p.IP.Is4(): // also rejects the zero Addr and IPv4-mapped addresses
		if sub, inSubnet = db.subnet4(ip4(p.IP)); !inSubnet {
			bad("IP", "IP %s is not in any subnet of this network (%s)", p.IP, db.subnetList())
		}
	case !p.IP.IsValid():
		bad("IP", "IP is missing; an IPv4 address in a subnet of this network (%s) is required", db.subnetList())
	case p.IP.Is4In6():
		bad("IP", "IP %s is an IPv4-mapped IPv6 address; a plain IPv4 address in a subnet of this network (%s) is required", p.IP, db.subnetList())
	default:
		bad("IP", "IP %s is not an IPv4 address; an IPv4 address in a subnet of this network (%s) is required", p.IP, db.subnetList())
	}

	if p.IPv6.IsValid() { // skeleton: claims of IPv6 addresses come next
		bad("IPv6", "IPv6 %s: IPv6 peers are not supported yet", p.IPv6)
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
		return sub, nil
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
