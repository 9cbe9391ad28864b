package driver

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net/netip"

	api "github.com/docker/go-plugins-helpers/network"

	"github.com/overlayd/overlayd/internal/reaper"
	"github.com/overlayd/overlayd/internal/sandbox"
	"github.com/overlayd/overlayd/peerdb"
)

// endpoint is one endpoint of a network; guarded by its network's mu.
type endpoint struct {
	id       string
	addr     netip.Prefix // IPv4 address with the pool's prefix length as Docker gave it; invalid if none
	addr6    netip.Prefix // IPv6 address with its prefix length as Docker gave it; invalid if none
	mac      peerdb.MAC
	subnet   int // index into network.subnets
	hostName string
	sbName   string
	joined   bool
	// sandboxKey: the container's namespace, as the last Join named it
	// (which container the endpoint belongs to, for the names it may
	// resolve); dnsRoute: that Join gave the container the route to the
	// name server (see claimDNSRouteLocked).
	sandboxKey string
	dnsRoute   bool
	// names: the endpoint's DNS names, packed (internal/dnsname), as the
	// engine last gave them (SetNames).
	names string
}

// peer returns the endpoint's record without a VTEP: the local VTEP has
// one owner (see VTEP), and a local entry of the peer table needs none.
func (ep *endpoint) peer() peerdb.Peer {
	return peerdb.Peer{EndpointID: ep.id, IP: ep.addr.Addr(), IPv6: ep.addr6.Addr(), MAC: ep.mac}
}

// addrs renders the endpoint's addresses for logs and status.
func (ep *endpoint) addrs() string {
	switch {
	case !ep.addr6.IsValid():
		return ep.addr.String()
	case !ep.addr.IsValid():
		return ep.addr6.String()
	}
	return ep.addr.String() + "," + ep.addr6.String()
}

func (ep *endpoint) sandboxEndpoint(mtu int) sandbox.Endpoint {
	return sandbox.Endpoint{Subnet: ep.subnet, HostName: ep.hostName, SandboxName: ep.sbName, MAC: ep.mac, MTU: mtu}
}

// linkNames derives the veth names of an endpoint from a hash of the network
// and endpoint ids: unique in practice, at most 15 bytes, and the same after a
// restart.
func linkNames(netID, epID string) (host, sb string) {
	sum := sha256.Sum256([]byte(netID + "/" + epID))
	h := hex.EncodeToString(sum[:])
	return "ovd" + h[:12], "ovs" + h[:12]
}

// CreateEndpoint records an endpoint. It has an IPv4 address
// (Interface.Address), an IPv6 address (Interface.AddressIPv6) or both,
// each in one of the network's subnets of its family (so an endpoint of an
// IPv6-only network has no IPv4 address). The MAC is Docker's if given
// (never changed), otherwise derived from the endpoint id (unique even when two hosts hand out the same
// address) and returned; either way it is persisted with the endpoint, so a
// restart keeps it. No kernel change.
func (d *Driver) CreateEndpoint(req *api.CreateEndpointRequest) (*api.CreateEndpointResponse, error) {
	if req == nil {
		return nil, errors.New("CreateEndpoint: empty request")
	}
	if err := checkID("EndpointID", req.EndpointID); err != nil {
		return nil, err
	}
	if req.Interface == nil || req.Interface.Address == "" && req.Interface.AddressIPv6 == "" {
		return nil, fmt.Errorf("endpoint %q: Interface.Address and Interface.AddressIPv6 are empty: an overlayd endpoint needs an address", req.EndpointID)
	}
	var addr, addr6 netip.Prefix
	var err error
	if req.Interface.Address != "" {
		addr, err = netip.ParsePrefix(req.Interface.Address)
		if err != nil || !addr.Addr().Is4() {
			return nil, fmt.Errorf("endpoint %q: Interface.Address %q is not an IPv4 address with prefix length (like 192.0.2.5/24)", req.EndpointID, req.Interface.Address)
		}
	}
	if req.Interface.AddressIPv6 != "" {
		addr6, err = netip.ParsePrefix(req.Interface.AddressIPv6)
		if err != nil || !addr6.Addr().Is6() || addr6.Addr().Is4In6() || addr6.Addr().Zone() != "" {
			return nil, fmt.Errorf("endpoint %q: Interface.AddressIPv6 %q is not an IPv6 address with prefix length (like 2001:db8:1::5/64)", req.EndpointID, req.Interface.AddressIPv6)
		}
	}
	var mac peerdb.MAC
	macGiven := req.Interface.MacAddress != ""
	if macGiven {
		if mac, err = peerdb.ParseMAC(req.Interface.MacAddress); err != nil || !mac.IsUnicast() {
			return nil, fmt.Errorf("endpoint %q: Interface.MacAddress %q is not a unicast 48-bit MAC address", req.EndpointID, req.Interface.MacAddress)
		}
	} else {
		mac = peerdb.MACFromEndpointID(req.EndpointID)
	}

	n, unlock, err := d.lockNetwork(req.NetworkID)
	if err != nil {
		return nil, fmt.Errorf("CreateEndpoint %q: %w", req.EndpointID, err)
	}
	defer unlock()
	if _, exists := n.endpoints[req.EndpointID]; exists {
		return nil, fmt.Errorf("EndpointID %q already exists in network %q", req.EndpointID, n.id)
	}
	subnet, err := n.segmentOfLocked(addr, addr6)
	if err != nil {
		return nil, fmt.Errorf("endpoint %q: %w", req.EndpointID, err)
	}
	ep := &endpoint{id: req.EndpointID, addr: addr, addr6: addr6, mac: mac, subnet: subnet}
	ep.hostName, ep.sbName = linkNames(n.id, ep.id)
	if err := d.saveEndpoint(n, ep); err != nil {
		return nil, fmt.Errorf("CreateEndpoint %q: %w", ep.id, err)
	}
	n.endpoints[ep.id] = ep
	d.trace(TraceEvent{Kind: TraceCreateEndpoint, Network: n.id, Endpoint: ep.id, Addr: ep.addr, MAC: ep.mac})
	resp := &api.CreateEndpointResponse{}
	if !macGiven {
		resp.Interface = &api.EndpointInterface{MacAddress: mac.String()}
	}
	return resp, nil
}

// DeleteEndpoint forgets an endpoint, undoing its Join first if dockerd did
// not send Leave. Unknown networks and endpoints succeed (dockerd sends them
// after restarts).
func (d *Driver) DeleteEndpoint(req *api.DeleteEndpointRequest) error {
	if req == nil {
		return errors.New("DeleteEndpoint: empty request")
	}
	n, unlock, err := d.lockNetwork(req.NetworkID)
	if err != nil {
		if IsNotFound(err) {
			return nil
		}
		return err
	}
	defer unlock()
	ep := n.endpoints[req.EndpointID]
	if ep == nil {
		return nil
	}
	if ep.joined {
		if err := d.leaveLocked(n, ep); err != nil {
			return err
		}
	}
	if err := d.forgetEndpoint(n, ep); err != nil {
		return fmt.Errorf("DeleteEndpoint %q: %w", ep.id, err)
	}
	delete(n.endpoints, ep.id)
	d.trace(TraceEvent{Kind: TraceDeleteEndpoint, Network: n.id, Endpoint: ep.id})
	return nil
}

// EndpointInfo returns operational data of an endpoint.
func (d *Driver) EndpointInfo(req *api.InfoRequest) (*api.InfoResponse, error) {
	if req == nil {
		return nil, errors.New("EndpointOperInfo: empty request")
	}
	n, unlock, err := d.lockNetwork(req.NetworkID)
	if err != nil {
		return nil, err
	}
	defer unlock()
	ep := n.endpoints[req.EndpointID]
	if ep == nil {
		return nil, &notFoundError{what: "endpoint", id: req.EndpointID}
	}
	return &api.InfoResponse{Value: map[string]string{
		"address": ep.addrs(),
		"mac":     ep.mac.String(),
		"vni":     fmt.Sprint(n.subnets[ep.subnet].vni),
		"veth":    ep.hostName,
	}}, nil
}

// Join builds the network's sandbox if this is its first local endpoint,
// creates the endpoint's veth and records it as a local peer. Any failure
// undoes everything this call did, kernel and encryption state included.
func (d *Driver) Join(req *api.JoinRequest) (_ *api.JoinResponse, err error) {
	if req == nil {
		return nil, errors.New("Join: empty request")
	}
	n, unlock, err := d.lockNetwork(req.NetworkID)
	if err != nil {
		return nil, fmt.Errorf("Join of endpoint %q: %w", req.EndpointID, err)
	}
	defer unlock()
	ep := n.endpoints[req.EndpointID]
	if ep == nil {
		return nil, fmt.Errorf("Join: endpoint %q not found in network %q (CreateEndpoint first)", req.EndpointID, n.id)
	}
	if ep.joined {
		return nil, fmt.Errorf("Join: endpoint %q of network %q is already joined", ep.id, n.id)
	}
	var undo []func()
	defer func() {
		if err != nil {
			for i := len(undo) - 1; i >= 0; i-- {
				undo[i]()
			}
		}
	}()
	// The sandbox the last Leave handed to the reaper goes before a new
	// one is built: it holds the namespace's path and the VNIs. If its
	// teardown failed, it is marked for teardown and retried just below.
	d.settleTeardownLocked(n, true)
	if n.teardown {
		// The last Leave could not remove the sandbox: finish that first
		// rather than joining a half-removed one.
		if err := d.destroySandboxLocked(n); err != nil {
			return nil, fmt.Errorf("Join of endpoint %q: the network's previous sandbox could not be removed: %w", ep.id, err)
		}
	}
	if n.sb == nil {
		if n.encrypted {
			if err := d.checkEncryption(); err != nil {
				return nil, fmt.Errorf("Join of endpoint %q to encrypted network %q: %w", ep.id, n.id, err)
			}
		}
		sb, err := sandbox.Create(d.host, n.id, n.sandboxSubnets(d.cfg.DNSAddress))
		if err != nil {
			return nil, fmt.Errorf("Join of endpoint %q: %w", ep.id, err)
		}
		n.sb = sb
		d.noteBridgeNetfilter(n)
		undo = append(undo, func() {
			if err := d.destroySandboxLocked(n); err != nil {
				d.log.Error("rollback: failed to destroy sandbox; the periodic reconcile retries", "network", n.id, "error", err)
			}
			if err := d.syncEncLocked(n, false); err != nil {
				d.log.Error("rollback: encryption state", "network", n.id, "error", err)
			}
		})
		// Encryption for the known peers before they are programmed.
		if err := d.syncEncLocked(n, true); err != nil {
			return nil, fmt.Errorf("Join of endpoint %q: %w", ep.id, err)
		}
		if err := sb.Populate(n.peers.Desired()); err != nil {
			return nil, fmt.Errorf("Join of endpoint %q: programming the known peers of network %q: %w", ep.id, n.id, err)
		}
	}
	if err := n.sb.AddEndpoint(ep.sandboxEndpoint(n.mtu)); err != nil {
		// A link holds one of the names (derived from the ids, so a
		// re-Join reuses them): the veth of this endpoint's previous Join,
		// retired and awaiting deletion, or a host end left by a crash.
		// Delete it now and retry once.
		rmErr := d.finishRetiredLocked(n)
		if rmErr == nil {
			rmErr = sandbox.RemoveHostLink(d.host.Handle, ep.hostName)
		}
		if rmErr == nil {
			err = n.sb.AddEndpoint(ep.sandboxEndpoint(n.mtu))
		}
		if err != nil {
			return nil, fmt.Errorf("Join of endpoint %q: %w", ep.id, err)
		}
	}
	undo = append(undo, func() {
		if err := n.sb.RemoveEndpoint(ep.sbName); err != nil {
			d.log.Error("rollback: failed to remove veth", "network", n.id, "endpoint", ep.id, "error", err)
		}
	})
	delta, err := n.peers.AddLocal(ep.peer())
	if err != nil {
		return nil, fmt.Errorf("Join of endpoint %q: %w", ep.id, err)
	}
	undo = append(undo, func() {
		// The local entry shadowed remote claimants of its IP: restore
		// them, with their VTEPs' encryption state first, as any change
		// of peers.
		back, _ := n.peers.RemoveLocal(ep.id)
		if err := d.programLocked(n, back); err != nil {
			d.log.Error("rollback: failed to restore peers", "network", n.id, "error", err)
		}
	})
	if err := n.sb.ApplyDelta(delta); err != nil {
		return nil, fmt.Errorf("Join of endpoint %q: %w", ep.id, err)
	}
	// The local endpoint may shadow a remote claimant of its IP, whose VTEP
	// may then need no SA any more. A failure leaves more state than
	// needed, never less, and the encryption owner reports and retries it.
	if err := d.syncEncLocked(n, false); err != nil {
		d.log.Warn("encryption state after a Join", "network", n.id, "error", err)
	}
	ep.joined, ep.sandboxKey = true, req.SandboxKey
	ep.dnsRoute = ep.addr.IsValid() && d.claimDNSRouteLocked(n, ep)
	if err := d.saveEndpoint(n, ep); err != nil {
		d.releaseDNSRouteLocked(n, ep)
		ep.joined = false
		return nil, fmt.Errorf("Join of endpoint %q: %w", ep.id, err)
	}
	n.joined++
	d.publishLocked(n, ep, true)
	d.trace(TraceEvent{Kind: TraceJoin, Network: n.id, Endpoint: ep.id, Addr: ep.addr, MAC: ep.mac})

	resp := &api.JoinResponse{
		InterfaceName:         api.InterfaceName{SrcName: ep.hostName, DstPrefix: "eth"},
		DisableGatewayService: n.internal,
	}
	own := n.subnets[ep.subnet]
	for i, s := range n.subnets {
		if i == ep.subnet || !own.gateway.IsValid() {
			continue
		}
		resp.StaticRoutes = append(resp.StaticRoutes, &api.StaticRoute{
			Destination: s.pool.String(), RouteType: 0, NextHop: own.gateway.Addr().String(),
		})
	}
	if ep.addr6.IsValid() {
		// Every IPv6 subnet is on the one segment (see netdef.Subnet): the
		// others are on-link, reached without a router.
		for _, s := range own.v6 {
			switch {
			case s.Pool.Contains(ep.addr6.Addr()):
				if s.Gateway.IsValid() {
					resp.GatewayIPv6 = s.Gateway.Addr().String()
				}
			default:
				resp.StaticRoutes = append(resp.StaticRoutes, &api.StaticRoute{Destination: s.Pool.String(), RouteType: routeConnected})
			}
		}
	}
	if ep.dnsRoute {
		// On-link through the endpoint's own link: the name server's
		// address is on the segment's bridge (see serveNamesLocked).
		resp.StaticRoutes = append(resp.StaticRoutes, &api.StaticRoute{
			Destination: netip.PrefixFrom(d.cfg.DNSAddress, 32).String(), RouteType: routeConnected,
		})
	}
	d.serveNamesLocked(n)
	d.namesChangedLocked()
	d.log.Debug("endpoint joined", "network", n.id, "endpoint", ep.id, "address", ep.addrs(), "veth", ep.hostName)
	return resp, nil
}

// routeConnected is libnetwork's route type of an on-link static route
// (types.CONNECTED; 0 is a route via NextHop).
const routeConnected = 1

// segmentOfLocked returns the segment of an endpoint with these addresses (either
// may be invalid, not both): the one whose subnets hold them; the error
// names the field.
func (n *network) segmentOfLocked(addr, addr6 netip.Prefix) (int, error) {
	seg := -1
	if addr.IsValid() {
		for i := range n.subnets {
			if n.subnets[i].contains(addr.Addr()) {
				seg = i
			}
		}
		if seg < 0 {
			if n.subnets[0].pool.IsValid() {
				return 0, fmt.Errorf("Interface.Address %s is not in any subnet of network %q (%v)", addr, n.id, n.pools())
			}
			return 0, fmt.Errorf("Interface.Address %s: network %q is IPv6-only (%v): its endpoints have no IPv4 address", addr, n.id, n.pools())
		}
	}
	if addr6.IsValid() {
		if !n.hasIPv6() {
			return 0, fmt.Errorf("Interface.AddressIPv6 %s: network %q has no IPv6 subnet (%v): create it with --ipv6 and an IPv6 --subnet", addr6, n.id, n.pools())
		}
		if !n.subnets[0].contains(addr6.Addr()) {
			return 0, fmt.Errorf("Interface.AddressIPv6 %s is not in any IPv6 subnet of network %q (%v)", addr6, n.id, n.pools())
		}
		seg = 0
	}
	return seg, nil
}

// destroySandboxLocked removes n's sandbox. On failure it keeps the reference and
// marks the network for teardown: the periodic reconcile and the next Join
// retry, so no namespace is leaked and none is reused half-removed.
func (d *Driver) destroySandboxLocked(n *network) error {
	if n.sb == nil {
		n.teardown = false
		return nil
	}
	if err := n.sb.Destroy(); err != nil {
		n.teardown = true
		return err
	}
	n.sb, n.teardown = nil, false
	return nil
}

// Leave undoes Join. Unknown networks and endpoints succeed.
func (d *Driver) Leave(req *api.LeaveRequest) error {
	if req == nil {
		return errors.New("Leave: empty request")
	}
	n, unlock, err := d.lockNetwork(req.NetworkID)
	if err != nil {
		if IsNotFound(err) {
			return nil
		}
		return err
	}
	defer unlock()
	ep := n.endpoints[req.EndpointID]
	if ep == nil || !ep.joined {
		return nil
	}
	return d.leaveLocked(n, ep)
}

// leaveLocked removes what Join made for ep: its local peer (re-activating remote
// claimants of its IP), its veth, and the sandbox when ep was the last joined
// endpoint. The deletions themselves, which make the kernel wait for grace
// periods, are handed to the reaper (see retireSandboxLocked and
// reapRetiredLocked):
// the veth is retired at once (marked for deletion, off the bridge)
// and the sandbox handed over whole, so the caller does not wait for them.
func (d *Driver) leaveLocked(n *network, ep *endpoint) error {
	var delta peerdb.Delta
	if !faultActive(FaultLeaveKeepsLocal) {
		delta, _ = n.peers.RemoveLocal(ep.id)
	}
	ep.joined = false
	d.releaseDNSRouteLocked(n, ep)
	n.joined--
	d.publishLocked(n, ep, false)
	d.namesChangedLocked()
	d.trace(TraceEvent{Kind: TraceLeave, Network: n.id, Endpoint: ep.id})
	var errs []error
	if n.joined == 0 {
		d.retireSandboxLocked(n)
		if err := d.syncEncLocked(n, false); err != nil {
			errs = append(errs, err)
		}
	} else {
		retired, err := n.sb.RetireEndpoint(ep.sbName)
		if err != nil {
			errs = append(errs, err)
		}
		if retired {
			d.reapRetiredLocked(n)
		}
		// The bridge's one entry for ep's MAC may have gone with its port:
		// give it back to another endpoint with that MAC (dockerd gave
		// both the same).
		for _, o := range n.endpoints {
			if o.joined && o.mac == ep.mac && o.subnet == ep.subnet {
				if err := n.sb.RestoreEndpointPort(o.sandboxEndpoint(n.mtu)); err != nil {
					errs = append(errs, err)
				}
			}
		}
		// The delta may re-activate a remote claimant of the IP: its VTEP
		// needs SAs and a policy before its neighbour is programmed.
		if err := d.programLocked(n, delta); err != nil {
			errs = append(errs, err)
		}
	}
	if err := d.saveEndpoint(n, ep); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("Leave of endpoint %q from network %q: %w", ep.id, n.id, err)
	}
	return nil
}

// dyingSandbox is a sandbox the last Leave handed to the reaper, and the
// job that destroys it.
type dyingSandbox struct {
	sb  *sandbox.Sandbox
	job *reaper.Job
}

// retireSandboxLocked hands n's sandbox to the reaper, which destroys it (links,
// namespace) off the caller's path. Until the teardown is settled, a Join
// or DeleteNetwork of n finishes it first (settleTeardownLocked): a new sandbox
// never races the old one for its path or its VNIs. A daemon that dies
// meanwhile leaves a namespace of a network without joined endpoints,
// which the next start removes. n.sb is set.
func (d *Driver) retireSandboxLocked(n *network) {
	sb := n.sb
	n.sb, n.teardown = nil, false
	n.reapVeths = nil // the teardown deletes the retired veths too
	n.dying = &dyingSandbox{sb: sb, job: d.reaper.Submit("sandbox "+sb.Path(), sb.Destroy, sb.Close)}
}

// settleTeardownLocked ends n's pending teardown, if any: when wait, it runs it
// (or waits for it); otherwise it only collects one that is over. A
// teardown that failed gives the sandbox back marked for teardown, so the
// next Join or the periodic reconcile retries it as a failed Leave's; its
// error is returned.
func (d *Driver) settleTeardownLocked(n *network, wait bool) error {
	if n.dying == nil || (!wait && n.dying.job.Pending()) {
		return nil
	}
	dying := n.dying
	n.dying = nil
	if err := dying.job.Finish(); err != nil {
		n.sb, n.teardown = dying.sb, true
		return err
	}
	return nil
}

// reapRetiredLocked has the reaper delete n's retired veths, unless a deletion
// nobody has started yet is queued already: that one deletes whatever is
// retired when it starts, so Leaves in a burst share one deletion (one
// grace period).
func (d *Driver) reapRetiredLocked(n *network) {
	if n.reapVeths != nil && n.reapVeths.Queued() {
		return
	}
	id := n.id
	n.reapVeths = d.reaper.Submit("retired veths of network "+id, func() error { return d.host.ReapRetired(id) }, nil)
}

// finishRetiredLocked deletes n's retired veths now: it runs the queued
// deletion in the caller or waits for the running one, and deletes them
// itself if none is pending (or the pending one failed).
func (d *Driver) finishRetiredLocked(n *network) error {
	if j := n.reapVeths; j != nil {
		n.reapVeths = nil
		if j.Finish() == nil {
			return nil
		}
	}
	return d.host.ReapRetired(n.id)
}

// reapingRetiredLocked reports whether a deletion of n's retired veths is
// queued or under way.
func (n *network) reapingRetiredLocked() bool {
	return n.reapVeths != nil && n.reapVeths.Pending()
}

// tearingDownLocked reports whether the teardown of n's last sandbox is
// queued or under way.
func (n *network) tearingDownLocked() bool {
	return n.dying != nil && n.dying.job.Pending()
}

// teardownFailedLocked reports whether the reaper's teardown of n's last
// sandbox ended with an error not yet collected (settleTeardownLocked
// retries it).
func (n *network) teardownFailedLocked() bool {
	return n.dying != nil && !n.dying.job.Pending() && n.dying.job.Err() != nil
}

// WaitDeletions returns once every deletion Leaves handed over before the
// call (veths, sandboxes) is done.
func (d *Driver) WaitDeletions() { d.reaper.Wait() }

// publishLocked tells the control plane that a local endpoint joined or
// left. The record carries no VTEP (see VTEP).
func (d *Driver) publishLocked(n *network, ep *endpoint, up bool) {
	// No VTEP: the control plane gives the record the VTEP it advertises,
	// which follows this driver's (LocalPublisher.VTEPChanged).
	p := ep.peer()
	vni := n.subnets[ep.subnet].vni
	if up {
		d.cfg.Publisher.PublishLocalPeer(vni, nil, &p)
	} else {
		d.cfg.Publisher.PublishLocalPeer(vni, &p, nil)
	}
}
