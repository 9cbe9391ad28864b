//go:build testhooks

package stress

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/netnsutil"
)

// The kernel side of the oracle: netlink dumps rendered in the same line
// format as model.desired, so that the comparison is a plain set difference.
// It reads the kernel with its own handles and code (not internal/sandbox's),
// opening each sandbox namespace from its mount in the netns directory.

// dumpKernel renders the host namespace's links, the sandbox directory and
// the contents of every sandbox namespace mounted there.
func dumpKernel(host *netlink.Handle, netnsDir string) ([]string, error) {
	var lines []string
	links, err := listLinks(host)
	if err != nil {
		return nil, fmt.Errorf("host links: %w", err)
	}
	for _, l := range links {
		a := l.Attrs()
		line := fmt.Sprintf("host link %s %s", a.Name, l.Type())
		if strings.HasPrefix(a.Name, "ov") {
			line += fmt.Sprintf(" %s mtu=%d mac=%s", upDown(a), a.MTU, a.HardwareAddr)
		}
		lines = append(lines, line)
	}
	entries, err := os.ReadDir(netnsDir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, err
	}
	for _, e := range entries {
		id := e.Name()
		lines = append(lines, "sandbox "+id)
		path := filepath.Join(netnsDir, id)
		if !netnsutil.IsNamespace(path) {
			lines = append(lines, id+" is not a mounted network namespace")
			continue
		}
		sl, err := dumpSandbox(id, path)
		if err != nil {
			return nil, err
		}
		lines = append(lines, sl...)
	}
	sort.Strings(lines)
	return lines, nil
}

func upDown(a *netlink.LinkAttrs) string {
	if a.Flags&net.FlagUp != 0 {
		return "up"
	}
	return "down"
}

func dumpSandbox(id, path string) ([]string, error) {
	ns, err := netns.GetFromPath(path)
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: %w", path, err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns, unix.NETLINK_ROUTE)
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: netlink handle: %w", path, err)
	}
	defer h.Close()
	links, err := listLinks(h)
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: links: %w", path, err)
	}
	var lines []string
	names := map[int]string{}
	for _, l := range links {
		names[l.Attrs().Index] = l.Attrs().Name
	}
	for _, l := range links {
		a := l.Attrs()
		line := fmt.Sprintf("%s link %s %s %s", id, a.Name, l.Type(), upDown(a))
		if a.Name != "lo" {
			line += fmt.Sprintf(" mtu=%d", a.MTU)
		}
		if a.MasterIndex != 0 {
			m, ok := names[a.MasterIndex]
			if !ok {
				m = fmt.Sprintf("ifindex%d", a.MasterIndex)
			}
			line += " master=" + m
		}
		if vx, ok := l.(*netlink.Vxlan); ok {
			line += fmt.Sprintf(" vni=%d port=%d learning=%v proxy=%v l2miss=%v l3miss=%v", vx.VxlanId, vx.Port, vx.Learning, vx.Proxy, vx.L2miss, vx.L3miss)
			if vx.Group != nil && !vx.Group.IsUnspecified() {
				line += " group=" + vx.Group.String()
			}
		}
		lines = append(lines, line)
	}
	// Addresses of both families; the kernel's own IPv6 ones (link-local,
	// and ::1 on lo) are not the driver's.
	addrs, err := retry(func() ([]netlink.Addr, error) { return h.AddrList(nil, unix.AF_UNSPEC) })
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: addresses: %w", path, err)
	}
	for _, a := range addrs {
		ones, _ := a.Mask.Size()
		ip, _ := netip.AddrFromSlice(a.IP)
		ip = ip.Unmap()
		if ip.Is6() && (ip.IsLinkLocalUnicast() || ip.IsLoopback()) {
			continue
		}
		lines = append(lines, fmt.Sprintf("%s addr %s %s", id, names[a.LinkIndex], netip.PrefixFrom(ip, ones)))
	}
	// IPv4 forwarding on each bridge (routing between the subnets of a
	// multi-subnet network), read in the sandbox's namespace.
	if err := netnsutil.DoIn(ns, func() error {
		for _, l := range links {
			if l.Type() != "bridge" {
				continue
			}
			b, err := os.ReadFile("/proc/sys/net/ipv4/conf/" + l.Attrs().Name + "/forwarding")
			if err != nil {
				return err
			}
			lines = append(lines, fmt.Sprintf("%s sysctl net.ipv4.conf.%s.forwarding=%s", id, l.Attrs().Name, strings.TrimSpace(string(b))))
		}
		return nil
	}); err != nil {
		return nil, fmt.Errorf("sandbox %s: forwarding: %w", path, err)
	}

	// Neighbours: every IPv4 and IPv6 entry in the namespace (only the
	// VXLANs should have any). FDB: the VXLANs' own ("self") entries.
	neighs, err := retry(func() ([]netlink.Neigh, error) { return h.NeighList(0, unix.AF_INET) })
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: neighbours: %w", path, err)
	}
	neighs6, err := retry(func() ([]netlink.Neigh, error) { return h.NeighList(0, unix.AF_INET6) })
	if err != nil {
		return nil, fmt.Errorf("sandbox %s: IPv6 neighbours: %w", path, err)
	}
	for _, n := range append(neighs, neighs6...) {
		ip, _ := netip.AddrFromSlice(n.IP)
		if ip.IsMulticast() {
			continue // the kernel's own (IGMP and MLD from the bridge's gateway addresses)
		}
		lines = append(lines, fmt.Sprintf("%s neigh %s %s lladdr %s %s", id, names[n.LinkIndex], ip.Unmap(), n.HardwareAddr, nudState(n.State)))
	}
	for _, l := range links {
		if l.Type() != "vxlan" {
			continue
		}
		fdbs, err := retry(func() ([]netlink.Neigh, error) { return h.NeighList(l.Attrs().Index, unix.AF_BRIDGE) })
		if err != nil {
			return nil, fmt.Errorf("sandbox %s: fdb of %s: %w", path, l.Attrs().Name, err)
		}
		for _, f := range fdbs {
			// Only the VXLAN's own table (NTF_SELF); the bridge's entries
			// for its port (its permanent entry for the port's MAC) come
			// without NTF_SELF and are not the driver's.
			if f.Flags&netlink.NTF_SELF == 0 || f.LinkIndex != l.Attrs().Index {
				continue
			}
			lines = append(lines, fmt.Sprintf("%s fdb %s %s dst %s self %s", id, l.Attrs().Name, f.HardwareAddr, ipString(f.IP), nudState(f.State)))
		}
	}
	return lines, nil
}

func ipString(ip net.IP) string {
	if ip == nil {
		return "none"
	}
	a, _ := netip.AddrFromSlice(ip)
	return a.Unmap().String()
}

func nudState(s int) string {
	names := []struct {
		bit  int
		name string
	}{
		{netlink.NUD_PERMANENT, "permanent"}, {netlink.NUD_NOARP, "noarp"}, {netlink.NUD_REACHABLE, "reachable"},
		{netlink.NUD_STALE, "stale"}, {netlink.NUD_DELAY, "delay"}, {netlink.NUD_PROBE, "probe"},
		{netlink.NUD_FAILED, "failed"}, {netlink.NUD_INCOMPLETE, "incomplete"},
	}
	var out []string
	for _, n := range names {
		if s&n.bit != 0 {
			out = append(out, n.name)
		}
	}
	if len(out) == 0 {
		return fmt.Sprintf("state=%#x", s)
	}
	return strings.Join(out, ",")
}

func listLinks(h *netlink.Handle) ([]netlink.Link, error) {
	return retry(h.LinkList)
}

// retry repeats a dump the kernel reports as interrupted by a concurrent
// change (its partial result would be wrong).
func retry[T any](f func() ([]T, error)) ([]T, error) {
	var err error
	for i := 0; i < 20; i++ {
		var res []T
		res, err = f()
		if !errors.Is(err, netlink.ErrDumpInterrupted) {
			return res, err
		}
	}
	return nil, err
}
