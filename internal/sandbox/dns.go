package sandbox

import (
	"fmt"
	"net"
	"net/netip"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/netnsutil"
)

// dnsSockets are the UDP and TCP sockets of a network's name server, bound
// to its address inside the sandbox: containers reach them through their
// link on the network (the route Join hands dockerd), so the source of a
// query is the container's address on this network, and nothing outside
// the network's segments can reach them.
type dnsSockets struct {
	addr netip.AddrPort
	pc   net.PacketConn
	ln   net.Listener
}

// ServeDNS makes sure every IPv4 segment's bridge holds the name server's
// address (a sandbox adopted from an older run, or a bridge someone
// stripped, may lack it) and returns the sandbox's UDP and TCP sockets
// bound to addr:53, opening them on the first call. The sandbox owns them:
// they are closed when it is closed or destroyed, which ends whatever
// serves them. Not safe for concurrent use (see Sandbox).
func (sb *Sandbox) ServeDNS(addr netip.Addr) (net.PacketConn, net.Listener, bool, error) {
	if !addr.Is4() {
		return nil, nil, false, fmt.Errorf("name server address %s of sandbox %s: not an IPv4 address", addr, sb.path)
	}
	want := netip.PrefixFrom(addr, 32)
	for _, sl := range sb.subnets {
		if !sl.Pool.IsValid() {
			continue
		}
		if err := sb.ensureAddr(sl.bridge, BridgeName(sl.VNI), want); err != nil {
			return nil, nil, false, err
		}
	}
	if sb.dns != nil && sb.dns.addr.Addr() == addr {
		return sb.dns.pc, sb.dns.ln, false, nil
	}
	sb.closeDNS()
	ap := netip.AddrPortFrom(addr, 53)
	pc, ln, err := netnsutil.ListenPair(sb.ns, ap)
	if err != nil {
		return nil, nil, false, fmt.Errorf("name server of sandbox %s: %w", sb.path, err)
	}
	sb.dns = &dnsSockets{addr: ap, pc: pc, ln: ln}
	return pc, ln, true, nil
}

// ensureAddr adds p to the bridge unless it holds it already.
func (sb *Sandbox) ensureAddr(index int, name string, p netip.Prefix) error {
	br, err := sb.h.LinkByIndex(index)
	if err != nil {
		return fmt.Errorf("failed to find bridge %s in sandbox %s: %w", name, sb.path, err)
	}
	addrs, err := sb.h.AddrList(br, unix.AF_INET)
	if err != nil {
		return fmt.Errorf("failed to list the addresses of bridge %s in sandbox %s: %w", name, sb.path, err)
	}
	for _, a := range addrs {
		ip, _ := netip.AddrFromSlice(a.IP)
		ones, _ := a.Mask.Size()
		if netip.PrefixFrom(ip.Unmap(), ones) == p {
			return nil
		}
	}
	if err := sb.h.AddrAdd(br, &netlink.Addr{IPNet: prefixToIPNet(p)}); err != nil {
		return fmt.Errorf("failed to add name server address %s to bridge %s in sandbox %s: %w", p, name, sb.path, err)
	}
	return nil
}

// closeDNS closes the name server's sockets, if open.
func (sb *Sandbox) closeDNS() {
	if sb.dns != nil {
		sb.dns.pc.Close()
		sb.dns.ln.Close()
		sb.dns = nil
	}
}
