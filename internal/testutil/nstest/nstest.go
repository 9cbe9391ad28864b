// Package nstest builds throwaway network topologies for kernel tests: hosts
// and containers are network namespaces the test creates and that vanish when
// the test ends (also on failure). Tests never switch their own goroutine's
// namespace: they use netlink handles bound to a namespace, and ICMP sockets
// opened on a locked thread inside it.
package nstest

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/netnsutil"
)

// RequireRoot skips the test unless it runs as root (kernel tests need
// CAP_NET_ADMIN and CAP_SYS_ADMIN).
func RequireRoot(t testing.TB) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("kernel test: needs root")
	}
}

// NS is a throwaway network namespace with a netlink handle bound to it.
type NS struct {
	Handle netns.NsHandle
	NL     *netlink.Handle
	Name   string
}

// NewNS creates an anonymous namespace, removed in t.Cleanup.
func NewNS(t testing.TB, name string) *NS {
	t.Helper()
	RequireRoot(t)
	h, err := netnsutil.New()
	if err != nil {
		t.Fatalf("namespace %s: %v", name, err)
	}
	nl, err := netlink.NewHandleAt(h, unix.NETLINK_ROUTE)
	if err != nil {
		h.Close()
		t.Fatalf("namespace %s: netlink handle: %v", name, err)
	}
	ns := &NS{Handle: h, NL: nl, Name: name}
	lo, err := nl.LinkByName("lo")
	if err == nil {
		err = nl.LinkSetUp(lo)
	}
	if err != nil {
		t.Fatalf("namespace %s: lo up: %v", name, err)
	}
	t.Cleanup(func() {
		// Delete links explicitly so VXLAN sockets and veths go now, not
		// when the kernel gets round to destroying the namespace.
		if links, err := nl.LinkList(); err == nil {
			for _, l := range links {
				if l.Attrs().Name != "lo" {
					nl.LinkDel(l)
				}
			}
		}
		nl.Close()
		h.Close()
	})
	return ns
}

// Hosts creates n "hosts" joined by an underlay: a switch namespace with a
// bridge, and in each host a veth "eth0" with address 192.0.2.(10+i)/24
// (or 2001:db8::(10+i)/64 when v6). Hosts[i] is the host namespace.
func Hosts(t testing.TB, n int, v6 bool) ([]*NS, []netip.Addr) {
	t.Helper()
	sw := NewNS(t, "switch")
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "sw0", Flags: net.FlagUp, TxQLen: -1}}
	if err := sw.NL.LinkAdd(br); err != nil {
		t.Fatalf("switch bridge: %v", err)
	}
	var hosts []*NS
	var addrs []netip.Addr
	for i := 0; i < n; i++ {
		h := NewNS(t, fmt.Sprintf("host%d", i))
		veth := &netlink.Veth{
			LinkAttrs:     netlink.LinkAttrs{Name: fmt.Sprintf("sw-h%d", i), MasterIndex: br.Index, Flags: net.FlagUp, TxQLen: -1},
			PeerName:      "eth0",
			PeerNamespace: netlink.NsFd(int(h.Handle)),
		}
		if err := sw.NL.LinkAdd(veth); err != nil {
			t.Fatalf("underlay veth for host %d: %v", i, err)
		}
		var a netip.Prefix
		if v6 {
			a = netip.MustParsePrefix(fmt.Sprintf("2001:db8::%x/64", 0x10+i))
		} else {
			a = netip.MustParsePrefix(fmt.Sprintf("192.0.2.%d/24", 10+i))
		}
		eth0, err := h.NL.LinkByName("eth0")
		if err != nil {
			t.Fatalf("host %d eth0: %v", i, err)
		}
		if err := h.NL.AddrAdd(eth0, &netlink.Addr{IPNet: ipNet(a), Flags: unix.IFA_F_NODAD}); err != nil {
			t.Fatalf("host %d address: %v", i, err)
		}
		if err := h.NL.LinkSetUp(eth0); err != nil {
			t.Fatalf("host %d eth0 up: %v", i, err)
		}
		hosts = append(hosts, h)
		addrs = append(addrs, a.Addr())
	}
	return hosts, addrs
}

// Pair creates two "hosts" joined by one veth, no switch between them:
// each holds an end named "eth0" with address 192.0.2.(10+i)/24 (or
// 2001:db8::(10+i)/64 when v6). The shortest underlay, for measuring a data
// path against the underlay itself.
func Pair(t testing.TB, v6 bool) ([]*NS, []netip.Addr) {
	t.Helper()
	hosts := []*NS{NewNS(t, "host0"), NewNS(t, "host1")}
	veth := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: "eth0", TxQLen: -1},
		PeerName:      "eth0-peer",
		PeerNamespace: netlink.NsFd(int(hosts[1].Handle)),
	}
	if err := hosts[0].NL.LinkAdd(veth); err != nil {
		t.Fatalf("underlay veth: %v", err)
	}
	var addrs []netip.Addr
	for i, h := range hosts {
		name := "eth0"
		if i == 1 {
			name = "eth0-peer"
		}
		l, err := h.NL.LinkByName(name)
		if err != nil {
			t.Fatalf("host %d %s: %v", i, name, err)
		}
		if i == 1 {
			if err := h.NL.LinkSetName(l, "eth0"); err != nil {
				t.Fatalf("host 1 rename: %v", err)
			}
		}
		a := netip.MustParsePrefix(fmt.Sprintf("192.0.2.%d/24", 10+i))
		if v6 {
			a = netip.MustParsePrefix(fmt.Sprintf("2001:db8::%x/64", 0x10+i))
		}
		if err := h.NL.AddrAdd(l, &netlink.Addr{IPNet: ipNet(a), Flags: unix.IFA_F_NODAD}); err != nil {
			t.Fatalf("host %d address: %v", i, err)
		}
		if err := h.NL.LinkSetUp(l); err != nil {
			t.Fatalf("host %d eth0 up: %v", i, err)
		}
		addrs = append(addrs, a.Addr())
	}
	return hosts, addrs
}

// Container plays dockerd's part of Join: it moves the host-side link
// srcName from host into a new namespace, renames it eth0, gives it addr and
// brings it up; routes are added as given (dst -> via).
func Container(t testing.TB, name string, host *NS, srcName string, addr netip.Prefix, routes map[netip.Prefix]netip.Addr) *NS {
	t.Helper()
	c := NewNS(t, name)
	l, err := host.NL.LinkByName(srcName)
	if err != nil {
		t.Fatalf("container %s: link %s in host %s: %v", name, srcName, host.Name, err)
	}
	if err := host.NL.LinkSetNsFd(l, int(c.Handle)); err != nil {
		t.Fatalf("container %s: move %s: %v", name, srcName, err)
	}
	l, err = c.NL.LinkByName(srcName)
	if err != nil {
		t.Fatalf("container %s: find %s: %v", name, srcName, err)
	}
	if err := c.NL.LinkSetName(l, "eth0"); err != nil {
		t.Fatalf("container %s: rename: %v", name, err)
	}
	if err := c.NL.AddrAdd(l, &netlink.Addr{IPNet: ipNet(addr)}); err != nil {
		t.Fatalf("container %s: address: %v", name, err)
	}
	if err := c.NL.LinkSetUp(l); err != nil {
		t.Fatalf("container %s: up: %v", name, err)
	}
	for dst, via := range routes {
		r := &netlink.Route{LinkIndex: l.Attrs().Index, Dst: ipNet(dst), Gw: via.AsSlice()}
		if err := c.NL.RouteAdd(r); err != nil {
			t.Fatalf("container %s: route %s via %s: %v", name, dst, via, err)
		}
	}
	return c
}

// Ping sends one ICMP echo request (ICMPv6 for an IPv6 dst, like ping -6)
// from ns to dst and waits up to timeout for the reply.
func Ping(ns *NS, dst netip.Addr, timeout time.Duration) error {
	domain, proto, echo, reply := unix.AF_INET, unix.IPPROTO_ICMP, byte(8), byte(0)
	if dst.Is6() {
		domain, proto, echo, reply = unix.AF_INET6, unix.IPPROTO_ICMPV6, 128, 129
	}
	fd, err := netnsutil.Socket(ns.Handle, domain, unix.SOCK_RAW|unix.SOCK_CLOEXEC, proto)
	if err != nil {
		return fmt.Errorf("icmp socket in %s: %w", ns.Name, err)
	}
	defer unix.Close(fd)
	id := uint16(os.Getpid()) ^ uint16(time.Now().UnixNano())
	pkt := make([]byte, 16)
	pkt[0] = echo
	binary.BigEndian.PutUint16(pkt[4:], id)
	binary.BigEndian.PutUint16(pkt[6:], 1)
	copy(pkt[8:], "overlayd")
	var sa unix.Sockaddr
	if dst.Is6() {
		// The kernel computes the ICMPv6 checksum (it covers the
		// pseudo-header, which only it knows).
		sa = &unix.SockaddrInet6{Addr: dst.As16()}
	} else {
		binary.BigEndian.PutUint16(pkt[2:], checksum(pkt))
		sa = &unix.SockaddrInet4{Addr: dst.As4()}
	}
	if err := unix.Sendto(fd, pkt, 0, sa); err != nil {
		return fmt.Errorf("ping %s from %s: %w", dst, ns.Name, err)
	}
	deadline := time.Now().Add(timeout)
	buf := make([]byte, 1500)
	for {
		left := time.Until(deadline)
		if left <= 0 {
			return fmt.Errorf("ping %s from %s: no reply within %v", dst, ns.Name, timeout)
		}
		tv := unix.NsecToTimeval(left.Nanoseconds())
		unix.SetsockoptTimeval(fd, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
		n, from, err := unix.Recvfrom(fd, buf, 0)
		if err != nil {
			if errors.Is(err, unix.EAGAIN) || errors.Is(err, unix.EINTR) {
				continue
			}
			return fmt.Errorf("ping %s from %s: %w", dst, ns.Name, err)
		}
		var icmp []byte
		switch src := from.(type) {
		case *unix.SockaddrInet4:
			if netip.AddrFrom4(src.Addr) != dst || n < 20 {
				continue
			}
			ihl := int(buf[0]&0x0f) * 4
			if n < ihl+8 {
				continue
			}
			icmp = buf[ihl:n]
		case *unix.SockaddrInet6:
			// Raw ICMPv6 sockets receive no IPv6 header.
			if netip.AddrFrom16(src.Addr) != dst || n < 8 {
				continue
			}
			icmp = buf[:n]
		default:
			continue
		}
		if icmp[0] == reply && binary.BigEndian.Uint16(icmp[4:]) == id {
			return nil
		}
	}
}

// Eventually polls fn until it returns nil or the deadline passes; it returns
// the last error.
func Eventually(timeout, interval time.Duration, fn func() error) error {
	deadline := time.Now().Add(timeout)
	for {
		err := fn()
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(interval)
	}
}

// PingEventually pings until a reply arrives or timeout passes.
func PingEventually(ns *NS, dst netip.Addr, timeout time.Duration) error {
	return Eventually(timeout, 0, func() error { return Ping(ns, dst, 200*time.Millisecond) })
}

func checksum(b []byte) uint16 {
	var s uint32
	for i := 0; i+1 < len(b); i += 2 {
		s += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	if len(b)%2 == 1 {
		s += uint32(b[len(b)-1]) << 8
	}
	for s>>16 != 0 {
		s = s&0xffff + s>>16
	}
	return ^uint16(s)
}

func ipNet(p netip.Prefix) *net.IPNet {
	bits := 32
	if p.Addr().Is6() {
		bits = 128
	}
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), bits)}
}

// NetnsDir returns a temporary directory for sandbox namespaces whose
// leftover mounts are removed when the test ends, before the directory is.
func NetnsDir(t testing.TB) string {
	t.Helper()
	dir := t.TempDir()
	t.Cleanup(func() {
		entries, _ := os.ReadDir(dir)
		for _, e := range entries {
			p := dir + "/" + e.Name()
			if netnsutil.IsNamespace(p) {
				if ns, err := netnsutil.Open(p); err == nil {
					if nl, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE); err == nil {
						if links, err := nl.LinkList(); err == nil {
							for _, l := range links {
								if l.Attrs().Name != "lo" {
									nl.LinkDel(l)
								}
							}
						}
						nl.Close()
					}
					ns.Close()
				}
			}
			netnsutil.RemoveNamed(p)
		}
		// The daemon makes its netns directory a shared mount of itself.
		for unix.Unmount(dir, unix.MNT_DETACH) == nil {
		}
	})
	return dir
}

// LinkNames lists the link names of ns, sorted by the kernel's order.
func LinkNames(t testing.TB, nl *netlink.Handle) []string {
	t.Helper()
	links, err := nl.LinkList()
	if err != nil {
		t.Fatalf("link list: %v", err)
	}
	var names []string
	for _, l := range links {
		names = append(names, l.Attrs().Name)
	}
	return names
}

// HasPrefix reports whether any name starts with prefix.
func HasPrefix(names []string, prefix string) bool {
	for _, n := range names {
		if strings.HasPrefix(n, prefix) {
			return true
		}
	}
	return false
}

// PingLoop pings dst from ns continuously (every interval, each waiting up
// to timeout) until stop is called, which returns how many were sent and
// lost. For counting packets lost across a restart or a key rotation.
type PingLoop struct {
	sent, lost atomic.Int64
	stop, done chan struct{}
}

// StartPingLoop starts a PingLoop.
func StartPingLoop(ns *NS, dst netip.Addr, interval, timeout time.Duration) *PingLoop {
	p := &PingLoop{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(p.done)
		for {
			select {
			case <-p.stop:
				return
			default:
			}
			p.sent.Add(1)
			if Ping(ns, dst, timeout) != nil {
				p.lost.Add(1)
			}
			time.Sleep(interval)
		}
	}()
	return p
}

// Sent returns the number of pings sent so far.
func (p *PingLoop) Sent() int64 { return p.sent.Load() }

// WaitSent waits until n more pings have been sent.
func (p *PingLoop) WaitSent(n int64) {
	for target := p.sent.Load() + n; p.sent.Load() < target; {
		time.Sleep(5 * time.Millisecond)
	}
}

// Stop stops the loop and returns the numbers of pings sent and lost.
func (p *PingLoop) Stop() (sent, lost int64) {
	close(p.stop)
	<-p.done
	return p.sent.Load(), p.lost.Load()
}

// Underlay gives the namespace behind nl an underlay: a veth "under0" (its
// peer "under1" stays in the namespace) with addr, up, and if route an
// IPv4 default route through the .254 of addr's subnet. That is what a
// host's own address looks like to overlayd (an address to advertise, a
// default route to learn the VTEP from).
func Underlay(t testing.TB, nl *netlink.Handle, addr netip.Prefix, route bool) {
	t.Helper()
	if err := nl.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "under0", TxQLen: -1}, PeerName: "under1"}); err != nil {
		t.Fatalf("underlay veth: %v", err)
	}
	for _, name := range []string{"lo", "under0", "under1"} {
		l, err := nl.LinkByName(name)
		if err == nil {
			err = nl.LinkSetUp(l)
		}
		if err != nil {
			t.Fatalf("underlay: %s up: %v", name, err)
		}
	}
	l, err := nl.LinkByName("under0")
	if err != nil {
		t.Fatal(err)
	}
	if err := nl.AddrAdd(l, &netlink.Addr{IPNet: ipNet(addr), Flags: unix.IFA_F_NODAD}); err != nil {
		t.Fatalf("underlay address %s: %v", addr, err)
	}
	if route {
		gw := addr.Masked().Addr().As4()
		gw[3] = 254
		if err := nl.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Gw: net.IP(gw[:])}); err != nil {
			t.Fatalf("underlay default route: %v", err)
		}
	}
}
