package sandbox

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/vishvananda/netlink"

	"github.com/overlayd/overlayd/internal/netnsutil"
)

// addrGenModeNone is IN6_ADDR_GEN_MODE_NONE (linux/if_link.h): the link
// gets no automatic IPv6 address, link-local included.
const addrGenModeNone = 1

// quietIPv6 prepares a link of a segment with IPv6, before it is up: IPv6
// enabled on it (the bridge holds the IPv6 gateways, the VXLAN link the
// permanent IPv6 neighbours its proxy answers Neighbour Solicitations
// from), and no automatic addresses. Without a link-local address a link
// sends no duplicate address detection, no router solicitation and no
// MLD report of its own: the sandbox adds no multicast to the segment.
// (What containers send is theirs; none of it crosses to other hosts,
// because the VXLAN links have no all-zeros FDB entry: multicast has no
// destination there.)
func (sb *Sandbox) quietIPv6(l netlink.Link) error {
	name := l.Attrs().Name
	if err := sb.enableIPv6(name); err != nil {
		return err
	}
	if err := sb.h.LinkSetIP6AddrGenMode(l, addrGenModeNone); err != nil {
		return fmt.Errorf("failed to turn off IPv6 address generation on %s in sandbox %s: %w", name, sb.path, err)
	}
	return nil
}

// enableIPv6 makes sure IPv6 is not disabled on link name: a namespace
// inherits disable_ipv6 from the host's defaults when the host sets
// net.core.devconf_inherit_init_net. The sysctl is read and written only
// if it is set (netlink cannot change it; a managed plugin's /proc/sys is
// read-only, so there the error says what to change on the host).
func (sb *Sandbox) enableIPv6(name string) error {
	path := filepath.Join("/proc/sys/net/ipv6/conf", name, "disable_ipv6")
	return netnsutil.DoIn(sb.ns, func() error {
		b, err := os.ReadFile(path)
		if errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("IPv6 is not available on %s in sandbox %s (no %s: is the kernel booted with ipv6.disable=1?)", name, sb.path, path)
		}
		if err != nil {
			return fmt.Errorf("failed to read %s for %s in sandbox %s: %w", path, name, sb.path, err)
		}
		if strings.TrimSpace(string(b)) == "0" {
			return nil
		}
		if err := os.WriteFile(path, []byte("0"), 0); err != nil {
			return fmt.Errorf("IPv6 is disabled on %s in sandbox %s (new namespaces inherit the host's net.ipv6.conf.default.disable_ipv6=1) and enabling it failed: %w; set net.ipv6.conf.default.disable_ipv6=0 or net.core.devconf_inherit_init_net=0 on the host", name, sb.path, err)
		}
		return nil
	})
}
