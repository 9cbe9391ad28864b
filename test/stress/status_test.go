//go:build testhooks

package stress

import (
	"fmt"
	"net/netip"
	"path/filepath"
	"slices"
	"sort"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/peerdb"
)

// The driver's own view (driver.Status, what `overlayd status` shows)
// against the model, rendered as lines like the kernel comparison: the
// networks with their settings, endpoints, remote peers (and which one is
// active for its IP), conflicts, and the records of the source the network
// refuses (by key) — the only view of what a network does not hold.

func statusLines(st driver.Status, netnsDir string) []string {
	var lines []string
	for _, n := range st.Networks {
		lines = append(lines, fmt.Sprintf("network %s vnis=%v subnets=%v mtu=%d internal=%v sandbox=%q", n.ID, n.VNIs, n.Subnets, n.MTU, n.Internal, n.Sandbox))
		for _, ep := range n.Endpoints {
			lines = append(lines, fmt.Sprintf("network %s endpoint %s %s%s %s joined=%v veth=%s", n.ID, ep.ID, ep.Address, v6Part(ep.AddressIPv6), ep.MAC, ep.Joined, ep.Veth))
		}
		for _, p := range n.RemotePeers {
			line := fmt.Sprintf("network %s remote {%s %s %s %s} active=%v", n.ID, p.EndpointID, p.IP, p.MAC, p.VTEP, p.Active)
			if p.IPv6 != "" {
				line += fmt.Sprintf(" ipv6=%s active6=%v", p.IPv6, p.ActiveIPv6)
			}
			lines = append(lines, line)
		}
		for _, c := range n.Conflicts {
			lines = append(lines, fmt.Sprintf("network %s conflict %s active=%s local=%v shadowed=%v", n.ID, c.IP, c.Active, c.Local, c.Shadowed))
		}
		for _, r := range n.Rejected {
			line := fmt.Sprintf("network %s refused %s", n.ID, fmtKey(peerdb.Key{VNI: r.VNI, Origin: r.Origin, EndpointID: r.EndpointID}))
			if r.Reason == "" {
				line += " without a reason"
			}
			lines = append(lines, line)
		}
		// A network's error is the last failure to program its peers (or a
		// sandbox left to remove): none in this workload but the known ESP
		// defect's.
		if n.Error != "" {
			lines = append(lines, fmt.Sprintf("network %s error %q", n.ID, n.Error))
		}
	}
	sort.Strings(lines)
	return lines
}

// v6Part renders an IPv6 address after an endpoint's IPv4 one ("" if none).
func v6Part(a string) string {
	if a == "" {
		return ""
	}
	return " ipv6=" + a
}

// prefixString is a prefix as Status shows it: "" when invalid.
func prefixString(p netip.Prefix) string {
	if !p.IsValid() {
		return ""
	}
	return p.String()
}

// addrString is an address as Status shows it: "" when invalid.
func addrString(a netip.Addr) string {
	if !a.IsValid() {
		return ""
	}
	return a.String()
}

// desiredStatus is what the model says Status must show. Each address is
// a claim of its own: a remote record shows, per address it has, whether
// it is that address's active claimant.
func (m *model) desiredStatus(netnsDir string) []string {
	var lines []string
	for _, n := range m.nets {
		vnis := make([]uint32, len(n.subnets))
		var pools []string
		for i, s := range n.subnets {
			vnis[i] = s.vni
			if s.pool.IsValid() {
				pools = append(pools, s.pool.String())
			}
			for _, p := range s.pools6 {
				pools = append(pools, p.String())
			}
		}
		sb := ""
		if n.joined() > 0 {
			sb = filepath.Join(netnsDir, n.id)
		}
		lines = append(lines, fmt.Sprintf("network %s vnis=%v subnets=%v mtu=%d internal=%v sandbox=%q", n.id, vnis, pools, n.mtu, n.internal, sb))
		for _, ep := range n.eps {
			host, _ := vethNames(n.id, ep.id)
			lines = append(lines, fmt.Sprintf("network %s endpoint %s %s%s %s joined=%v veth=%s", n.id, ep.id, prefixString(ep.addr), v6Part(prefixString(ep.addr6)), ep.mac, ep.joined, host))
		}
		// Claimants per IP: joined endpoints (by id), then remotes in
		// precedence order.
		locals := map[netip.Addr][]string{}
		remotes := map[netip.Addr][]peerdb.Peer{}
		for _, ep := range n.eps {
			if !ep.joined {
				continue
			}
			for _, a := range []netip.Prefix{ep.addr, ep.addr6} {
				if a.IsValid() {
					locals[a.Addr()] = append(locals[a.Addr()], ep.id)
				}
			}
		}
		for p := range n.remote {
			for _, a := range []netip.Addr{p.IP, p.IPv6} {
				if a.IsValid() {
					remotes[a] = append(remotes[a], p)
				}
			}
		}
		// active[ip] is the remote record active for ip (none where a
		// joined endpoint claims it).
		active := map[netip.Addr]peerdb.Peer{}
		ips := map[netip.Addr]bool{}
		for ip := range locals {
			ips[ip] = true
		}
		for ip := range remotes {
			ips[ip] = true
		}
		for ip := range ips {
			ls, rs := locals[ip], remotes[ip]
			sort.Strings(ls)
			slices.SortFunc(rs, func(a, b peerdb.Peer) int {
				if remoteLess(a, b) {
					return -1
				}
				if remoteLess(b, a) {
					return 1
				}
				return 0
			})
			if len(ls) == 0 && len(rs) > 0 {
				active[ip] = rs[0]
			}
			if len(ls)+len(rs) < 2 {
				continue
			}
			var ids []string
			ids = append(ids, ls...)
			for _, p := range rs {
				ids = append(ids, p.EndpointID)
			}
			lines = append(lines, fmt.Sprintf("network %s conflict %s active=%s local=%v shadowed=%v", n.id, ip, ids[0], len(ls) > 0, ids[1:]))
		}
		for p := range n.remote {
			act := func(a netip.Addr) bool { q, ok := active[a]; return a.IsValid() && ok && q == p }
			line := fmt.Sprintf("network %s remote {%s %s %s %s} active=%v", n.id, p.EndpointID, addrString(p.IP), p.MAC, p.VTEP, act(p.IP))
			if p.IPv6.IsValid() {
				line += fmt.Sprintf(" ipv6=%s active6=%v", p.IPv6, act(p.IPv6))
			}
			lines = append(lines, line)
		}
		for _, k := range n.rejected {
			lines = append(lines, fmt.Sprintf("network %s refused %s", n.id, fmtKey(k)))
		}
	}
	sort.Strings(lines)
	return lines
}

func compareStatus(e *env, m *model) []string {
	var diffs []string
	for _, l := range diffLines(m.desiredStatus(e.netnsDir), statusLines(e.d.Status(), e.netnsDir)) {
		diffs = append(diffs, "driver status vs model: "+l)
	}
	return diffs
}
