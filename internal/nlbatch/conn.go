// Package nlbatch is overlayd's one netlink transport for bulk kernel
// programming: many requests sent with one sendto on a socket of one
// netlink family, an error reported per request. Two families use it:
// NETLINK_ROUTE (Open, Conn.Apply: permanent neighbour entries and VXLAN
// FDB "self" entries, route.go) and NETLINK_XFRM (OpenXfrm, Conn.Send: IPsec
// SAs and policies, xfrm.go). The families differ only in their encoders;
// the socket, the reply loop, the resynchronisation after lost replies and
// the errors (ErrResultUnknown, ErrClosed, ErrInvalidOp, *KernelError with
// the kernel's extended ack) are this file's and errors.go's.
//
// Only the last request of each batch asks for an acknowledgement
// (NLM_F_ACK). The kernel processes the requests of a datagram one after
// the other and answers every failing one with an NLMSG_ERROR carrying that
// request's sequence number, so errors are still reported per request.
// Because the requests of a datagram are handled in order, the reply to the
// last one (its ACK, or its error) means every earlier request without an
// error reply succeeded.
//
// If replies are lost (the socket's receive queue overflowed: ENOBUFS), the
// requests of that batch that got no reply are reported with
// ErrResultUnknown instead of being counted as successes, and the reader
// resynchronises with an acknowledged NLMSG_NOOP before the next batch.
package nlbatch

import (
	"encoding/binary"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

const (
	// DefaultBatchSize is the number of route requests sent per sendto
	// unless SetBatchSize says otherwise.
	DefaultBatchSize = 512

	// XfrmBatchSize is the number of xfrm requests sent per sendto unless
	// SetBatchSize says otherwise: the kernel's work per request is larger
	// (an SA or policy insertion) and the xfrm callers send a few hundred
	// at most.
	XfrmBatchSize = 128

	// wantRcvBuf and wantSndBuf are the socket buffer sizes asked for.
	wantRcvBuf = 16 << 20
	wantSndBuf = 4 << 20

	// errReplyCost is a generous estimate of the receive buffer one error
	// reply occupies (skb truesize); the batch size is capped so that the
	// error replies of a whole batch fit into the receive buffer.
	errReplyCost = 1024

	// maxBatchBytes caps the size of one datagram (it must also stay below
	// the socket's send buffer).
	maxBatchBytes = 1 << 20

	// recvBufSize is the size of the receive buffer in user space. Replies
	// to our requests are small (an NLMSG_ERROR with a capped request and
	// an optional extended-ack message).
	recvBufSize = 64 << 10

	defaultReplyTimeout = 10 * time.Second

	// maxProbes bounds the resynchronisation after lost replies.
	maxProbes = 64
)

// Conn is one netlink socket of one family (NETLINK_ROUTE or NETLINK_XFRM)
// opened inside a network namespace. It is safe for concurrent use: an
// internal mutex serialises Apply and Send (it is a leaf lock: nothing else
// is locked while holding it).
type Conn struct {
	mu           sync.Mutex
	proto        int // NETLINK_ROUTE or NETLINK_XFRM
	fd           int // -1 once closed
	portID       uint32
	seq          uint32
	batchSize    int           // requested messages per sendto
	defaultBatch int           // the family's default batch size
	maxBatch     int           // cap from the receive buffer size
	maxBytes     int           // cap from the send buffer size
	replyTimeout time.Duration // SO_RCVTIMEO
	counts       *counts       // the process-wide totals this Conn adds to; nil: none

	kernel unix.SockaddrNetlink

	// Reused between batches.
	sbuf     []byte   // route: outgoing datagram
	rbuf     []byte   // incoming datagram
	idx      []int    // route: batch position → index into the ops given to Apply
	absentOK []bool   // batch position → ENOENT and ESRCH count as success
	out      []byte   // the datagram being exchanged (during exchange only)
	starts   []int    // batch position → offset of its request in out
	errs     []error  // batch position → error reported by the kernel
	seen     []bool   // batch position → a reply (error) was received
	tmp      [16]byte // scratch for addresses
}

// Open opens a NETLINK_ROUTE socket inside ns, for Apply. The socket is
// created on a locked OS thread switched into ns and stays bound to that
// namespace (and keeps it alive) until Close; the caller may close ns right
// away. The receive buffer is enlarged (SO_RCVBUFFORCE, else SO_RCVBUF up
// to net.core.rmem_max) so that the error replies of a whole batch fit.
func Open(ns netns.NsHandle) (*Conn, error) { return open(ns, unix.NETLINK_ROUTE) }

// OpenXfrm opens a NETLINK_XFRM socket inside ns, for Send; as Open
// otherwise.
func OpenXfrm(ns netns.NsHandle) (*Conn, error) { return open(ns, unix.NETLINK_XFRM) }

func familyName(proto int) string {
	switch proto {
	case unix.NETLINK_ROUTE:
		return "NETLINK_ROUTE"
	case unix.NETLINK_XFRM:
		return "NETLINK_XFRM"
	}
	return fmt.Sprintf("netlink family %d", proto)
}

func open(ns netns.NsHandle, proto int) (*Conn, error) {
	if !ns.IsOpen() {
		return nil, errors.New("nlbatch: invalid network namespace handle")
	}
	fd, err := netnsutil.Socket(ns, unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, proto)
	if err != nil {
		return nil, fmt.Errorf("nlbatch: failed to open %s socket: %w", familyName(proto), err)
	}
	c := &Conn{
		proto:        proto,
		fd:           fd,
		defaultBatch: DefaultBatchSize,
		replyTimeout: defaultReplyTimeout,
		kernel:       unix.SockaddrNetlink{Family: unix.AF_NETLINK},
		rbuf:         make([]byte, recvBufSize),
	}
	switch proto {
	case unix.NETLINK_ROUTE:
		c.counts = &routeCounts
	case unix.NETLINK_XFRM:
		c.defaultBatch = XfrmBatchSize
	}
	c.batchSize = c.defaultBatch
	if err := c.setup(); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("nlbatch: failed to set up %s socket: %w", familyName(proto), err)
	}
	return c, nil
}

func (c *Conn) setup() error {
	fd := c.fd
	if err := setBuf(fd, unix.SO_RCVBUFFORCE, unix.SO_RCVBUF, wantRcvBuf); err != nil {
		return fmt.Errorf("receive buffer: %w", err)
	}
	if err := setBuf(fd, unix.SO_SNDBUFFORCE, unix.SO_SNDBUF, wantSndBuf); err != nil {
		return fmt.Errorf("send buffer: %w", err)
	}
	// Error replies carry only the header of the failed request, not all of it.
	if err := unix.SetsockoptInt(fd, unix.SOL_NETLINK, unix.NETLINK_CAP_ACK, 1); err != nil {
		return fmt.Errorf("NETLINK_CAP_ACK: %w", err)
	}
	// The kernel's error message, when it has one, ends up in the error.
	// Not essential: ignore a kernel that does not support it.
	_ = unix.SetsockoptInt(fd, unix.SOL_NETLINK, unix.NETLINK_EXT_ACK, 1)
	if err := c.setReplyTimeout(c.replyTimeout); err != nil {
		return err
	}
	port, err := netnsutil.BindToKernel(fd)
	if err != nil {
		return err
	}
	c.portID = port
	return c.readBufSizes()
}

func setBuf(fd, force, plain, size int) error {
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, force, size); err == nil {
		return nil
	}
	// Without CAP_NET_ADMIN: as much as net.core.[rw]mem_max allows.
	return unix.SetsockoptInt(fd, unix.SOL_SOCKET, plain, size)
}

// readBufSizes derives the batch caps from the socket's actual buffer sizes.
func (c *Conn) readBufSizes() error {
	rcv, err := unix.GetsockoptInt(c.fd, unix.SOL_SOCKET, unix.SO_RCVBUF)
	if err != nil {
		return fmt.Errorf("SO_RCVBUF: %w", err)
	}
	snd, err := unix.GetsockoptInt(c.fd, unix.SOL_SOCKET, unix.SO_SNDBUF)
	if err != nil {
		return fmt.Errorf("SO_SNDBUF: %w", err)
	}
	c.maxBatch = max(1, rcv/errReplyCost)
	// netlink_sendmsg refuses datagrams longer than sk_sndbuf - 32.
	c.maxBytes = max(1024, min(maxBatchBytes, snd/2))
	return nil
}

func (c *Conn) setReplyTimeout(d time.Duration) error {
	tv := unix.NsecToTimeval(d.Nanoseconds())
	if err := unix.SetsockoptTimeval(c.fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv); err != nil {
		return fmt.Errorf("SO_RCVTIMEO: %w", err)
	}
	c.replyTimeout = d
	return nil
}

// SetBatchSize sets the number of requests sent per sendto (default
// DefaultBatchSize, XfrmBatchSize for an xfrm Conn). n < 1 restores the
// default. The effective size is further capped so that the error replies
// of a whole batch fit into the socket's receive buffer.
func (c *Conn) SetBatchSize(n int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if n < 1 {
		n = c.defaultBatch
	}
	c.batchSize = n
}

// BatchSize returns the effective number of requests sent per sendto.
func (c *Conn) BatchSize() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.effectiveBatch()
}

func (c *Conn) effectiveBatch() int { return min(c.batchSize, c.maxBatch) }

// Close closes the socket; closing a nil Conn does nothing. Apply and Send
// on a closed Conn fail every request with ErrClosed.
func (c *Conn) Close() error {
	if c == nil {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.fd < 0 {
		return nil
	}
	err := unix.Close(c.fd)
	c.fd = -1
	return err
}

// usable returns the error of every request for family proto on c: nil,
// ErrClosed, or one wrapping ErrInvalidOp for another family's socket.
// Expects c.mu held.
func (c *Conn) usable(proto int) error {
	switch {
	case c.fd < 0:
		return ErrClosed
	case c.proto != proto:
		return invalid("%s request on a %s socket", familyName(proto), familyName(c.proto))
	}
	return nil
}

// Process-wide counts of what every route Conn sent: the kernel work peer
// programming costs, read by the metrics at scrape time. Package-level
// because Conns come and go with sandboxes while the totals must not.
// xfrm Conns add to none: Send returns its datagrams to its caller.
type counts struct{ messages, datagrams, sendFailures atomic.Uint64 }

var routeCounts counts

// Counts are the totals of every route Conn since the process started.
type Counts struct {
	Messages     uint64 // requests the kernel accepted in a datagram
	Datagrams    uint64 // datagrams sent (a batch each)
	SendFailures uint64 // datagrams the kernel refused as a whole
}

// Sent returns what every route Conn has sent so far.
func Sent() Counts {
	return Counts{Messages: routeCounts.messages.Load(), Datagrams: routeCounts.datagrams.Load(), SendFailures: routeCounts.sendFailures.Load()}
}

func (c *Conn) nextSeq() uint32 {
	c.seq++
	return c.seq
}

// exchange sends the requests of dg (whole netlink messages from the
// family's encoder) as one datagram and reads their replies. It stamps every
// request with the next sequence number and the socket's port id, and asks
// for an acknowledgement on the last one only. c.absentOK must have an entry
// per request.
//
// Afterwards, for batch position p (the p-th request of dg), c.errs[p] is
// the kernel's refusal (nil: applied, or refused with ENOENT or ESRCH where
// c.absentOK[p]) and c.seen[p] whether a reply came. sendErr is the error
// of a datagram the kernel refused as a whole (nothing was applied); lost,
// wrapping ErrResultUnknown, is the outcome of the requests without a reply
// when replies may have been lost.
func (c *Conn) exchange(dg []byte) (sendErr, lost error) {
	c.out = dg
	c.starts = c.starts[:0]
	first := c.seq + 1
	for off := 0; off+unix.SizeofNlMsghdr <= len(dg); {
		l := int(binary.NativeEndian.Uint32(dg[off:]))
		if l < unix.SizeofNlMsghdr {
			break // not from an encoder of ours
		}
		c.starts = append(c.starts, off)
		binary.NativeEndian.PutUint32(dg[off+8:], c.nextSeq())
		binary.NativeEndian.PutUint32(dg[off+12:], c.portID)
		flags := binary.NativeEndian.Uint16(dg[off+6:]) &^ unix.NLM_F_ACK
		binary.NativeEndian.PutUint16(dg[off+6:], flags)
		off += nlmAlign(l)
	}
	n := len(c.starts)
	if n == 0 {
		return nil, nil
	}
	last := c.starts[n-1]
	binary.NativeEndian.PutUint16(dg[last+6:], binary.NativeEndian.Uint16(dg[last+6:])|unix.NLM_F_ACK)

	c.errs = slices.Grow(c.errs[:0], n)[:n]
	c.seen = slices.Grow(c.seen[:0], n)[:n]
	clear(c.errs)
	clear(c.seen)

	if err := c.send(dg); err != nil {
		c.out = nil
		if c.counts != nil {
			c.counts.sendFailures.Add(1)
		}
		return err, nil
	}
	if c.counts != nil {
		c.counts.messages.Add(uint64(n))
		c.counts.datagrams.Add(1)
	}
	lost = c.collect(first, n)
	c.out = nil // the caller's
	return nil, lost
}

// request returns the request at batch position p as sent, or nil.
func (c *Conn) request(p int) []byte {
	if p >= len(c.starts) {
		return nil
	}
	start := c.starts[p]
	if start+unix.SizeofNlMsghdr > len(c.out) {
		return nil
	}
	l := int(binary.NativeEndian.Uint32(c.out[start:]))
	return c.out[start:min(start+l, len(c.out))]
}

func (c *Conn) send(b []byte) error {
	for {
		err := unix.Sendto(c.fd, b, 0, &c.kernel)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return fmt.Errorf("netlink sendto: %w", err)
		}
		return nil
	}
}

// collect reads replies until the one to the batch's last request
// (sequence number first+n-1) arrives. Errors are stored in c.errs and the
// positions that got a reply are marked in c.seen. It returns nil if every
// reply of the batch has been received, or the error to report for the
// requests that got no reply if some replies may have been lost.
//
// The kernel handles a datagram of requests synchronously within sendto, so
// all replies are queued (or dropped) when collect starts. If replies were
// dropped because the receive queue overflowed (ENOBUFS), the queue is
// drained without blocking and an NLMSG_NOOP probe with NLM_F_ACK is sent;
// its acknowledgement marks the end of everything sent before. (The queue
// must be drained first: while it stays congested the kernel drops further
// replies, the probe's included, without reporting ENOBUFS again.)
func (c *Conn) collect(first uint32, n int) error {
	st := batchState{first: first, n: uint32(n)}
	draining := false // reading without blocking until the queue is empty
	lose := func(cause error) {
		if st.lost == nil {
			st.lost = cause
		}
		draining = true
	}

	for {
		flags := unix.MSG_TRUNC
		if draining {
			flags |= unix.MSG_DONTWAIT
		}
		nr, fromKernel, err := recvfrom(c.fd, c.rbuf, flags)
		switch {
		case err == unix.EINTR:
			continue
		case err == unix.ENOBUFS:
			// The receive queue overflowed: replies were dropped.
			lose(unix.ENOBUFS)
			continue
		case (err == unix.EAGAIN || err == unix.EWOULDBLOCK) && draining:
			// Queue empty: ask for an acknowledgement after all that.
			draining = false
			if st.probes >= maxProbes {
				return fmt.Errorf("%w: %w: could not resynchronise", ErrResultUnknown, st.lost)
			}
			seq := c.nextSeq()
			if st.probes == 0 {
				st.probeLo = seq
			}
			st.probeHi = seq
			st.probes++
			if err := c.send(c.probe(seq)); err != nil {
				return fmt.Errorf("%w: %w: probe: %w", ErrResultUnknown, st.lost, err)
			}
			continue
		case err == unix.EAGAIN || err == unix.EWOULDBLOCK:
			if st.lost != nil {
				return fmt.Errorf("%w: %w, and no netlink reply within %v", ErrResultUnknown, st.lost, c.replyTimeout)
			}
			return fmt.Errorf("%w: no netlink reply within %v: %w", ErrResultUnknown, c.replyTimeout, unix.ETIMEDOUT)
		case err != nil:
			return fmt.Errorf("%w: netlink recvfrom: %w", ErrResultUnknown, err)
		}
		if !fromKernel {
			continue
		}
		if nr > len(c.rbuf) {
			// Truncated datagram: its replies are lost.
			lose(errTruncated)
			continue
		}
		if c.handleReplies(c.rbuf[:nr], &st) && !draining {
			if st.lost != nil {
				return fmt.Errorf("%w: %w: netlink replies of the batch were lost", ErrResultUnknown, st.lost)
			}
			return nil
		}
	}
}

// recvfrom is unix.Recvfrom without its two allocations per call (the
// sender's address is only checked to be the kernel's): a notification
// of one peer costs one datagram and one reply.
func recvfrom(fd int, p []byte, flags int) (n int, fromKernel bool, err error) {
	var sa unix.RawSockaddrNetlink
	salen := uint32(unix.SizeofSockaddrNetlink)
	r, _, e := unix.Syscall6(unix.SYS_RECVFROM, uintptr(fd), uintptr(unsafe.Pointer(&p[0])), uintptr(len(p)),
		uintptr(flags), uintptr(unsafe.Pointer(&sa)), uintptr(unsafe.Pointer(&salen)))
	if e != 0 {
		return 0, false, e
	}
	return int(r), sa.Pid == 0, nil
}

// batchState is what collect knows about the replies to a batch.
type batchState struct {
	first, n         uint32 // sequence numbers first … first+n-1
	lost             error  // non-nil once replies may have been lost
	probes           int    // probes sent
	probeLo, probeHi uint32 // their sequence numbers
}

// handleReplies processes the netlink messages of one datagram: errors for
// the batch's requests go to c.errs, replies are marked in c.seen. It reports
// whether the datagram ended the batch: the reply to its last request or,
// once replies were lost, the acknowledgement of a probe. Messages for other
// ports, of other sequence numbers and of other types are ignored.
func (c *Conn) handleReplies(b []byte, st *batchState) (done bool) {
	forEachMsg(b, func(msg []byte, typ, flags uint16, seq, pid uint32) {
		if pid != c.portID {
			return
		}
		if typ != unix.NLMSG_ERROR && typ != unix.NLMSG_DONE {
			return // NLMSG_NOOP, or something we did not ask for
		}
		if st.probes > 0 && seq-st.probeLo <= st.probeHi-st.probeLo {
			done = done || st.lost != nil
			return
		}
		p := seq - st.first
		if p >= st.n {
			return // another batch's, or stale
		}
		if errno, ok := replyErrno(msg); ok {
			c.seen[p] = true
			if errno != 0 && !c.ignorable(int(p), errno) {
				c.errs[p] = kernelErr(errno, typ, flags, msg, c.request(int(p)))
			}
		}
		if p == st.n-1 && st.lost == nil {
			done = true
		}
	})
	return done
}

var errTruncated = errors.New("truncated netlink reply")

// ignorable reports whether errno for the request at batch position p
// counts as success: deleting what does not exist, where the family's
// encoder said so.
func (c *Conn) ignorable(p int, errno unix.Errno) bool {
	return p < len(c.absentOK) && c.absentOK[p] && (errno == unix.ENOENT || errno == unix.ESRCH)
}

// probe returns an NLMSG_NOOP request with NLM_F_ACK: the kernel acknowledges
// it after everything sent before, which resynchronises the reader.
func (c *Conn) probe(seq uint32) []byte {
	var b [unix.SizeofNlMsghdr]byte
	putHdr(b[:], unix.SizeofNlMsghdr, unix.NLMSG_NOOP, unix.NLM_F_REQUEST|unix.NLM_F_ACK, seq, c.portID)
	return b[:]
}
