// Package rawnl is the reference the peer-programming benchmarks measure
// overlayd against: the least work that programs remote peers (a permanent
// IPv4 or IPv6 neighbour and a VXLAN FDB "self" entry each) into the
// kernel.
//
// One NETLINK_ROUTE socket in the target namespace; hand-built messages
// written into one reused buffer; Batch messages per sendto, only the last of
// each asking for an acknowledgement (the kernel answers any failing request
// with an error of its own, and handles the requests of a datagram in
// order, so the last one's ACK closes the batch); NLM_F_EXCL on adds (the
// entries are new). Nothing else: no validation, no bookkeeping, no
// recovery from lost replies (a lost reply is an error here; the product
// code, internal/nlbatch, recovers). It exists so that every benchmark run
// can report overlayd as a ratio to the kernel's limit measured in the same
// run, on the same machine, instead of to a remembered figure.
package rawnl

import (
	"encoding/binary"
	"errors"
	"fmt"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/netnsutil"
)

// Batch is the number of messages sent per sendto (a peer is two).
const Batch = 256

// Peer is one remote peer: neighbour IP (or IPv6, when V6) → MAC and FDB
// MAC → VTEP.
type Peer struct {
	IP   [4]byte
	IPv6 [16]byte
	V6   bool
	MAC  [6]byte
	VTEP [4]byte
}

// Sizes of the hand-built requests: nlmsghdr (16) + ndmsg (12) + the
// attributes, each a 4-byte header and its value padded to 4 bytes.
const (
	hdrLen       = unix.SizeofNlMsghdr + unix.SizeofNdMsg
	neighAddLen  = hdrLen + 8 + 12 // NDA_DST (IPv4), NDA_LLADDR
	neighDelLen  = hdrLen + 8      // NDA_DST
	neigh6Extra  = 12              // NDA_DST holds 16 bytes, not 4
	fdbLen       = hdrLen + 12 + 8 // NDA_LLADDR, NDA_DST (IPv4)
	maxPerPeer   = neighAddLen + neigh6Extra + fdbLen
	replyBufSize = 64 << 10
)

// Programmer programs peers on one link through one netlink socket. It is
// not safe for concurrent use.
type Programmer struct {
	fd     int
	kernel unix.SockaddrNetlink
	link   uint32
	seq    uint32
	buf    []byte
	rbuf   []byte
}

// Open opens a NETLINK_ROUTE socket in ns for programming peers on the link
// with index link.
func Open(ns netns.NsHandle, link int) (*Programmer, error) {
	fd, err := netnsutil.Socket(ns, unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("rawnl: failed to open a netlink socket: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("rawnl: failed to bind the netlink socket: %w", err)
	}
	return &Programmer{
		fd:     fd,
		kernel: unix.SockaddrNetlink{Family: unix.AF_NETLINK},
		link:   uint32(link),
		buf:    make([]byte, 0, Batch/2*maxPerPeer),
		rbuf:   make([]byte, replyBufSize),
	}, nil
}

// Close closes the socket.
func (p *Programmer) Close() error { return unix.Close(p.fd) }

// Add creates a neighbour and an FDB entry for every peer; every entry must
// be new.
func (p *Programmer) Add(peers []Peer) error { return p.run(peers, true) }

// Delete deletes the neighbour and the FDB entry of every peer.
func (p *Programmer) Delete(peers []Peer) error { return p.run(peers, false) }

func (p *Programmer) run(peers []Peer, add bool) error {
	var firstErr error
	for len(peers) > 0 {
		n := min(len(peers), Batch/2)
		p.buf = p.buf[:0]
		first := p.seq + 1
		for i := range peers[:n] {
			p.appendPeer(&peers[i], add)
		}
		// Only the batch's last request is acknowledged.
		last := len(p.buf) - fdbLen
		flags := binary.NativeEndian.Uint16(p.buf[last+6:])
		binary.NativeEndian.PutUint16(p.buf[last+6:], flags|unix.NLM_F_ACK)
		if err := p.sendAndWait(first, p.seq); err != nil && firstErr == nil {
			firstErr = err
		}
		peers = peers[n:]
	}
	return firstErr
}

// appendPeer appends the peer's neighbour request, then its FDB request.
func (p *Programmer) appendPeer(peer *Peer, add bool) {
	typ, flags, state := uint16(unix.RTM_DELNEIGH), uint16(unix.NLM_F_REQUEST), uint16(0)
	nlen := neighDelLen
	if add {
		typ, flags, state = unix.RTM_NEWNEIGH, unix.NLM_F_REQUEST|unix.NLM_F_CREATE|unix.NLM_F_EXCL, unix.NUD_PERMANENT
		nlen = neighAddLen
	}
	family, dst := byte(unix.AF_INET), peer.IP[:]
	if peer.V6 {
		family, dst = unix.AF_INET6, peer.IPv6[:]
		nlen += neigh6Extra
	}
	b := p.buf
	off := len(b)
	b = b[:off+nlen+fdbLen]
	clear(b[off:])

	// Neighbour: ndmsg{family, link, state}, NDA_DST, NDA_LLADDR on adds.
	p.seq++
	m := b[off:]
	p.putHeader(m, nlen, typ, flags)
	m[16] = family
	binary.NativeEndian.PutUint32(m[20:], p.link)
	binary.NativeEndian.PutUint16(m[24:], state)
	putAttr(m[28:], unix.NDA_DST, dst)
	if add {
		putAttr(m[28+unix.SizeofRtAttr+len(dst):], unix.NDA_LLADDR, peer.MAC[:])
	}

	// FDB: ndmsg{AF_BRIDGE, link, state, NTF_SELF}, NDA_LLADDR, NDA_DST.
	p.seq++
	m = b[off+nlen:]
	p.putHeader(m, fdbLen, typ, flags)
	m[16] = unix.AF_BRIDGE
	binary.NativeEndian.PutUint32(m[20:], p.link)
	binary.NativeEndian.PutUint16(m[24:], state)
	m[26] = unix.NTF_SELF
	putAttr(m[28:], unix.NDA_LLADDR, peer.MAC[:])
	putAttr(m[40:], unix.NDA_DST, peer.VTEP[:])
	p.buf = b
}

func (p *Programmer) putHeader(m []byte, length int, typ, flags uint16) {
	binary.NativeEndian.PutUint32(m[0:], uint32(length))
	binary.NativeEndian.PutUint16(m[4:], typ)
	binary.NativeEndian.PutUint16(m[6:], flags)
	binary.NativeEndian.PutUint32(m[8:], p.seq)
}

// putAttr writes a route attribute into zeroed space (the padding stays 0).
func putAttr(b []byte, typ uint16, val []byte) {
	binary.NativeEndian.PutUint16(b[0:], uint16(unix.SizeofRtAttr+len(val)))
	binary.NativeEndian.PutUint16(b[2:], typ)
	copy(b[unix.SizeofRtAttr:], val)
}

// sendAndWait sends the buffer and reads replies until the one to the
// request with sequence number last. It returns the first error the kernel
// reported for a request of the batch (first … last).
func (p *Programmer) sendAndWait(first, last uint32) error {
	if err := unix.Sendto(p.fd, p.buf, 0, &p.kernel); err != nil {
		return fmt.Errorf("rawnl: sendto: %w", err)
	}
	var firstErr error
	for {
		n, err := unix.Read(p.fd, p.rbuf) // only the kernel sends to this port
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return errors.Join(firstErr, fmt.Errorf("rawnl: recvfrom: %w", err))
		}
		for b := p.rbuf[:n]; len(b) >= unix.SizeofNlMsghdr+4; {
			l := int(binary.NativeEndian.Uint32(b[0:]))
			if l < unix.SizeofNlMsghdr || l > len(b) {
				return errors.Join(firstErr, errors.New("rawnl: malformed reply"))
			}
			typ := binary.NativeEndian.Uint16(b[4:])
			seq := binary.NativeEndian.Uint32(b[8:])
			if typ == unix.NLMSG_ERROR && seq-first <= last-first {
				if e := int32(binary.NativeEndian.Uint32(b[16:])); e != 0 && firstErr == nil {
					firstErr = fmt.Errorf("rawnl: request %d of the batch: %w", seq-first, unix.Errno(-e))
				}
				if seq == last {
					return firstErr
				}
			}
			b = b[min(len(b), (l+3)&^3):]
		}
	}
}
