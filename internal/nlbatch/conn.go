// Package nlbatch programs permanent neighbour entries and VXLAN FDB "self"
// entries at a high rate.
//
// Many netlink requests are sent with one sendto on a single NETLINK_ROUTE
// socket; only the last request of each batch asks for an acknowledgement
// (NLM_F_ACK). The kernel processes the requests of a datagram one after the
// other and answers every failing one with an NLMSG_ERROR carrying that
// request's sequence number, so errors are still reported per operation.
// Because the requests of a datagram are handled in order, the reply to the
// last one (its ACK, or its error) means every earlier request without an
// error reply succeeded.
//
// If replies are lost (the socket's receive queue overflowed: ENOBUFS), the
// operations of that batch that got no reply are reported with
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
	// DefaultBatchSize is the number of requests sent per sendto unless
	// SetBatchSize says otherwise.
	DefaultBatchSize = 512

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

// Conn is one NETLINK_ROUTE socket opened inside a network namespace. It is
// safe for concurrent use: an internal mutex serialises Apply (it is a leaf
// lock: nothing else is locked while holding it).
type Conn struct {
	mu           sync.Mutex
	fd           int // -1 once closed
	portID       uint32
	seq          uint32
	batchSize    int           // requested messages per sendto
	maxBatch     int           // cap from the receive buffer size
	maxBytes     int           // cap from the send buffer size
	replyTimeout time.Duration // SO_RCVTIMEO

	kernel unix.SockaddrNetlink

	// Reused between batches.
	sbuf []byte   // outgoing datagram
	rbuf []byte   // incoming datagram
	idx  []int    // batch position → index into the ops given to Apply
	kind []Kind   // batch position → kind
	errs []error  // batch position → error reported by the kernel
	seen []bool   // batch position → a reply (error) was received
	tmp  [16]byte // scratch for addresses
}

// Open opens a NETLINK_ROUTE socket inside ns. The socket is created on a
// locked OS thread switched into ns and stays bound to that namespace (and
// keeps it alive) until Close; the caller may close ns right away. The
// receive buffer is enlarged (SO_RCVBUFFORCE, else SO_RCVBUF up to
// net.core.rmem_max) so that the error replies of a whole batch fit.
func Open(ns netns.NsHandle) (*Conn, error) {
	if !ns.IsOpen() {
		return nil, errors.New("nlbatch: invalid network namespace handle")
	}
	fd, err := netnsutil.Socket(ns, unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("nlbatch: failed to open netlink socket: %w", err)
	}
	c := &Conn{
		fd:           fd,
		batchSize:    DefaultBatchSize,
		replyTimeout: defaultReplyTimeout,
		kernel:       unix.SockaddrNetlink{Family: unix.AF_NETLINK},
		rbuf:         make([]byte, recvBufSize),
	}
	if err := c.setup(); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("nlbatch: failed to set up netlink socket: %w", err)
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
// DefaultBatchSize). n < 1 restores the default. The effective size is
// further capped so that the error replies of a whole batch fit into the
// socket's receive buffer.
func (c *Conn) SetBatchSize(n int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if n < 1 {
		n = DefaultBatchSize
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

// Close closes the socket. Apply on a closed Conn fails every operation with
// ErrClosed.
func (c *Conn) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.fd < 0 {
		return nil
	}
	err := unix.Close(c.fd)
	c.fd = -1
	return err
}

// Apply sends ops in batches and waits for every batch's final
// acknowledgement. Deleting an entry that does not exist counts as success.
// It returns nil or an *Error listing every failed operation: ops that are
// invalid (not sent), ops the kernel refused, and ops whose outcome is unknown
// (ErrResultUnknown) because replies were lost.
func (c *Conn) Apply(ops []Op) error {
	var failed []OpError
	fail := func(i int, err error) {
		failed = append(failed, OpError{Index: i, Op: ops[i], Err: err})
	}

	c.mu.Lock()
	defer c.mu.Unlock()

	if c.fd < 0 {
		for i := range ops {
			fail(i, ErrClosed)
		}
		return c.result(failed, len(ops))
	}

	batch := c.effectiveBatch()
	c.sbuf = c.sbuf[:0]
	c.idx = c.idx[:0]
	c.kind = c.kind[:0]
	lastMsg := 0 // offset of the last message in sbuf
	for i := range ops {
		ip, vtep, err := ops[i].normalize()
		if err != nil {
			fail(i, err)
			continue
		}
		if len(c.idx) > 0 && len(c.sbuf)+maxMsgLen > c.maxBytes {
			c.flush(lastMsg, fail)
		}
		lastMsg = len(c.sbuf)
		c.sbuf = c.appendMsg(c.sbuf, &ops[i], ip, vtep, c.nextSeq())
		c.idx = append(c.idx, i)
		c.kind = append(c.kind, ops[i].Kind)
		if len(c.idx) >= batch {
			c.flush(lastMsg, fail)
		}
	}
	if len(c.idx) > 0 {
		c.flush(lastMsg, fail)
	}
	return c.result(failed, len(ops))
}

func (c *Conn) result(failed []OpError, total int) error {
	if len(failed) == 0 {
		return nil
	}
	slices.SortStableFunc(failed, func(a, b OpError) int { return a.Index - b.Index })
	return &Error{Failed: failed, Total: total}
}

// Process-wide counts of what every Conn sent: the kernel work peer
// programming costs, read by the metrics at scrape time. Package-level
// because Conns come and go with sandboxes while the totals must not.
var sentMessages, sentDatagrams, sendFailures atomic.Uint64

// Counts are the totals of every Conn since the process started.
type Counts struct {
	Messages     uint64 // requests the kernel accepted in a datagram
	Datagrams    uint64 // datagrams sent (a batch each)
	SendFailures uint64 // datagrams the kernel refused as a whole
}

// Sent returns what every Conn has sent so far.
func Sent() Counts {
	return Counts{Messages: sentMessages.Load(), Datagrams: sentDatagrams.Load(), SendFailures: sendFailures.Load()}
}

func (c *Conn) nextSeq() uint32 {
	c.seq++
	return c.seq
}

// flush sends the batch in c.sbuf, whose last message starts at lastMsg,
// collects the replies and reports failures through fail. It empties the
// batch.
func (c *Conn) flush(lastMsg int, fail func(int, error)) {
	defer func() {
		c.sbuf = c.sbuf[:0]
		c.idx = c.idx[:0]
		c.kind = c.kind[:0]
	}()
	n := len(c.idx)
	// Only the last request asks for an acknowledgement.
	flags := binary.NativeEndian.Uint16(c.sbuf[lastMsg+6:])
	binary.NativeEndian.PutUint16(c.sbuf[lastMsg+6:], flags|unix.NLM_F_ACK)
	first := binary.NativeEndian.Uint32(c.sbuf[8:])

	c.errs = slices.Grow(c.errs[:0], n)[:n]
	c.seen = slices.Grow(c.seen[:0], n)[:n]
	clear(c.errs)
	clear(c.seen)

	if err := c.send(c.sbuf); err != nil {
		sendFailures.Add(1)
		// The kernel refused the datagram as a whole: nothing was applied.
		for _, i := range c.idx {
			fail(i, err)
		}
		return
	}
	sentMessages.Add(uint64(n))
	sentDatagrams.Add(1)
	lost := c.collect(first, n)
	for p, i := range c.idx {
		switch {
		case c.errs[p] != nil:
			fail(i, c.errs[p])
		case lost != nil && !c.seen[p]:
			fail(i, lost)
		}
	}
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
	for len(b) >= unix.SizeofNlMsghdr {
		l := int(binary.NativeEndian.Uint32(b[0:]))
		typ := binary.NativeEndian.Uint16(b[4:])
		flags := binary.NativeEndian.Uint16(b[6:])
		seq := binary.NativeEndian.Uint32(b[8:])
		pid := binary.NativeEndian.Uint32(b[12:])
		if l < unix.SizeofNlMsghdr || l > len(b) {
			break // malformed: ignore the rest of the datagram
		}
		msg := b[:l]
		b = b[min(nlmAlign(l), len(b)):]
		if pid != c.portID {
			continue
		}
		if typ != unix.NLMSG_ERROR && typ != unix.NLMSG_DONE {
			continue // NLMSG_NOOP, or something we did not ask for
		}
		if st.probes > 0 && seq-st.probeLo <= st.probeHi-st.probeLo {
			done = done || st.lost != nil
			continue
		}
		p := seq - st.first
		if p >= st.n {
			continue // another batch's, or stale
		}
		if errno, ok := replyErrno(msg); ok {
			c.seen[p] = true
			if errno != 0 && !c.ignorable(int(p), errno) {
				c.errs[p] = withExtAck(errno, typ, flags, msg)
			}
		}
		if p == st.n-1 && st.lost == nil {
			done = true
		}
	}
	return done
}

var errTruncated = errors.New("truncated netlink reply")

// ignorable reports whether errno for the request at batch position p
// counts as success: deleting what does not exist.
func (c *Conn) ignorable(p int, errno unix.Errno) bool {
	switch c.kind[p] {
	case NeighDel, FDBDel:
		return errno == unix.ENOENT || errno == unix.ESRCH
	}
	return false
}

// replyErrno extracts the error code of an NLMSG_ERROR or NLMSG_DONE message.
func replyErrno(msg []byte) (unix.Errno, bool) {
	if len(msg) < unix.SizeofNlMsghdr+4 {
		return 0, binary.NativeEndian.Uint16(msg[4:]) == unix.NLMSG_DONE
	}
	e := int32(binary.NativeEndian.Uint32(msg[unix.SizeofNlMsghdr:]))
	if e < 0 {
		e = -e
	}
	return unix.Errno(e), true
}

// withExtAck wraps errno with the kernel's extended-ack message, if any.
func withExtAck(errno unix.Errno, typ, flags uint16, msg []byte) error {
	if typ != unix.NLMSG_ERROR || flags&unix.NLM_F_ACK_TLVS == 0 {
		return errno
	}
	// struct nlmsgerr: int error; struct nlmsghdr msg; then, unless
	// capped, the rest of the request; then the TLVs.
	off := unix.SizeofNlMsghdr + unix.SizeofNlMsgerr
	if off > len(msg) {
		return errno
	}
	if flags&unix.NLM_F_CAPPED == 0 {
		reqLen := int(binary.NativeEndian.Uint32(msg[unix.SizeofNlMsghdr+4:]))
		off = unix.SizeofNlMsghdr + 4 + nlmAlign(reqLen)
	}
	for off+unix.SizeofNlAttr <= len(msg) {
		alen := int(binary.NativeEndian.Uint16(msg[off:]))
		atyp := binary.NativeEndian.Uint16(msg[off+2:]) & nlaTypeMask
		if alen < unix.SizeofNlAttr || off+alen > len(msg) {
			break
		}
		if atyp == unix.NLMSGERR_ATTR_MSG {
			s := msg[off+unix.SizeofNlAttr : off+alen]
			for len(s) > 0 && s[len(s)-1] == 0 {
				s = s[:len(s)-1]
			}
			if len(s) > 0 {
				return &kernelError{Errno: errno, Msg: string(s)}
			}
			break
		}
		off += nlmAlign(alen)
	}
	return errno
}

// kernelError is an errno with the kernel's extended-ack message.
type kernelError struct {
	Errno unix.Errno
	Msg   string
}

func (e *kernelError) Error() string { return fmt.Sprintf("%v (kernel: %s)", e.Errno, e.Msg) }
func (e *kernelError) Unwrap() error { return e.Errno }

func nlmAlign(n int) int { return (n + unix.NLMSG_ALIGNTO - 1) &^ (unix.NLMSG_ALIGNTO - 1) }

// probe returns an NLMSG_NOOP request with NLM_F_ACK: the kernel acknowledges
// it after everything sent before, which resynchronises the reader.
func (c *Conn) probe(seq uint32) []byte {
	var b [unix.SizeofNlMsghdr]byte
	putHdr(b[:], unix.SizeofNlMsghdr, unix.NLMSG_NOOP, unix.NLM_F_REQUEST|unix.NLM_F_ACK, seq, c.portID)
	return b[:]
}

// nlaTypeMask strips NLA_F_NESTED and NLA_F_NET_BYTEORDER from an attribute type.
const nlaTypeMask = ^uint16(unix.NLA_F_NESTED | unix.NLA_F_NET_BYTEORDER)
