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

// Subnets returns a copy of the network's subnets; the index of a subnet is
// the Subnet of the kernel entries derived from addresses inside it.
func (db *DB) Subnets() []netip.Prefix {
	return append([]netip.Prefix(nil), db.subnets...)
}

// SubnetOf returns the index of the subnet that contains ip.
func (db *DB) SubnetOf(ip netip.Addr) (int, bool) {
	for i, p := range db.subnets {
		if p.Contains(ip) {
			return i, true
		}
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
	return db.validate(p, true)
}

func (db *DB) validate(p Peer, checkVTEP bool) error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, &InvalidPeerError{EndpointID: p.EndpointID, Field: field, Reason: fmt.Sprintf(format, args...)})
	}

	switch {
	case p.EndpointID == "":
		bad("EndpointID", "EndpointID is empty; a non-empty id of at most %d bytes is required", MaxEndpointIDLen)
	case len(p.EndpointID) > MaxEndpointIDLen:
		bad("EndpointID", "EndpointID is %d bytes long; at most %d bytes are allowed", len(p.EndpointID), MaxEndpointIDLen)
	}

	switch {
	case !p.IP.IsValid():
		bad("IP", "IP is missing; an IPv4 address in a subnet of this network (%s) is required", db.subnetList())
	case p.IP.Is4In6():
		bad("IP", "IP %s is an IPv4-mapped IPv6 address; a plain IPv4 address in a subnet of this network (%s) is required", p.IP, db.subnetList())
	case !p.IP.Is4():
		bad("IP", "IP %s is not an IPv4 address; an IPv4 address in a subnet of this network (%s) is required", p.IP, db.subnetList())
	default:
		if _, ok := db.SubnetOf(p.IP); !ok {
			bad("IP", "IP %s is not in any subnet of this network (%s)", p.IP, db.subnetList())
		}
	}

	switch {
	case p.MAC.IsZero():
		bad("MAC", "MAC %s is the zero address; a non-zero unicast MAC is required", p.MAC)
	case !p.MAC.IsUnicast():
		bad("MAC", "MAC %s is a multicast/broadcast address (group bit set); a unicast MAC is required", p.MAC)
	}

	if checkVTEP {
		const want = "a unicast address of the remote host is required"
		switch {
		case !p.VTEP.IsValid():
			bad("VTEP", "VTEP is missing; %s", want)
		case p.VTEP.IsUnspecified():
			bad("VTEP", "VTEP %s is unspecified; %s", p.VTEP, want)
		case p.VTEP.IsMulticast():
			bad("VTEP", "VTEP %s is a multicast address; %s", p.VTEP, want)
		}
	}

	switch len(errs) {
	case 0:
		return nil
	case 1:
		return errs[0]
	default:
		return errors.Join(errs...)
	}
}

func (db *DB) subnetList() string {
	if len(db.subnets) == 0 {
		return "none"
	}
	s := make([]string, len(db.subnets))
	for i, p := range db.subnets {
		s[i] = p.String()
	}
	return strings.Join(s, ", ")
}

func (db *DB) validateEvent(ev Event) error {
	if ev.Prev == nil && ev.Next == nil {
		return errors.New("peerdb: event has neither Prev nor Next")
	}
	var errs []error
	if ev.Prev != nil {
		if err := db.Validate(*ev.Prev); err != nil {
			errs = append(errs, fmt.Errorf("prev: %w", err))
		}
	}
	if ev.Next != nil {
		if err := db.Validate(*ev.Next); err != nil {
			errs = append(errs, fmt.Errorf("next: %w", err))
		}
	}
	return errors.Join(errs...)
}

// check is the fast path of validate: it reports whether validate(*p,
// checkVTEP) would accept p, without building errors, and the index of the
// subnet holding p.IP. It must accept exactly what validate accepts.
func (db *DB) check(p *Peer, checkVTEP bool) (subnet int, ok bool) {
	if n := len(p.EndpointID); n == 0 || n > MaxEndpointIDLen {
		return 0, false
	}
	if !p.IP.Is4() { // also rejects the zero Addr and IPv4-mapped addresses
		return 0, false
	}
	if !p.MAC.IsUnicast() {
		return 0, false
	}
	if checkVTEP && (!p.VTEP.IsValid() || p.VTEP.IsUnspecified() || p.VTEP.IsMulticast()) {
		return 0, false
	}
	return db.subnet4(ip4(p.IP))
}
