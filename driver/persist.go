package driver

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"slices"
	"strings"

	"github.com/overlayd/overlayd/encryption"
	"github.com/overlayd/overlayd/internal/dnsname"
	"github.com/overlayd/overlayd/internal/lockorder"
	"github.com/overlayd/overlayd/internal/logkeys"
	"github.com/overlayd/overlayd/internal/netdef"
	"github.com/overlayd/overlayd/internal/sandbox"
	"github.com/overlayd/overlayd/internal/statefile"
	"github.com/overlayd/overlayd/peerdb"
)

// recordLocked returns what is persisted of n (also called before n is
// published, when no other goroutine can reach it).
func (n *network) recordLocked() statefile.Network {
	r := statefile.Network{ID: n.id, VNIs: n.vnis(), MTU: n.mtu, Internal: n.internal, Encrypted: n.encrypted, Options: n.options}
	for _, s := range n.subnets {
		r.Pools = append(r.Pools, prefixString(s.pool))
		r.Gateways = append(r.Gateways, prefixString(s.gateway))
		for _, v := range s.v6 {
			r.Pools6 = append(r.Pools6, v.Pool.String())
			r.Gateways6 = append(r.Gateways6, prefixString(v.Gateway))
		}
	}
	return r
}

// prefixString renders p, "" when invalid.
func prefixString(p netip.Prefix) string {
	if p.IsValid() {
		return p.String()
	}
	return ""
}

// parseOptionalPrefix parses s, the invalid prefix when "".
func parseOptionalPrefix(s string) (netip.Prefix, error) {
	if s == "" {
		return netip.Prefix{}, nil
	}
	return netip.ParsePrefix(s)
}

func (ep *endpoint) recordLocked(netID string) statefile.Endpoint {
	r := statefile.Endpoint{Network: netID, ID: ep.id, Addr: prefixString(ep.addr), AddrIPv6: prefixString(ep.addr6), MAC: ep.mac.String(), Joined: ep.joined,
		HostName: ep.hostName, SandboxName: ep.sbName, SandboxKey: ep.sandboxKey, DNSRoute: ep.dnsRoute, Names: ep.names}
	return r
}

func (d *Driver) saveNetwork(n *network) error {
	if d.cfg.StateFile == nil {
		return nil
	}
	return d.cfg.StateFile.PutNetwork(n.recordLocked())
}

func (d *Driver) forgetNetwork(n *network) error {
	if d.cfg.StateFile == nil {
		return nil
	}
	return d.cfg.StateFile.DeleteNetwork(n.id)
}

func (d *Driver) saveEndpoint(n *network, ep *endpoint) error {
	if d.cfg.StateFile == nil {
		return nil
	}
	return d.cfg.StateFile.PutEndpoint(ep.recordLocked(n.id))
}

func (d *Driver) forgetEndpoint(n *network, ep *endpoint) error {
	if d.cfg.StateFile == nil {
		return nil
	}
	return d.cfg.StateFile.DeleteEndpoint(n.id, ep.id)
}

func (d *Driver) saveAllocation(netID string, vnis []uint32) error {
	if d.cfg.StateFile == nil {
		return nil
	}
	return d.cfg.StateFile.PutAllocation(netID, vnis)
}

// restore loads the persisted state and adopts the kernel state an earlier
// run left: sandboxes that match are taken over as they are (running
// containers keep their connectivity), sandboxes that do not are rebuilt,
// and overlayd-owned leftovers that belong to nothing are removed. Remote
// peers are not persisted: the kernel keeps programming them until the
// control plane re-delivers them and ReconcileAll runs. Called from New,
// before the driver is shared.
func (d *Driver) restore() error {
	st, err := d.cfg.StateFile.Load()
	if err != nil {
		return err
	}
	d.adopting = true
	for id, vnis := range st.Allocations {
		d.allocNet[id] = vnis
		for _, v := range vnis {
			d.allocs[v] = id
		}
	}
	eps := map[string][]statefile.Endpoint{}
	for _, e := range st.Endpoints {
		eps[e.Network] = append(eps[e.Network], e)
	}
	keepNS := map[string]bool{}
	keepHostLinks := map[string]bool{}
	for _, rec := range st.Networks {
		n, err := networkFromRecord(rec)
		if err != nil {
			return &statefile.CorruptError{Path: d.cfg.StateFile.Path(), Err: fmt.Errorf("network %q: %w", rec.ID, err)}
		}
		for _, s := range n.subnets {
			if other := d.byVNI[s.vni]; other != nil {
				return &statefile.CorruptError{Path: d.cfg.StateFile.Path(), Err: fmt.Errorf("VNI %d is held by networks %q and %q", s.vni, other.id, n.id)}
			}
			d.byVNI[s.vni] = n
		}
		d.nets[n.id] = n
		d.lastID++
		n.share = encryption.ShareID(d.lastID)
		var joined []*endpoint
		for _, er := range eps[n.id] {
			ep, err := endpointFromRecord(n, er)
			if err != nil {
				return &statefile.CorruptError{Path: d.cfg.StateFile.Path(), Err: fmt.Errorf("endpoint %q of network %q: %w", er.ID, n.id, err)}
			}
			n.endpoints[ep.id] = ep
			if ep.joined {
				joined = append(joined, ep)
				keepHostLinks[ep.hostName] = true
			}
		}
		if len(joined) == 0 {
			continue
		}
		keepNS[n.id] = true
		sb, err := sandbox.Adopt(d.host, n.id, n.sandboxSubnets(d.cfg.DNSAddress))
		if err != nil {
			d.log.Warn("cannot adopt sandbox, rebuilding it: endpoints joined before the restart lose their link", "network", n.id, "error", err)
			if sb, err = sandbox.Create(d.host, n.id, n.sandboxSubnets(d.cfg.DNSAddress)); err != nil {
				return fmt.Errorf("restoring network %q: %w", n.id, err)
			}
		}
		n.sb = sb
		d.noteBridgeNetfilter(n)
		for _, ep := range joined {
			n.joined++
			if ep.dnsRoute {
				d.dnsRoutes[ep.sandboxKey] = n.id + "/" + ep.id
			}
			if _, err := n.peers.AddLocal(ep.peer()); err != nil {
				d.log.Warn("restored endpoint does not fit its network", "network", n.id, "endpoint", ep.id, "error", err)
			}
			if !sb.HasLink(ep.sbName) {
				d.log.Info("endpoint's veth is gone (its container stopped while overlayd was down); waiting for Leave", "network", n.id, "endpoint", ep.id)
			}
		}
		// The veths of endpoints that left before the restart, whose
		// deletion the earlier run had not done.
		if p, err := d.reapLeftRetiredLocked(n); err != nil {
			d.log.Warn("listing the veths of an adopted sandbox that await deletion; the periodic reconcile retries", "network", n.id, "error", err)
		} else if p != "" {
			d.log.Info("deleting the veths an earlier run retired", "network", n.id, "first", p)
		}
		// A sandbox an earlier version made has bridge ports that let a
		// remote frame move a local MAC: fix them before serving.
		if fixed, err := sb.RepairPorts(n.joinedEndpointsLocked()); err != nil {
			d.log.Warn("restoring the bridge ports of an adopted sandbox; the periodic reconcile retries", "network", n.id, "error", err)
		} else if len(fixed) > 0 {
			d.log.Info("restored the bridge ports of an adopted sandbox", "network", n.id, "corrected", len(fixed), "first", fixed[0])
		}
		d.serveNamesLocked(n)
		d.log.Info("network restored", logkeys.Event, logkeys.NetworkRestored, logkeys.Network, n.id, logkeys.VNIs, formatVNIs(n.vnis()), "joined", n.joined)
	}
	// Every network's share, before dockerd can call: the encryption
	// owner keeps what the earlier run programmed until Settle (no peer is
	// known yet), so running containers keep their encrypted traffic.
	for _, n := range d.nets {
		if err := d.syncEncLocked(n, false); err != nil {
			d.log.Warn("restoring the encryption share of a network (the encryption owner retries)", "network", n.id, "error", err)
		}
	}
	d.removeLeftovers(keepNS, keepHostLinks)
	return nil
}

// removeLeftovers deletes sandbox namespaces and host veth ends that belong
// to no network or joined endpoint (a crash between steps, or state removed
// by hand).
func (d *Driver) removeLeftovers(keepNS, keepHostLinks map[string]bool) {
	entries, err := os.ReadDir(d.cfg.NetnsDir)
	if err == nil {
		for _, e := range entries {
			if keepNS[e.Name()] {
				continue
			}
			if err := sandbox.RemoveLeftover(d.host, e.Name()); err != nil {
				d.log.Warn("failed to remove leftover sandbox", "sandbox", e.Name(), "error", err)
			} else {
				d.log.Info("removed leftover sandbox", "sandbox", e.Name())
			}
		}
	}
	links, err := d.host.Handle.LinkList()
	if err != nil {
		d.log.Warn("failed to list host links", "error", err)
		return
	}
	for _, l := range links {
		name := l.Attrs().Name
		if l.Type() != "veth" || !isHostVethName(name) || keepHostLinks[name] {
			continue
		}
		if err := sandbox.RemoveHostLink(d.host.Handle, name); err != nil {
			d.log.Warn("failed to remove leftover veth", "link", name, "error", err)
		} else {
			d.log.Info("removed leftover veth", "link", name)
		}
	}
}

// isHostVethName reports whether name has the shape of linkNames' host end.
func isHostVethName(name string) bool {
	if len(name) != 15 || !strings.HasPrefix(name, "ovd") {
		return false
	}
	for _, c := range name[3:] {
		if !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

func networkFromRecord(r statefile.Network) (*network, error) {
	if err := checkID("id", r.ID); err != nil {
		return nil, err
	}
	if len(r.Pools) == 0 || len(r.Pools) != len(r.VNIs) || len(r.Gateways) != len(r.Pools) {
		return nil, errors.New("pools, VNIs and gateways do not match")
	}
	n := &network{
		mu:        lockorder.New(lockorder.LevelNetwork),
		id:        r.ID,
		mtu:       r.MTU,
		internal:  r.Internal,
		encrypted: r.Encrypted,
		options:   r.Options,
		endpoints: map[string]*endpoint{},
	}
	if len(r.Pools6) != len(r.Gateways6) || len(r.Pools6) > 0 && len(r.Pools) != 1 {
		return nil, errors.New("IPv6 pools and gateways do not match, or a network with IPv6 has several segments")
	}
	for i, p := range r.Pools {
		pool, err := parseOptionalPrefix(p)
		if err != nil {
			return nil, err
		}
		s := subnetSpec{vni: r.VNIs[i], pool: pool}
		if s.gateway, err = parseOptionalPrefix(r.Gateways[i]); err != nil {
			return nil, err
		}
		n.subnets = append(n.subnets, s)
	}
	for i, p := range r.Pools6 {
		pool, err := netip.ParsePrefix(p)
		if err != nil {
			return nil, err
		}
		gw, err := parseOptionalPrefix(r.Gateways6[i])
		if err != nil {
			return nil, err
		}
		n.subnets[0].v6 = append(n.subnets[0].v6, netdef.Subnet6{Pool: pool, Gateway: gw})
	}
	// A network with IPv6 (written by this version) gets the checks of a
	// network created now, so a damaged record is refused rather than
	// programmed; older records are restored as they always were.
	if def := n.definitionLocked(); len(r.Pools6) > 0 && def.Validate() != nil {
		return nil, def.Validate()
	}
	n.peers = newPeerTable(n.subnets)
	return n, nil
}

func endpointFromRecord(n *network, r statefile.Endpoint) (*endpoint, error) {
	addr, err := parseOptionalPrefix(r.Addr)
	if err != nil {
		return nil, err
	}
	addr6, err := parseOptionalPrefix(r.AddrIPv6)
	if err != nil {
		return nil, err
	}
	if !addr.IsValid() && !addr6.IsValid() {
		return nil, errors.New("the endpoint has no address")
	}
	mac, err := peerdb.ParseMAC(r.MAC)
	if err != nil {
		return nil, err
	}
	if err := dnsname.ValidPacked(r.Names); err != nil {
		return nil, fmt.Errorf("names: %w", err)
	}
	ep := &endpoint{id: r.ID, addr: addr, addr6: addr6, mac: mac, hostName: r.HostName, sbName: r.SandboxName, joined: r.Joined,
		sandboxKey: r.SandboxKey, names: r.Names}
	ep.dnsRoute = r.Joined && r.DNSRoute
	if ep.subnet, err = n.segmentOfLocked(addr, addr6); err != nil {
		return nil, err
	}
	if ep.hostName == "" || ep.sbName == "" {
		ep.hostName, ep.sbName = linkNames(n.id, ep.id)
	}
	return ep, nil
}

// Reconcile is the driver's level-triggered repair; the daemon runs it on a
// short tick, and it can run at any time. For every network: pull all its
// records from the source (repairing any notification that was missed or
// could not be applied), log the cross-host address conflicts that
// appeared or went away, remove a sandbox a failed Leave left behind,
// restore the bridge ports (see package sandbox) and make the sandbox's
// peer state exactly what the peer table says (dump, diff, apply). While the driver is adopting the kernel state of an earlier
// run (until Settle), entries the kernel holds beyond the table's are kept:
// the control plane has not re-delivered the cluster's records yet. It
// returns the differences it corrected, each naming its network.
func (d *Driver) Reconcile() ([]string, error) {
	defer d.counts.reconciles.Add(1)
	d.RefreshVTEP()
	d.mu.Lock()
	adopting := d.adopting
	d.mu.Unlock()
	var fixed []string
	var errs []error
	d.eachNetwork(func(n *network) {
		if err := d.pullAllLocked(n); err != nil {
			errs = append(errs, err)
		}
		d.noteConflictsLocked(n)
		// A teardown the reaper has ended is collected; one that failed is
		// retried just below, as a failed Leave's.
		d.settleTeardownLocked(n, false)
		if n.teardown {
			if err := d.destroySandboxLocked(n); err != nil {
				errs = append(errs, fmt.Errorf("network %q: removing the sandbox of the last Leave: %w", n.id, err))
			} else {
				fixed = append(fixed, fmt.Sprintf("network %s: removed the sandbox a failed Leave left", n.id))
				d.logRepair(n, logkeys.KindSandbox, []string{"removed the sandbox a failed Leave left"})
				d.counts.repaired(RepairSandbox, 1)
			}
		}
		if n.sb == nil || n.teardown {
			return
		}
		d.serveNamesLocked(n)
		if p, err := d.reapLeftRetiredLocked(n); err != nil {
			errs = append(errs, fmt.Errorf("network %q: %w", n.id, err))
		} else if p != "" {
			fixed = append(fixed, fmt.Sprintf("network %s: %s", n.id, p))
			d.logRepair(n, logkeys.KindSandbox, []string{p})
			d.counts.repaired(RepairSandbox, 1)
		}
		ports, err := n.sb.RepairPorts(n.joinedEndpointsLocked())
		for _, s := range ports {
			fixed = append(fixed, fmt.Sprintf("network %s: %s", n.id, s))
		}
		if len(ports) > 0 {
			d.logRepair(n, logkeys.KindPorts, ports)
		}
		d.counts.repaired(RepairBridgePort, len(ports))
		if err != nil {
			errs = append(errs, fmt.Errorf("network %q: %w", n.id, err))
		}
		have, err := n.sb.Dump()
		if err != nil {
			errs = append(errs, err)
			return
		}
		delta, problems := sandbox.Diff(n.peers.Desired(), have)
		if adopting {
			delta.NeighDel, delta.FDBDel = nil, nil
			problems = slices.DeleteFunc(problems, func(s string) bool { return strings.HasSuffix(s, "not desired") })
		}
		if len(problems) == 0 {
			return
		}
		for _, s := range problems {
			fixed = append(fixed, fmt.Sprintf("network %s: %s", n.id, s))
		}
		d.counts.repaired(RepairPeerEntry, len(problems))
		if err := d.programLocked(n, delta); err != nil {
			errs = append(errs, err)
		} else {
			d.logRepair(n, logkeys.KindPeers, problems)
		}
	})
	return fixed, errors.Join(errs...)
}

// reapLeftRetiredLocked hands the reaper the retired veths of n's sandbox that
// nothing is deleting: left by a daemon that stopped before its deletions
// ran, or by a deletion that failed. It returns what it found ("" for
// nothing). n.sb is set.
func (d *Driver) reapLeftRetiredLocked(n *network) (string, error) {
	if n.reapingRetiredLocked() { // asked before the links are listed
		return "", nil
	}
	names, err := n.sb.Retired()
	if err != nil || len(names) == 0 {
		return "", err
	}
	d.reapRetiredLocked(n)
	return fmt.Sprintf("veth %s: awaits deletion, but none was queued (%d such veth(s)): deletion queued", names[0], len(names)), nil
}

// logRepair logs one repair of Reconcile: the kernel held something else
// than n's state for kind, and what[0] is the first of the differences it
// put right. One line per network, kind and reconcile, however many
// entries: a flushed table is one event to an operator, not hundreds.
func (d *Driver) logRepair(n *network, kind string, what []string) {
	d.log.Info("reconcile repaired kernel state", logkeys.Event, logkeys.ReconcileRepair, logkeys.Kind, kind,
		logkeys.Network, n.id, logkeys.Count, len(what), logkeys.First, what[0])
}

// Settle ends the adoption of an earlier run's kernel state: from now on
// the kernel holds exactly what the peer tables say, and the encryption
// state exactly what the networks need. The daemon calls it once the
// control plane has had time to re-deliver the cluster's records after a
// restart.
func (d *Driver) Settle() error {
	d.mu.Lock()
	was := d.adopting
	d.adopting = false
	d.mu.Unlock()
	if !was {
		return nil
	}
	if d.cfg.Encryption == nil {
		return nil
	}
	return d.cfg.Encryption.Restored()
}
