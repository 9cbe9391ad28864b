package nlbatch

import (
	"encoding/binary"
	"errors"
	"fmt"
	"strings"

	"golang.org/x/sys/unix"
)

// The errors every family reports.

// ErrInvalidOp is wrapped by the errors of requests that were rejected
// before anything was sent to the kernel.
var ErrInvalidOp = errors.New("invalid netlink operation")

// ErrResultUnknown is wrapped by the errors of requests whose outcome could
// not be learnt: the kernel may or may not have applied them (for example
// because replies were dropped when the socket's receive buffer overflowed,
// or none came in time).
var ErrResultUnknown = errors.New("result unknown")

// ErrClosed is reported for requests sent on a closed Conn.
var ErrClosed = errors.New("netlink connection closed")

func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrInvalidOp, fmt.Sprintf(format, args...))
}

// KernelError is a request the kernel refused, with what its extended
// acknowledgement said about it. errors.Is(err, unix.EINVAL) and the like
// look at Errno. A refusal without an extended ack is reported as the bare
// unix.Errno.
type KernelError struct {
	Errno unix.Errno
	// Msg is the kernel's message (NLMSGERR_ATTR_MSG), if it gave one.
	Msg string
	// Offset is the byte offset in the request (from its netlink header)
	// of the attribute the kernel blamed (NLMSGERR_ATTR_OFFS); 0: none.
	Offset int
	// Attr is the type of that attribute (flags stripped), read from the
	// request as sent; 0 when there is none or Offset is not within it.
	Attr uint16
}

func (e *KernelError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%v (kernel: ", e.Errno)
	if e.Msg != "" {
		b.WriteString(e.Msg)
	}
	if e.Offset != 0 {
		if e.Msg != "" {
			b.WriteString("; ")
		}
		if e.Attr != 0 {
			fmt.Fprintf(&b, "attribute type %d at offset %d", e.Attr, e.Offset)
		} else {
			fmt.Fprintf(&b, "attribute at offset %d", e.Offset)
		}
	}
	b.WriteByte(')')
	return b.String()
}

// Unwrap returns e.Errno.
func (e *KernelError) Unwrap() error { return e.Errno }

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

// kernelErr is errno, the error of the reply msg (of type typ, header
// flags flags), with its extended ack when it has one: a *KernelError. req
// is the request as sent (nil if unknown), to name the blamed attribute.
//
// struct nlmsgerr is the errno and the request's header, followed (unless
// NLM_F_CAPPED) by the rest of the request; the ext-ack TLVs come after
// (NLM_F_ACK_TLVS).
func kernelErr(errno unix.Errno, typ, flags uint16, msg, req []byte) error {
	if typ != unix.NLMSG_ERROR || flags&unix.NLM_F_ACK_TLVS == 0 {
		return errno
	}
	const echo = unix.SizeofNlMsghdr + 4 // where the request's header starts
	off := echo + unix.SizeofNlMsghdr
	if off > len(msg) {
		return errno
	}
	if flags&unix.NLM_F_CAPPED == 0 {
		reqLen := int(binary.NativeEndian.Uint32(msg[echo:]))
		if reqLen < unix.SizeofNlMsghdr || echo+reqLen > len(msg) {
			return errno
		}
		if req == nil {
			req = msg[echo : echo+reqLen]
		}
		off = echo + nlmAlign(reqLen)
	}
	ke := KernelError{Errno: errno}
	forEachAttr(msg[min(off, len(msg)):], func(typ uint16, data []byte) bool {
		switch typ {
		case unix.NLMSGERR_ATTR_MSG:
			ke.Msg = strings.TrimRight(string(data), "\x00")
		case unix.NLMSGERR_ATTR_OFFS:
			if len(data) >= 4 {
				ke.Offset = int(binary.NativeEndian.Uint32(data))
			}
		}
		return true
	})
	if ke.Offset < unix.SizeofNlMsghdr {
		ke.Offset = 0 // the header is no attribute
	}
	if ke.Offset != 0 && ke.Offset+unix.SizeofNlAttr <= len(req) {
		ke.Attr = binary.NativeEndian.Uint16(req[ke.Offset+2:]) & nlaTypeMask
	}
	if ke.Msg == "" && ke.Offset == 0 {
		return errno
	}
	return &ke
}
