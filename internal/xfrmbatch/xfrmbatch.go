// Package xfrmbatch sends many xfrm (IPsec SA and policy) requests to the
// kernel in one netlink datagram on a NETLINK_XFRM socket and reports an
// error per request.
//
// netlink v1.3.1 sends every xfrm request on its own and waits for its
// acknowledgement: one round trip per SA or policy. The kernel processes
// the requests of a datagram one after the other and answers every failing
// one with an NLMSG_ERROR carrying that request's sequence number, so only
// the last request of a datagram asks for an acknowledgement (NLM_F_ACK):
// its reply (the ACK or its error) comes after every other reply of the
// datagram, and an earlier request without an error reply succeeded.
//
// The messages are built from the netlink package's structs for the fields
// overlayd's encryption uses (see Batch.AddState, Batch.SetPolicy); the
// kernel's own request layout, not a copy of the library's code paths.
package xfrmbatch

import (
	"encoding/binary"
	"errors"
	"fmt"
	"time"
	"unsafe"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/netnsutil"
)

const (
	// MaxPerDatagram caps the requests of one datagram: the error replies
	// of a whole datagram must fit into the receive buffer (each costs
	// about 1 KiB of it) or they are lost (ENOBUFS).
	MaxPerDatagram = 128

	rcvBuf       = 1 << 20
	sndBuf       = 1 << 20
	recvBufSize  = 64 << 10
	replyTimeout = 10 * time.Second
)

// ErrResultUnknown is wrapped by the error of every request whose outcome
// could not be read (the datagram could not be sent, or its replies were
// lost or did not come): the kernel may or may not have applied it.
var ErrResultUnknown = errors.New("result of the xfrm request unknown")

// Conn is one NETLINK_XFRM socket in a network namespace, bound to it until
// Close. It is not safe for concurrent use: its owner serialises calls.
type Conn struct {
	fd     int // -1 once closed
	portID uint32
	seq    uint32
	rbuf   []byte
}

// Open opens a NETLINK_XFRM socket inside ns; the caller may close ns
// afterwards.
func Open(ns netns.NsHandle) (*Conn, error) {
	fd, err := netnsutil.Socket(ns, unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_XFRM)
	if err != nil {
		return nil, fmt.Errorf("xfrmbatch: failed to open NETLINK_XFRM socket: %w", err)
	}
	c := &Conn{fd: fd, rbuf: make([]byte, recvBufSize)}
	if err := c.setup(); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("xfrmbatch: failed to set up NETLINK_XFRM socket: %w", err)
	}
	return c, nil
}

func (c *Conn) setup() error {
	for _, o := range []struct{ force, plain, size int }{{unix.SO_RCVBUFFORCE, unix.SO_RCVBUF, rcvBuf}, {unix.SO_SNDBUFFORCE, unix.SO_SNDBUF, sndBuf}} {
		if err := unix.SetsockoptInt(c.fd, unix.SOL_SOCKET, o.force, o.size); err != nil {
			// Without CAP_NET_ADMIN: as much as net.core.[rw]mem_max allows.
			if err := unix.SetsockoptInt(c.fd, unix.SOL_SOCKET, o.plain, o.size); err != nil {
				return fmt.Errorf("socket buffer: %w", err)
			}
		}
	}
	// Error replies carry only the failed request's header.
	if err := unix.SetsockoptInt(c.fd, unix.SOL_NETLINK, unix.NETLINK_CAP_ACK, 1); err != nil {
		return fmt.Errorf("NETLINK_CAP_ACK: %w", err)
	}
	// The kernel's message, when it has one, goes into the error.
	_ = unix.SetsockoptInt(c.fd, unix.SOL_NETLINK, unix.NETLINK_EXT_ACK, 1)
	tv := unix.NsecToTimeval(replyTimeout.Nanoseconds())
	if err := unix.SetsockoptTimeval(c.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		return fmt.Errorf("SO_RCVTIMEO: %w", err)
	}
	port, err := netnsutil.BindToKernel(c.fd)
	if err != nil {
		return err
	}
	c.portID = port
	return nil
}

// Close closes the socket.
func (c *Conn) Close() error {
	if c == nil || c.fd < 0 {
		return nil
	}
	err := unix.Close(c.fd)
	c.fd = -1
	return err
}

// Batch is a list of xfrm requests to send together (Conn.Send). A Batch
// can be reused after Reset.
type Batch struct {
	msgs []byte // the requests, each a whole netlink message
	ends []int  // end offset of each request in msgs
}

// Len is the number of requests queued.
func (b *Batch) Len() int { return len(b.ends) }

// Reset empties b, keeping its memory.
func (b *Batch) Reset() { b.msgs, b.ends = b.msgs[:0], b.ends[:0] }

// AddState queues XFRM_MSG_NEWSA for s (create, exclusive). Used fields:
// Src, Dst, Proto, Mode, Spi, Reqid, ReplayWindow with ESN, Aead, Mark,
// Selector (Src, Dst, Proto, DstPort, SrcPort). Others must be zero.
func (b *Batch) AddState(s *netlink.XfrmState) error {
	if s.Spi == 0 || s.Auth != nil || s.Crypt != nil || s.Encap != nil || s.OutputMark != nil || s.Ifid != 0 || s.Replay != nil || s.SADir != 0 || s.Pcpunum != nil {
		return fmt.Errorf("xfrmbatch: SA spi 0x%08x dst %v: only AEAD transport states with a non-zero SPI can be batched", uint32(s.Spi), s.Dst)
	}
	info := nl.XfrmUsersaInfo{Family: uint16(nl.GetIPFamily(s.Dst)), Mode: uint8(s.Mode), Reqid: uint32(s.Reqid), ReplayWindow: uint8(s.ReplayWindow)}
	info.Id.Daddr.FromIP(s.Dst)
	info.Id.Proto = uint8(s.Proto)
	info.Id.Spi = nl.Swap32(uint32(s.Spi))
	info.Saddr.FromIP(s.Src)
	if s.Selector != nil {
		selector(&info.Sel, s.Selector)
	}
	info.Lft = infinite()
	if s.ESN {
		if s.ReplayWindow == 0 {
			return fmt.Errorf("xfrmbatch: SA spi 0x%08x dst %v: ESN without a replay window", uint32(s.Spi), s.Dst)
		}
		info.Flags |= nl.XFRM_STATE_ESN
		info.ReplayWindow = 0
	}
	start := b.begin(nl.XFRM_MSG_NEWSA, unix.NLM_F_CREATE|unix.NLM_F_EXCL)
	b.msgs = append(b.msgs, info.Serialize()...)
	if s.Aead != nil {
		name := [64]byte{}
		copy(name[:63], s.Aead.Name)
		algo := nl.XfrmAlgoAEAD{AlgName: name, AlgKeyLen: uint32(len(s.Aead.Key) * 8), AlgICVLen: uint32(s.Aead.ICVLen), AlgKey: s.Aead.Key}
		b.attr(nl.XFRMA_ALG_AEAD, algo.Serialize())
	}
	if s.Mark != nil {
		b.attr(nl.XFRMA_MARK, mark(s.Mark))
	}
	if s.ESN {
		bmp := (uint32(s.ReplayWindow) + 31) / 32
		esn := nl.XfrmReplayStateEsn{BmpLen: bmp, ReplayWindow: uint32(s.ReplayWindow)}
		b.attr(nl.XFRMA_REPLAY_ESN_VAL, esn.Serialize())
	}
	b.end(start)
	return nil
}

// DelState queues XFRM_MSG_DELSA for the SA of s's Dst, Spi, Proto, Src
// and Mark.
func (b *Batch) DelState(s *netlink.XfrmState) {
	id := nl.XfrmUsersaId{Family: uint16(nl.GetIPFamily(s.Dst)), Proto: uint8(s.Proto), Spi: nl.Swap32(uint32(s.Spi))}
	id.Daddr.FromIP(s.Dst)
	start := b.begin(nl.XFRM_MSG_DELSA, 0)
	b.msgs = append(b.msgs, id.Serialize()...)
	if s.Mark != nil {
		b.attr(nl.XFRMA_MARK, mark(s.Mark))
	}
	if s.Src != nil {
		b.attr(nl.XFRMA_SRCADDR, s.Src.To16())
	}
	b.end(start)
}

// SetPolicy queues XFRM_MSG_NEWPOLICY for pol (exclusive: an existing
// policy of that selector is an EEXIST error), or XFRM_MSG_UPDPOLICY
// (create or replace) with update. Used fields: Src, Dst, Proto, DstPort,
// SrcPort, Dir, Priority, Index, Action, Mark, Tmpls, Ifindex.
func (b *Batch) SetPolicy(pol *netlink.XfrmPolicy, update bool) error {
	if pol.Ifid != 0 {
		return fmt.Errorf("xfrmbatch: policy src %v dst %v: policies with an interface id cannot be batched", pol.Src, pol.Dst)
	}
	info := nl.XfrmUserpolicyInfo{Priority: uint32(pol.Priority), Index: uint32(pol.Index), Dir: uint8(pol.Dir), Action: uint8(pol.Action), Lft: infinite()}
	selector(&info.Sel, pol)
	typ := nl.XFRM_MSG_NEWPOLICY
	if update {
		typ = nl.XFRM_MSG_UPDPOLICY
	}
	start := b.begin(typ, unix.NLM_F_CREATE|unix.NLM_F_EXCL)
	b.msgs = append(b.msgs, info.Serialize()...)
	if len(pol.Tmpls) > 0 {
		tmpls := make([]byte, 0, nl.SizeofXfrmUserTmpl*len(pol.Tmpls))
		for i := range pol.Tmpls {
			t := &pol.Tmpls[i]
			u := nl.XfrmUserTmpl{Family: uint16(nl.GetIPFamily(t.Dst)), Mode: uint8(t.Mode), Reqid: uint32(t.Reqid), Optional: uint8(t.Optional),
				Aalgos: ^uint32(0), Ealgos: ^uint32(0), Calgos: ^uint32(0)}
			u.XfrmId.Daddr.FromIP(t.Dst)
			u.XfrmId.Proto = uint8(t.Proto)
			u.XfrmId.Spi = nl.Swap32(uint32(t.Spi))
			u.Saddr.FromIP(t.Src)
			tmpls = append(tmpls, u.Serialize()...)
		}
		b.attr(nl.XFRMA_TMPL, tmpls)
	}
	if pol.Mark != nil {
		b.attr(nl.XFRMA_MARK, mark(pol.Mark))
	}
	b.end(start)
	return nil
}

// DelPolicy queues XFRM_MSG_DELPOLICY for the policy of pol's selector,
// direction, index and mark (templates are not part of a policy's
// identity).
func (b *Batch) DelPolicy(pol *netlink.XfrmPolicy) {
	id := nl.XfrmUserpolicyId{Index: uint32(pol.Index), Dir: uint8(pol.Dir)}
	selector(&id.Sel, pol)
	start := b.begin(nl.XFRM_MSG_DELPOLICY, 0)
	b.msgs = append(b.msgs, id.Serialize()...)
	if pol.Mark != nil {
		b.attr(nl.XFRMA_MARK, mark(pol.Mark))
	}
	b.end(start)
}

// selector fills sel from a policy-shaped selector.
func selector(sel *nl.XfrmSelector, p *netlink.XfrmPolicy) {
	sel.Family = uint16(nl.FAMILY_V4)
	if p.Dst != nil {
		sel.Family = uint16(nl.GetIPFamily(p.Dst.IP))
		sel.Daddr.FromIP(p.Dst.IP)
		ones, _ := p.Dst.Mask.Size()
		sel.PrefixlenD = uint8(ones)
	}
	if p.Src != nil {
		sel.Saddr.FromIP(p.Src.IP)
		ones, _ := p.Src.Mask.Size()
		sel.PrefixlenS = uint8(ones)
	}
	sel.Proto = uint8(p.Proto)
	sel.Dport, sel.Sport = nl.Swap16(uint16(p.DstPort)), nl.Swap16(uint16(p.SrcPort))
	if sel.Dport != 0 {
		sel.DportMask = ^uint16(0)
	}
	if sel.Sport != 0 {
		sel.SportMask = ^uint16(0)
	}
	sel.Ifindex = int32(p.Ifindex)
}

func infinite() nl.XfrmLifetimeCfg {
	return nl.XfrmLifetimeCfg{SoftByteLimit: nl.XFRM_INF, HardByteLimit: nl.XFRM_INF, SoftPacketLimit: nl.XFRM_INF, HardPacketLimit: nl.XFRM_INF}
}

// mark is struct xfrm_mark; a zero mask means "all bits", as ip(8) does.
func mark(m *netlink.XfrmMark) []byte {
	v := nl.XfrmMark{Value: m.Value, Mask: m.Mask}
	if v.Mask == 0 {
		v.Mask = ^uint32(0)
	}
	return v.Serialize()
}

// begin appends a netlink header (length and sequence number filled in by
// end and Send) and returns the message's start.
func (b *Batch) begin(typ int, flags uint16) int {
	start := len(b.msgs)
	var h [unix.SizeofNlMsghdr]byte
	binary.NativeEndian.PutUint16(h[4:], uint16(typ))
	binary.NativeEndian.PutUint16(h[6:], unix.NLM_F_REQUEST|flags)
	b.msgs = append(b.msgs, h[:]...)
	return start
}

func (b *Batch) attr(typ uint16, data []byte) {
	var h [unix.SizeofRtAttr]byte
	binary.NativeEndian.PutUint16(h[0:], uint16(unix.SizeofRtAttr+len(data)))
	binary.NativeEndian.PutUint16(h[2:], typ)
	b.msgs = append(b.msgs, h[:]...)
	b.msgs = append(b.msgs, data...)
	for len(b.msgs)%unix.NLMSG_ALIGNTO != 0 {
		b.msgs = append(b.msgs, 0)
	}
}

func (b *Batch) end(start int) {
	for len(b.msgs)%unix.NLMSG_ALIGNTO != 0 {
		b.msgs = append(b.msgs, 0)
	}
	binary.NativeEndian.PutUint32(b.msgs[start:], uint32(len(b.msgs)-start))
	b.ends = append(b.ends, len(b.msgs))
}

// Send sends b's requests in order, at most MaxPerDatagram per datagram,
// and returns one error per request (nil: applied), in b's order. A request
// the kernel refused has its errno (errors.Is works), with the kernel's
// message when it gave one; a request whose outcome could not be read
// wraps ErrResultUnknown. The datagrams after one whose replies could not
// be read are not sent (their requests are reported with ErrResultUnknown
// too). Sent returns the number of datagrams sent.
func (c *Conn) Send(b *Batch) (errs []error, sent int) {
	errs = make([]error, len(b.ends))
	if c == nil || c.fd < 0 {
		for i := range errs {
			errs[i] = fmt.Errorf("%w: the xfrm socket is closed", ErrResultUnknown)
		}
		return errs, 0
	}
	for lo := 0; lo < len(b.ends); lo += MaxPerDatagram {
		hi := min(lo+MaxPerDatagram, len(b.ends))
		if err := c.sendOne(b, lo, hi, errs); err != nil {
			for i := lo; i < len(errs); i++ {
				if i >= hi || errs[i] == nil {
					errs[i] = err
				}
			}
			return errs, sent + 1
		}
		sent++
	}
	return errs, sent
}

// sendOne sends requests lo…hi-1 as one datagram and fills errs from the
// replies; the error is for the requests without a reply when the replies
// could not be read.
func (c *Conn) sendOne(b *Batch, lo, hi int, errs []error) error {
	from := 0
	if lo > 0 {
		from = b.ends[lo-1]
	}
	first := c.seq + 1
	for i := lo; i < hi; i++ {
		start := from
		if i > lo {
			start = b.ends[i-1]
		}
		c.seq++
		binary.NativeEndian.PutUint32(b.msgs[start+8:], c.seq)
		binary.NativeEndian.PutUint32(b.msgs[start+12:], c.portID)
		flags := binary.NativeEndian.Uint16(b.msgs[start+6:]) &^ unix.NLM_F_ACK
		if i == hi-1 {
			flags |= unix.NLM_F_ACK
		}
		binary.NativeEndian.PutUint16(b.msgs[start+6:], flags)
	}
	last := c.seq
	if err := unix.Send(c.fd, b.msgs[from:b.ends[hi-1]], 0); err != nil {
		return fmt.Errorf("%w: netlink send: %w", ErrResultUnknown, err)
	}
	for {
		n, fromKernel, err := recvfrom(c.fd, c.rbuf)
		switch {
		case err == unix.EINTR:
			continue
		case err == unix.EAGAIN || err == unix.EWOULDBLOCK:
			return fmt.Errorf("%w: no netlink reply within %v", ErrResultUnknown, replyTimeout)
		case err != nil:
			// ENOBUFS included: replies were dropped.
			return fmt.Errorf("%w: netlink receive: %w", ErrResultUnknown, err)
		case !fromKernel:
			continue
		case n > len(c.rbuf):
			return fmt.Errorf("%w: truncated netlink reply", ErrResultUnknown)
		}
		for msg := c.rbuf[:n]; len(msg) >= unix.SizeofNlMsghdr; {
			l := int(binary.NativeEndian.Uint32(msg))
			if l < unix.SizeofNlMsghdr || l > len(msg) {
				break
			}
			typ, flags := binary.NativeEndian.Uint16(msg[4:]), binary.NativeEndian.Uint16(msg[6:])
			seq := binary.NativeEndian.Uint32(msg[8:])
			if typ == unix.NLMSG_ERROR && seq >= first && seq <= last && l >= unix.SizeofNlMsghdr+4 {
				if e := int32(binary.NativeEndian.Uint32(msg[unix.SizeofNlMsghdr:])); e != 0 {
					errs[lo+int(seq-first)] = kernelErr(unix.Errno(-e), flags, msg[:l])
				}
				if seq == last {
					return nil
				}
			}
			msg = msg[min(nlmAlign(l), len(msg)):]
		}
	}
}

// recvfrom reads one datagram (MSG_TRUNC: n is its real length) and
// reports whether the kernel sent it.
func recvfrom(fd int, p []byte) (n int, fromKernel bool, err error) {
	var sa unix.RawSockaddrNetlink
	salen := uint32(unix.SizeofSockaddrNetlink)
	r, _, e := unix.Syscall6(unix.SYS_RECVFROM, uintptr(fd), uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)),
		uintptr(unix.MSG_TRUNC), uintptr(unsafe.Pointer(&sa)), uintptr(unsafe.Pointer(&salen)))
	if e != 0 {
		return 0, false, e
	}
	return int(r), sa.Pid == 0, nil
}

// KernelError is a refused request's errno with the kernel's extended-ack
// message.
type KernelError struct {
	Errno unix.Errno
	Msg   string
}

func (e *KernelError) Error() string { return fmt.Sprintf("%v (kernel: %s)", e.Errno, e.Msg) }
func (e *KernelError) Unwrap() error { return e.Errno }

// kernelErr is errno, with the message of the NLMSGERR_ATTR_MSG attribute
// of the error reply msg when there is one.
func kernelErr(errno unix.Errno, flags uint16, msg []byte) error {
	if flags&unix.NLM_F_ACK_TLVS == 0 || flags&unix.NLM_F_CAPPED == 0 {
		// Without NETLINK_CAP_ACK the request follows; we always set it.
		return errno
	}
	if len(msg) < unix.SizeofNlMsghdr+unix.SizeofNlMsgerr {
		return errno
	}
	for attrs := msg[unix.SizeofNlMsghdr+unix.SizeofNlMsgerr:]; len(attrs) >= unix.SizeofNlAttr; {
		l := int(binary.NativeEndian.Uint16(attrs))
		if l < unix.SizeofNlAttr || l > len(attrs) {
			break
		}
		if binary.NativeEndian.Uint16(attrs[2:])&^uint16(unix.NLA_F_NESTED|unix.NLA_F_NET_BYTEORDER) == unix.NLMSGERR_ATTR_MSG {
			s := string(attrs[unix.SizeofNlAttr:l])
			for len(s) > 0 && s[len(s)-1] == 0 {
				s = s[:len(s)-1]
			}
			if s != "" {
				return &KernelError{Errno: errno, Msg: s}
			}
			break
		}
		attrs = attrs[min(nlmAlign(l), len(attrs)):]
	}
	return errno
}

func nlmAlign(n int) int { return (n + unix.NLMSG_ALIGNTO - 1) &^ (unix.NLMSG_ALIGNTO - 1) }
