package driver

import (
	"errors"
	"fmt"
	"net/netip"
	"os"
	"strings"

	"github.com/overlayd/overlayd/internal/lockorder"
	"github.com/overlayd/overlayd/internal/sandbox"
	"github.com/overlayd/overlayd/internal/store"
	"github.com/overlayd/overlayd/peerdb"
)

// record returns what is persisted of n; expects n.mu held (or n unpublished).
func (n *network) record() store.Network {
	r := store.Network{ID: n.id, VNIs: n.vnis(), MTU: n.mtu, Internal: n.internal, Encrypted: n.encrypted, Options: n.options}
	for _, s := range n.subnets {
		r.Pools = append(r.Pools, s.pool.String())
		gw := ""
		if s.gateway.IsValid() {
			gw = s.gateway.String()
		}
		r.Gateways = append(r.Gateways, gw)
	}
	return r
}

func (ep *endpoint) record(netID string) store.Endpoint {
	r := store.Endpoint{Network: netID, ID: ep.id, Addr: ep.addr.String(), MAC: ep.mac.String(), Joined: ep.joined,
		HostName: ep.hostName, SandboxName: ep.sbName}
	if ep.vtep.IsValid() {
		r.VTEP = ep.vtep.String()
	}
	return r
}

func (d *Driver) saveNetwork(n *network) error {
	if d.cfg.Store == nil {
		return nil
	}
	return d.cfg.Store.PutNetwork(n.record())
}

func (d *Driver) forgetNetwork(n *network) error {
	if d.cfg.Store == nil {
		return nil
	}
	return d.cfg.Store.DeleteNetwork(n.id)
}

func (d *Driver) saveEndpoint(n *network, ep *endpoint) error {
	if d.cfg.Store == nil {
		return nil
	}
	return d.cfg.Store.PutEndpoint(ep.record(n.id))
}

func (d *Driver) forgetEndpoint(n *network, ep *endpoint) error {
	if d.cfg.Store == nil {
		return nil
	}
	return d.cfg.Store.DeleteEndpoint(n.id, ep.id)
}

func (d *Driver) saveAllocation(netID string, vnis []uint32) error {
	if d.cfg.Store == nil {
		return nil
	}
	return d.cfg.Store.PutAllocation(netID, vnis)
}

// restore loads the persisted state and adopts the kernel state an earlier
// run left: sandboxes that match are taken over as they are (running
// containers keep their connectivity), sandboxes that do not are rebuilt,
// and overlayd-owned leftovers that belong to nothing are removed. Remote
// peers are not persisted: the kernel keeps programming them until the
// control plane re-delivers them and ReconcileAll runs. Called from New,
// before the driver is shared.
func (d *Driver) restore() error {
	st, err := d.cfg.Store.Load()
	if err != nil {
		return err
	}
	if err := d.restoreEnc(); err != nil {
		return &store.CorruptError{Path: d.cfg.Store.Path(), Err: err}
	}
	for id, vnis := range st.Allocations {
		d.allocNet[id] = vnis
		for _, v := range vnis {
			d.allocs[v] = id
		}
	}
	eps := map[string][]store.Endpoint{}
	for _, e := range st.Endpoints {
		eps[e.Network] = append(eps[e.Network], e)
	}
	keepNS := map[string]bool{}
	keepHostLinks := map[string]bool{}
	for _, rec := range st.Networks {
		n, err := networkFromRecord(rec)
		if err != nil {
			return &store.CorruptError{Path: d.cfg.Store.Path(), Err: fmt.Errorf("network %q: %w", rec.ID, err)}
		}
		for _, s := range n.subnets {
			if other := d.byVNI[s.vni]; other != nil {
				return &store.CorruptError{Path: d.cfg.Store.Path(), Err: fmt.Errorf("VNI %d is held by networks %q and %q", s.vni, other.id, n.id)}
			}
			d.byVNI[s.vni] = n
		}
		d.nets[n.id] = n
		if n.encrypted {
			// Not programmed now: the kernel keeps what the earlier run
			// installed until keys and peers are back (SetKeys,
			// ReconcileAll).
			if d.enc.vnis == nil {
				d.enc.vnis, d.enc.remotes = map[*network][]uint32{}, map[*network]map[netip.Addr]bool{}
			}
			d.enc.vnis[n] = n.vnis()
		}
		var joined []*endpoint
		for _, er := range eps[n.id] {
			ep, err := endpointFromRecord(n, er)
			if err != nil {
				return &store.CorruptError{Path: d.cfg.Store.Path(), Err: fmt.Errorf("endpoint %q of network %q: %w", er.ID, n.id, err)}
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
		sb, err := sandbox.Adopt(d.host, n.id, n.sandboxSubnets())
		if err != nil {
			d.log.Warn("cannot adopt sandbox, rebuilding it: endpoints joined before the restart lose their link", "network", n.id, "error", err)
			if sb, err = sandbox.Create(d.host, n.id, n.sandboxSubnets()); err != nil {
				return fmt.Errorf("restoring network %q: %w", n.id, err)
			}
		}
		n.sb = sb
		for _, ep := range joined {
			n.joined++
			if _, err := n.peers.AddLocal(ep.peer(ep.vtep)); err != nil {
				d.log.Warn("restored endpoint does not fit its network", "network", n.id, "endpoint", ep.id, "error", err)
			}
			if !sb.HasLink(ep.sbName) {
				d.log.Info("endpoint's veth is gone (its container stopped while overlayd was down); waiting for Leave", "network", n.id, "endpoint", ep.id)
			}
		}
		d.log.Info("network restored", "network", n.id, "vnis", formatVNIs(n.vnis()), "joined", n.joined)
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

func networkFromRecord(r store.Network) (*network, error) {
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
	for i, p := range r.Pools {
		pool, err := netip.ParsePrefix(p)
		if err != nil {
			return nil, err
		}
		s := subnetSpec{vni: r.VNIs[i], pool: pool}
		if r.Gateways[i] != "" {
			if s.gateway, err = netip.ParsePrefix(r.Gateways[i]); err != nil {
				return nil, err
			}
		}
		n.subnets = append(n.subnets, s)
	}
	n.peers = peerdb.New(n.pools())
	return n, nil
}

func endpointFromRecord(n *network, r store.Endpoint) (*endpoint, error) {
	addr, err := netip.ParsePrefix(r.Addr)
	if err != nil {
		return nil, err
	}
	mac, err := peerdb.ParseMAC(r.MAC)
	if err != nil {
		return nil, err
	}
	ep := &endpoint{id: r.ID, addr: addr, mac: mac, subnet: -1, hostName: r.HostName, sbName: r.SandboxName, joined: r.Joined}
	for i, s := range n.subnets {
		if s.pool.Contains(addr.Addr()) {
			ep.subnet = i
		}
	}
	if ep.subnet < 0 {
		return nil, fmt.Errorf("address %s is in no subnet of the network", addr)
	}
	if r.VTEP != "" {
		if ep.vtep, err = netip.ParseAddr(r.VTEP); err != nil {
			return nil, err
		}
	}
	if ep.hostName == "" || ep.sbName == "" {
		ep.hostName, ep.sbName = linkNames(n.id, ep.id)
	}
	return ep, nil
}

// ReconcileAll makes every sandbox's peer state exactly what its peer DB
// says (dump, diff, apply), removing entries that an earlier run programmed
// and nobody re-announced. The daemon calls it once the control plane has
// re-delivered the cluster's records after a restart, and it can run at any
// time. It returns the differences it corrected.
func (d *Driver) ReconcileAll() ([]string, error) {
	d.mu.Lock()
	ids := make([]string, 0, len(d.nets))
	for id := range d.nets {
		ids = append(ids, id)
	}
	d.mu.Unlock()
	var fixed []string
	var errs []error
	if err := d.dropAdoptedEnc(); err != nil {
		errs = append(errs, fmt.Errorf("encryption: %w", err))
	}
	for _, id := range ids {
		n, unlock, err := d.lockNetwork(id)
		if err != nil {
			continue
		}
		if n.sb != nil {
			p, err := n.sb.Reconcile(n.peers.Desired())
			for _, s := range p {
				fixed = append(fixed, fmt.Sprintf("network %s: %s", id, s))
			}
			if err != nil {
				errs = append(errs, err)
			}
		}
		unlock()
	}
	return fixed, errors.Join(errs...)
}
