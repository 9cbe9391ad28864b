package nlbatch

import (
	"encoding/binary"
	"errors"
	"net"
	"net/netip"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"golang.org/x/sys/unix"
)

// exchangeOne sends one hand-made request through c's transport and
// returns the kernel's verdict on it.
func exchangeOne(t *testing.T, c *Conn, req []byte) error {
	t.Helper()
	c.mu.Lock()
	defer c.mu.Unlock()
	c.absentOK = append(c.absentOK[:0], false)
	sendErr, lost := c.exchange(req)
	if sendErr != nil || lost != nil {
		t.Fatalf("exchange: send %v, lost %v", sendErr, lost)
	}
	return c.errs[0]
}

// wantKernelError checks that err is a *KernelError (of errno unless 0)
// whose message contains msg and, with attr != 0, blames attribute attr at
// its offset in req.
func wantKernelError(t *testing.T, err error, errno unix.Errno, msg string, req []byte, attr uint16) *KernelError {
	t.Helper()
	var ke *KernelError
	if !errors.As(err, &ke) || errno != 0 && !errors.Is(err, errno) {
		t.Fatalf("got %v (%T), want %v as a *KernelError", err, err, errno)
	}
	if !strings.Contains(ke.Msg, msg) {
		t.Errorf("kernel message %q, want it to contain %q", ke.Msg, msg)
	}
	if attr != 0 {
		if ke.Attr != attr || ke.Offset < unix.SizeofNlMsghdr || ke.Offset+4 > len(req) ||
			binary.NativeEndian.Uint16(req[ke.Offset+2:]) != attr {
			t.Errorf("blamed attribute type %d at offset %d, want type %d at its offset in the request", ke.Attr, ke.Offset, attr)
		}
	}
	t.Logf("%v", err)
	return ke
}

// TestRouteExtAck: the route family's refusals carry the kernel's extended
// ack: its message through Apply (an FDB entry on a link that does not
// exist), and the offending attribute of a request whose attribute fails
// the kernel's policy (a neighbour with an NDA_PROBES of two bytes).
func TestRouteExtAck(t *testing.T) {
	e := newEnv(t, envOpts{})
	err := e.conn.Apply([]Op{fdbSet(badIfindex, peerMAC(1), vtep4(1))})
	wantKernelError(t, err, unix.ENODEV, "ifindex", nil, 0)

	// A neighbour entry, with a short NDA_PROBES (a u32).
	op := neighSet(e.link, peerIP(2), peerMAC(2))
	ip, vtep, err := op.normalize()
	if err != nil {
		t.Fatal(err)
	}
	req := e.conn.appendMsg(nil, &op, ip, vtep)
	req = appendAttr(req, unix.NDA_PROBES, []byte{0, 1})
	binary.NativeEndian.PutUint32(req, uint32(len(req)))
	ke := wantKernelError(t, exchangeOne(t, e.conn, req), 0, "", req, unix.NDA_PROBES)
	if ke.Msg == "" {
		t.Errorf("no kernel message with the blamed attribute")
	}
	if len(e.neighbours(t)) != 0 {
		t.Error("the refused neighbour entry is in the kernel")
	}
}

// TestXfrmExtAck: the xfrm family's refusals carry the kernel's extended
// ack: its message for a policy whose selector is invalid (an IPv4
// selector with a 64-bit prefix), and the offending attribute of a policy
// with a short XFRMA_MARK.
func TestXfrmExtAck(t *testing.T) {
	c, h := openXfrmInNewNS(t)
	bad := testPolicy(1)
	bad.Dst = &net.IPNet{IP: netip.MustParseAddr("192.0.2.1").AsSlice(), Mask: net.CIDRMask(64, 128)}
	bad.Tmpls = nil
	var b XfrmBatch
	if err := b.SetPolicy(bad, false); err != nil {
		t.Fatal(err)
	}
	if err := b.SetPolicy(testPolicy(2), false); err != nil {
		t.Fatal(err)
	}
	errs, _ := c.Send(&b)
	wantKernelError(t, errs[0], unix.EINVAL, "prefix length", nil, 0)
	if errs[1] != nil {
		t.Fatalf("the policy after the refused one: %v", errs[1])
	}
	if n := len(dumpPolicies(t, h)); n != 1 {
		t.Fatalf("%d policies installed, want the valid one", n)
	}

	b.Reset()
	pol := testPolicy(3)
	info := nl.XfrmUserpolicyInfo{Priority: uint32(pol.Priority), Dir: uint8(pol.Dir), Action: uint8(pol.Action), Lft: infinite()}
	selector(&info.Sel, pol)
	start := b.begin(nl.XFRM_MSG_NEWPOLICY, unix.NLM_F_CREATE|unix.NLM_F_EXCL)
	b.msgs = append(b.msgs, info.Serialize()...)
	b.attr(nl.XFRMA_MARK, []byte{1, 0, 0, 0}) // struct xfrm_mark is 8 bytes
	b.end(start)
	req := b.msgs
	errs, _ = c.Send(&b)
	ke := wantKernelError(t, errs[0], 0, "", req, nl.XFRMA_MARK)
	if ke.Msg == "" {
		t.Errorf("no kernel message with the blamed attribute")
	}
	pols, err := h.XfrmPolicyList(netlink.FAMILY_ALL)
	if err != nil || len(pols) != 1 {
		t.Fatalf("after the refused policy: %d policies, %v", len(pols), err)
	}
}

// TestExtAckParse decodes crafted error replies: the blamed attribute is
// read from the request as sent (capped reply) or from the request the
// reply echoes (uncapped), offsets outside the request or in its header
// name no attribute, and a reply without TLVs is the bare errno.
func TestExtAckParse(t *testing.T) {
	req, start := beginMsg(nil, unix.RTM_NEWNEIGH, 0)
	req = append(req, make([]byte, unix.SizeofNdMsg)...)
	req = appendAttr(req, unix.NDA_LLADDR, make([]byte, 6))
	attrOff := len(req)
	req = appendAttr(req, unix.NDA_DST|unix.NLA_F_NET_BYTEORDER, make([]byte, 4))
	req = endMsg(req, start)

	reply := func(capped bool, offs uint32, msg string) []byte {
		b := make([]byte, unix.SizeofNlMsghdr)
		b = append(b, negErrno(unix.EINVAL)...)
		flags := uint16(unix.NLM_F_ACK_TLVS)
		if capped {
			flags |= unix.NLM_F_CAPPED
			b = append(b, req[:unix.SizeofNlMsghdr]...)
		} else {
			b = append(b, req...)
		}
		if msg != "" {
			b = appendAttr(b, unix.NLMSGERR_ATTR_MSG, append([]byte(msg), 0))
		}
		b = appendAttr(b, unix.NLMSGERR_ATTR_OFFS, binary.NativeEndian.AppendUint32(nil, offs))
		putHdr(b, uint32(len(b)), unix.NLMSG_ERROR, flags, 1, 1)
		return b
	}
	for _, tc := range []struct {
		name   string
		reply  []byte
		sent   []byte
		offset int
		attr   uint16
		text   string
	}{
		{"capped, request as sent", reply(true, uint32(attrOff), "bad address"), req, attrOff, unix.NDA_DST,
			"invalid argument (kernel: bad address; attribute type 1 at offset 40)"},
		{"capped, request unknown", reply(true, uint32(attrOff), ""), nil, attrOff, 0,
			"invalid argument (kernel: attribute at offset 40)"},
		{"uncapped, echoed request", reply(false, uint32(attrOff), ""), nil, attrOff, unix.NDA_DST,
			"invalid argument (kernel: attribute type 1 at offset 40)"},
		{"offset beyond the request", reply(true, 400, "m"), req, 400, 0,
			"invalid argument (kernel: m; attribute at offset 400)"},
		{"offset in the header", reply(true, 4, "m"), req, 0, 0, "invalid argument (kernel: m)"},
	} {
		err := kernelErr(unix.EINVAL, unix.NLMSG_ERROR, binary.NativeEndian.Uint16(tc.reply[6:]), tc.reply, tc.sent)
		var ke *KernelError
		if !errors.As(err, &ke) || ke.Offset != tc.offset || ke.Attr != tc.attr || err.Error() != tc.text {
			t.Errorf("%s: %#v %q, want offset %d attribute %d %q", tc.name, err, err, tc.offset, tc.attr, tc.text)
		}
		if !errors.Is(err, unix.EINVAL) {
			t.Errorf("%s: %v is not EINVAL", tc.name, err)
		}
	}
	// An offset in the header and no message: nothing to add to the errno.
	if err := kernelErr(unix.EINVAL, unix.NLMSG_ERROR, unix.NLM_F_ACK_TLVS|unix.NLM_F_CAPPED, reply(true, 4, ""), req); err != unix.EINVAL {
		t.Errorf("no message, no attribute: %#v, want the bare errno", err)
	}
	// Without NLM_F_ACK_TLVS the TLVs are not read.
	if err := kernelErr(unix.EINVAL, unix.NLMSG_ERROR, unix.NLM_F_CAPPED, reply(true, uint32(attrOff), "m"), req); err != unix.EINVAL {
		t.Errorf("without NLM_F_ACK_TLVS: %#v, want the bare errno", err)
	}
}
