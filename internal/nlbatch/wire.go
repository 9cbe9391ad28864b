package nlbatch

import (
	"encoding/binary"

	"golang.org/x/sys/unix"
)

// The netlink wire format shared by every family: headers, attributes and
// their alignment. The per-family encoders (route.go, xfrm.go) build their
// requests with these; the transport (conn.go) stamps them and parses the
// replies with them.

// nlmAlign rounds n up to the netlink alignment (4 bytes); messages and
// attributes alike are padded to it.
func nlmAlign(n int) int { return (n + unix.NLMSG_ALIGNTO - 1) &^ (unix.NLMSG_ALIGNTO - 1) }

// nlaTypeMask strips NLA_F_NESTED and NLA_F_NET_BYTEORDER from an attribute type.
const nlaTypeMask = ^uint16(unix.NLA_F_NESTED | unix.NLA_F_NET_BYTEORDER)

func putHdr(b []byte, length uint32, typ, flags uint16, seq, pid uint32) {
	binary.NativeEndian.PutUint32(b[0:], length)
	binary.NativeEndian.PutUint16(b[4:], typ)
	binary.NativeEndian.PutUint16(b[6:], flags)
	binary.NativeEndian.PutUint32(b[8:], seq)
	binary.NativeEndian.PutUint32(b[12:], pid)
}

// beginMsg appends a request header of type typ with NLM_F_REQUEST|flags
// and returns the message's start; endMsg pads the message and writes its
// length. The sequence number and port id are the transport's (stamp).
func beginMsg(b []byte, typ, flags uint16) ([]byte, int) {
	start := len(b)
	var h [unix.SizeofNlMsghdr]byte
	putHdr(h[:], 0, typ, unix.NLM_F_REQUEST|flags, 0, 0)
	return append(b, h[:]...), start
}

func endMsg(b []byte, start int) []byte {
	b = pad(b)
	binary.NativeEndian.PutUint32(b[start:], uint32(len(b)-start))
	return b
}

// appendAttr appends an attribute, padded to 4 bytes.
func appendAttr(b []byte, typ uint16, data []byte) []byte {
	b = binary.NativeEndian.AppendUint16(b, uint16(unix.SizeofNlAttr+len(data)))
	b = binary.NativeEndian.AppendUint16(b, typ)
	return pad(append(b, data...))
}

func pad(b []byte) []byte {
	for len(b)%unix.NLMSG_ALIGNTO != 0 {
		b = append(b, 0)
	}
	return b
}

// forEachMsg calls f with every whole netlink message of b and its header
// fields, stopping at the first malformed one.
func forEachMsg(b []byte, f func(msg []byte, typ, flags uint16, seq, pid uint32)) {
	for len(b) >= unix.SizeofNlMsghdr {
		l := int(binary.NativeEndian.Uint32(b[0:]))
		if l < unix.SizeofNlMsghdr || l > len(b) {
			return
		}
		f(b[:l], binary.NativeEndian.Uint16(b[4:]), binary.NativeEndian.Uint16(b[6:]),
			binary.NativeEndian.Uint32(b[8:]), binary.NativeEndian.Uint32(b[12:]))
		b = b[min(nlmAlign(l), len(b)):]
	}
}

// forEachAttr calls f with the type (flags stripped) and payload of every
// attribute of b, stopping at the first malformed one or when f returns
// false.
func forEachAttr(b []byte, f func(typ uint16, data []byte) bool) {
	for len(b) >= unix.SizeofNlAttr {
		l := int(binary.NativeEndian.Uint16(b[0:]))
		if l < unix.SizeofNlAttr || l > len(b) {
			return
		}
		if !f(binary.NativeEndian.Uint16(b[2:])&nlaTypeMask, b[unix.SizeofNlAttr:l]) {
			return
		}
		b = b[min(nlmAlign(l), len(b)):]
	}
}
