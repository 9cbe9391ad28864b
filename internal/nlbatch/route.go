package nlbatch

import (
	"encoding/binary"
	"fmt"
	"math"
	"net"
	"net/netip"
	"slices"
	"strings"

	"golang.org/x/sys/unix"
)

// The route family (NETLINK_ROUTE): permanent neighbour entries and VXLAN
// FDB "self" entries, given as Ops to Conn.Apply and encoded into the
// Conn's datagram as they are sent.

// Kind is the kind of a netlink operation.
type Kind uint8

const (
	// NeighSet creates or replaces a permanent neighbour entry IP → MAC on
	// a link (RTM_NEWNEIGH, NLM_F_CREATE|NLM_F_REPLACE, AF_INET or AF_INET6
	// by the IP, NUD_PERMANENT, NDA_DST=IP, NDA_LLADDR=MAC).
	NeighSet Kind = iota + 1
	// NeighDel deletes the neighbour entry of IP on a link (RTM_DELNEIGH).
	// The kernel ignores the MAC for deletes: whatever entry IP has goes.
	NeighDel
	// FDBSet creates or replaces a permanent VXLAN FDB "self" entry
	// MAC → VTEP (RTM_NEWNEIGH, NLM_F_CREATE|NLM_F_REPLACE, AF_BRIDGE,
	// NTF_SELF, NUD_PERMANENT, NDA_LLADDR=MAC, NDA_DST=VTEP).
	FDBSet
	// FDBDel deletes the VXLAN FDB "self" entry of MAC whose destination is
	// VTEP (RTM_DELNEIGH, AF_BRIDGE, NTF_SELF, NDA_LLADDR, NDA_DST). The
	// kernel deletes nothing, and reports success, when the entry's
	// destination is another address.
	FDBDel
)

// String returns the kind as "neigh set", "neigh del", "fdb set" or "fdb del".
func (k Kind) String() string {
	switch k {
	case NeighSet:
		return "neigh set"
	case NeighDel:
		return "neigh del"
	case FDBSet:
		return "fdb set"
	case FDBDel:
		return "fdb del"
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// Op is one neighbour or FDB operation.
//
// IPv4-mapped IPv6 addresses (::ffff:a.b.c.d) in IP and VTEP are treated as
// the IPv4 addresses they map; zones are ignored.
type Op struct {
	Kind      Kind
	LinkIndex int
	IP        netip.Addr // NeighSet, NeighDel: the neighbour's address
	MAC       [6]byte    // NeighSet: link-layer address; FDBSet, FDBDel: the FDB entry's MAC
	VTEP      netip.Addr // FDBSet, FDBDel: the remote VTEP (NDA_DST)
}

// String describes the operation, for example
// "neigh set 192.0.2.5 lladdr 02:42:c0:00:02:05 on ifindex 7".
func (o Op) String() string {
	var b strings.Builder
	b.WriteString(o.Kind.String())
	switch o.Kind {
	case NeighSet:
		fmt.Fprintf(&b, " %s lladdr %s", addrString(o.IP), net.HardwareAddr(o.MAC[:]))
	case NeighDel:
		fmt.Fprintf(&b, " %s", addrString(o.IP))
	case FDBSet, FDBDel:
		fmt.Fprintf(&b, " %s dst %s self", net.HardwareAddr(o.MAC[:]), addrString(o.VTEP))
	default:
		fmt.Fprintf(&b, " ip %s lladdr %s vtep %s", addrString(o.IP), net.HardwareAddr(o.MAC[:]), addrString(o.VTEP))
	}
	fmt.Fprintf(&b, " on ifindex %d", o.LinkIndex)
	return b.String()
}

func addrString(a netip.Addr) string {
	if !a.IsValid() {
		return "<no address>"
	}
	return a.String()
}

// normalize validates o and returns its addresses in the form sent to the
// kernel.
func (o Op) normalize() (ip, vtep netip.Addr, err error) {
	switch o.Kind {
	case NeighSet, NeighDel, FDBSet, FDBDel:
	default:
		return ip, vtep, invalid("unknown kind %d", uint8(o.Kind))
	}
	if o.LinkIndex <= 0 || o.LinkIndex > math.MaxInt32 {
		return ip, vtep, invalid("link index %d out of range", o.LinkIndex)
	}
	switch o.Kind {
	case NeighSet, NeighDel:
		ip, err = checkAddr("IP", o.IP)
	case FDBSet, FDBDel:
		vtep, err = checkAddr("VTEP", o.VTEP)
	}
	return ip, vtep, err
}

func checkAddr(what string, a netip.Addr) (netip.Addr, error) {
	if !a.IsValid() {
		return a, invalid("no %s address", what)
	}
	a = a.Unmap().WithZone("")
	if a.IsUnspecified() {
		return a, invalid("unspecified %s address %s", what, a)
	}
	return a, nil
}

// OpError is the failure of one operation.
type OpError struct {
	Index int   // index of Op in the slice given to Apply
	Op    Op    // the operation
	Err   error // a unix.Errno, or a *KernelError (the errno with the kernel's extended ack), or wraps ErrInvalidOp, ErrResultUnknown or ErrClosed
}

func (e OpError) Error() string { return fmt.Sprintf("%v: %v", e.Op, e.Err) }

// Unwrap returns e.Err.
func (e OpError) Unwrap() error { return e.Err }

// Error lists the operations of one Apply call that failed, in the order of
// their indexes.
type Error struct {
	Failed []OpError
	Total  int // number of operations given to Apply
}

// maxListed caps the number of failures that Error.Error spells out.
const maxListed = 5

func (e *Error) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d of %d netlink operations failed: ", len(e.Failed), e.Total)
	for i, f := range e.Failed {
		if i == maxListed {
			fmt.Fprintf(&b, "; and %d more", len(e.Failed)-maxListed)
			break
		}
		if i > 0 {
			b.WriteString("; ")
		}
		b.WriteString(f.Error())
	}
	return b.String()
}

// Unwrap returns the errors of the failed operations, so that errors.Is and
// errors.As look into them.
func (e *Error) Unwrap() []error {
	errs := make([]error, len(e.Failed))
	for i := range e.Failed {
		errs[i] = e.Failed[i]
	}
	return errs
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

	if err := c.usable(unix.NETLINK_ROUTE); err != nil {
		for i := range ops {
			fail(i, err)
		}
		return opsResult(failed, len(ops))
	}

	batch := c.effectiveBatch()
	c.sbuf = c.sbuf[:0]
	c.idx = c.idx[:0]
	c.absentOK = c.absentOK[:0]
	for i := range ops {
		ip, vtep, err := ops[i].normalize()
		if err != nil {
			fail(i, err)
			continue
		}
		if len(c.idx) > 0 && len(c.sbuf)+maxMsgLen > c.maxBytes {
			c.flushRoute(fail)
		}
		c.sbuf = c.appendMsg(c.sbuf, &ops[i], ip, vtep)
		c.idx = append(c.idx, i)
		// Deleting what does not exist counts as success.
		c.absentOK = append(c.absentOK, ops[i].Kind == NeighDel || ops[i].Kind == FDBDel)
		if len(c.idx) >= batch {
			c.flushRoute(fail)
		}
	}
	if len(c.idx) > 0 {
		c.flushRoute(fail)
	}
	return opsResult(failed, len(ops))
}

func opsResult(failed []OpError, total int) error {
	if len(failed) == 0 {
		return nil
	}
	slices.SortStableFunc(failed, func(a, b OpError) int { return a.Index - b.Index })
	return &Error{Failed: failed, Total: total}
}

// flushRoute sends the batch in c.sbuf and reports its failures through
// fail. It empties the batch.
func (c *Conn) flushRoute(fail func(int, error)) {
	sendErr, lost := c.exchange(c.sbuf)
	for p, i := range c.idx {
		switch {
		case sendErr != nil:
			// The kernel refused the datagram as a whole: nothing was applied.
			fail(i, sendErr)
		case c.errs[p] != nil:
			fail(i, c.errs[p])
		case lost != nil && !c.seen[p]:
			fail(i, lost)
		}
	}
	c.sbuf = c.sbuf[:0]
	c.idx = c.idx[:0]
	c.absentOK = c.absentOK[:0]
}

// maxMsgLen is the longest request appendMsg produces: header, ndmsg, an
// IPv6 NDA_DST and NDA_LLADDR.
const maxMsgLen = unix.SizeofNlMsghdr + unix.SizeofNdMsg +
	unix.SizeofRtAttr + 16 + // NDA_DST (IPv6)
	unix.SizeofRtAttr + 8 // NDA_LLADDR (6 bytes, padded)

// appendMsg appends the request for op (already validated; ip and vtep are
// its normalised addresses) to b.
func (c *Conn) appendMsg(b []byte, op *Op, ip, vtep netip.Addr) []byte {
	var (
		typ    uint16
		flags  uint16
		family uint8
		state  uint16
		ndf    uint8
	)
	switch op.Kind {
	case NeighSet:
		typ, flags, family, state = unix.RTM_NEWNEIGH, unix.NLM_F_CREATE|unix.NLM_F_REPLACE, addrFamily(ip), unix.NUD_PERMANENT
	case NeighDel:
		typ, family = unix.RTM_DELNEIGH, addrFamily(ip)
	case FDBSet:
		typ, flags, family, state, ndf = unix.RTM_NEWNEIGH, unix.NLM_F_CREATE|unix.NLM_F_REPLACE, unix.AF_BRIDGE, unix.NUD_PERMANENT, unix.NTF_SELF
	case FDBDel:
		typ, family, ndf = unix.RTM_DELNEIGH, unix.AF_BRIDGE, unix.NTF_SELF
	}
	b, start := beginMsg(b, typ, flags)
	// struct ndmsg
	var nd [unix.SizeofNdMsg]byte
	nd[0] = family
	binary.NativeEndian.PutUint32(nd[4:], uint32(int32(op.LinkIndex)))
	binary.NativeEndian.PutUint16(nd[8:], state)
	nd[10] = ndf
	b = append(b, nd[:]...)

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
	return endMsg(b, start)
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
