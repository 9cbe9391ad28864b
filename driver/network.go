package driver

import (
	"fmt"
	"net/netip"
	"slices"
	"strings"

	api "github.com/docker/go-plugins-helpers/network"

	"github.com/overlayd/overlayd/encryption"
	"github.com/overlayd/overlayd/internal/lockorder"
	"github.com/overlayd/overlayd/internal/logkeys"
	"github.com/overlayd/overlayd/internal/netdef"
	"github.com/overlayd/overlayd/internal/reaper"
	"github.com/overlayd/overlayd/internal/sandbox"
	"github.com/overlayd/overlayd/peerdb"
)

// network is one overlay network on this host. Every mutable field is
// guarded by mu (network.mu, lockorder.LevelNetwork); the driver's methods
// named ...Locked run with it held.
type network struct {
	mu *lockorder.Mutex // network.mu, lockorder.LevelNetwork

	// Immutable after creation.
	id        string
	subnets   []subnetSpec
	mtu       int
	internal  bool
	encrypted bool
	options   map[string]string

	share encryption.ShareID // this instance's share of the encryption state

	endpoints map[string]*endpoint // guarded by mu
	peers     *peerdb.DB           // guarded by mu: the network owns its peer table
	sb        *sandbox.Sandbox     // guarded by mu; nil until the first Join
	// teardown: the last Leave could not remove the sandbox; the periodic
	// reconcile (or the next Join) retries. Guarded by mu.
	teardown bool
	// dying: the sandbox the last Leave handed to the reaper to destroy,
	// until its teardown is settled (settleTeardownLocked); n.sb is nil
	// meanwhile. Guarded by mu.
	dying *dyingSandbox
	// reapVeths: the latest deletion of the sandbox's retired veths (the
	// endpoints that left), queued, running or done. Guarded by mu.
	reapVeths *reaper.Job
	joined    int  // endpoints joined; guarded by mu
	deleted   bool // guarded by mu; set when removed from the driver
	// lastErr is the last kernel programming error of the network's peers,
	// for status; cleared by the next success. Guarded by mu.
	lastErr error
	// contra: the other hosts whose definition of one of its VNIs
	// contradicts the network's, by VNI and host, as last checked (for the
	// log-once and status; the definitions are the control plane's).
	// Their records of that VNI are refused. Guarded by mu.
	contra map[uint32]map[string]contradiction
	// logged: rejected remote records already logged, with the reason;
	// guarded by mu.
	logged map[peerdb.Key]string
	// conflicts: the cross-host address conflicts logged; guarded by mu.
	conflicts conflictLog
	// dnsErr: the last failure to serve the network's name server (for
	// the log-once), "" when served. Guarded by mu.
	dnsErr string
	// found: room for a keyed pull's batched lookups (PeerSource.PeersOf,
	// pullLookahead entries once used); guarded by mu.
	found []peerdb.Found
}

// traceLocked emits the creation of n.
func (n *network) traceLocked(d *Driver, kind TraceKind) {
	if !traceEnabled {
		return
	}
	ev := TraceEvent{Kind: kind, Network: n.id, VNIs: n.vnis(), Pools: n.pools(), MTU: n.mtu, Internal: n.internal, Encrypted: n.encrypted}
	for _, s := range n.subnets {
		ev.Gateways = append(ev.Gateways, s.gateway)
	}
	d.trace(ev)
}

func (n *network) vnis() []uint32 {
	v := make([]uint32, len(n.subnets))
	for i, s := range n.subnets {
		v[i] = s.vni
	}
	return v
}

// pools returns every subnet of the network, of both families, in the
// order of its segments (IPv4 first in each).
func (n *network) pools() []netip.Prefix {
	var p []netip.Prefix
	for i := range n.subnets {
		p = append(p, n.subnets[i].prefixes()...)
	}
	return p
}

// formatPrefixes renders prefixes comma-separated (for logs).
func formatPrefixes(ps []netip.Prefix) string {
	s := make([]string, len(ps))
	for i, p := range ps {
		s[i] = p.String()
	}
	return strings.Join(s, ",")
}

// hasIPv6 reports whether the network has IPv6 subnets (then it has one
// segment).
func (n *network) hasIPv6() bool {
	return len(n.subnets) == 1 && len(n.subnets[0].v6) > 0
}

// newPeerTable returns the empty peer table of a network of these
// segments. Networks without IPv6 keep New's one-prefix-per-segment table
// (the IPv4 path, unchanged).
func newPeerTable(subnets []subnetSpec) *peerdb.DB {
	if len(subnets) == 1 && len(subnets[0].v6) > 0 {
		return peerdb.NewSegments([]peerdb.Segment{{Prefixes: subnets[0].prefixes(), VNI: subnets[0].vni}})
	}
	pools := make([]netip.Prefix, len(subnets))
	vnis := make([]uint32, len(subnets))
	for i, s := range subnets {
		pools[i], vnis[i] = s.pool, s.vni
	}
	return peerdb.New(pools, vnis...)
}

// sandboxSubnets describes n's segments to its sandbox; every segment with
// an IPv4 pool gets the name server's address dns (if valid) on its bridge.
func (n *network) sandboxSubnets(dns netip.Addr) []sandbox.Subnet {
	s := make([]sandbox.Subnet, len(n.subnets))
	for i, sub := range n.subnets {
		s[i] = sandbox.Subnet{VNI: sub.vni, Pool: sub.pool, Gateway: sub.gateway, MTU: n.mtu}
		if dns.IsValid() && sub.pool.IsValid() {
			s[i].DNS = netip.PrefixFrom(dns, 32)
		}
		for _, v := range sub.v6 {
			s[i].IPv6 = append(s[i].IPv6, sandbox.Subnet6{Pool: v.Pool, Gateway: v.Gateway})
		}
	}
	return s
}

// CreateNetwork validates the request and registers the network. It makes
// no kernel change (the sandbox is built at the first Join) except, for an
// encrypted network, the fail-closed rules. It pulls the remote records of
// its VNIs from the source, so records that arrived before it existed are
// taken now.
//
// A network of the same id or VNI whose DeleteNetwork is in flight is
// waited for (on its lock, never holding another network's), then the
// registration is re-checked: create after delete of one id is sound, as in
// moby's driver after #50260.
//
// The gossip seeds the network carries (OptSeeds, from the swarm leader)
// are handed to the control plane once the network exists, without driver
// locks held.
func (d *Driver) CreateNetwork(req *api.CreateNetworkRequest) error {
	spec, err := parseCreateNetwork(req)
	var u underlayLink
	var seeds []string
	if err == nil {
		u = d.underlay()
		err = d.checkSpec(spec, u)
	}
	if err == nil {
		seeds, err = seedsOption(spec.options)
	}
	if err != nil {
		d.log.Warn("CreateNetwork rejected", "network", reqNetworkID(req), "error", err)
		return err
	}
	if err := d.createNetwork(spec, u); err != nil {
		return err
	}
	if len(seeds) > 0 {
		d.log.Debug("network carries gossip seeds", "network", spec.id, "seeds", seeds)
		d.cfg.Membership.AddSeeds(seeds)
	}
	return nil
}

// createNetwork registers the network of a valid spec (see CreateNetwork).
func (d *Driver) createNetwork(spec *netSpec, u underlayLink) error {
	if spec.encrypted {
		if err := d.checkEncryption(); err != nil {
			return fmt.Errorf("option %s: %w", OptEncrypted, err)
		}
	}
	mtu := spec.mtu
	if mtu == 0 {
		mtu = u.innerMTU(spec.encrypted)
	}
	def := definitionOf(spec.subnets, mtu, spec.encrypted, spec.internal)
	if err := d.checkDefinitions(&def, spec.mtu != 0); err != nil {
		d.log.Warn("CreateNetwork rejected", "network", spec.id, "error", err)
		return err
	}
	n := &network{
		mu:        lockorder.New(lockorder.LevelNetwork),
		id:        spec.id,
		subnets:   spec.subnets,
		mtu:       mtu,
		internal:  spec.internal,
		encrypted: spec.encrypted,
		options:   spec.options,
		endpoints: map[string]*endpoint{},
		share:     d.newShareID(),
	}
	n.peers = newPeerTable(n.subnets)

	if err := d.register(n); err != nil {
		return err
	}
	defer n.mu.Unlock()

	// Persist before answering (outside driver.mu: a write waits for the
	// disk). On failure the registration is undone; operations that found n
	// meanwhile wait on n.mu and then see it deleted.
	if err := d.saveNetwork(n); err != nil {
		d.dropFromMapsLocked(n)
		return fmt.Errorf("CreateNetwork %q: %w", n.id, err)
	}
	n.traceLocked(d, TraceCreateNetwork)
	// An encrypted network's fail-closed rules go in before anything can
	// send on it; an unencrypted one's VNIs are let through in clear.
	if err := d.syncEncLocked(n, false); err != nil {
		if ferr := d.forgetNetwork(n); ferr != nil {
			d.log.Error("undoing a failed CreateNetwork", "network", n.id, "error", ferr)
		}
		d.unregisterLocked(n)
		return fmt.Errorf("CreateNetwork %q: %w", n.id, err)
	}
	// Registered under its VNIs before pulling: a change notified from now
	// on waits for n.mu and pulls again, so none is missed.
	if err := d.pullAllLocked(n); err != nil {
		d.log.Warn("pulling the remote peers of a new network", "network", n.id, "error", err)
	}
	d.publishDefinitionLocked(n, false)
	d.log.Info("network created", logkeys.Event, logkeys.NetworkCreated, logkeys.Network, n.id, logkeys.VNIs, formatVNIs(n.vnis()),
		"subnets", formatPrefixes(n.pools()), "mtu", n.mtu, "internal", n.internal, "encrypted", n.encrypted)
	return nil
}

// register publishes n under its id and VNIs and returns with n locked.
// Networks holding the id or a VNI are waited for: if they are being
// deleted, register proceeds once they are gone; if they stay, it fails
// naming them.
func (d *Driver) register(n *network) error {
	for {
		// Lock the new network before publishing it, so that operations
		// finding it wait until it is complete. Nobody else can hold it
		// yet: it is not published.
		n.mu.Lock()
		d.mu.Lock()
		var blockers []*network
		if other := d.nets[n.id]; other != nil {
			blockers = append(blockers, other)
		}
		for _, s := range n.subnets {
			if other := d.byVNI[s.vni]; other != nil && !slices.Contains(blockers, other) {
				blockers = append(blockers, other)
			}
		}
		if len(blockers) == 0 {
			d.nets[n.id] = n
			for _, s := range n.subnets {
				d.byVNI[s.vni] = n
			}
			d.mu.Unlock()
			return nil
		}
		n.mu.Unlock()
		d.mu.Unlock()
		// Wait for each blocker's operation in flight (a DeleteNetwork),
		// one network lock at a time, and see whether it is still there.
		for _, other := range blockers {
			other.mu.Lock()
			alive := !other.deleted
			other.mu.Unlock()
			if !alive {
				continue
			}
			if other.id == n.id {
				return fmt.Errorf("NetworkID %q already exists on this host", n.id)
			}
			for _, s := range n.subnets {
				for _, o := range other.subnets {
					if o.vni == s.vni {
						return fmt.Errorf("option %s: VNI %d is already used by network %q on this host: each network needs its own VNIs", OptVNI, s.vni, other.id)
					}
				}
			}
		}
		// Every blocker was deleted meanwhile: look again.
	}
}

// checkSpec refuses what a request can only be judged wrong for on this
// host: an MTU the underlay cannot carry, and (outside swarm) a pool that
// dockerd may have picked from its defaults.
func (d *Driver) checkSpec(spec *netSpec, u underlayLink) error {
	if spec.hasIPv6() && spec.mtu == 0 && u.name != "" && u.innerMTU(spec.encrypted) < netdef.MinMTU6 {
		return fmt.Errorf("IPv6Data: a network with IPv6 needs an MTU of at least %d (IPv6's minimum link MTU), but this host's underlay device %s (MTU %d) leaves %d for the network's links: raise the underlay's MTU, or create the network without IPv6",
			netdef.MinMTU6, u.name, u.mtu, u.innerMTU(spec.encrypted))
	}
	if spec.mtu > 0 {
		limit := u.innerMTU(spec.encrypted)
		kind := "VXLAN over IPv4"
		if u.v6 {
			kind = "VXLAN over IPv6"
		}
		if spec.encrypted {
			kind = "ESP-encrypted " + kind
		}
		switch {
		case u.name == "":
			// Not refused on a guess: the VTEP (and so the device) is not
			// known yet.
			d.log.Warn("cannot check the MTU of a new network against the underlay: no VTEP yet", "network", spec.id, "mtu", spec.mtu)
		case spec.mtu > limit:
			return fmt.Errorf("option %s=%d is larger than this host's underlay can carry: the largest MTU is %d, because the underlay device %s has MTU %d and %s takes %d bytes of it; give %s=%d or less, or leave it out",
				spec.mtuKey, spec.mtu, limit, u.name, u.mtu, kind, u.mtu-limit, spec.mtuKey, limit)
		}
	}
	// Only outside swarm: overlayd serves swarm with scope global, and
	// swarm networks get their pools from the manager's allocator, unique
	// cluster-wide. dockerd sends the same CreateNetwork with and without
	// --subnet (recorded on Docker 20.10), so the pool is all there is to
	// go by.
	if d.cfg.Scope == api.LocalScope && !spec.explicitSubnet {
		for i, s := range spec.subnets {
			if isDockerDefaultPool(s.pool) {
				return fmt.Errorf("IPv4Data[%d].Pool %s is one of dockerd's default address pools (172.17.0.0/16 … 172.31.0.0/16, 192.168.N.0/20), as if the network was created without --subnet: "+
					"without --subnet every engine picks its own pool, so hosts hand out the same addresses (and MACs) to different containers, or put the network in different subnets. "+
					"Give the same --subnet on every host, outside those pools; dockerd sends a plugin the same request with and without --subnet, so if you gave this one on purpose add -o %s",
					i, s.pool, OptExplicitSubnet)
			}
		}
	}
	return nil
}

func reqNetworkID(req *api.CreateNetworkRequest) string {
	if req == nil {
		return ""
	}
	return req.NetworkID
}

// DeleteNetwork removes the network and everything of it in the kernel. An
// unknown id succeeds: dockerd sends deletes for networks a restarted plugin
// never saw.
func (d *Driver) DeleteNetwork(req *api.DeleteNetworkRequest) error {
	if req == nil {
		return fmt.Errorf("DeleteNetwork: empty request")
	}
	n, unlock, err := d.lockNetwork(req.NetworkID)
	if err != nil {
		if IsNotFound(err) {
			d.log.Info("DeleteNetwork for an unknown network: nothing to do", "network", req.NetworkID)
			return nil
		}
		return err
	}
	defer unlock()
	// Deletions handed to the reaper end first: nothing of the network
	// stays in the kernel once DeleteNetwork has answered.
	if err := d.settleTeardownLocked(n, true); err != nil {
		d.log.Warn("the teardown of the network's last sandbox failed; retrying", "network", n.id, "error", err)
	}
	if err := d.finishRetiredLocked(n); err != nil {
		d.log.Warn("deleting the veths of endpoints that left", "network", n.id, "error", err)
	}
	if n.sb != nil {
		if err := n.sb.Destroy(); err != nil {
			// Keep the network registered: a retry can finish the job.
			return fmt.Errorf("failed to delete network %q: %w", n.id, err)
		}
		n.sb = nil
	}
	if err := d.forgetNetwork(n); err != nil {
		return fmt.Errorf("DeleteNetwork %q: %w", n.id, err)
	}
	d.publishDefinitionLocked(n, true)
	d.unregisterLocked(n)
	d.log.Info("network deleted", logkeys.Event, logkeys.NetworkDeleted, logkeys.Network, n.id, logkeys.VNIs, formatVNIs(n.vnis()))
	return nil
}

// unregisterLocked removes n from the driver and drops its share of the
// encryption state; n's sandbox is gone. Its remote
// records stay with their owner, the control plane: a network created
// again pulls them.
func (d *Driver) unregisterLocked(n *network) {
	for _, ep := range n.endpoints {
		if ep.joined {
			d.publishLocked(n, ep, false)
		}
	}
	d.dropFromMapsLocked(n)
	n.endpoints = nil
	if err := d.dropEncLocked(n); err != nil {
		d.log.Warn("removing the encryption state of a deleted network", "network", n.id, "error", err)
	}
}

// dropFromMapsLocked takes n out of the driver's maps (under driver.mu)
// and marks it deleted.
func (d *Driver) dropFromMapsLocked(n *network) {
	d.mu.Lock()
	if d.nets[n.id] == n {
		delete(d.nets, n.id)
	}
	for _, s := range n.subnets {
		if d.byVNI[s.vni] == n {
			delete(d.byVNI, s.vni)
		}
	}
	// Traced under driver.mu too: a new network of the same id or VNIs is
	// ordered after it.
	d.trace(TraceEvent{Kind: TraceDeleteNetwork, Network: n.id})
	d.mu.Unlock()
	n.deleted = true
}

// AllocateNetwork (swarm leader) echoes the options and adds a VNI per IPv4
// subnet (one for a network with IPv6, whose subnets share one segment)
// unless they carry VNIs already — the leader re-sends its previous
// output after a restart, so allocation is idempotent: given VNIs are kept
// and marked used. It also adds the gossip seeds (OptSeeds, see
// allocSeeds), refreshed on every call, and warns once per network that
// its services need --endpoint-mode dnsrr.
func (d *Driver) AllocateNetwork(req *api.AllocateNetworkRequest) (*api.AllocateNetworkResponse, error) {
	if req == nil {
		return nil, fmt.Errorf("AllocateNetwork: empty request")
	}
	if err := checkID("NetworkID", req.NetworkID); err != nil {
		return nil, err
	}
	if len(req.IPv4Data) == 0 && len(req.IPv6Data) == 0 {
		return nil, fmt.Errorf("IPv4Data and IPv6Data are empty: an overlayd network needs at least one subnet (--subnet)")
	}
	out := map[string]string{}
	for k, v := range req.Options {
		out[k] = v
	}
	// Checked as every node's CreateNetwork will check them, but not
	// refused here: swarm allocates after docker network create has
	// answered, so a refusal reaches only the manager's dockerd log, and
	// tasks on the network stay "New" with no error; each node's
	// CreateNetwork refusal is shown by docker service ps (both measured
	// on Docker 20.10). The network is unusable either way.
	if _, err := parseGeneric(out); err != nil {
		d.log.Warn("swarm network allocated with options every node's CreateNetwork will refuse", "network", req.NetworkID, "error", err)
	}
	vnis, given, err := parseVNIs(out)
	if err != nil {
		return nil, err
	}
	seeds, withSeeds, err := d.allocSeeds(req.NetworkID, out)
	if err != nil {
		return nil, err
	}
	delete(out, OptSeeds)
	if withSeeds {
		out[OptSeeds] = seeds
	}
	resp, first, err := d.allocate(req, out, vnis, given)
	if err != nil {
		return nil, err
	}
	if first {
		// dockerd builds a service's virtual-IP load balancer (and its
		// endpoint on the network) only for its built-in overlay driver
		// (moby daemon/network.go: `agent && driver == "overlay"`): on any
		// plugin network the VIP answers nothing.
		d.log.Warn(DNSRRWarning,
			"network", req.NetworkID, "vni", resp.Options[OptVNI])
	}
	return resp, nil
}

// DNSRRWarning is logged once per swarm network the leader allocates.
const DNSRRWarning = "swarm network allocated: services on overlayd networks need --endpoint-mode dnsrr " +
	"(dockerd builds the virtual-IP load balancer only for its built-in overlay driver, so in the default VIP mode the service name does not answer; tasks.<service> and dnsrr work)"

// allocate allocates the VNIs of an AllocateNetwork request whose answer's
// options are out; first reports that the network held no allocation
// before (not a leader's re-send).
func (d *Driver) allocate(req *api.AllocateNetworkRequest, out map[string]string, vnis []uint32, given bool) (_ *api.AllocateNetworkResponse, first bool, _ error) {
	d.allocMu.Lock()
	defer d.allocMu.Unlock()
	_, known := d.allocNet[req.NetworkID]
	first = !known
	// One segment per IPv4 subnet, or one for all subnets with IPv6 (see
	// netdef.Subnet).
	segments := len(req.IPv4Data)
	if len(req.IPv6Data) > 0 {
		segments = 1
	}
	if given {
		if len(vnis) != segments {
			return nil, false, fmt.Errorf("option %s=%s gives %d VNI(s) for %d segment(s) (one per IPv4 subnet, or one for a network with IPv6): give exactly one VNI per segment", OptVNI, formatVNIs(vnis), len(vnis), segments)
		}
		for _, v := range vnis {
			if owner, ok := d.allocs[v]; ok && owner != req.NetworkID {
				return nil, false, fmt.Errorf("option %s: VNI %d is already allocated to network %q", OptVNI, v, owner)
			}
		}
		if err := d.saveAllocation(req.NetworkID, vnis); err != nil {
			return nil, false, fmt.Errorf("AllocateNetwork %q: %w", req.NetworkID, err)
		}
		for _, v := range d.allocNet[req.NetworkID] {
			delete(d.allocs, v)
		}
		for _, v := range vnis {
			d.allocs[v] = req.NetworkID
		}
		d.allocNet[req.NetworkID] = vnis
		return &api.AllocateNetworkResponse{Options: out}, first, nil
	}
	// Re-allocation for a network that already holds VNIs returns them.
	mine := d.allocNet[req.NetworkID]
	if len(mine) != segments {
		old := mine
		mine = nil
		d.mu.Lock() // to skip VNIs that local networks use
		for v := d.cfg.VNIStart; len(mine) < segments; v++ {
			if owner, used := d.allocs[v]; (!used || owner == req.NetworkID) && d.byVNI[v] == nil {
				mine = append(mine, v)
			}
			if v >= d.cfg.VNIEnd {
				break
			}
		}
		d.mu.Unlock()
		if len(mine) != segments {
			return nil, false, fmt.Errorf("no free VNI left in the allocation range %d..%d", d.cfg.VNIStart, d.cfg.VNIEnd)
		}
		if err := d.saveAllocation(req.NetworkID, mine); err != nil {
			return nil, false, fmt.Errorf("AllocateNetwork %q: %w", req.NetworkID, err)
		}
		for _, v := range old {
			delete(d.allocs, v)
		}
		for _, v := range mine {
			d.allocs[v] = req.NetworkID
		}
		d.allocNet[req.NetworkID] = mine
	}
	out[OptVNI] = formatVNIs(mine)
	return &api.AllocateNetworkResponse{Options: out}, first, nil
}

// FreeNetwork (swarm leader) releases the network's VNIs. Unknown ids succeed.
func (d *Driver) FreeNetwork(req *api.FreeNetworkRequest) error {
	if req == nil {
		return fmt.Errorf("FreeNetwork: empty request")
	}
	d.allocMu.Lock()
	defer d.allocMu.Unlock()
	if _, ok := d.allocNet[req.NetworkID]; !ok {
		return nil
	}
	if err := d.saveAllocation(req.NetworkID, nil); err != nil {
		return fmt.Errorf("FreeNetwork %q: %w", req.NetworkID, err)
	}
	for _, v := range d.allocNet[req.NetworkID] {
		delete(d.allocs, v)
	}
	delete(d.allocNet, req.NetworkID)
	return nil
}
