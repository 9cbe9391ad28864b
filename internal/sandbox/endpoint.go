package sandbox

import (
	"errors"
	"fmt"
	"slices"

	"github.com/vishvananda/netlink"

	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/overlayd/overlayd/internal/nlwrap"
	"github.com/overlayd/overlayd/peerdb"
)

// Endpoint describes the veth of one joined endpoint: SandboxName is the end
// left on the subnet's bridge in the sandbox; HostName is the end created in
// the host namespace, which dockerd moves into the container.
type Endpoint struct {
	Subnet      int // index into the sandbox's subnets
	HostName    string
	SandboxName string
	MAC         peerdb.MAC
	MTU         int
}

// AddEndpoint creates the endpoint's veth pair: the sandbox end enslaved to
// the subnet's bridge and up, as a port that gets no unknown unicast and
// has a static entry for the endpoint's MAC (see setEndpointPort), the host
// end in the host namespace with the endpoint's MAC and MTU. On failure
// nothing is left behind.
//
// Two things keep the kernel from waiting for RCU grace periods while it
// holds RTNL, the lock every network's link changes share (two or three
// expedited grace periods per Join otherwise): each end is created with
// one queue each way, which the kernel would otherwise allocate per CPU
// and then cut to one; and the sandbox end is brought up only once it is
// on its bridge, as an up link without carrier (its peer is down until
// dockerd moves it into the container) is deactivated again as soon as
// anyone reads it.
func (sb *Sandbox) AddEndpoint(ep Endpoint) error {
	if ep.Subnet < 0 || ep.Subnet >= len(sb.subnets) {
		return fmt.Errorf("endpoint %s: subnet index %d out of range (sandbox %s has %d subnets)", ep.HostName, ep.Subnet, sb.path, len(sb.subnets))
	}
	sl := sb.subnets[ep.Subnet]
	veth := &netlink.Veth{
		LinkAttrs: netlink.LinkAttrs{
			Name:        ep.SandboxName,
			MTU:         ep.MTU,
			TxQLen:      -1,
			Group:       LinkGroup,
			NumTxQueues: 1,
			NumRxQueues: 1,
		},
		PeerName:         ep.HostName,
		PeerHardwareAddr: ep.MAC.HardwareAddr(),
		PeerNamespace:    netlink.NsFd(int(sb.host.NS)),
		PeerTxQLen:       -1,
		PeerNumTxQueues:  1,
		PeerNumRxQueues:  1,
	}
	if err := sb.h.LinkAdd(veth); err != nil {
		if errors.Is(err, errExist) {
			return fmt.Errorf("failed to create veth %s/%s for sandbox %s: a link with one of these names already exists: %w", ep.SandboxName, ep.HostName, sb.path, err)
		}
		return fmt.Errorf("failed to create veth %s/%s for sandbox %s: %w", ep.SandboxName, ep.HostName, sb.path, err)
	}
	if err := sb.h.LinkSetMasterByIndex(veth, sl.bridge); err != nil {
		sb.h.LinkDel(veth)
		return fmt.Errorf("failed to attach veth %s to bridge %s in sandbox %s: %w", ep.SandboxName, BridgeName(sl.VNI), sb.path, err)
	}
	if err := sb.setEndpointPort(veth, ep); err != nil {
		sb.h.LinkDel(veth)
		return err
	}
	if sl.hasIPv6() {
		// A port has no address of its own: no link-local, so it sends
		// no DAD, router solicitation or MLD report (see quietIPv6).
		if err := sb.h.LinkSetIP6AddrGenMode(veth, addrGenModeNone); err != nil {
			sb.h.LinkDel(veth)
			return fmt.Errorf("failed to turn off IPv6 address generation on veth %s in sandbox %s: %w", ep.SandboxName, sb.path, err)
		}
	}
	if err := sb.h.LinkSetUp(veth); err != nil {
		sb.h.LinkDel(veth)
		return fmt.Errorf("failed to bring up veth %s in sandbox %s: %w", ep.SandboxName, sb.path, err)
	}
	sb.fresh = false
	return nil
}

// RemoveEndpoint deletes the endpoint's veth pair through its sandbox end.
// A pair that is already gone (its container namespace was destroyed) is not
// an error.
func (sb *Sandbox) RemoveEndpoint(sandboxName string) error {
	l, err := sb.h.LinkByName(sandboxName)
	if err != nil {
		if isNotFound(err) {
			return nil
		}
		return fmt.Errorf("failed to find veth %s in sandbox %s: %w", sandboxName, sb.path, err)
	}
	if err := sb.h.LinkDel(l); err != nil && !isNotFound(err) {
		return fmt.Errorf("failed to delete veth %s in sandbox %s: %w", sandboxName, sb.path, err)
	}
	return nil
}

// RetireEndpoint takes the endpoint's veth out of service at once and
// leaves its deletion for later (ReapRetired): the sandbox end joins
// RetiredGroup, which marks it, in the kernel itself, as awaiting deletion
// (the mark survives a restart of the daemon), and leaves the bridge,
// which drops the bridge's entries for the port, the endpoint's static one
// included: nothing reaches or leaves the network through it any more.
// That costs the kernel one expedited grace period; the deletion costs
// several, and a full one (see package reaper). It is not brought down,
// which would cost another: off the bridge it forwards nothing, and its
// peer goes down when dockerd takes it back from the container. The names
// stay taken until the deletion: a new veth of the same names must wait
// for it. retired is false when the veth is already gone (its container's
// namespace was destroyed).
func (sb *Sandbox) RetireEndpoint(sandboxName string) (retired bool, err error) {
	l, err := sb.h.LinkByName(sandboxName)
	if err != nil {
		if isNotFound(err) {
			return false, nil
		}
		return false, fmt.Errorf("failed to find veth %s in sandbox %s: %w", sandboxName, sb.path, err)
	}
	// The group first: whatever happens next, the link is marked for
	// deletion, never left in the sandbox as an endpoint's.
	if err := sb.h.LinkSetGroup(l, RetiredGroup); err != nil {
		if isNotFound(err) {
			return false, nil
		}
		return false, fmt.Errorf("failed to retire veth %s in sandbox %s: %w", sandboxName, sb.path, err)
	}
	if err := sb.h.LinkSetNoMaster(l); err != nil && !isNotFound(err) {
		return true, fmt.Errorf("failed to take retired veth %s off its bridge in sandbox %s: %w", sandboxName, sb.path, err)
	}
	return true, nil
}

// Retired returns the names of the sandbox's links that await deletion
// (RetireEndpoint), sorted.
func (sb *Sandbox) Retired() ([]string, error) {
	links, err := sb.h.LinkList()
	if err != nil {
		return nil, fmt.Errorf("failed to list links in sandbox %s: %w", sb.path, err)
	}
	var names []string
	for _, l := range links {
		if l.Attrs().Group == RetiredGroup {
			names = append(names, l.Attrs().Name)
		}
	}
	slices.Sort(names)
	return names, nil
}

// ReapRetired deletes every link awaiting deletion in the sandbox of
// network id, in one request (one grace period for all of them, and both
// ends of each veth). A sandbox that is gone, or holds none, is not an
// error. It opens the namespace by its path rather than through a Sandbox,
// so it may run on any goroutine while the sandbox's owner uses it (or
// after it was destroyed, and another made at the same path: links of
// RetiredGroup are to be deleted in any sandbox).
func (hs *Host) ReapRetired(id string) error {
	path := hs.Path(id)
	if !netnsutil.IsNamespace(path) {
		return nil
	}
	ns, err := netnsutil.Open(path)
	if err != nil {
		if !netnsutil.IsNamespace(path) {
			return nil // removed meanwhile
		}
		return err
	}
	defer ns.Close()
	if err := deleteGroup(ns, RetiredGroup); err != nil {
		return fmt.Errorf("failed to delete the retired links of sandbox %s: %w", path, err)
	}
	return nil
}

// RemoveHostLink deletes a link left in the host namespace (the host end of a
// veth whose sandbox end could not be created). Missing is not an error.
func RemoveHostLink(h *nlwrap.Handle, name string) error {
	l, err := h.LinkByName(name)
	if err != nil {
		if isNotFound(err) {
			return nil
		}
		return err
	}
	if err := h.LinkDel(l); err != nil && !isNotFound(err) {
		return fmt.Errorf("failed to delete %s in the host namespace: %w", name, err)
	}
	return nil
}
