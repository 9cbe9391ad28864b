package peerdb

import (
	"crypto/sha256"
	"fmt"
	"net"
	"net/netip"
)

// MAC is an Ethernet address as a comparable value.
type MAC [6]byte

// ParseMAC parses the textual form of a 48-bit MAC address.
func ParseMAC(s string) (MAC, error) {
	hw, err := net.ParseMAC(s)
	if err != nil {
		return MAC{}, err
	}
	if len(hw) != 6 {
		return MAC{}, fmt.Errorf("%q is not a 48-bit MAC address", s)
	}
	return MAC(hw), nil
}

// MACFromEndpointID derives the MAC of an endpoint dockerd gave none: the
// first six bytes of the SHA-256 of its id, made locally administered and
// unicast. Not from its IP: two hosts that hand out the same address (two
// engines with the same --subnet) would give their endpoints the same MAC,
// and a duplicate address would become a duplicate MAC as well, which no
// L2 rule can keep apart. Docker's endpoint ids are random and unique, so
// the MACs are unique in practice (46 random bits); the same id always
// gives the same MAC, and the driver also persists it.
func MACFromEndpointID(id string) MAC {
	sum := sha256.Sum256([]byte(id))
	var m MAC
	copy(m[:], sum[:6])
	m[0] = m[0]&^0x01 | 0x02 // unicast, locally administered
	return m
}

// MACFromIP derives a locally administered unicast MAC from an IPv4 address
// (02:42:a:b:c:d), the way Docker's bridge driver does. Endpoints do not
// use it (see MACFromEndpointID); tests use it for readable MACs.
func MACFromIP(ip netip.Addr) MAC {
	m := MAC{0x02, 0x42}
	if ip.Is4() {
		b := ip.As4()
		copy(m[2:], b[:])
	} else {
		b := ip.As16()
		copy(m[2:], b[12:])
	}
	return m
}

func (m MAC) String() string { return net.HardwareAddr(m[:]).String() }

// HardwareAddr returns a fresh net.HardwareAddr holding m.
func (m MAC) HardwareAddr() net.HardwareAddr { return append(net.HardwareAddr(nil), m[:]...) }

// IsZero reports whether m is 00:00:00:00:00:00.
func (m MAC) IsZero() bool { return m == MAC{} }

// IsUnicast reports whether m is a non-zero unicast address (group bit clear).
func (m MAC) IsUnicast() bool { return !m.IsZero() && m[0]&1 == 0 }

// Peer is one endpoint's record: where the endpoint with these addresses and
// MAC lives. It is a comparable value; two records are the same entry iff all
// fields are equal.
//
// IP is the endpoint's IPv4 address and IPv6 its IPv6 address; either may be
// the zero Addr (an IPv6-only or an IPv4-only endpoint), not both. Each valid
// address is a claim of its own (see the package documentation).
type Peer struct {
	EndpointID string
	IP         netip.Addr
	MAC        MAC
	VTEP       netip.Addr // the underlay address of the host holding the endpoint
	IPv6       netip.Addr
}

// Found is one answer of a batched lookup at the records' source: the
// record in force for a key, if OK.
type Found struct {
	Peer Peer
	OK   bool
}

func (p Peer) String() string {
	if p.IPv6.IsValid() {
		return fmt.Sprintf("%s ip=%s ipv6=%s mac=%s vtep=%s", p.EndpointID, p.IP, p.IPv6, p.MAC, p.VTEP)
	}
	return fmt.Sprintf("%s ip=%s mac=%s vtep=%s", p.EndpointID, p.IP, p.MAC, p.VTEP)
}

// Neigh is a desired permanent neighbour entry (IP -> MAC) on the VXLAN link
// of segment Subnet (an index into the DB's segments). IP is IPv4 or IPv6.
type Neigh struct {
	Subnet int
	IP     netip.Addr
	MAC    MAC
}

// FDB is a desired permanent forwarding entry (MAC -> VTEP, "self") on the
// VXLAN link of segment Subnet.
type FDB struct {
	Subnet int
	MAC    MAC
	VTEP   netip.Addr
}

// NeighKey identifies a neighbour entry: the kernel holds one entry per IP on
// a link.
type NeighKey struct {
	Subnet int
	IP     netip.Addr
}

// FDBKey identifies a forwarding entry: we hold one destination per MAC on a
// link (written with replace semantics).
type FDBKey struct {
	Subnet int
	MAC    MAC
}

// State is the complete desired kernel state of a network.
type State struct {
	Neigh map[NeighKey]MAC
	FDB   map[FDBKey]netip.Addr
}

// Delta is the change of desired state caused by one mutation of the DB.
// A key never appears in both the Set and the Del list of one kind: an entry
// whose value changes is only Set (the kernel write uses replace semantics).
// Del entries carry the value that was desired before, because deleting an
// FDB entry must name its current destination. The Set and Del slices of a
// Delta returned by a DB are valid until the DB's next mutation.
type Delta struct {
	NeighSet []Neigh
	NeighDel []Neigh
	FDBSet   []FDB
	FDBDel   []FDB
	// NeighMoved lists the entries of NeighSet whose IP was desired with
	// another MAC before this change: containers may have the old MAC
	// cached, so the sandbox announces these. It adds nothing to write.
	NeighMoved []Neigh
}

// Empty reports whether d changes nothing.
func (d Delta) Empty() bool {
	return len(d.NeighSet) == 0 && len(d.NeighDel) == 0 && len(d.FDBSet) == 0 && len(d.FDBDel) == 0
}

// Key identifies one remote record: the VNI it was published under, the
// node that owns it and its endpoint. The control plane owns the records;
// a network's peer table holds at most one record per Key.
type Key struct {
	VNI        uint32
	Origin     string
	EndpointID string
}

func (k Key) String() string { return fmt.Sprintf("vni %d %s/%s", k.VNI, k.Origin, k.EndpointID) }
