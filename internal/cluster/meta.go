package cluster

import (
	"encoding/binary"
	"fmt"
	"net/netip"
)

// Node metadata (memberlist's per-node meta, at most 512 bytes), version 1:
//
//	metaVersion:u8 (>=1) protoMin:u8 protoMax:u8 incarnation:u64be
//	vtepFamily:u8 (4|6) vtep:4|16 [ignored trailing bytes]
//
// Later metadata versions may only append fields, so an older node still
// reads what it knows. The incarnation is chosen once per process start
// (the wall clock in ns, made unique): records carry it, and records of any
// other incarnation than the one a node currently advertises are discarded.

const (
	metaVersion byte = 1
	// ProtocolVersion is the wire protocol this package speaks; nodes
	// advertise the range they understand in their metadata.
	ProtocolVersion    byte = 1
	protocolVersionMin byte = 1
)

type nodeMeta struct {
	ProtoMin, ProtoMax byte
	Incarnation        uint64
	VTEP               netip.Addr
}

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
	return b
}

func decodeMeta(b []byte) (nodeMeta, error) {
	var m nodeMeta
	if len(b) < 12 {
		return m, fmt.Errorf("node metadata of %d bytes is too short (not an overlayd node?)", len(b))
	}
	if b[0] < metaVersion {
		return m, fmt.Errorf("node metadata version %d", b[0])
	}
	m.ProtoMin, m.ProtoMax = b[1], b[2]
	m.Incarnation = binary.BigEndian.Uint64(b[3:11])
	switch fam := b[11]; {
	case fam == 4 && len(b) >= 16:
		m.VTEP = netip.AddrFrom4([4]byte(b[12:16]))
	case fam == 6 && len(b) >= 28:
		m.VTEP = netip.AddrFrom16([16]byte(b[12:28]))
	default:
		return m, fmt.Errorf("node metadata: bad VTEP (family %d, %d bytes)", fam, len(b))
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
