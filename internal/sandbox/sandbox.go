// Package sandbox manages the kernel side of one overlay network on one host:
// a named network namespace holding, per segment (an IPv4 subnet, or every
// subnet of a network with IPv6), a bridge with the gateway addresses and a
// VXLAN link enslaved to it, plus one veth per joined endpoint, and the
// permanent neighbour (IPv4 and IPv6) and FDB entries for the network's
// remote peers. The links of a segment with IPv6 have no IPv6 address of
// their own (see quietIPv6); the VXLAN link's proxy answers Neighbour
// Solicitations as it answers ARP.
//
// The VXLAN links are created from the host namespace directly into the
// sandbox, so their UDP sockets live in the host namespace (where the
// underlay is) while the links themselves live in the sandbox. Veths are
// created in the sandbox with their peer directly in the host namespace:
// creating links in their target namespace is an order of magnitude cheaper
// than moving them.
//
// Local always wins, in the kernel too: the bridge port of each VXLAN link
// does not learn. Otherwise the bridge moves a MAC to the tunnel as soon as
// a frame from a remote host carries it as its source (a duplicate address
// on another host, or a spoofed frame), and the local endpoint that owns it
// loses its traffic. Frames to MACs the bridge has not learned on its local
// ports are flooded to the VXLAN link, whose own FDB entries decide where
// they go: only to the remote peers overlayd programmed, never for a local
// MAC. Audit reports a port that learns (or learned) and RepairPorts
// restores it.
//
// Endpoint MACs are not derived from their address, so an address that
// moves to another endpoint changes MAC: each neighbour ApplyDelta sets to
// another MAC than its address had (in place, or after a deletion within a
// minute) is announced to the local containers with a gratuitous ARP (see
// movedNeighs and announce).
//
// A Sandbox is not safe for concurrent use: its owner (the driver's network,
// under network.mu) serialises calls.
package sandbox

import (
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/overlayd/overlayd/internal/nlbatch"
	"github.com/overlayd/overlayd/internal/nlwrap"
)

// Host is the host side the sandboxes of one driver share: the namespace
// holding the underlay (where VXLAN sockets live and host veth ends are left)
// and a netlink handle bound to it.
type Host struct {
	NS        netns.NsHandle
	Handle    *nlwrap.Handle
	Dir       string // directory where sandbox namespaces are mounted
	VXLANPort int
	IPv6      bool // the underlay is IPv6: VXLAN links get an IPv6 family
}

// Subnet describes one L2 segment of a network: its VNI, its IPv4 pool (if
// any) with the gateway address with the pool's prefix length (invalid when
// Docker gave no gateway), its IPv6 subnets, and the MTU of its links.
type Subnet struct {
	VNI     uint32
	Pool    netip.Prefix
	Gateway netip.Prefix
	IPv6    []Subnet6
	MTU     int
	// DNS, if valid, is the address (a /32) of the network's name server
	// on this segment's bridge (see ServeDNS); only segments with an IPv4
	// pool get it.
	DNS netip.Prefix
}

// Subnet6 is an IPv6 subnet of a segment with its gateway (the pool's
// prefix length; invalid when Docker gave none).
type Subnet6 struct {
	Pool    netip.Prefix
	Gateway netip.Prefix
}

// gateways returns the addresses the segment's bridge must hold.
func (s *Subnet) gateways() []netip.Prefix {
	var out []netip.Prefix
	if s.Gateway.IsValid() {
		out = append(out, s.Gateway)
	}
	if s.DNS.IsValid() {
		out = append(out, s.DNS)
	}
	for _, v := range s.IPv6 {
		if v.Gateway.IsValid() {
			out = append(out, v.Gateway)
		}
	}
	return out
}

// hasIPv6 reports whether the segment carries IPv6.
func (s *Subnet) hasIPv6() bool { return len(s.IPv6) > 0 }

// LinkGroup is the interface group of every link overlayd creates in a
// sandbox: Destroy deletes them all with one RTM_DELLINK, which the kernel
// does as one batch (one RCU grace period instead of one per link).
const LinkGroup = 0x6f766c64 // "ovld"

// RetiredGroup is the interface group of the links that await deletion: the
// veths of endpoints that left (see RetireEndpoint and ReapRetired).
const RetiredGroup = 0x6f767270 // "ovrp"

// BridgeName and VXLANName name the links of subnet vni inside a sandbox.
// Defaults of the settings the sandboxes depend on (the daemon's flags and
// the driver's zero Config use them).
const (
	// DefaultVXLANPort is overlayd's VXLAN UDP port: not 4789, which
	// Docker's own overlay uses.
	DefaultVXLANPort = 4799
	// DefaultNetnsDir is where network sandboxes are mounted.
	DefaultNetnsDir = "/run/overlayd/netns"
)

func BridgeName(vni uint32) string { return fmt.Sprintf("ovbr-%d", vni) }
func VXLANName(vni uint32) string  { return fmt.Sprintf("ovvx-%d", vni) }

type subnetLinks struct {
	Subnet
	bridge int // ifindex in the sandbox
	vxlan  int // ifindex in the sandbox
}

// Sandbox is one network's namespace and links.
type Sandbox struct {
	host    *Host
	id      string
	path    string
	ns      netns.NsHandle
	h       *nlwrap.Handle
	batch   *nlbatch.Conn
	subnets []subnetLinks
	arp     int // packet socket for announcements, -1 until the first (see announce)
	// fresh: created by Create and no endpoint added yet, so no container
	// has anything cached to correct (announce sends nothing).
	fresh bool
	// gone remembers the MAC of each IPv4 neighbour deleted in the last
	// goneMemory, so that an address deleted in one change and set with
	// another MAC in a later one (a container moved between hosts) is
	// announced like one moved in place (see movedNeighs). Keyed by
	// goneKey; times are since born (monotonic). Pruned by age from
	// pruneAt on.
	gone    map[uint64]goneNeigh
	born    time.Time
	pruneAt time.Duration
	// ops is ApplyDelta's scratch space for the operations it builds.
	ops []nlbatch.Op
	// dns: the name server's sockets in the namespace (see ServeDNS),
	// closed before the namespace goes; nil until served.
	dns *dnsSockets
	// brnf is why bridged traffic still passes the namespace's netfilter
	// hooks, nil if it does not (see bridgeNetfilterOff).
	brnf error
}

// newBridgeMAC returns a random locally administered unicast MAC: each
// host's bridge of a segment has its own (a frame it routes onto the
// tunnel must not carry the source MAC of the receiving host's bridge).
func newBridgeMAC() net.HardwareAddr {
	m := make(net.HardwareAddr, 6)
	rand.Read(m)
	m[0] = m[0]&^0x01 | 0x02
	return m
}

// Path returns where the sandbox namespace of network id is mounted.
func (hs *Host) Path(id string) string { return filepath.Join(hs.Dir, id) }

// Create makes the sandbox of network id with the given subnets. A leftover
// namespace of the same id (from a crashed run) is emptied and removed first,
// so its VXLAN links cannot block the VNIs. On failure nothing is left behind.
func Create(host *Host, id string, subnets []Subnet) (_ *Sandbox, err error) {
	path := host.Path(id)
	if _, statErr := os.Lstat(path); statErr == nil {
		if err := RemoveLeftover(host, id); err != nil {
			return nil, err
		}
	}
	ns, err := netnsutil.NewNamed(path)
	if err != nil {
		return nil, err
	}
	sb := &Sandbox{host: host, id: id, path: path, ns: ns, arp: -1, fresh: true, born: time.Now()}
	defer func() {
		if err != nil {
			sb.Destroy()
		}
	}()
	if err := sb.openHandles(); err != nil {
		return nil, err
	}
	if err := sb.setupNamespace(); err != nil {
		return nil, err
	}
	sb.brnf = sb.bridgeNetfilterOff()
	for _, s := range subnets {
		sl, err := sb.createSubnet(s)
		if err != nil {
			return nil, err
		}
		sb.subnets = append(sb.subnets, sl)
	}
	return sb, nil
}

// setupNamespace brings up loopback.
func (sb *Sandbox) setupNamespace() error {
	lo, err := sb.h.LinkByName("lo")
	if err == nil {
		err = sb.h.LinkSetUp(lo)
	}
	if err != nil {
		return fmt.Errorf("failed to bring up lo in sandbox %s: %w", sb.path, err)
	}
	return nil
}

// Netlink attribute numbers of IPv4 device configuration (linux/if_link.h,
// linux/ip.h), which x/sys/unix does not name.
const (
	iflaInetConf         = 1
	ipv4DevconfForwading = 1
)

// enableForwarding turns on IPv4 forwarding on one link of the sandbox over
// netlink (RTM_SETLINK with IFLA_AF_SPEC/AF_INET/IFLA_INET_CONF), which
// routing between the subnets of a multi-subnet network needs. Not through
// /proc/sys: Docker mounts it read-only in managed plugins.
func (sb *Sandbox) enableForwarding(index int, name string) error {
	err := netnsutil.DoIn(sb.ns, func() error {
		req := nl.NewNetlinkRequest(unix.RTM_SETLINK, unix.NLM_F_ACK)
		msg := nl.NewIfInfomsg(unix.AF_UNSPEC)
		msg.Index = int32(index)
		req.AddData(msg)
		spec := nl.NewRtAttr(unix.IFLA_AF_SPEC, nil)
		conf := spec.AddRtAttr(unix.AF_INET, nil).AddRtAttr(iflaInetConf, nil)
		conf.AddRtAttr(ipv4DevconfForwading, nl.Uint32Attr(1))
		req.AddData(spec)
		_, err := req.Execute(unix.NETLINK_ROUTE, 0)
		return err
	})
	if err != nil {
		return fmt.Errorf("failed to enable forwarding on %s in sandbox %s: %w", name, sb.path, err)
	}
	return nil
}

func (sb *Sandbox) createSubnet(s Subnet) (subnetLinks, error) {
	sl := subnetLinks{Subnet: s}
	brName, vxName := BridgeName(s.VNI), VXLANName(s.VNI)
	// A segment with IPv6 gets its bridge up only once it has no IPv6
	// address generation (see quietIPv6).
	var flags net.Flags
	if !s.hasIPv6() {
		flags = net.FlagUp
	}
	// The bridge's MAC is set, not inherited: a bridge without one takes
	// the lowest MAC of its ports, so an endpoint leaving would change the
	// MAC behind the gateway and the name server, and every container's
	// ARP entry for them would go stale for seconds.
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: brName, MTU: s.MTU, Flags: flags, TxQLen: -1, Group: LinkGroup,
		HardwareAddr: newBridgeMAC()}}
	if s.hasIPv6() {
		off := false
		br.MulticastSnooping = &off // see snoopingProblem
	}
	if err := sb.h.LinkAdd(br); err != nil {
		return sl, fmt.Errorf("failed to create bridge %s in sandbox %s: %w", brName, sb.path, err)
	}
	sl.bridge = br.Index
	if err := sb.enableForwarding(br.Index, brName); err != nil {
		return sl, err
	}
	if s.hasIPv6() {
		if err := sb.quietIPv6(br); err != nil {
			return sl, err
		}
		if err := sb.h.LinkSetUp(br); err != nil {
			return sl, fmt.Errorf("failed to bring up bridge %s in sandbox %s: %w", brName, sb.path, err)
		}
	}
	for _, gw := range s.gateways() {
		addr := &netlink.Addr{IPNet: prefixToIPNet(gw)}
		if gw.Addr().Is6() {
			// No duplicate address detection: every host's bridge
			// holds the same gateway by design (each answers for it
			// locally), and DAD would only delay the address and send
			// multicast.
			addr.Flags = unix.IFA_F_NODAD
		}
		if err := sb.h.AddrAdd(br, addr); err != nil {
			return sl, fmt.Errorf("failed to add gateway %s to bridge %s in sandbox %s: %w", gw, brName, sb.path, err)
		}
	}
	vx := &netlink.Vxlan{
		LinkAttrs: netlink.LinkAttrs{Name: vxName, MTU: s.MTU, TxQLen: -1, Group: LinkGroup, Namespace: netlink.NsFd(int(sb.ns))},
		VxlanId:   int(s.VNI),
		Port:      sb.host.VXLANPort,
		Learning:  false,
		Proxy:     true,
		L2miss:    false,
		L3miss:    false,
	}
	if sb.host.IPv6 {
		vx.Group = net.IPv6zero // IPv6 family, so IPv6 FDB destinations are accepted
	}
	// Created through the host handle: the UDP socket stays in the host namespace.
	if err := sb.host.Handle.LinkAdd(vx); err != nil {
		if errors.Is(err, unix.EEXIST) {
			return sl, fmt.Errorf("failed to create VXLAN %s (VNI %d, port %d) for sandbox %s: a VXLAN link with VNI %d on UDP port %d already exists in the host namespace (another network or a leftover of an earlier run): %w",
				vxName, s.VNI, sb.host.VXLANPort, sb.path, s.VNI, sb.host.VXLANPort, err)
		}
		return sl, fmt.Errorf("failed to create VXLAN %s (VNI %d, port %d) for sandbox %s: %w", vxName, s.VNI, sb.host.VXLANPort, sb.path, err)
	}
	link, err := sb.h.LinkByName(vxName)
	if err != nil {
		return sl, fmt.Errorf("failed to find VXLAN %s in sandbox %s: %w", vxName, sb.path, err)
	}
	sl.vxlan = link.Attrs().Index
	if s.hasIPv6() {
		// Its permanent IPv6 neighbours answer the containers' Neighbour
		// Solicitations (proxy), which needs IPv6 on the link.
		if err := sb.quietIPv6(link); err != nil {
			return sl, err
		}
	}
	if err := sb.h.LinkSetMasterByIndex(link, sl.bridge); err != nil {
		return sl, fmt.Errorf("failed to attach VXLAN %s to bridge %s in sandbox %s: %w", vxName, brName, sb.path, err)
	}
	if err := sb.h.LinkSetLearning(link, false); err != nil {
		return sl, fmt.Errorf("failed to turn off learning on the bridge port of VXLAN %s in sandbox %s: %w", vxName, sb.path, err)
	}
	if err := sb.h.LinkSetUp(link); err != nil {
		return sl, fmt.Errorf("failed to bring up VXLAN %s in sandbox %s: %w", vxName, sb.path, err)
	}
	return sl, nil
}

// ID returns the network id of the sandbox.
func (sb *Sandbox) ID() string { return sb.id }

// Path returns where the sandbox namespace is mounted.
func (sb *Sandbox) Path() string { return sb.path }

// NS returns the sandbox namespace handle (owned by the sandbox).
func (sb *Sandbox) NS() netns.NsHandle { return sb.ns }

// Destroy deletes the sandbox's links and namespace. The VXLAN links are
// deleted explicitly rather than left to the namespace's asynchronous
// teardown, so their VNIs are free again when Destroy returns.
func (sb *Sandbox) Destroy() error {
	var errs []error
	sb.closeDNS() // a socket would keep the namespace alive
	if sb.h != nil {
		if err := deleteGroup(sb.ns, LinkGroup); err != nil {
			errs = append(errs, fmt.Errorf("failed to delete the links of sandbox %s: %w", sb.path, err))
		}
		// The veths of endpoints that left and await deletion: almost
		// free when there are none (no link, no grace period).
		if err := deleteGroup(sb.ns, RetiredGroup); err != nil {
			errs = append(errs, fmt.Errorf("failed to delete the retired links of sandbox %s: %w", sb.path, err))
		}
		// Whatever the group delete missed (links made by others, or by an
		// older version) goes one by one.
		errs = append(errs, deleteAllLinks(sb.h, sb.path))
		sb.h.Close()
		sb.h = nil
	}
	if sb.batch != nil {
		sb.batch.Close()
		sb.batch = nil
	}
	errs = append(errs, sb.closeARP())
	if sb.ns.IsOpen() {
		sb.ns.Close()
		sb.ns = netns.None()
	}
	errs = append(errs, netnsutil.RemoveNamed(sb.path))
	return errors.Join(errs...)
}

// RemoveLeftover empties and removes a sandbox namespace of network id that
// no Sandbox value owns (a crashed run's). A missing one is not an error.
func RemoveLeftover(host *Host, id string) error {
	path := host.Path(id)
	if netnsutil.IsNamespace(path) {
		ns, err := netnsutil.Open(path)
		if err != nil {
			return err
		}
		// Overlayd's links in two requests (one grace period each), then
		// whatever else is there one by one.
		gerr := errors.Join(deleteGroup(ns, LinkGroup), deleteGroup(ns, RetiredGroup))
		h, err := nlwrap.NewHandleAt(ns, unix.NETLINK_ROUTE)
		ns.Close()
		if err != nil {
			return errors.Join(gerr, fmt.Errorf("failed to open netlink handle in leftover sandbox %s: %w", path, err))
		}
		err = deleteAllLinks(h, path)
		h.Close()
		if err != nil {
			return errors.Join(gerr, err)
		}
	}
	return netnsutil.RemoveNamed(path)
}

// deleteAllLinks deletes every link but loopback in the namespace of h:
// VXLANs first (they hold VNIs in the host namespace), then the rest.
func deleteAllLinks(h *nlwrap.Handle, path string) error {
	links, err := h.LinkList()
	if err != nil {
		return fmt.Errorf("failed to list links in sandbox %s: %w", path, err)
	}
	var errs []error
	for pass := 0; pass < 2; pass++ {
		for _, l := range links {
			isVX := l.Type() == "vxlan"
			if l.Attrs().Name == "lo" || (pass == 0) != isVX {
				continue
			}
			if err := h.LinkDel(l); err != nil && !isNotFound(err) {
				errs = append(errs, fmt.Errorf("failed to delete %s %s in sandbox %s: %w", l.Type(), l.Attrs().Name, path, err))
			}
		}
	}
	return errors.Join(errs...)
}

// deleteGroup deletes every link of group in ns with one request.
func deleteGroup(ns netns.NsHandle, group uint32) error {
	return netnsutil.DoIn(ns, func() error {
		req := nl.NewNetlinkRequest(unix.RTM_DELLINK, unix.NLM_F_ACK)
		req.AddData(nl.NewIfInfomsg(unix.AF_UNSPEC))
		req.AddData(nl.NewRtAttr(unix.IFLA_GROUP, nl.Uint32Attr(group)))
		_, err := req.Execute(unix.NETLINK_ROUTE, 0)
		if errors.Is(err, unix.ENODEV) || errors.Is(err, unix.ENOENT) {
			return nil // no link in the group
		}
		return err
	})
}

func isNotFound(err error) bool {
	var nf netlink.LinkNotFoundError
	return errors.As(err, &nf) || errors.Is(err, unix.ENODEV) || errors.Is(err, unix.ENOENT)
}

func prefixToIPNet(p netip.Prefix) *net.IPNet {
	bits := 32
	if p.Addr().Is6() {
		bits = 128
	}
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), bits)}
}

// Adopt takes over the sandbox of network id left by an earlier run of the
// daemon, if its namespace and links match subnets (names, VNIs, port).
// It returns an error naming the first mismatch; the caller then rebuilds.
func Adopt(host *Host, id string, subnets []Subnet) (_ *Sandbox, err error) {
	path := host.Path(id)
	if !netnsutil.IsNamespace(path) {
		return nil, fmt.Errorf("sandbox %s: no namespace mounted", path)
	}
	ns, err := netnsutil.Open(path)
	if err != nil {
		return nil, err
	}
	sb := &Sandbox{host: host, id: id, path: path, ns: ns, arp: -1, born: time.Now()}
	defer func() {
		if err != nil {
			sb.close()
		}
	}()
	if err := sb.openHandles(); err != nil {
		return nil, err
	}
	for _, s := range subnets {
		sl := subnetLinks{Subnet: s}
		br, err := sb.h.LinkByName(BridgeName(s.VNI))
		if err != nil || br.Type() != "bridge" {
			return nil, fmt.Errorf("sandbox %s: bridge %s missing", path, BridgeName(s.VNI))
		}
		l, err := sb.h.LinkByName(VXLANName(s.VNI))
		vx, ok := l.(*netlink.Vxlan)
		if err != nil || !ok {
			return nil, fmt.Errorf("sandbox %s: vxlan %s missing", path, VXLANName(s.VNI))
		}
		if vx.VxlanId != int(s.VNI) || vx.Port != host.VXLANPort || vx.Attrs().MasterIndex != br.Attrs().Index {
			return nil, fmt.Errorf("sandbox %s: vxlan %s has VNI %d port %d master %d, want VNI %d port %d master %s",
				path, vx.Attrs().Name, vx.VxlanId, vx.Port, vx.Attrs().MasterIndex, s.VNI, host.VXLANPort, BridgeName(s.VNI))
		}
		sl.bridge, sl.vxlan = br.Attrs().Index, vx.Attrs().Index
		sb.subnets = append(sb.subnets, sl)
	}
	// A sandbox of an earlier version still has the hooks.
	sb.brnf = sb.bridgeNetfilterOff()
	return sb, nil
}

// openHandles opens the netlink handle and the batch socket bound to the
// sandbox's namespace.
func (sb *Sandbox) openHandles() (err error) {
	if sb.h, err = nlwrap.NewHandleAt(sb.ns, unix.NETLINK_ROUTE); err != nil {
		return fmt.Errorf("failed to open netlink handle in sandbox %s: %w", sb.path, err)
	}
	if sb.batch, err = nlbatch.Open(sb.ns); err != nil {
		return fmt.Errorf("failed to open netlink socket in sandbox %s: %w", sb.path, err)
	}
	return nil
}

// HasLink reports whether the sandbox holds a link named name.
func (sb *Sandbox) HasLink(name string) bool {
	_, err := sb.h.LinkByName(name)
	return err == nil
}

// close releases the sandbox's handles without touching the kernel.
func (sb *Sandbox) close() {
	sb.closeDNS()
	if sb.h != nil {
		sb.h.Close()
		sb.h = nil
	}
	if sb.batch != nil {
		sb.batch.Close()
		sb.batch = nil
	}
	sb.closeARP() // nothing to report: the kernel state stays
	if sb.ns.IsOpen() {
		sb.ns.Close()
		sb.ns = netns.None()
	}
}

// Close releases the sandbox's handles and leaves the kernel state in place
// (for a daemon that stops while containers keep running).
func (sb *Sandbox) Close() { sb.close() }
