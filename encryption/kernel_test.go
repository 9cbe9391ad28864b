package encryption

import (
	"encoding/binary"
	"errors"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/google/nftables/userdata"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

// Kernel tests run on any kernel, as root, in throwaway namespaces. On a
// kernel without ESP/AEAD (this project's workplace) they check the
// unsupported path: policies and rules programmed, SAs reported missing,
// traffic of encrypted VNIs dropped both ways. In the VM that test/vm boots
// (Debian's kernel) the same tests check the supported path.

var (
	supportOnce sync.Once
	supportErr  error
)

func espSupported(t *testing.T) bool {
	t.Helper()
	supportOnce.Do(func() { supportErr = CheckKernelSupport() })
	return supportErr == nil
}

func TestCheckKernelSupport(t *testing.T) {
	nstest.RequireRoot(t)
	err := CheckKernelSupport()
	if os.Getenv("OVERLAYD_VM_GUEST") != "" && err != nil {
		t.Fatalf("the VM's kernel must support ESP: %v", err)
	}
	if err == nil {
		t.Log("this kernel can install ESP/AEAD states")
		return
	}
	t.Logf("this kernel cannot: %v", err)
	if !errors.Is(err, ErrKernelUnsupported) {
		t.Fatalf("error does not wrap ErrKernelUnsupported: %v", err)
	}
	for _, want := range []string{"kernel cannot install ESP/AEAD states (rfc4106(gcm(aes)))", "esp4", "GCM"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
}

// dumpOurs dumps overlayd's SAs and policies in ns.
func dumpOurs(t *testing.T, ns *nstest.NS) ([]netlink.XfrmState, []netlink.XfrmPolicy) {
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
	var states []netlink.XfrmState
	for _, s := range ss {
		if s.Reqid == ReqID {
			states = append(states, s)
		}
	}
	// Per family: a dump of all families cannot tell 0.0.0.0/0 from ::/0.
	var ps []netlink.XfrmPolicy
	for _, fam := range []int{netlink.FAMILY_V4, netlink.FAMILY_V6} {
		p, err := h.XfrmPolicyList(fam)
		if err != nil {
			t.Fatal(err)
		}
		ps = append(ps, p...)
	}
	var pols []netlink.XfrmPolicy
	for _, p := range ps {
		if ours(&p) {
			pols = append(pols, p)
		}
	}
	return states, pols
}

// remotePolicies returns the policies of pols that have a template (the
// per-remote ones), and whether the clear policy is among them.
func remotePolicies(pols []netlink.XfrmPolicy) (remote []netlink.XfrmPolicy, clear bool) {
	for _, p := range pols {
		if len(p.Tmpls) > 0 {
			remote = append(remote, p)
		} else if p.Mark != nil && p.Mark.Value == ClearMark {
			clear = true
		}
	}
	return remote, clear
}

// nftView is what the nftables dump shows of our table.
type nftView struct {
	exists bool
	vnis   map[uint32]bool     // encrypted_vnis
	clear  map[uint32]bool     // clear_vnis
	rules  map[string][]string // chain -> rule comments
	count  map[string]uint64   // chain -> counter packets
}

func nftDumpView(t *testing.T, ns *nstest.NS) nftView {
	t.Helper()
	c, err := nftables.New(nftables.WithNetNSFd(int(ns.Handle)))
	if err != nil {
		t.Fatal(err)
	}
	v := nftView{vnis: map[uint32]bool{}, clear: map[uint32]bool{}, rules: map[string][]string{}, count: map[string]uint64{}}
	tables, err := c.ListTablesOfFamily(nftables.TableFamilyINet)
	if err != nil {
		t.Fatal(err)
	}
	for _, tb := range tables {
		if tb.Name == TableName {
			v.exists = true
		}
	}
	if !v.exists {
		return v
	}
	for name, m := range map[string]map[uint32]bool{SetName: v.vnis, ClearSetName: v.clear} {
		set, err := c.GetSetByName(table, name)
		if err != nil {
			t.Fatal(err)
		}
		elems, err := c.GetSetElements(set)
		if err != nil {
			t.Fatal(err)
		}
		for _, e := range elems {
			x, _ := vniFromKey(e.Key)
			m[x] = true
		}
	}
	chains, err := c.ListChainsOfTableFamily(nftables.TableFamilyINet)
	if err != nil {
		t.Fatal(err)
	}
	for _, ch := range chains {
		if ch.Table.Name != TableName {
			continue
		}
		rules, err := c.GetRules(table, ch)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range rules {
			tag, _ := userdata.GetString(r.UserData, userdata.TypeComment)
			v.rules[ch.Name] = append(v.rules[ch.Name], tag)
			for _, e := range r.Exprs {
				if cnt, ok := e.(*expr.Counter); ok {
					v.count[ch.Name] += cnt.Packets
				}
			}
		}
	}
	return v
}

// TestApplyProgramsAndRemoves: policies, SAs (where the kernel can) and nft
// rules are programmed as desired, changed in place, left alone when
// foreign, and removed when no longer desired.
func TestApplyProgramsAndRemoves(t *testing.T) {
	nstest.RequireRoot(t)
	supported := espSupported(t)
	ns := nstest.NewNS(t, "host")
	p, err := NewProgrammer(ns.Handle)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()

	// Foreign state that must survive everything.
	h, err := netlink.NewHandleAt(ns.Handle, unix.NETLINK_XFRM)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	foreign := &netlink.XfrmPolicy{
		Src: &net.IPNet{IP: net.IPv4(203, 0, 113, 1), Mask: net.CIDRMask(32, 32)}, Dst: &net.IPNet{IP: net.IPv4(203, 0, 113, 2), Mask: net.CIDRMask(32, 32)},
		Dir: netlink.XFRM_DIR_OUT, Tmpls: []netlink.XfrmPolicyTmpl{{Src: net.IPv4(203, 0, 113, 1), Dst: net.IPv4(203, 0, 113, 2), Proto: netlink.XFRM_PROTO_ESP, Mode: netlink.XFRM_MODE_TRANSPORT, Reqid: 42}},
	}
	if err := h.XfrmPolicyAdd(foreign); err != nil {
		t.Fatal(err)
	}
	fc, _ := nftables.New(nftables.WithNetNSFd(int(ns.Handle)))
	fc.AddTable(&nftables.Table{Name: "someone-else", Family: nftables.TableFamilyINet})
	if err := fc.Flush(); err != nil {
		t.Fatal(err)
	}

	d := testDesired(0)
	d.Local = hostA
	d.Remotes = []netip.Addr{hostB, hostC}
	d.RemoteGens = map[netip.Addr]uint64{hostB: 11, hostC: 12}
	checkApply := func(what string) {
		t.Helper()
		err := p.Apply(d)
		if supported {
			if err != nil {
				t.Fatalf("%s: %v", what, err)
			}
			if a := p.Audit(d); len(a) != 0 {
				t.Fatalf("%s: audit: %v", what, a)
			}
			return
		}
		if !errors.Is(err, ErrKernelUnsupported) {
			t.Fatalf("%s: want ErrKernelUnsupported, got %v", what, err)
		}
		// Only SAs may be missing; everything else is in place.
		for _, l := range p.Audit(d) {
			if !strings.Contains(l, "SA") || !strings.Contains(l, "missing") {
				t.Fatalf("%s: audit reports more than missing SAs: %s", what, l)
			}
		}
	}
	checkApply("initial")
	states, all := dumpOurs(t, ns)
	pols, clear := remotePolicies(all)
	if len(pols) != 2 || !clear || len(all) != 3 {
		t.Fatalf("%d policies (%d per remote, clear policy %v), want 2 per remote and the clear policy", len(all), len(pols), clear)
	}
	for _, pol := range pols {
		r := addrOf(pol.Dst.IP)
		spi, _ := SPI(testSecret, d.Local, r, 1, testGen)
		if pol.Dir != netlink.XFRM_DIR_OUT || pol.Mark != nil || pol.DstPort != 4799 || pol.Proto != netlink.Proto(unix.IPPROTO_UDP) ||
			uint32(pol.Tmpls[0].Spi) != spi || pol.Tmpls[0].Mode != netlink.XFRM_MODE_TRANSPORT || pol.Src.String() != "0.0.0.0/0" || addrOf(pol.Tmpls[0].Src) != d.Local {
			t.Fatalf("policy for %v: %v", r, pol)
		}
	}
	wantStates := 0
	if supported {
		wantStates = 4 // 2 remotes x (1 inbound + 1 outbound)
	}
	if len(states) != wantStates {
		t.Fatalf("%d SAs, want %d", len(states), wantStates)
	}
	v := nftDumpView(t, ns)
	if !v.exists || len(v.vnis) != 2 || !v.vnis[100] || !v.vnis[200] || len(v.clear) != 1 || !v.clear[300] {
		t.Fatalf("nft: %+v", v)
	}
	for _, c := range []string{ChainMark, ChainOutDrop, ChainInDrop} {
		if len(v.rules[c]) != 1 || !strings.HasPrefix(v.rules[c][0], "overlayd v2 ") {
			t.Fatalf("nft chain %s: rules %q", c, v.rules[c])
		}
	}

	// Idempotent: nothing but (failing) SA adds on a second Apply.
	before := p.Stats()
	checkApply("again")
	if st := p.Stats().Sub(before); st.PolicyAdds+st.PolicyUpdates+st.PolicyDels+st.NftBatches+st.StateDels != 0 || (supported && st.StateAdds != 0) {
		t.Fatalf("second Apply changed the kernel: %v", st)
	}

	// Rotation steps and a removed remote and VNI.
	d.Accept = []uint32{1, 2}
	checkApply("accept 2")
	d.Send = 2
	checkApply("send 2")
	d.Accept = []uint32{2}
	d.Remotes = []netip.Addr{hostC}
	d.VNIs = []uint32{100}
	d.ClearVNIs = []uint32{200}
	checkApply("retire 1, drop a remote, VNI 200 becomes clear, VNI 300 goes")
	states, all = dumpOurs(t, ns)
	pols, clear = remotePolicies(all)
	spi, _ := SPI(testSecret, d.Local, hostC, 2, testGen)
	if len(pols) != 1 || !clear || addrOf(pols[0].Dst.IP) != hostC || uint32(pols[0].Tmpls[0].Spi) != spi {
		t.Fatalf("policies after the change: %v", all)
	}
	if supported && len(states) != 2 {
		t.Fatalf("%d SAs after the change, want 2", len(states))
	}
	if v := nftDumpView(t, ns); len(v.vnis) != 1 || !v.vnis[100] || len(v.clear) != 1 || !v.clear[200] {
		t.Fatalf("VNI sets after the change: encrypted %v, clear %v", v.vnis, v.clear)
	}

	// Drift: someone deletes our policy and our table; a stray policy with
	// our reqid appears. Audit sees it all, Apply repairs it.
	if err := h.XfrmPolicyDel(&pols[0]); err != nil {
		t.Fatal(err)
	}
	stray := *foreign
	stray.Dir = netlink.XFRM_DIR_IN
	stray.Tmpls = []netlink.XfrmPolicyTmpl{{Src: net.IPv4(203, 0, 113, 1), Dst: net.IPv4(203, 0, 113, 2), Proto: netlink.XFRM_PROTO_ESP, Mode: netlink.XFRM_MODE_TRANSPORT, Reqid: ReqID}}
	if err := h.XfrmPolicyAdd(&stray); err != nil {
		t.Fatal(err)
	}
	fc.DelTable(table)
	if err := fc.Flush(); err != nil {
		t.Fatal(err)
	}
	audit := strings.Join(p.Audit(d), "\n")
	for _, want := range []string{"table inet overlayd missing", "policy out src 0.0.0.0/0 dst 192.0.2.12/32 udp dport 4799 missing", "not one we install"} {
		if !strings.Contains(audit, want) {
			t.Fatalf("audit misses %q:\n%s", want, audit)
		}
	}
	checkApply("repair")

	// A new VXLAN port: the table is rebuilt in one transaction (delete
	// and re-add), policies move to the new selector.
	d.Port = 4800
	checkApply("new port")
	if _, all = dumpOurs(t, ns); len(all) != 2 || all[0].DstPort != 4800 || all[1].DstPort != 4800 {
		t.Fatalf("policies after the port change: %v", all)
	}
	if v := nftDumpView(t, ns); !strings.Contains(v.rules[ChainInDrop][0], "port=4800 ") {
		t.Fatalf("rules after the port change: %v", v.rules)
	}

	// Nothing encrypted: everything of ours goes, the foreign state stays.
	if err := p.Apply(Desired{}); err != nil {
		t.Fatalf("apply empty: %v", err)
	}
	if a := p.Audit(Desired{}); len(a) != 0 {
		t.Fatalf("audit of empty: %v", a)
	}
	states, pols = dumpOurs(t, ns)
	if len(states) != 0 || len(pols) != 0 || nftDumpView(t, ns).exists {
		t.Fatalf("left behind: %d SAs, %d policies, table %v", len(states), len(pols), nftDumpView(t, ns).exists)
	}
	if _, err := h.XfrmPolicyGet(foreign); err != nil {
		t.Fatalf("foreign policy removed: %v", err)
	}
	tables, _ := fc.ListTablesOfFamily(nftables.TableFamilyINet)
	if len(tables) != 1 || tables[0].Name != "someone-else" {
		t.Fatalf("foreign table: %v", tables)
	}
}

// vxlanFrame is a VXLAN packet (UDP payload) for vni carrying a broadcast
// ARP request: what a VXLAN link floods when a container looks for a peer.
func vxlanFrame(vni uint32) []byte {
	b := make([]byte, 8+14+28)
	b[0] = 0x08 // I flag: VNI valid
	b[4], b[5], b[6] = byte(vni>>16), byte(vni>>8), byte(vni)
	eth := b[8:]
	copy(eth[0:6], []byte{0xff, 0xff, 0xff, 0xff, 0xff, 0xff})
	copy(eth[6:12], []byte{0x02, 0, 0, 0, 0, 0x01})
	binary.BigEndian.PutUint16(eth[12:], unix.ETH_P_ARP)
	arp := eth[14:]
	binary.BigEndian.PutUint16(arp[0:], 1)      // Ethernet
	binary.BigEndian.PutUint16(arp[2:], 0x0800) // IPv4
	arp[4], arp[5] = 6, 4
	binary.BigEndian.PutUint16(arp[6:], 1) // request
	copy(arp[8:14], eth[6:12])
	copy(arp[14:18], []byte{10, 98, 0, 1})
	copy(arp[24:28], []byte{10, 98, 0, 2})
	return b
}

// sendUDP sends payload n times from namespace ns to dst:port.
func sendUDP(t *testing.T, ns *nstest.NS, dst netip.Addr, port int, payload []byte, n int) {
	t.Helper()
	var fd int
	err := netnsutil.DoIn(ns.Handle, func() error {
		var err error
		fd, err = unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	for i := 0; i < n; i++ {
		if err := unix.Sendto(fd, payload, 0, &unix.SockaddrInet4{Addr: dst.As4(), Port: port}); err != nil {
			t.Fatalf("send: %v", err)
		}
	}
}

func addVXLAN(t *testing.T, ns *nstest.NS, name string, vni uint32, local netip.Addr, addr string, remote netip.Addr) {
	t.Helper()
	vx := &netlink.Vxlan{LinkAttrs: netlink.LinkAttrs{Name: name}, VxlanId: int(vni), Port: 4799, SrcAddr: local.AsSlice(), Learning: false}
	if err := ns.NL.LinkAdd(vx); err != nil {
		t.Fatalf("vxlan %s: %v", name, err)
	}
	l, err := ns.NL.LinkByName(name)
	if err != nil {
		t.Fatal(err)
	}
	if addr != "" {
		a, _ := netlink.ParseAddr(addr)
		if err := ns.NL.AddrAdd(l, a); err != nil {
			t.Fatal(err)
		}
	}
	if err := ns.NL.LinkSetUp(l); err != nil {
		t.Fatal(err)
	}
	if remote.IsValid() {
		fdb := &netlink.Neigh{LinkIndex: l.Attrs().Index, Family: unix.AF_BRIDGE, Flags: netlink.NTF_SELF, State: netlink.NUD_PERMANENT, HardwareAddr: make(net.HardwareAddr, 6), IP: remote.AsSlice()}
		if err := ns.NL.NeighAppend(fdb); err != nil {
			t.Fatal(err)
		}
	}
}

func rxPackets(t *testing.T, ns *nstest.NS, name string) uint64 {
	t.Helper()
	l, err := ns.NL.LinkByName(name)
	if err != nil {
		t.Fatal(err)
	}
	return l.Attrs().Statistics.RxPackets
}

// TestFailClosedDatapath sends real traffic between two hosts (namespaces
// joined by an underlay) and checks that VXLAN of an encrypted VNI never
// crosses in clear: inbound clear text is dropped by the input rule before
// the VXLAN link sees it; outbound, without an SA (this kernel) or without a
// policy, nothing leaves in clear. An unencrypted VNI on the same port is
// the control: it crosses.
func TestFailClosedDatapath(t *testing.T) {
	nstest.RequireRoot(t)
	supported := espSupported(t)
	hosts, addrs := nstest.Hosts(t, 2, false)
	a, b := hosts[0], hosts[1]

	pb, err := NewProgrammer(b.Handle)
	if err != nil {
		t.Fatal(err)
	}
	defer pb.Close()
	db := Desired{Local: addrs[1], Port: 4799, VNIs: []uint32{100}, ClearVNIs: []uint32{200}, Remotes: []netip.Addr{addrs[0]}, RemoteGens: map[netip.Addr]uint64{addrs[0]: 1}, Accept: []uint32{1}, Send: 1, Gen: 2, Secret: testSecret}
	if err := pb.Apply(db); err != nil && !errors.Is(err, ErrKernelUnsupported) {
		t.Fatal(err)
	}
	addVXLAN(t, b, "vx100", 100, addrs[1], "", netip.Addr{})
	addVXLAN(t, b, "vx200", 200, addrs[1], "", netip.Addr{})

	t.Run("inbound clear text dropped", func(t *testing.T) {
		const n = 20
		c0, _ := pb.Counters(db)
		rx100, rx200 := rxPackets(t, b, "vx100"), rxPackets(t, b, "vx200")
		sendUDP(t, a, addrs[1], 4799, vxlanFrame(100), n)
		sendUDP(t, a, addrs[1], 4799, vxlanFrame(200), n)
		var c1 map[string]uint64
		err := nstest.Eventually(2*time.Second, 20*time.Millisecond, func() error {
			c1, _ = pb.Counters(db)
			if rxPackets(t, b, "vx200")-rx200 < n || c1[ChainInDrop]-c0[ChainInDrop] < n {
				return errors.New("not yet")
			}
			return nil
		})
		if err != nil {
			t.Fatalf("control VNI 200 rx +%d, drop counter +%d; want +%d each", rxPackets(t, b, "vx200")-rx200, c1[ChainInDrop]-c0[ChainInDrop], n)
		}
		if got := rxPackets(t, b, "vx100") - rx100; got != 0 {
			t.Fatalf("clear-text VXLAN of encrypted VNI 100 reached its link: rx +%d", got)
		}
		t.Logf("%d clear-text packets of encrypted VNI 100: dropped by %s (+%d), VXLAN link rx +0; unencrypted VNI 200 rx +%d",
			n, ChainInDrop, c1[ChainInDrop]-c0[ChainInDrop], rxPackets(t, b, "vx200")-rx200)
	})

	// Why overlayd installs no inbound (dir in) xfrm policy: the kernel
	// checks inbound policies on UDP sockets, VXLAN's included, so a
	// policy requiring ESP from R to L's VXLAN port would drop the clear
	// text of unencrypted VNIs between the same hosts too; only nftables
	// can tell VNIs apart.
	t.Run("an inbound policy could not tell VNIs apart", func(t *testing.T) {
		h, err := netlink.NewHandleAt(b.Handle, unix.NETLINK_XFRM)
		if err != nil {
			t.Fatal(err)
		}
		defer h.Close()
		in := &netlink.XfrmPolicy{
			Src: &net.IPNet{IP: addrs[0].AsSlice(), Mask: net.CIDRMask(32, 32)}, Dst: &net.IPNet{IP: addrs[1].AsSlice(), Mask: net.CIDRMask(32, 32)},
			Proto: netlink.Proto(unix.IPPROTO_UDP), DstPort: 4799, Dir: netlink.XFRM_DIR_IN,
			Tmpls: []netlink.XfrmPolicyTmpl{{Src: addrs[0].AsSlice(), Dst: addrs[1].AsSlice(), Proto: netlink.XFRM_PROTO_ESP, Mode: netlink.XFRM_MODE_TRANSPORT, Reqid: 7}},
		}
		if err := h.XfrmPolicyAdd(in); err != nil {
			t.Fatal(err)
		}
		defer h.XfrmPolicyDel(in)
		rx200 := rxPackets(t, b, "vx200")
		sendUDP(t, a, addrs[1], 4799, vxlanFrame(200), 10)
		time.Sleep(200 * time.Millisecond)
		got := rxPackets(t, b, "vx200") - rx200
		t.Logf("with a dir-in policy requiring ESP for udp dport 4799, unencrypted VNI 200 rx +%d of 10", got)
		if got != 0 {
			t.Fatalf("the kernel did not apply the inbound policy to VXLAN (rx +%d): revisit the doc's reasoning", got)
		}
	})

	t.Run("outbound never in clear", func(t *testing.T) {
		pa, err := NewProgrammer(a.Handle)
		if err != nil {
			t.Fatal(err)
		}
		defer pa.Close()
		da := Desired{Local: addrs[0], Port: 4799, VNIs: []uint32{100}, ClearVNIs: []uint32{200}, Remotes: []netip.Addr{addrs[1]}, RemoteGens: map[netip.Addr]uint64{addrs[1]: 2}, Accept: []uint32{1}, Send: 1, Gen: 1, Secret: testSecret}
		if err := pa.Apply(da); err != nil && !errors.Is(err, ErrKernelUnsupported) {
			t.Fatal(err)
		}
		addVXLAN(t, a, "vx100", 100, addrs[0], "198.51.100.1/24", addrs[1])
		addVXLAN(t, a, "vx200", 200, addrs[0], "203.0.113.1/24", addrs[1])
		capt := nstest.StartCapture(t, b, "eth0", 4799)
		time.Sleep(50 * time.Millisecond)
		try := func() {
			// ARP requests for these addresses are flooded to B as VXLAN;
			// forget the (failed) neighbours first, so that each try sends
			// an ARP request at once.
			for name, ip := range map[string]string{"vx100": "198.51.100.2", "vx200": "203.0.113.2"} {
				if l, err := a.NL.LinkByName(name); err == nil {
					a.NL.NeighDel(&netlink.Neigh{LinkIndex: l.Attrs().Index, IP: net.ParseIP(ip)})
				}
			}
			nstest.Ping(a, netip.MustParseAddr("198.51.100.2"), 300*time.Millisecond)
			nstest.Ping(a, netip.MustParseAddr("203.0.113.2"), 300*time.Millisecond)
			time.Sleep(100 * time.Millisecond)
		}

		try()
		if capt.ClearOf(200) == 0 {
			t.Fatal("control: unencrypted VNI 200 did not reach the underlay")
		}
		if capt.ClearOf(100) != 0 {
			t.Fatalf("encrypted VNI 100 left in clear (%d packets) with a policy and %s", capt.ClearOf(100), map[bool]string{true: "an SA", false: "no SA"}[supported])
		}
		if supported && capt.ESP() == 0 {
			t.Fatal("encrypted VNI 100 did not leave as ESP")
		}
		t.Logf("with policy: VNI 100 in clear: 0, ESP: %d; VNI 200 in clear: %d", capt.ESP(), capt.ClearOf(200))

		// Without the nftables table (nft flush ruleset, a firewall
		// reload) nothing is marked clear: every VXLAN packet to B takes
		// B's policy (no mark), so it is encrypted, or, without an SA,
		// dropped — the clear VNI 200 too, never anything in clear.
		fc, _ := nftables.New(nftables.WithNetNSFd(int(a.Handle)))
		fc.FlushRuleset()
		if err := fc.Flush(); err != nil {
			t.Fatal(err)
		}
		clear100, clear200 := capt.ClearOf(100), capt.ClearOf(200)
		try()
		if capt.ClearOf(100) != clear100 {
			t.Fatalf("encrypted VNI 100 left in clear with the ruleset flushed (%d packets)", capt.ClearOf(100)-clear100)
		}
		if !supported && capt.ClearOf(200) != clear200 {
			t.Fatalf("with the ruleset flushed, VXLAN to B left in clear although B's policy selects it (%d packets of VNI 200)", capt.ClearOf(200)-clear200)
		}
		t.Logf("ruleset flushed: VNI 100 in clear +%d, VNI 200 in clear +%d (its packets took B's policy: %s)", capt.ClearOf(100)-clear100, capt.ClearOf(200)-clear200,
			map[bool]string{true: "encrypted", false: "no SA here, dropped"}[supported])
		if err := pa.Apply(da); err != nil && !errors.Is(err, ErrKernelUnsupported) {
			t.Fatal(err)
		}
		clear200 = capt.ClearOf(200)
		try()
		if capt.ClearOf(200) == clear200 {
			t.Fatal("the clear VNI 200 did not cross again once the rules were back")
		}

		// Without a policy (remote removed) the encrypted VNI's packets
		// have no transform: the postrouting rule drops them.
		da.Remotes = nil
		if err := pa.Apply(da); err != nil {
			t.Fatal(err)
		}
		c0, _ := pa.Counters(da)
		try()
		c1, _ := pa.Counters(da)
		if capt.ClearOf(100) != 0 {
			t.Fatalf("encrypted VNI 100 left in clear without a policy (%d packets)", capt.ClearOf(100))
		}
		if c1[ChainOutDrop] <= c0[ChainOutDrop] || c1[ChainMark] <= c0[ChainMark] {
			t.Fatalf("counters: clear VNI marked %d -> %d, encrypted VNI dropped %d -> %d", c0[ChainMark], c1[ChainMark], c0[ChainOutDrop], c1[ChainOutDrop])
		}
		t.Logf("without policy: VNI 100 dropped by %s +%d, in clear 0; VNI 200 marked clear +%d", ChainOutDrop, c1[ChainOutDrop]-c0[ChainOutDrop], c1[ChainMark]-c0[ChainMark])
		if err := pa.Apply(Desired{}); err != nil {
			t.Fatal(err)
		}
	})
	if err := pb.Apply(Desired{}); err != nil {
		t.Fatal(err)
	}
}

// TestApplyUnsupportedFailsClosed: on a kernel without ESP, Apply returns a
// clear error and leaves a consistent fail-closed state (rules and policies,
// no SA), does nothing more on retry, and cleans up completely.
func TestApplyUnsupportedFailsClosed(t *testing.T) {
	nstest.RequireRoot(t)
	if espSupported(t) {
		t.Skip("this kernel supports ESP; the supported path is tested by TestApplyProgramsAndRemoves")
	}
	ns := nstest.NewNS(t, "host")
	p, err := NewProgrammer(ns.Handle)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	d := testDesired(3)
	err = p.Apply(d)
	if !errors.Is(err, ErrKernelUnsupported) {
		t.Fatalf("want ErrKernelUnsupported, got %v", err)
	}
	msg := err.Error()
	if !strings.Contains(msg, "failed to add inbound SA spi 0x") || !strings.Contains(msg, " dst 203.0.113.1 (epoch 1, generation ") {
		t.Fatalf("error does not name the SA: %v", err)
	}
	if st := p.Stats(); st.StateAdds != 1 {
		t.Fatalf("after the kernel said it cannot, Apply kept trying: %d SA adds", st.StateAdds)
	}
	t.Logf("Apply: %v", err)
	states, pols := dumpOurs(t, ns)
	if len(states) != 0 || len(pols) != 4 || !nftDumpView(t, ns).exists {
		t.Fatalf("want the fail-closed state (3 policies and the clear policy, rules, no SA): %d SAs, %d policies", len(states), len(pols))
	}
	before := p.Stats()
	if err := p.Apply(d); !errors.Is(err, ErrKernelUnsupported) {
		t.Fatalf("retry: %v", err)
	}
	if st := p.Stats().Sub(before); st.Changes() != st.StateAdds || st.StateAdds != 1 {
		t.Fatalf("retry changed more than it tried: %v", st)
	}
	if err := p.Apply(Desired{}); err != nil {
		t.Fatal(err)
	}
	states, pols = dumpOurs(t, ns)
	if len(states) != 0 || len(pols) != 0 || nftDumpView(t, ns).exists {
		t.Fatal("left state behind")
	}
}

func TestApplyRejectsInvalid(t *testing.T) {
	nstest.RequireRoot(t)
	ns := nstest.NewNS(t, "host")
	p, err := NewProgrammer(ns.Handle)
	if err != nil {
		t.Fatal(err)
	}
	d := testDesired(1)
	d.Port = -1
	if err := p.Apply(d); err == nil {
		t.Fatal("invalid Desired accepted")
	}
	if s, pol := dumpOurs(t, ns); len(s)+len(pol) != 0 || nftDumpView(t, ns).exists {
		t.Fatal("invalid Desired changed the kernel")
	}
	p.Close()
	if err := p.Apply(testDesired(1)); err == nil {
		t.Fatal("Apply on a closed Programmer succeeded")
	}
	if p.Close() != nil {
		t.Fatal("second Close failed")
	}
}

// TestApplyIPv6 programs an IPv6 underlay (esp6 where supported).
func TestApplyIPv6(t *testing.T) {
	nstest.RequireRoot(t)
	supported := espSupported(t) && CheckKernelSupportIPv6() == nil
	ns := nstest.NewNS(t, "host6")
	p, err := NewProgrammer(ns.Handle)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	r := netip.MustParseAddr("2001:db8::11")
	d := Desired{Local: netip.MustParseAddr("2001:db8::10"), Port: 4799, VNIs: []uint32{7}, ClearVNIs: []uint32{8}, Remotes: []netip.Addr{r}, RemoteGens: map[netip.Addr]uint64{r: 5}, Accept: []uint32{3}, Send: 3, Gen: 9, Secret: testSecret}
	err = p.Apply(d)
	if supported {
		if err != nil {
			t.Fatal(err)
		}
		if a := p.Audit(d); len(a) != 0 {
			t.Fatalf("audit: %v", a)
		}
	} else if !errors.Is(err, ErrKernelUnsupported) {
		t.Fatalf("want ErrKernelUnsupported, got %v", err)
	}
	states, all := dumpOurs(t, ns)
	pols, clear := remotePolicies(all)
	if len(pols) != 1 || !clear || pols[0].Src.String() != "::/0" || pols[0].Dst.String() != "2001:db8::11/128" || addrOf(pols[0].Tmpls[0].Src) != d.Local {
		t.Fatalf("policies: %v", all)
	}
	if supported && len(states) != 2 {
		t.Fatalf("%d SAs, want 2", len(states))
	}
	if err := p.Apply(Desired{}); err != nil {
		t.Fatal(err)
	}
	if states, pols := dumpOurs(t, ns); len(states)+len(pols) != 0 || nftDumpView(t, ns).exists {
		t.Fatal("left state behind")
	}
}
