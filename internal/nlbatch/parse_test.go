package nlbatch

import (
	"encoding/binary"
	"errors"
	"testing"

	"golang.org/x/sys/unix"
)

// nlErr builds an NLMSG_ERROR message. If req is nil the request header is
// capped (NLM_F_CAPPED); extMsg, if not empty, is added as an
// NLMSGERR_ATTR_MSG TLV.
func nlErr(seq, pid uint32, errno unix.Errno, req []byte, extMsg string) []byte {
	var flags uint16
	b := make([]byte, unix.SizeofNlMsghdr)
	b = append(b, negErrno(errno)...)
	if req == nil {
		flags |= unix.NLM_F_CAPPED
		var h [unix.SizeofNlMsghdr]byte
		putHdr(h[:], 60, unix.RTM_NEWNEIGH, unix.NLM_F_REQUEST, seq, pid)
		b = append(b, h[:]...)
	} else {
		b = append(b, req...)
		for len(b)%4 != 0 {
			b = append(b, 0)
		}
	}
	if extMsg != "" {
		flags |= unix.NLM_F_ACK_TLVS
		b = appendAttr(b, unix.NLMSGERR_ATTR_OFFS, []byte{0, 0, 0, 0})
		b = appendAttr(b, unix.NLMSGERR_ATTR_MSG, append([]byte(extMsg), 0))
	}
	putHdr(b, uint32(len(b)), unix.NLMSG_ERROR, flags, seq, pid)
	return b
}

func nlMsg(typ uint16, seq, pid uint32, payload []byte) []byte {
	b := make([]byte, unix.SizeofNlMsghdr, unix.SizeofNlMsghdr+len(payload))
	b = append(b, payload...)
	putHdr(b, uint32(len(b)), typ, 0, seq, pid)
	return b
}

// TestHandleReplies feeds synthetic datagrams with several messages each:
// replies must be matched by sequence number, and messages of other ports,
// other sequence numbers and other types ignored.
func TestHandleReplies(t *testing.T) {
	const pid, first = 4242, 100
	c := &Conn{portID: pid}
	c.absentOK = []bool{false, false, true, true, false} // neigh set, fdb set, fdb del, neigh del, neigh set
	c.errs = make([]error, 5)
	c.seen = make([]bool, 5)
	st := &batchState{first: first, n: 5}

	orig := make([]byte, unix.SizeofNlMsghdr+unix.SizeofNdMsg)
	putHdr(orig, uint32(len(orig)), unix.RTM_NEWNEIGH, unix.NLM_F_REQUEST, first, pid)

	var dgram []byte
	for _, m := range [][]byte{
		nlErr(first, pid, unix.EINVAL, orig, "bad thing"),        // uncapped, with TLVs
		nlErr(first+1, pid, unix.ENODEV, nil, "unknown ifindex"), // capped, with TLVs
		nlErr(first+2, 999, unix.EPERM, nil, ""),                 // other port
		nlErr(first-50, pid, unix.EEXIST, nil, ""),               // stale
		nlErr(first+5, pid, unix.EEXIST, nil, ""),                // beyond the batch
		nlMsg(unix.NLMSG_NOOP, first+2, pid, nil),                // ignored type
		nlMsg(unix.RTM_NEWNEIGH, first+2, pid, make([]byte, 12)), // ignored type
		nlErr(first+2, pid, unix.ENOENT, nil, ""),                // absent on delete: fine
		nlErr(first+3, pid, unix.ESRCH, nil, ""),                 // absent on delete: fine
	} {
		dgram = append(dgram, m...)
	}
	if c.handleReplies(dgram, st) {
		t.Fatal("batch done before the reply to its last request")
	}
	// The last request's reply, after an NLMSG_DONE carrying an error.
	done := nlMsg(unix.NLMSG_DONE, first+4, 999, binary.NativeEndian.AppendUint32(nil, 0))
	ack := nlErr(first+4, pid, 0, nil, "")
	if !c.handleReplies(append(done, ack...), st) {
		t.Fatal("final ACK did not end the batch")
	}

	var ke *KernelError
	if !errors.As(c.errs[0], &ke) || ke.Errno != unix.EINVAL || ke.Msg != "bad thing" {
		t.Errorf("errs[0] = %v, want EINVAL with the kernel's message", c.errs[0])
	}
	if !errors.Is(c.errs[1], unix.ENODEV) || c.errs[1].Error() != "no such device (kernel: unknown ifindex)" {
		t.Errorf("errs[1] = %v", c.errs[1])
	}
	for p := 2; p < 5; p++ {
		if c.errs[p] != nil {
			t.Errorf("errs[%d] = %v, want nil", p, c.errs[p])
		}
	}
	for p, seen := range c.seen {
		if !seen {
			t.Errorf("reply %d not marked as seen", p)
		}
	}

	// NLMSG_DONE with an error for a request of the batch, and a failed
	// last request: the error ends the batch too.
	clear(c.errs)
	clear(c.seen)
	st = &batchState{first: first, n: 5}
	if c.handleReplies(nlMsg(unix.NLMSG_DONE, first, pid, negErrno(unix.EBUSY)), st) {
		t.Fatal("done too early")
	}
	if !errors.Is(c.errs[0], unix.EBUSY) {
		t.Errorf("errs[0] = %v, want EBUSY", c.errs[0])
	}
	if !c.handleReplies(nlErr(first+4, pid, unix.EINVAL, nil, ""), st) || c.errs[4] != unix.EINVAL {
		t.Errorf("failed last request: errs[4] = %v", c.errs[4])
	}

	// Once replies were lost, only a probe's ACK ends the batch.
	clear(c.errs)
	clear(c.seen)
	st = &batchState{first: first, n: 5, lost: unix.ENOBUFS, probes: 2, probeLo: 200, probeHi: 201}
	if c.handleReplies(nlErr(first+4, pid, 0, nil, ""), st) {
		t.Fatal("last request's ACK ended a batch with lost replies")
	}
	if !c.handleReplies(nlErr(200, pid, 0, nil, ""), st) {
		t.Fatal("probe ACK did not end the batch")
	}
}

func negErrno(e unix.Errno) []byte {
	v := -int32(e)
	return binary.NativeEndian.AppendUint32(nil, uint32(v))
}
