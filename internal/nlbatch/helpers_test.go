package nlbatch

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strconv"
	"testing"

	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// badIfindex is a link index that does not exist in the test namespaces.
const badIfindex = 99999

// testEnv is a throwaway network namespace with a VXLAN link in it and a
// Conn opened there.
type testEnv struct {
	ns   netns.NsHandle
	h    *netlink.Handle
	link int // VXLAN ifindex
	conn *Conn
}

type envOpts struct {
	v6Underlay bool // VXLAN of the IPv6 family (accepts IPv6 VTEPs)
	gcThresh   int  // if > 0, raise the neighbour gc thresholds to this
}

func newEnv(tb testing.TB, o envOpts) *testEnv {
	tb.Helper()
	ns, err := netnsutil.New()
	if err != nil {
		tb.Fatalf("netnsutil.New: %v", err)
	}
	tb.Cleanup(func() { ns.Close() })
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		tb.Fatalf("NewHandleAt: %v", err)
	}
	tb.Cleanup(h.Close)

	vx := &netlink.Vxlan{
		LinkAttrs: netlink.LinkAttrs{Name: "vx42"},
		VxlanId:   42,
		Port:      4800,
		Learning:  false,
	}
	if o.v6Underlay {
		vx.Group = net.IPv6zero // IFLA_VXLAN_GROUP6 = :: → IPv6 family
	}
	if err := h.LinkAdd(vx); err != nil {
		tb.Fatalf("create vxlan: %v", err)
	}
	l, err := h.LinkByName("vx42")
	if err != nil {
		tb.Fatalf("LinkByName: %v", err)
	}
	if err := h.LinkSetUp(l); err != nil {
		tb.Fatalf("LinkSetUp: %v", err)
	}
	if o.gcThresh > 0 {
		raiseGCThresh(tb, ns, o.gcThresh)
	}
	c, err := Open(ns)
	if err != nil {
		tb.Fatalf("Open: %v", err)
	}
	tb.Cleanup(func() {
		if err := c.Close(); err != nil {
			tb.Errorf("Close: %v", err)
		}
	})
	return &testEnv{ns: ns, h: h, link: l.Attrs().Index, conn: c}
}

// raiseGCThresh writes the neighbour gc thresholds (IPv4 and IPv6) of ns
// from a thread switched into ns: /proc/sys/net shows the namespace of the
// thread that opens the file.
//
// On this kernel (6.18) the neighbour tables, and so their gc_thresh
// sysctls, are shared by all namespaces and exposed only in the initial one;
// a child namespace has no neigh/default directory. The thresholds are then
// left alone (they are the host's): permanent entries are exempt from
// garbage collection and from the gc_thresh3 limit anyway, which the
// benchmarks confirm by dumping all entries back.
func raiseGCThresh(tb testing.TB, ns netns.NsHandle, n int) {
	tb.Helper()
	missing := false
	err := netnsutil.DoIn(ns, func() error {
		for _, fam := range []string{"ipv4", "ipv6"} {
			for i, v := range []int{n / 4, n / 2, n} {
				p := fmt.Sprintf("/proc/sys/net/%s/neigh/default/gc_thresh%d", fam, i+1)
				err := os.WriteFile(p, []byte(strconv.Itoa(v)), 0o644)
				if errors.Is(err, os.ErrNotExist) {
					missing = true
					return nil
				}
				if err != nil {
					return err
				}
			}
		}
		return nil
	})
	if err != nil {
		tb.Fatalf("raise gc thresholds: %v", err)
	}
	if missing {
		tb.Logf("no per-namespace neighbour gc thresholds on this kernel: left as they are")
	}
}

// Addresses used by the tests: only documentation ranges.
var v4Nets = []netip.Prefix{
	netip.MustParsePrefix("192.0.2.0/24"),
	netip.MustParsePrefix("198.51.100.0/24"),
	netip.MustParsePrefix("203.0.113.0/24"),
}

// numV4 is how many distinct IPv4 neighbour addresses peerIP hands out.
const numV4 = 3 * 254

// peerIP returns the overlay address of peer i: IPv4 from the
// documentation ranges for the first numV4 peers, then 2001:db8::/32.
func peerIP(i int) netip.Addr {
	if i < numV4 {
		b := v4Nets[i/254].Addr().As4()
		b[3] = byte(i%254 + 1)
		return netip.AddrFrom4(b)
	}
	return peerIP6(i)
}

// peerIP6 returns an IPv6 overlay address of peer i in 2001:db8:1::/48.
func peerIP6(i int) netip.Addr {
	var b [16]byte
	b[0], b[1], b[2], b[3], b[4], b[5] = 0x20, 0x01, 0x0d, 0xb8, 0, 1
	b[12], b[13], b[14], b[15] = byte(i>>24), byte(i>>16), byte(i>>8), byte(i)
	return netip.AddrFrom16(b)
}

// peerMAC returns the MAC of peer i (locally administered 02:42:…).
func peerMAC(i int) [6]byte {
	return [6]byte{0x02, 0x42, byte(i >> 24), byte(i >> 16), byte(i >> 8), byte(i)}
}

// vtep4 returns an IPv4 VTEP address for peer i.
func vtep4(i int) netip.Addr {
	b := v4Nets[(i/254)%3].Addr().As4()
	b[3] = byte(i%254 + 1)
	return netip.AddrFrom4(b)
}

// vtep6 returns an IPv6 VTEP address for peer i in 2001:db8:ffff::/48.
func vtep6(i int) netip.Addr {
	var b [16]byte
	b[0], b[1], b[2], b[3], b[4], b[5] = 0x20, 0x01, 0x0d, 0xb8, 0xff, 0xff
	b[14], b[15] = byte(i>>8), byte(i)|1
	return netip.AddrFrom16(b)
}

func neighSet(link int, ip netip.Addr, mac [6]byte) Op {
	return Op{Kind: NeighSet, LinkIndex: link, IP: ip, MAC: mac}
}

func neighDel(link int, ip netip.Addr) Op {
	return Op{Kind: NeighDel, LinkIndex: link, IP: ip}
}

func fdbSet(link int, mac [6]byte, vtep netip.Addr) Op {
	return Op{Kind: FDBSet, LinkIndex: link, MAC: mac, VTEP: vtep}
}

func fdbDel(link int, mac [6]byte, vtep netip.Addr) Op {
	return Op{Kind: FDBDel, LinkIndex: link, MAC: mac, VTEP: vtep}
}

// peerOps returns, for peers [from, to), a NeighSet (ipOf(i) → peerMAC(i))
// and an FDBSet (peerMAC(i) → vtepOf(i)) each.
func peerOps(link, from, to int, ipOf, vtepOf func(int) netip.Addr) []Op {
	ops := make([]Op, 0, 2*(to-from))
	for i := from; i < to; i++ {
		ops = append(ops, neighSet(link, ipOf(i), peerMAC(i)), fdbSet(link, peerMAC(i), vtepOf(i)))
	}
	return ops
}

// delOps returns the deletes undoing peerOps.
func delOps(link, from, to int, ipOf, vtepOf func(int) netip.Addr) []Op {
	ops := make([]Op, 0, 2*(to-from))
	for i := from; i < to; i++ {
		ops = append(ops, neighDel(link, ipOf(i)), fdbDel(link, peerMAC(i), vtepOf(i)))
	}
	return ops
}

// neighList dumps link's neighbours of family, retrying interrupted dumps.
func neighList(tb testing.TB, h *netlink.Handle, link, family int) []netlink.Neigh {
	tb.Helper()
	var err error
	for range 20 {
		var l []netlink.Neigh
		l, err = h.NeighList(link, family)
		if errors.Is(err, netlink.ErrDumpInterrupted) {
			continue
		}
		if err != nil {
			tb.Fatalf("NeighList(%d, %d): %v", link, family, err)
		}
		return l
	}
	tb.Fatalf("NeighList(%d, %d): %v (kept being interrupted)", link, family, err)
	return nil
}

func toAddr(ip net.IP) netip.Addr {
	a, _ := netip.AddrFromSlice(ip)
	return a.Unmap()
}

func toMAC(hw net.HardwareAddr) (m [6]byte) {
	copy(m[:], hw)
	return m
}

var docNet6 = netip.MustParsePrefix("2001:db8::/32")

// neighbours returns the neighbour entries of the link: every IPv4 one and
// the IPv6 ones in 2001:db8::/32 (the kernel adds entries of its own for
// IPv6 multicast addresses). It fails on an entry that is not permanent.
func (e *testEnv) neighbours(tb testing.TB) map[netip.Addr][6]byte {
	tb.Helper()
	got := map[netip.Addr][6]byte{}
	for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
		for _, n := range neighList(tb, e.h, e.link, fam) {
			ip := toAddr(n.IP)
			if fam == unix.AF_INET6 && !docNet6.Contains(ip) {
				continue
			}
			if n.LinkIndex != e.link {
				continue
			}
			if n.State&unix.NUD_PERMANENT == 0 {
				tb.Errorf("neighbour %s is not permanent (state %#x)", ip, n.State)
			}
			if _, dup := got[ip]; dup {
				tb.Errorf("neighbour %s listed twice", ip)
			}
			got[ip] = toMAC(n.HardwareAddr)
		}
	}
	return got
}

// fdb returns the FDB entries of the VXLAN link, MAC → dst, failing on one
// that is not a permanent self entry or on a MAC listed twice.
func (e *testEnv) fdb(tb testing.TB) map[[6]byte]netip.Addr {
	tb.Helper()
	got := map[[6]byte]netip.Addr{}
	for _, n := range neighList(tb, e.h, e.link, unix.AF_BRIDGE) {
		if n.LinkIndex != e.link {
			continue
		}
		mac := toMAC(n.HardwareAddr)
		if n.Flags&unix.NTF_SELF == 0 {
			tb.Errorf("fdb %s: not a self entry (flags %#x)", n.HardwareAddr, n.Flags)
		}
		if n.State&unix.NUD_PERMANENT == 0 {
			tb.Errorf("fdb %s: not permanent (state %#x)", n.HardwareAddr, n.State)
		}
		if _, dup := got[mac]; dup {
			tb.Errorf("fdb %s listed twice", n.HardwareAddr)
		}
		got[mac] = toAddr(n.IP)
	}
	return got
}

// wantState checks that the kernel holds exactly the given neighbours and
// FDB entries on the link.
func (e *testEnv) wantState(tb testing.TB, neigh map[netip.Addr][6]byte, fdb map[[6]byte]netip.Addr) {
	tb.Helper()
	gotN := e.neighbours(tb)
	if len(gotN) != len(neigh) {
		tb.Errorf("kernel has %d neighbours, want %d", len(gotN), len(neigh))
	}
	bad := 0
	for ip, mac := range neigh {
		g, ok := gotN[ip]
		if (!ok || g != mac) && bad < 10 {
			bad++
			tb.Errorf("neighbour %s: got %v (present %v), want %v", ip, net.HardwareAddr(g[:]), ok, net.HardwareAddr(mac[:]))
		}
	}
	for ip := range gotN {
		if _, ok := neigh[ip]; !ok && bad < 10 {
			bad++
			tb.Errorf("unexpected neighbour %s", ip)
		}
	}
	gotF := e.fdb(tb)
	if len(gotF) != len(fdb) {
		tb.Errorf("kernel has %d fdb entries, want %d", len(gotF), len(fdb))
	}
	for mac, dst := range fdb {
		g, ok := gotF[mac]
		if (!ok || g != dst) && bad < 20 {
			bad++
			tb.Errorf("fdb %v: got dst %v (present %v), want %v", net.HardwareAddr(mac[:]), g, ok, dst)
		}
	}
	for mac := range gotF {
		if _, ok := fdb[mac]; !ok && bad < 20 {
			bad++
			tb.Errorf("unexpected fdb entry %v", net.HardwareAddr(mac[:]))
		}
	}
}

// stateOf returns the kernel state that applying the given set ops leaves.
func stateOf(ops []Op) (map[netip.Addr][6]byte, map[[6]byte]netip.Addr) {
	neigh := map[netip.Addr][6]byte{}
	fdb := map[[6]byte]netip.Addr{}
	for _, o := range ops {
		switch o.Kind {
		case NeighSet:
			neigh[o.IP] = o.MAC
		case NeighDel:
			delete(neigh, o.IP)
		case FDBSet:
			fdb[o.MAC] = o.VTEP
		case FDBDel:
			if fdb[o.MAC] == o.VTEP {
				delete(fdb, o.MAC)
			}
		}
	}
	return neigh, fdb
}

// mustApply applies ops and fails the test on any error.
func mustApply(tb testing.TB, c *Conn, ops []Op) {
	tb.Helper()
	if err := c.Apply(ops); err != nil {
		tb.Fatalf("Apply(%d ops): %v", len(ops), err)
	}
}

// failedIndexes returns the indexes listed in err, which must be an *Error.
func failedIndexes(tb testing.TB, err error) []int {
	tb.Helper()
	var e *Error
	if !errors.As(err, &e) {
		tb.Fatalf("error %v (%T) is not an *Error", err, err)
	}
	idx := make([]int, len(e.Failed))
	for i, f := range e.Failed {
		idx[i] = f.Index
	}
	return idx
}
