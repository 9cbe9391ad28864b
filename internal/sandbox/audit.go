package sandbox

import (
	"fmt"
	"net"
	"net/netip"
	"slices"
	"sort"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/peerdb"
)

// Audit compares the sandbox's links and peer entries with what they should
// be: a bridge per subnet (up, MTU, gateway address), a VXLAN per subnet (VNI,
// port, learning off, proxy on, MTU, enslaved, up, its bridge port not
// learning and nothing learned on it), the sandbox end of every
// joined endpoint's veth (enslaved to its subnet's bridge, up, no
// unknown-unicast flooding to it, a static entry for its MAC) and nothing
// else, and exactly the desired neighbour and FDB entries. An empty result
// means the kernel holds exactly the desired state.
//
// Links awaiting deletion (RetiredGroup) are neither missing nor extra
// while reaping says their deletion is queued or under way; otherwise
// each is reported, as nothing will delete it. The caller must tell
// reaping as it was before Audit lists the links: a deletion that ends
// meanwhile then removes them, and one that had ended already cannot.
func (sb *Sandbox) Audit(want peerdb.State, endpoints []Endpoint, reaping bool) ([]string, error) {
	var problems []string
	links, err := sb.h.LinkList()
	if err != nil {
		return nil, fmt.Errorf("failed to list links in sandbox %s: %w", sb.path, err)
	}
	byName := map[string]netlink.Link{}
	for _, l := range links {
		byName[l.Attrs().Name] = l
	}
	expected := map[string]bool{"lo": true}
	for _, sl := range sb.subnets {
		brName, vxName := BridgeName(sl.VNI), VXLANName(sl.VNI)
		expected[brName], expected[vxName] = true, true
		br, ok := byName[brName]
		switch {
		case !ok:
			problems = append(problems, fmt.Sprintf("bridge %s: missing", brName))
		case br.Type() != "bridge":
			problems = append(problems, fmt.Sprintf("bridge %s: is a %s", brName, br.Type()))
		default:
			problems = append(problems, checkUpMTU(br, sl.MTU)...)
			if br.Attrs().Index != sl.bridge {
				problems = append(problems, fmt.Sprintf("bridge %s: ifindex %d, want %d", brName, br.Attrs().Index, sl.bridge))
			}
			problems = append(problems, sb.checkGateways(br, sl.gateways())...)
			if p := snoopingProblem(br, &sl); p != "" {
				problems = append(problems, p)
			}
		}
		l, ok := byName[vxName]
		vx, isVX := l.(*netlink.Vxlan)
		switch {
		case !ok:
			problems = append(problems, fmt.Sprintf("vxlan %s: missing", vxName))
		case !isVX:
			problems = append(problems, fmt.Sprintf("vxlan %s: is a %s", vxName, l.Type()))
		default:
			problems = append(problems, checkUpMTU(vx, sl.MTU)...)
			if vx.VxlanId != int(sl.VNI) {
				problems = append(problems, fmt.Sprintf("vxlan %s: VNI %d, want %d", vxName, vx.VxlanId, sl.VNI))
			}
			if vx.Port != sb.host.VXLANPort {
				problems = append(problems, fmt.Sprintf("vxlan %s: port %d, want %d", vxName, vx.Port, sb.host.VXLANPort))
			}
			if vx.Learning {
				problems = append(problems, fmt.Sprintf("vxlan %s: learning on, want off", vxName))
			}
			if !vx.Proxy {
				problems = append(problems, fmt.Sprintf("vxlan %s: proxy off, want on", vxName))
			}
			if vx.Attrs().MasterIndex != sl.bridge {
				problems = append(problems, fmt.Sprintf("vxlan %s: master ifindex %d, want %s (%d)", vxName, vx.Attrs().MasterIndex, brName, sl.bridge))
			}
			if vx.Attrs().Index != sl.vxlan {
				problems = append(problems, fmt.Sprintf("vxlan %s: ifindex %d, want %d", vxName, vx.Attrs().Index, sl.vxlan))
			} else {
				p, _, err := sb.portProblems(sl)
				if err != nil {
					return nil, err
				}
				problems = append(problems, p...)
			}
		}
	}
	for _, ep := range endpoints {
		expected[ep.SandboxName] = true
		l, ok := byName[ep.SandboxName]
		if !ok {
			problems = append(problems, fmt.Sprintf("veth %s: missing", ep.SandboxName))
			continue
		}
		if l.Type() != "veth" {
			problems = append(problems, fmt.Sprintf("veth %s: is a %s", ep.SandboxName, l.Type()))
			continue
		}
		if l.Attrs().Group == RetiredGroup {
			problems = append(problems, fmt.Sprintf("veth %s: awaits deletion, but its endpoint is joined", ep.SandboxName))
			continue
		}
		problems = append(problems, checkUpMTU(l, ep.MTU)...)
		if ep.Subnet >= 0 && ep.Subnet < len(sb.subnets) && l.Attrs().MasterIndex != sb.subnets[ep.Subnet].bridge {
			problems = append(problems, fmt.Sprintf("veth %s: master ifindex %d, want %s", ep.SandboxName, l.Attrs().MasterIndex, BridgeName(sb.subnets[ep.Subnet].VNI)))
			continue
		}
		p, err := sb.endpointPortProblems(l, ep)
		if err != nil {
			return nil, err
		}
		problems = append(problems, p...)
	}
	missing, err := sb.missingStatic(endpoints)
	if err != nil {
		return nil, err
	}
	for _, ep := range missing {
		problems = append(problems, staticProblem(ep))
	}
	for name, l := range byName {
		switch {
		case expected[name]:
		case l.Attrs().Group == RetiredGroup && reaping:
			// Its deletion is queued or under way.
		case l.Attrs().Group == RetiredGroup:
			problems = append(problems, fmt.Sprintf("%s %s: awaits deletion, but none is queued", l.Type(), name))
		default:
			problems = append(problems, fmt.Sprintf("%s %s: not desired", l.Type(), name))
		}
	}
	have, err := sb.Dump()
	if err != nil {
		return nil, err
	}
	_, peerProblems := Diff(want, have)
	problems = append(problems, peerProblems...)
	sort.Strings(problems)
	return problems, nil
}

func checkUpMTU(l netlink.Link, mtu int) []string {
	var p []string
	a := l.Attrs()
	if a.Flags&net.FlagUp == 0 {
		p = append(p, fmt.Sprintf("%s %s: down, want up", l.Type(), a.Name))
	}
	if mtu > 0 && a.MTU != mtu {
		p = append(p, fmt.Sprintf("%s %s: MTU %d, want %d", l.Type(), a.Name, a.MTU, mtu))
	}
	return p
}

// checkGateways reports a bridge whose addresses are not exactly gws (of
// both families; IPv6 link-local addresses are not the sandbox's concern
// and are skipped).
func (sb *Sandbox) checkGateways(br netlink.Link, gws []netip.Prefix) []string {
	addrs, err := sb.h.AddrList(br, unix.AF_UNSPEC)
	if err != nil {
		return []string{fmt.Sprintf("bridge %s: cannot list addresses: %v", br.Attrs().Name, err)}
	}
	var p []string
	found := map[netip.Prefix]bool{}
	for _, a := range addrs {
		ip, _ := netip.AddrFromSlice(a.IP)
		ip = ip.Unmap()
		if ip.IsLinkLocalUnicast() && ip.Is6() {
			continue
		}
		ones, _ := a.Mask.Size()
		have := netip.PrefixFrom(ip, ones)
		if slices.Contains(gws, have) {
			found[have] = true
			continue
		}
		p = append(p, fmt.Sprintf("bridge %s: address %s not desired", br.Attrs().Name, have))
	}
	for _, gw := range gws {
		if !found[gw] {
			p = append(p, fmt.Sprintf("bridge %s: gateway %s missing", br.Attrs().Name, gw))
		}
	}
	return p
}
