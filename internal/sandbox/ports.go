package sandbox

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/peerdb"
)

// portProblems describes how the bridge port of the VXLAN link of subnet sl
// differs from what it must be (see the package doc): learning off, and no
// MAC learned on it (an entry learned before learning was turned off, or by
// an earlier version, still sends a local MAC's traffic into the tunnel
// until it ages out). It returns the learned entries too, for RepairPorts.
func (sb *Sandbox) portProblems(sl subnetLinks) ([]string, []netlink.Neigh, error) {
	vxName := VXLANName(sl.VNI)
	l, err := sb.h.LinkByIndex(sl.vxlan)
	if err != nil {
		return nil, nil, fmt.Errorf("failed to find VXLAN %s in sandbox %s: %w", vxName, sb.path, err)
	}
	pi, err := sb.h.LinkGetProtinfo(l)
	if err != nil {
		return nil, nil, fmt.Errorf("failed to read the bridge port settings of VXLAN %s in sandbox %s: %w", vxName, sb.path, err)
	}
	var problems []string
	if pi.Learning {
		problems = append(problems, fmt.Sprintf("vxlan %s: bridge port learning on, want off", vxName))
	}
	fdbs, err := sb.h.NeighList(sl.vxlan, unix.AF_BRIDGE)
	if err != nil {
		return nil, nil, fmt.Errorf("failed to dump fdb of %s in sandbox %s: %w", vxName, sb.path, err)
	}
	var learned []netlink.Neigh
	for _, f := range fdbs {
		// The bridge's entries for the port (dumped with the bridge as
		// master, not NTF_SELF, which are the VXLAN link's own); the
		// permanent one is the port's own address, which the bridge keeps.
		if f.MasterIndex != sl.bridge || f.Flags&netlink.NTF_SELF != 0 || f.State&netlink.NUD_PERMANENT != 0 || f.LinkIndex != sl.vxlan {
			continue
		}
		f.Flags |= netlink.NTF_MASTER // deleting it must address the bridge
		problems = append(problems, fmt.Sprintf("vxlan %s: bridge learned %s on the port, want nothing learned", vxName, f.HardwareAddr))
		learned = append(learned, f)
	}
	return problems, learned, nil
}

// setEndpointPort makes the bridge port of an endpoint's veth what it must
// be: no unknown unicast flooded to it, and a static bridge entry for the
// endpoint's MAC. With the VXLAN's port not learning, the bridge never
// learns where a remote MAC is, and would flood every frame to a remote
// endpoint to every local container as well as to the VXLAN link: a copy
// per container, and one container's cross-host traffic shown to the
// others. The static entry brings frames to the endpoint even before it
// sent any (or after the bridge aged out what it learned); broadcasts (ARP)
// still reach every port.
func (sb *Sandbox) setEndpointPort(l netlink.Link, ep Endpoint) error {
	if err := sb.h.LinkSetFlood(l, false); err != nil {
		return fmt.Errorf("failed to turn off unknown-unicast flooding to veth %s in sandbox %s: %w", ep.SandboxName, sb.path, err)
	}
	static := &netlink.Neigh{LinkIndex: l.Attrs().Index, Family: unix.AF_BRIDGE, Flags: netlink.NTF_MASTER, State: netlink.NUD_NOARP, HardwareAddr: ep.MAC.HardwareAddr()}
	if err := sb.h.NeighSet(static); err != nil {
		return fmt.Errorf("failed to add the bridge entry of %s on veth %s in sandbox %s: %w", ep.MAC, ep.SandboxName, sb.path, err)
	}
	return nil
}

// endpointPortProblems describes how the bridge port of an endpoint's veth
// l floods differently from what setEndpointPort makes (its static entry
// is checked per MAC, by missingStatic).
func (sb *Sandbox) endpointPortProblems(l netlink.Link, ep Endpoint) ([]string, error) {
	pi, err := sb.h.LinkGetProtinfo(l)
	if err != nil {
		return nil, fmt.Errorf("failed to read the bridge port settings of veth %s in sandbox %s: %w", ep.SandboxName, sb.path, err)
	}
	if pi.Flood {
		return []string{fmt.Sprintf("veth %s: unknown-unicast flooding on, want off", ep.SandboxName)}, nil
	}
	return nil, nil
}

// missingStatic returns, for every MAC of the given endpoints that has no
// static bridge entry on the port of an endpoint with that MAC in the same
// subnet, the endpoint that should have it (the first by veth name). A
// bridge holds one entry per MAC: endpoints that share one (dockerd gave
// them the same) share the entry, on whichever of their ports it is.
// Endpoints whose veth is gone are left out (Audit reports the veth; Leave
// removes the endpoint).
func (sb *Sandbox) missingStatic(endpoints []Endpoint) ([]Endpoint, error) {
	type group struct {
		first Endpoint
		ok    bool
	}
	type key struct {
		subnet int // each subnet has its own bridge
		mac    peerdb.MAC
	}
	groups := map[key]*group{}
	for _, ep := range endpoints {
		l, err := sb.h.LinkByName(ep.SandboxName)
		if err != nil {
			continue
		}
		k := key{ep.Subnet, ep.MAC}
		g := groups[k]
		if g == nil {
			g = &group{first: ep}
			groups[k] = g
		} else if ep.SandboxName < g.first.SandboxName {
			g.first = ep
		}
		fdbs, err := sb.h.NeighList(l.Attrs().Index, unix.AF_BRIDGE)
		if err != nil {
			return nil, fmt.Errorf("failed to dump fdb of %s in sandbox %s: %w", ep.SandboxName, sb.path, err)
		}
		g.ok = g.ok || slices.ContainsFunc(fdbs, func(f netlink.Neigh) bool {
			return f.MasterIndex != 0 && f.Flags&netlink.NTF_SELF == 0 && f.State&netlink.NUD_NOARP != 0 &&
				f.LinkIndex == l.Attrs().Index && len(f.HardwareAddr) == 6 && peerdb.MAC(f.HardwareAddr) == ep.MAC
		})
	}
	var missing []Endpoint
	for _, g := range groups {
		if !g.ok {
			missing = append(missing, g.first)
		}
	}
	slices.SortFunc(missing, func(a, b Endpoint) int { return strings.Compare(a.SandboxName, b.SandboxName) })
	return missing, nil
}

func staticProblem(ep Endpoint) string {
	return fmt.Sprintf("veth %s: static bridge entry for %s missing", ep.SandboxName, ep.MAC)
}

// RestoreEndpointPort makes the bridge port of ep's veth what AddEndpoint
// made it. The driver calls it when another endpoint with the same MAC
// left: the bridge's one entry for the MAC went with that endpoint's veth.
func (sb *Sandbox) RestoreEndpointPort(ep Endpoint) error {
	l, err := sb.h.LinkByName(ep.SandboxName)
	if err != nil {
		if isNotFound(err) {
			return nil
		}
		return fmt.Errorf("failed to find veth %s in sandbox %s: %w", ep.SandboxName, sb.path, err)
	}
	return sb.setEndpointPort(l, ep)
}

// RepairPorts makes the bridge ports what they must be: for every VXLAN
// link, learning off and nothing learned on it; for the veth of every
// endpoint given (the joined ones), what setEndpointPort makes; and the
// bridge of a segment with IPv6 not snooping multicast (snoopingProblem). It returns
// what it corrected, each naming the link; the level-triggered repair calls
// it, so a port someone changed, or that an earlier version made, is
// restored.
func (sb *Sandbox) RepairPorts(endpoints []Endpoint) ([]string, error) {
	var fixed []string
	var errs []error
	for _, ep := range endpoints {
		l, err := sb.h.LinkByName(ep.SandboxName)
		if err != nil {
			continue // a veth gone with its container: Audit reports it, Leave removes it
		}
		problems, err := sb.endpointPortProblems(l, ep)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if len(problems) == 0 {
			continue
		}
		if err := sb.h.LinkSetFlood(l, false); err != nil {
			errs = append(errs, fmt.Errorf("failed to turn off unknown-unicast flooding to veth %s in sandbox %s: %w", ep.SandboxName, sb.path, err))
			continue
		}
		fixed = append(fixed, problems...)
	}
	missing, err := sb.missingStatic(endpoints)
	if err != nil {
		errs = append(errs, err)
	}
	for _, ep := range missing {
		if err := sb.RestoreEndpointPort(ep); err != nil {
			errs = append(errs, err)
		} else {
			fixed = append(fixed, staticProblem(ep))
		}
	}
	for _, sl := range sb.subnets {
		if p, err := sb.repairSnooping(&sl); err != nil {
			errs = append(errs, err)
		} else if p != "" {
			fixed = append(fixed, p)
		}
		problems, learned, err := sb.portProblems(sl)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		if len(problems) == 0 {
			continue
		}
		vxName := VXLANName(sl.VNI)
		// Learning off first, so nothing is learned again between the two.
		if err := sb.h.LinkSetLearning(&netlink.Vxlan{LinkAttrs: netlink.LinkAttrs{Index: sl.vxlan, Name: vxName}}, false); err != nil {
			errs = append(errs, fmt.Errorf("failed to turn off learning on the bridge port of VXLAN %s in sandbox %s: %w", vxName, sb.path, err))
			continue
		}
		for _, f := range learned {
			if err := sb.h.NeighDel(&f); err != nil && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("failed to delete the bridge entry %s learned on VXLAN %s in sandbox %s: %w", f.HardwareAddr, vxName, sb.path, err))
			}
		}
		fixed = append(fixed, problems...)
	}
	return fixed, errors.Join(errs...)
}
