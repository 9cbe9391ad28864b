package nlbatch

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

// testPolicy is the i-th outbound policy of the tests: UDP to port 4799
// of 2001:db8:3::i (documentation addresses, selectors only in the test's
// namespace), with one ESP transport template.
func testPolicy(i int) *netlink.XfrmPolicy {
	dst := netip.AddrFrom16([16]byte{0x20, 0x01, 0x0d, 0xb8, 0, 3, 14: byte(i >> 8), 15: byte(i)})
	local := netip.MustParseAddr("2001:db8::a")
	return &netlink.XfrmPolicy{
		Src:      &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)},
		Dst:      &net.IPNet{IP: dst.AsSlice(), Mask: net.CIDRMask(128, 128)},
		Proto:    netlink.Proto(unix.IPPROTO_UDP),
		DstPort:  4799,
		Dir:      netlink.XFRM_DIR_OUT,
		Priority: 100,
		Action:   netlink.XFRM_POLICY_ALLOW,
		Tmpls: []netlink.XfrmPolicyTmpl{{Src: local.AsSlice(), Dst: dst.AsSlice(), Proto: netlink.XFRM_PROTO_ESP,
			Mode: netlink.XFRM_MODE_TRANSPORT, Spi: 0x1000 + i, Reqid: 0x0d}},
	}
}

func policyLine(p *netlink.XfrmPolicy) string {
	s := fmt.Sprintf("dir %v %v -> %v proto %d dport %d prio %d action %v", p.Dir, p.Src, p.Dst, p.Proto, p.DstPort, p.Priority, p.Action)
	if p.Mark != nil {
		s += fmt.Sprintf(" mark %#x/%#x", p.Mark.Value, p.Mark.Mask)
	}
	for _, t := range p.Tmpls {
		s += fmt.Sprintf(" tmpl %v -> %v proto %v mode %v spi %#x reqid %#x", t.Src, t.Dst, t.Proto, t.Mode, t.Spi, t.Reqid)
	}
	return s
}

func dumpPolicies(t *testing.T, h *netlink.Handle) []string {
	t.Helper()
	pols, err := h.XfrmPolicyList(netlink.FAMILY_V6)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for i := range pols {
		out = append(out, policyLine(&pols[i]))
	}
	slices.Sort(out)
	return out
}

// openXfrmInNewNS opens an xfrm Conn in a new namespace, and a netlink
// handle there to read what it did; both close when the test ends.
func openXfrmInNewNS(t *testing.T) (*Conn, *netlink.Handle) {
	t.Helper()
	nstest.RequireRoot(t)
	ns := nstest.NewNS(t, "xb")
	c, err := OpenXfrm(ns.Handle)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	h, err := netlink.NewHandleAt(ns.Handle, unix.NETLINK_XFRM)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Close)
	return c, h
}

// TestXfrmSendReportsEachRefusedRequest: requests sent together are applied
// in order, and the requests the kernel refuses, and only those, get an
// error, also across datagrams (more requests than XfrmBatchSize) and
// when the refused one is a datagram's last (the acknowledged one). What
// the batch installs is what netlink's own XfrmPolicyAdd installs.
func TestXfrmSendReportsEachRefusedRequest(t *testing.T) {
	c, h := openXfrmInNewNS(t)

	// The library's own encoding, as the reference.
	ref := testPolicy(0)
	if err := h.XfrmPolicyAdd(ref); err != nil {
		t.Fatal(err)
	}
	want := dumpPolicies(t, h)
	if err := h.XfrmPolicyDel(ref); err != nil {
		t.Fatal(err)
	}
	var b XfrmBatch
	if err := b.SetPolicy(ref, false); err != nil {
		t.Fatal(err)
	}
	if errs, sent := c.Send(&b); errs[0] != nil || sent != 1 {
		t.Fatalf("add: %v (%d datagrams)", errs, sent)
	}
	if got := dumpPolicies(t, h); !slices.Equal(got, want) {
		t.Fatalf("batched add installed\n%v\nnetlink's XfrmPolicyAdd\n%v", got, want)
	}

	// n adds; the ones at refused already exist (EEXIST), one of them the
	// last of the first datagram, one the very last request.
	n := 2*XfrmBatchSize + 7
	refused := []int{0, 5, XfrmBatchSize - 1, XfrmBatchSize + 3, n - 1}
	for _, i := range refused[1:] {
		if err := h.XfrmPolicyAdd(testPolicy(i)); err != nil {
			t.Fatal(err)
		}
	}
	b.Reset()
	for i := 0; i < n; i++ {
		if err := b.SetPolicy(testPolicy(i), false); err != nil {
			t.Fatal(err)
		}
	}
	errs, sent := c.Send(&b)
	if sent != 3 {
		t.Fatalf("%d requests went in %d datagrams, want 3", n, sent)
	}
	for i, err := range errs {
		if slices.Contains(refused, i) != (err != nil) {
			t.Fatalf("request %d: error %v; want errors for exactly %v", i, err, refused)
		}
		if err != nil && !errors.Is(err, unix.EEXIST) {
			t.Fatalf("request %d: %v, want EEXIST", i, err)
		}
	}
	if got := len(dumpPolicies(t, h)); got != n {
		t.Fatalf("%d policies installed, want %d", got, n)
	}

	// Updates and deletions in one datagram, in order: an update, the
	// deletion of every other policy, a deletion of one that is gone.
	b.Reset()
	upd := testPolicy(1)
	upd.Priority = 7
	if err := b.SetPolicy(upd, true); err != nil {
		t.Fatal(err)
	}
	for i := 2; i < n; i++ {
		b.DelPolicy(testPolicy(i))
	}
	b.DelPolicy(testPolicy(2))
	errs, _ = c.Send(&b)
	for i, err := range errs[:len(errs)-1] {
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
	}
	if last := errs[len(errs)-1]; !errors.Is(last, unix.ENOENT) {
		t.Fatalf("deleting a deleted policy: %v, want ENOENT", last)
	}
	got := dumpPolicies(t, h)
	if len(got) != 2 || got[1] != policyLine(upd) && got[0] != policyLine(upd) {
		t.Fatalf("after the update and deletions: %v", got)
	}
}

// TestXfrmSendStates: an SA add is one request whose outcome is its own,
// between policy requests that succeed. Where the kernel has no ESP (this
// machine), it is refused and the error says so; where it has (test/vm),
// the SA is installed as netlink's dump reads it back.
func TestXfrmSendStates(t *testing.T) {
	c, h := openXfrmInNewNS(t)
	src, dst := netip.MustParseAddr("192.0.2.1"), netip.MustParseAddr("192.0.2.2")
	st := &netlink.XfrmState{
		Src: src.AsSlice(), Dst: dst.AsSlice(), Proto: netlink.XFRM_PROTO_ESP, Mode: netlink.XFRM_MODE_TRANSPORT,
		Spi: 0x12345, Reqid: 0x0d, ReplayWindow: 64, ESN: true,
		Aead: &netlink.XfrmStateAlgo{Name: "rfc4106(gcm(aes))", Key: make([]byte, 20), ICVLen: 128},
		Selector: &netlink.XfrmPolicy{Src: &net.IPNet{IP: src.AsSlice(), Mask: net.CIDRMask(32, 32)},
			Dst: &net.IPNet{IP: dst.AsSlice(), Mask: net.CIDRMask(32, 32)}, Proto: netlink.Proto(unix.IPPROTO_UDP), DstPort: 4799},
	}
	var b XfrmBatch
	if err := b.SetPolicy(testPolicy(1), false); err != nil {
		t.Fatal(err)
	}
	if err := b.AddState(st); err != nil {
		t.Fatal(err)
	}
	if err := b.SetPolicy(testPolicy(2), false); err != nil {
		t.Fatal(err)
	}
	errs, _ := c.Send(&b)
	if errs[0] != nil || errs[2] != nil {
		t.Fatalf("policies around the SA: %v", errs)
	}
	if len(dumpPolicies(t, h)) != 2 {
		t.Fatal("the policies around the SA are not installed")
	}
	states, err := h.XfrmStateList(netlink.FAMILY_ALL)
	if err != nil {
		t.Fatal(err)
	}
	if errs[1] != nil {
		if !errors.Is(errs[1], unix.ENOSYS) && !errors.Is(errs[1], unix.EPROTONOSUPPORT) && !errors.Is(errs[1], unix.ENOENT) {
			t.Fatalf("SA add refused with %v, want the kernel's no-ESP error", errs[1])
		}
		if len(states) != 0 {
			t.Fatalf("refused SA installed: %d states", len(states))
		}
		t.Logf("this kernel has no ESP: %v", errs[1])
		return
	}
	if len(states) != 1 {
		t.Fatalf("%d states, want 1", len(states))
	}
	// The reference: the same SA (another SPI) added by netlink's own
	// XfrmStateAdd must read back the same.
	lib := *st
	lib.Spi = 0x23456
	if err := h.XfrmStateAdd(&lib); err != nil {
		t.Fatal(err)
	}
	if states, err = h.XfrmStateList(netlink.FAMILY_ALL); err != nil || len(states) != 2 {
		t.Fatalf("after netlink's add: %d states, %v", len(states), err)
	}
	line := func(s *netlink.XfrmState) string {
		return fmt.Sprintf("%v -> %v proto %v mode %v reqid %#x replay %d esn %v aead %v sel %v -> %v proto %d dport %d lft %+v",
			s.Src, s.Dst, s.Proto, s.Mode, s.Reqid, s.ReplayWindow, s.ESN, s.Aead, s.Selector.Src, s.Selector.Dst, s.Selector.Proto, s.Selector.DstPort, s.Limits)
	}
	if s0, s1 := line(&states[0]), line(&states[1]); s0 != s1 || states[0].Spi == states[1].Spi {
		t.Fatalf("batched and netlink's SA differ:\n%s\n%s", s0, s1)
	}
	if err := h.XfrmStateDel(&lib); err != nil {
		t.Fatal(err)
	}
	// Deleting it, and again: the second is refused alone.
	b.Reset()
	b.DelState(st)
	b.DelState(st)
	errs, _ = c.Send(&b)
	if errs[0] != nil || !errors.Is(errs[1], unix.ESRCH) {
		t.Fatalf("deleting twice: %v, want nil then ESRCH", errs)
	}
}

// TestXfrmSendLostReplies: when the error replies of a datagram overflow
// the receive buffer, the requests without a reply are reported as
// ErrResultUnknown, the datagrams after it are not sent, and the Conn
// works normally afterwards.
func TestXfrmSendLostReplies(t *testing.T) {
	c, h := openXfrmInNewNS(t)
	n := 2 * XfrmBatchSize
	var b XfrmBatch
	for i := range n {
		if err := b.SetPolicy(testPolicy(i), false); err != nil {
			t.Fatal(err)
		}
	}
	if errs, _ := c.Send(&b); errors.Join(errs...) != nil {
		t.Fatal(errors.Join(errs...))
	}
	// The same adds again: every one is refused (EEXIST), and the replies
	// do not fit a minimal receive buffer.
	if err := unix.SetsockoptInt(c.fd, unix.SOL_SOCKET, unix.SO_RCVBUF, 0); err != nil {
		t.Fatal(err)
	}
	errs, sent := c.Send(&b)
	if sent != 1 {
		t.Errorf("%d datagrams sent, want 1: none after the one whose replies were lost", sent)
	}
	unknown := 0
	for i, err := range errs {
		switch {
		case errors.Is(err, ErrResultUnknown):
			unknown++
		case !errors.Is(err, unix.EEXIST):
			t.Fatalf("request %d: %v, want EEXIST or ErrResultUnknown", i, err)
		case i >= XfrmBatchSize:
			t.Fatalf("request %d of an unsent datagram: %v", i, err)
		}
	}
	if unknown < XfrmBatchSize {
		t.Fatalf("%d requests of unknown outcome, want at least the %d not sent", unknown, XfrmBatchSize)
	}
	t.Logf("%d of %d requests of unknown outcome: %v", unknown, n, errs[n-1])

	if err := unix.SetsockoptInt(c.fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, wantRcvBuf); err != nil {
		t.Fatal(err)
	}
	b.Reset()
	for i := range n {
		b.DelPolicy(testPolicy(i))
	}
	if errs, _ := c.Send(&b); errors.Join(errs...) != nil {
		t.Fatal(errors.Join(errs...))
	}
	if got := dumpPolicies(t, h); len(got) != 0 {
		t.Fatalf("%d policies left", len(got))
	}
}

// TestFamilies: a Conn takes only its own family's requests, and none
// once closed.
func TestFamilies(t *testing.T) {
	x, _ := openXfrmInNewNS(t)
	e := newEnv(t, envOpts{})
	var b XfrmBatch
	b.DelPolicy(testPolicy(1))
	if errs, sent := e.conn.Send(&b); sent != 0 || !errors.Is(errs[0], ErrInvalidOp) {
		t.Errorf("xfrm batch on a route Conn: %v (%d sent), want ErrInvalidOp", errs, sent)
	}
	if err := x.Apply([]Op{neighDel(e.link, peerIP(1))}); !errors.Is(err, ErrInvalidOp) {
		t.Errorf("route ops on an xfrm Conn: %v, want ErrInvalidOp", err)
	}
	if x.BatchSize() != XfrmBatchSize || e.conn.BatchSize() != DefaultBatchSize {
		t.Errorf("batch sizes %d (xfrm), %d (route), want %d and %d", x.BatchSize(), e.conn.BatchSize(), XfrmBatchSize, DefaultBatchSize)
	}
	if err := x.Close(); err != nil {
		t.Fatal(err)
	}
	if errs, sent := x.Send(&b); sent != 0 || !errors.Is(errs[0], ErrClosed) {
		t.Errorf("Send on a closed Conn: %v (%d sent), want ErrClosed", errs, sent)
	}
}
