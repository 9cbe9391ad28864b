package sandbox

import (
	"errors"
	"fmt"
	"net"

	"github.com/vishvananda/netlink"

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
func (sb *Sandbox) AddEndpoint(ep Endpoint) error {
	if ep.Subnet < 0 || ep.Subnet >= len(sb.subnets) {
		return fmt.Errorf("endpoint %s: subnet index %d out of range (sandbox %s has %d subnets)", ep.HostName, ep.Subnet, sb.path, len(sb.subnets))
	}
	sl := sb.subnets[ep.Subnet]
	veth := &netlink.Veth{
		LinkAttrs: netlink.LinkAttrs{
			Name:   ep.SandboxName,
			MTU:    ep.MTU,
			TxQLen: -1,
			Flags:  net.FlagUp,
			Group:  LinkGroup,
		},
		PeerName:         ep.HostName,
		PeerHardwareAddr: ep.MAC.HardwareAddr(),
		PeerNamespace:    netlink.NsFd(int(sb.host.NS)),
		PeerTxQLen:       -1,
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

// RemoveHostLink deletes a link left in the host namespace (the host end of a
// veth whose sandbox end could not be created). Missing is not an error.
func RemoveHostLink(h *netlink.Handle, name string) error {
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
