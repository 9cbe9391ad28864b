package cluster

import (
	"encoding/binary"
	"fmt"
	"net/netip"
)

// Node metadata (memberlist's per-node meta, at most 512 bytes), version 1:
//
//	metaVersion:u8 (>=1) protoMin:u8 protoMax:u8 incarnation:u64be
//	vtepFamily:u8 (4|6) vtep:4|16 [since version 2: appLen:u16be app:appLen]
//	[since version 3: flags:u8] [ignored trailing bytes]
//
// app is the application state (SetAppState: the encryption key epochs),
// opaque to this package. flags bit 0 (metaInterest): the node's network
// definitions are its interest, the VNIs whose records it wants (see
// interest.go); other bits are ignored.
//
// Later metadata versions may only append fields, so an older node still
// reads what it knows. The incarnation is chosen once per process start
// (the wall clock in ns, made unique): records carry it, and records of any
// other incarnation than the one a node currently advertises are discarded.

const (
	metaVersion byte = 3
	// ProtocolVersion is the wire protocol this package speaks; nodes
	// advertise the range they understand in their metadata.
	// Version 2 adds the network definitions (msgDefs); version 3 the
	// application messages (msgApp, the address management's); version 4
	// IPv6 addresses in peer records (and IPv6 subnets in definitions);
	// version 5 DNS names in peer records.
	// Nodes of versions 1 to 4 are still served, without what they lack.
	ProtocolVersion    byte = 5
	protocolVersionMin byte = 1
)

// ProtocolIPv6 is the first protocol version whose peer records carry
// IPv6 addresses (see wire.go, "IPv6").
const ProtocolIPv6 byte = 4

// ProtocolNames is the first protocol version whose peer records carry
// DNS names (see wire.go, "Names").
const ProtocolNames byte = 5

type nodeMeta struct {
	ProtoMin, ProtoMax byte
	Incarnation        uint64
	VTEP               netip.Addr
	App                []byte // nil when absent
	// Interest: the node wants only the records of the VNIs it has a
	// definition of, and sends members that say the same only theirs
	// (metaInterest; interest.go).
	Interest bool
}

// metaInterest is the flags bit of nodeMeta.Interest.
const metaInterest byte = 1 << 0

// MaxAppState is the largest application state a node can advertise
// (memberlist's metadata holds 512 bytes).
const MaxAppState = 400

func encodeMeta(m nodeMeta) []byte {
	b := []byte{metaVersion, m.ProtoMin, m.ProtoMax}
	b = binary.BigEndian.AppendUint64(b, m.Incarnation)
	if m.VTEP.Is4() {
		v := m.VTEP.As4()
		b = append(b, 4)
		b = append(b, v[:]...)
	} else {
		v := m.VTEP.As16()
		b = append(b, 6)
		b = append(b, v[:]...)
	}
	b = binary.BigEndian.AppendUint16(b, uint16(len(m.App)))
	b = append(b, m.App...)
	var flags byte
	if m.Interest {
		flags |= metaInterest
	}
	return append(b, flags)
}

func decodeMeta(b []byte) (nodeMeta, error) {
	var m nodeMeta
	if len(b) < 12 {
		return m, fmt.Errorf("node metadata of %d bytes is too short (not an overlayd node?)", len(b))
	}
	if b[0] < 1 {
		return m, fmt.Errorf("node metadata version %d", b[0])
	}
	m.ProtoMin, m.ProtoMax = b[1], b[2]
	m.Incarnation = binary.BigEndian.Uint64(b[3:11])
	var rest []byte
	switch fam := b[11]; {
	case fam == 4 && len(b) >= 16:
		m.VTEP, rest = netip.AddrFrom4([4]byte(b[12:16])), b[16:]
	case fam == 6 && len(b) >= 28:
		m.VTEP, rest = netip.AddrFrom16([16]byte(b[12:28])), b[28:]
	default:
		return m, fmt.Errorf("node metadata: bad VTEP (family %d, %d bytes)", fam, len(b))
	}
	if b[0] >= 2 {
		if len(rest) < 2 {
			return m, fmt.Errorf("node metadata version %d without its application state", b[0])
		}
		n := int(binary.BigEndian.Uint16(rest))
		if n > MaxAppState || len(rest) < 2+n {
			return m, fmt.Errorf("node metadata: application state of %d bytes does not fit (%d left, at most %d)", n, len(rest)-2, MaxAppState)
		}
		if n > 0 {
			m.App = append([]byte{}, rest[2:2+n]...)
		}
		rest = rest[2+n:]
	}
	if b[0] >= 3 {
		if len(rest) < 1 {
			return m, fmt.Errorf("node metadata version %d without its flags", b[0])
		}
		m.Interest = rest[0]&metaInterest != 0
	}
	switch {
	case !validVTEP(m.VTEP):
		return m, fmt.Errorf("node metadata: VTEP %v is not a unicast address", m.VTEP)
	case m.Incarnation == 0:
		return m, fmt.Errorf("node metadata: incarnation 0")
	case m.ProtoMin > m.ProtoMax || m.ProtoMin > ProtocolVersion || m.ProtoMax < protocolVersionMin:
		return m, fmt.Errorf("node speaks protocol versions %d..%d, this node %d..%d",
			m.ProtoMin, m.ProtoMax, protocolVersionMin, ProtocolVersion)
	}
	return m, nil
}
