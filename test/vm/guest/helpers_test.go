package guest

import (
	"net"
	"net/netip"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/encryption"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

const vxlanPort = 4799

var secret = []byte("vm test cluster secret, 32 bytes")

// requireESP skips unless this kernel can do ESP: these tests are meant to
// run in the VM that test/vm boots (Debian's kernel), not on a host kernel
// without ESP/AEAD.
func requireESP(t *testing.T) {
	t.Helper()
	nstest.RequireRoot(t)
	if err := encryption.CheckKernelSupport(); err != nil {
		t.Skipf("needs a kernel with ESP/AEAD (run through test/vm): %v", err)
	}
}

// host is one overlay host: its namespace, Programmer, desired state and a
// "container" namespace holding the VXLAN link of the encrypted VNI.
type host struct {
	ns        *nstest.NS
	addr      netip.Addr
	prog      *encryption.Programmer
	want      encryption.Desired
	container *nstest.NS
	inner     netip.Addr
}

// newPair builds two hosts joined by an underlay, each with a Programmer
// applied for the other and an encrypted VXLAN (VNI vni) whose link lives
// in a container namespace (created from the host namespace, so its UDP
// socket stays in the host namespace, as the driver does).
func newPair(t *testing.T, vni uint32) [2]*host {
	t.Helper()
	nss, addrs := nstest.Hosts(t, 2, false)
	var hs [2]*host
	for i := range hs {
		p, err := encryption.NewProgrammer(nss[i].Handle)
		if err != nil {
			t.Fatalf("programmer: %v", err)
		}
		t.Cleanup(func() { p.Close() })
		hs[i] = &host{ns: nss[i], addr: addrs[i], prog: p, inner: netip.AddrFrom4([4]byte{198, 51, 100, byte(1 + i)})}
		hs[i].want = encryption.Desired{
			Local: addrs[i], Port: vxlanPort, VNIs: []uint32{vni}, Remotes: []netip.Addr{addrs[1-i]},
			RemoteGens: map[netip.Addr]uint64{addrs[1-i]: uint64(101 + 1 - i)},
			Accept:     []uint32{1}, Send: 1, Gen: uint64(101 + i), Secret: secret,
		}
	}
	for i, h := range hs {
		if err := h.prog.Apply(h.want); err != nil {
			t.Fatalf("host %d: apply: %v", i, err)
		}
		if d := h.prog.Audit(h.want); len(d) != 0 {
			t.Fatalf("host %d: audit after apply: %v", i, d)
		}
		h.container = nstest.NewNS(t, "c"+string(rune('0'+i)))
		eth0, err := h.ns.NL.LinkByName("eth0")
		if err != nil {
			t.Fatal(err)
		}
		vx := &netlink.Vxlan{
			LinkAttrs: netlink.LinkAttrs{Name: "vx", MTU: encryption.InnerMTU(1500, false), Namespace: netlink.NsFd(int(h.container.Handle))},
			VxlanId:   int(vni), Port: vxlanPort, SrcAddr: h.addr.AsSlice(), VtepDevIndex: eth0.Attrs().Index,
			Learning: false,
		}
		if err := h.ns.NL.LinkAdd(vx); err != nil {
			t.Fatalf("host %d: vxlan: %v", i, err)
		}
		l, err := h.container.NL.LinkByName("vx")
		if err != nil {
			t.Fatalf("host %d: vxlan in container: %v", i, err)
		}
		if err := h.container.NL.AddrAdd(l, &netlink.Addr{IPNet: &net.IPNet{IP: h.inner.AsSlice(), Mask: net.CIDRMask(24, 32)}}); err != nil {
			t.Fatal(err)
		}
		if err := h.container.NL.LinkSetUp(l); err != nil {
			t.Fatal(err)
		}
		fdb := &netlink.Neigh{
			LinkIndex: l.Attrs().Index, Family: unix.AF_BRIDGE, Flags: netlink.NTF_SELF, State: netlink.NUD_PERMANENT,
			HardwareAddr: make(net.HardwareAddr, 6), IP: hs[1-i].addr.AsSlice(),
		}
		if err := h.container.NL.NeighAppend(fdb); err != nil {
			t.Fatalf("host %d: fdb: %v", i, err)
		}
	}
	return hs
}

// ourXfrm returns the SAs and policies with overlayd's reqid in ns.
func ourXfrm(t *testing.T, ns *nstest.NS) (states, policies int) {
	t.Helper()
	h, err := netlink.NewHandleAt(ns.Handle, unix.NETLINK_XFRM)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	ss, err := h.XfrmStateList(netlink.FAMILY_ALL)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range ss {
		if s.Reqid == encryption.ReqID {
			states++
		}
	}
	ps, err := h.XfrmPolicyList(netlink.FAMILY_ALL)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range ps {
		for _, tm := range p.Tmpls {
			if tm.Reqid == encryption.ReqID {
				policies++
			}
		}
	}
	return states, policies
}
