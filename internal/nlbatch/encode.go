package nlbatch

import (
	"encoding/binary"
	"net/netip"

	"golang.org/x/sys/unix"
)

// maxMsgLen is the longest request appendMsg produces: header, ndmsg, an
// IPv6 NDA_DST and NDA_LLADDR.
const maxMsgLen = unix.SizeofNlMsghdr + unix.SizeofNdMsg +
	unix.SizeofRtAttr + 16 + // NDA_DST (IPv6)
	unix.SizeofRtAttr + 8 // NDA_LLADDR (6 bytes, padded)

func putHdr(b []byte, length uint32, typ, flags uint16, seq, pid uint32) {
	binary.NativeEndian.PutUint32(b[0:], length)
	binary.NativeEndian.PutUint16(b[4:], typ)
	binary.NativeEndian.PutUint16(b[6:], flags)
	binary.NativeEndian.PutUint32(b[8:], seq)
	binary.NativeEndian.PutUint32(b[12:], pid)
}

// appendMsg appends the request for op (already validated; ip and vtep are
// its normalised addresses) with sequence number seq to b. NLM_F_ACK is not
// set.
func (c *Conn) appendMsg(b []byte, op *Op, ip, vtep netip.Addr, seq uint32) []byte {
	start := len(b)
	b = append(b, make([]byte, unix.SizeofNlMsghdr+unix.SizeofNdMsg)...)
	hdr := b[start:]
	nd := hdr[unix.SizeofNlMsghdr:]

	var (
		typ    uint16
		flags  uint16 = unix.NLM_F_REQUEST
		family uint8
		state  uint16
		ndf    uint8
	)
	switch op.Kind {
	case NeighSet:
		typ, flags, family, state = unix.RTM_NEWNEIGH, flags|unix.NLM_F_CREATE|unix.NLM_F_REPLACE, addrFamily(ip), unix.NUD_PERMANENT
	case NeighDel:
		typ, family = unix.RTM_DELNEIGH, addrFamily(ip)
	case FDBSet:
		typ, flags, family, state, ndf = unix.RTM_NEWNEIGH, flags|unix.NLM_F_CREATE|unix.NLM_F_REPLACE, unix.AF_BRIDGE, unix.NUD_PERMANENT, unix.NTF_SELF
	case FDBDel:
		typ, family, ndf = unix.RTM_DELNEIGH, unix.AF_BRIDGE, unix.NTF_SELF
	}
	// struct ndmsg
	nd[0] = family
	nd[1], nd[2], nd[3] = 0, 0, 0
	binary.NativeEndian.PutUint32(nd[4:], uint32(int32(op.LinkIndex)))
	binary.NativeEndian.PutUint16(nd[8:], state)
	nd[10] = ndf
	nd[11] = 0 // ndm_type

	switch op.Kind {
	case NeighSet:
		b = c.appendAddr(b, unix.NDA_DST, ip)
		b = appendAttr(b, unix.NDA_LLADDR, op.MAC[:])
	case NeighDel:
		b = c.appendAddr(b, unix.NDA_DST, ip)
	case FDBSet, FDBDel:
		b = appendAttr(b, unix.NDA_LLADDR, op.MAC[:])
		b = c.appendAddr(b, unix.NDA_DST, vtep)
	}
	putHdr(b[start:], uint32(len(b)-start), typ, flags, seq, c.portID)
	return b
}

func addrFamily(a netip.Addr) uint8 {
	if a.Is4() {
		return unix.AF_INET
	}
	return unix.AF_INET6
}

func (c *Conn) appendAddr(b []byte, typ uint16, a netip.Addr) []byte {
	if a.Is4() {
		v := a.As4()
		copy(c.tmp[:], v[:])
		return appendAttr(b, typ, c.tmp[:4])
	}
	c.tmp = a.As16()
	return appendAttr(b, typ, c.tmp[:16])
}

// appendAttr appends a route attribute, padded to 4 bytes.
func appendAttr(b []byte, typ uint16, data []byte) []byte {
	l := unix.SizeofRtAttr + len(data)
	b = binary.NativeEndian.AppendUint16(b, uint16(l))
	b = binary.NativeEndian.AppendUint16(b, typ)
	b = append(b, data...)
	for pad := nlmAlign(l) - l; pad > 0; pad-- {
		b = append(b, 0)
	}
	return b
}
