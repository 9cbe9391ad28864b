package sandbox

import (
	"errors"
	"fmt"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
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
	fdbs, err := neighList(sb.h, sl.vxlan, unix.AF_BRIDGE)
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

// RepairPorts makes the bridge port of every VXLAN link what it must be:
// learning off and nothing learned on it. It returns what it corrected, each
// naming the link; the level-triggered repair calls it, so a port someone
// turned learning back on is restored.
func (sb *Sandbox) RepairPorts() ([]string, error) {
	var fixed []string
	var errs []error
	for _, sl := range sb.subnets {
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
