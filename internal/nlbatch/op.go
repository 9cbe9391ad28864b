package nlbatch

import (
	"errors"
	"fmt"
	"math"
	"net"
	"net/netip"
	"strings"
)

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

// ErrInvalidOp is wrapped by the errors of operations that were rejected
// before anything was sent to the kernel.
var ErrInvalidOp = errors.New("invalid netlink operation")

// ErrResultUnknown is wrapped by the errors of operations whose outcome could
// not be learnt: the kernel may or may not have applied them (for example
// because replies were dropped when the socket's receive buffer overflowed).
var ErrResultUnknown = errors.New("result unknown")

// ErrClosed is reported for operations applied on a closed Conn.
var ErrClosed = errors.New("netlink connection closed")

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalidOp, fmt.Sprintf(format, args...))
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
	Err   error // a syscall.Errno (possibly wrapped with the kernel's message), or wraps ErrInvalidOp, ErrResultUnknown or ErrClosed
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
