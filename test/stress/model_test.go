//go:build testhooks

package stress

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"strings"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/peerdb"
)

// The model is the oracle's sequential reference: it is fed the driver's
// trace (driver.Config.Trace), which records every state change that
// succeeded in the order the driver linearised them, and at every quiet
// point the source's records; from its own state it derives the kernel
// state the driver must have programmed. It deliberately re-implements the
// rules of peerdb/doc.go and of the driver in the simplest way
// (whole-state recomputation, no indexes, no deltas) and never calls
// peerdb's derivation, so that a bug there shows up as a difference.
//
// Rules (see README.md for the full list):
//   - CreateNetwork registers the network; DeleteNetwork forgets it and
//     its endpoints. Records are never handed over: they stay at the source.
//   - Remote records are level-triggered: at a quiet point (every operation
//     returned) a network holds exactly the source's records of its VNIs
//     that are valid for it (peerdb's rules: a valid record, whose
//     EndpointID is its key's and whose IP lies in the subnet of its key's
//     VNI), as a set of values; every other record of its VNIs is refused
//     and listed in Status. Pull events only have to be possible (the
//     network exists and has the VNI).
//   - Join adds a local entry {endpoint, IP, MAC}; Leave removes it. A
//     network has a sandbox iff at least one of its endpoints is joined.
//   - For each IP with claimants: a local claimant wins (no neighbour);
//     otherwise the smallest remote by (EndpointID, MAC bytes, VTEP) is active
//     and yields neighbour IP -> MAC on the VXLAN of the IP's subnet.
//     IPv6 (issue 12): every address is a claim of its own, the same rule
//     for both families; an endpoint or record with both addresses claims
//     both, and may be active for one and shadowed for the other.
//   - Each active remote proposes FDB (subnet, MAC) -> VTEP; the proposal of
//     the smallest IP (netip order: every IPv4 address before every IPv6
//     one) wins; no FDB entry for a (subnet, MAC) that a joined endpoint of
//     that subnet has.
type model struct {
	nets map[string]*mNetwork

	// owed counts DeleteNetwork trace events still to come for a network
	// whose deletion the model had to infer from a later event (see
	// inferDelete); every owed delete must arrive before the quiet point.
	owed map[string]int

	seq      int      // sequence number of the event being applied (for notes)
	inferred []string // how each inferred deletion was detected and settled (first few)

	stats modelStats
}

type modelStats struct {
	creates, deletes, epCreates, epDeletes int
	encryptedCreates                       int
	joins, leaves, sandboxesBuilt          int
	pulls, fullPulls, pullsOnSandbox       int
	readsPulled                            int // records (or absences) the pulls read
	takenAtCreate, refusedAtCreate         int // valid and refused records a new network found at the source
	quietPoints                            int
	held, heldMax, rejected, rejectedMax   int // records held/refused by the networks, summed over quiet points, and the peak
	inferredDeletes                        int
	joins6                                 int // joins of endpoints with an IPv6 address
	held6                                  int // records with an IPv6 address held, summed over quiet points
	neigh6                                 int // IPv6 neighbours the model required, summed over checks
}

func (s modelStats) String() string {
	return fmt.Sprintf("networks created %d (encrypted %d) deleted %d; endpoints created %d deleted %d; joins %d (sandboxes built %d) leaves %d; "+
		"pulls %d (%d of a whole VNI, %d on a network with a sandbox, %d records read); records found by a new network: %d taken, %d refused; "+
		"records held per quiet point %.1f (max %d), refused %.1f (max %d); inferred deletes %d; "+
		"IPv6: joins %d, records held %d, neighbours required %d (summed over quiet points)",
		s.creates, s.encryptedCreates, s.deletes, s.epCreates, s.epDeletes, s.joins, s.sandboxesBuilt, s.leaves,
		s.pulls, s.fullPulls, s.pullsOnSandbox, s.readsPulled, s.takenAtCreate, s.refusedAtCreate,
		float64(s.held)/float64(max(1, s.quietPoints)), s.heldMax, float64(s.rejected)/float64(max(1, s.quietPoints)), s.rejectedMax, s.inferredDeletes,
		s.joins6, s.held6, s.neigh6)
}

type mSubnet struct {
	vni  uint32
	pool netip.Prefix // IPv4; invalid for an IPv6-only segment
	gw   netip.Prefix // invalid when the network was created without a gateway
	// pools6 and gws6: the IPv6 subnets of the segment and their gateways
	// (invalid without), from the workload's request (see enrich).
	pools6, gws6 []netip.Prefix
}

type mEndpoint struct {
	id    string
	addr  netip.Prefix // IPv4; invalid for an endpoint of an IPv6-only network
	addr6 netip.Prefix // IPv6; invalid for an endpoint without
	// traced is the address the trace gives (IPv4, or for an IPv6-only
	// endpoint none or its IPv6 one): Join must trace the same.
	traced netip.Prefix
	mac    peerdb.MAC
	subnet int
	joined bool
}

type mNetwork struct {
	id        string
	subnets   []mSubnet
	mtu       int
	internal  bool
	encrypted bool
	eps       map[string]*mEndpoint
	// remote and rejected are derived from the source at quiet points
	// (syncRemotes): the valid records of the network's VNIs, as a set of
	// values, and the keys of the others.
	remote   map[peerdb.Peer]struct{}
	rejected []peerdb.Key
	// pulled: the network has pulled since its CreateNetwork (the first
	// pulls of its VNIs count what it found at the source).
	pulled map[uint32]bool
	neigh6 int // IPv6 neighbours desiredPeers required (counted into stats by desired)
}

func newModel() *model {
	return &model{
		nets: map[string]*mNetwork{},
		owed: map[string]int{},
	}
}

// subnetOf returns the segment of an address of either family.
func (n *mNetwork) subnetOf(ip netip.Addr) (int, bool) {
	for i, s := range n.subnets {
		if s.pool.IsValid() && s.pool.Contains(ip) {
			return i, true
		}
		for _, p := range s.pools6 {
			if p.Contains(ip) {
				return i, true
			}
		}
	}
	return 0, false
}

func (n *mNetwork) joined() int {
	c := 0
	for _, ep := range n.eps {
		if ep.joined {
			c++
		}
	}
	return c
}

// hasVNI returns the index of the subnet of vni.
func (n *mNetwork) hasVNI(vni uint32) (int, bool) {
	for i, s := range n.subnets {
		if s.vni == vni {
			return i, true
		}
	}
	return 0, false
}

// owner returns the network that has vni.
func (m *model) owner(vni uint32) *mNetwork {
	for _, n := range m.nets {
		if _, ok := n.hasVNI(vni); ok {
			return n
		}
	}
	return nil
}

// validFor is what the network's peer table accepts as the record of key
// k (peerdb's Validate, then its keyed rules): a non-empty EndpointID of at
// most MaxEndpointIDLen bytes that is k's; an IPv4 address, an IPv6 address
// or both, each (if given) of its family — a plain IPv4 address, an IPv6
// one that is not IPv4-mapped — and in a subnet of the segment of k's VNI;
// a non-zero unicast MAC and a VTEP that is neither unspecified nor
// multicast.
func (n *mNetwork) validFor(k peerdb.Key, p peerdb.Peer) bool {
	if p.EndpointID == "" || len(p.EndpointID) > peerdb.MaxEndpointIDLen || p.EndpointID != k.EndpointID {
		return false
	}
	sub, ok := n.hasVNI(k.VNI)
	if !ok || !p.IP.IsValid() && !p.IPv6.IsValid() {
		return false
	}
	s := n.subnets[sub]
	if p.IP.IsValid() && (!p.IP.Is4() || !s.pool.IsValid() || !s.pool.Contains(p.IP)) {
		return false
	}
	if p.IPv6.IsValid() && (!p.IPv6.Is6() || p.IPv6.Is4In6() || !slices.ContainsFunc(s.pools6, func(q netip.Prefix) bool { return q.Contains(p.IPv6) })) {
		return false
	}
	if p.MAC == (peerdb.MAC{}) || p.MAC[0]&1 != 0 {
		return false
	}
	return p.VTEP.IsValid() && !p.VTEP.IsUnspecified() && !p.VTEP.IsMulticast()
}

// syncRemotes sets every network's remote set and refused keys from the
// source's records: the level-triggered contract, checked when every
// operation has returned.
func (m *model) syncRemotes(recs map[peerdb.Key]peerdb.Peer) {
	held, rejected := 0, 0
	for _, n := range m.nets {
		n.remote = map[peerdb.Peer]struct{}{}
		n.rejected = nil
	}
	for k, p := range recs {
		n := m.owner(k.VNI)
		if n == nil {
			continue
		}
		if n.validFor(k, p) {
			n.remote[p] = struct{}{}
			if p.IPv6.IsValid() {
				m.stats.held6++
			}
		} else {
			n.rejected = append(n.rejected, k)
		}
	}
	for _, n := range m.nets {
		slices.SortFunc(n.rejected, compareKey)
		held += len(n.remote)
		rejected += len(n.rejected)
	}
	m.stats.quietPoints++
	m.stats.held += held
	m.stats.rejected += rejected
	m.stats.heldMax = max(m.stats.heldMax, held)
	m.stats.rejectedMax = max(m.stats.rejectedMax, rejected)
}

// deleteNet forgets n; its records stay at the source.
func (m *model) deleteNet(n *mNetwork) {
	delete(m.nets, n.id)
}

// inferDelete handles a trace event that is only possible if n was deleted
// already although its DeleteNetwork trace event has not arrived (a
// CreateNetwork of the same id or of one of its VNIs). The driver traces
// DeleteNetwork under driver.mu while it unregisters the network, so this
// must not happen (OVERLAYD_STRICT_TRACE, on by default, fails the run);
// with OVERLAYD_STRICT_TRACE=0 the model applies the deletion now and owes
// the trace event; quiet points fail if it never comes.
func (m *model) inferDelete(n *mNetwork, ev driver.TraceEvent) {
	m.deleteNet(n)
	m.owed[n.id]++
	m.stats.inferredDeletes++
	m.note(fmt.Sprintf("trace #%d %q is only possible once network %s is deleted, whose DeleteNetwork is not traced yet", m.seq, fmtTrace(tev{TraceEvent: ev}), n.id))
}

func (m *model) note(s string) {
	if len(m.inferred) < 20 {
		m.inferred = append(m.inferred, s)
	}
}

// apply feeds one trace event to the model. An error means the trace is not
// a possible sequential history (for example a Join of an endpoint that does
// not exist): the driver linearised something wrongly.
func (m *model) apply(ev tev) error {
	switch ev.Kind {
	case driver.TraceCreateNetwork:
		// Per segment its IPv4 subnet, if any, then its IPv6 ones; a
		// network with IPv6 has one segment.
		var pools4, pools6 []netip.Prefix
		for _, p := range ev.Pools {
			if p.Addr().Is4() {
				pools4 = append(pools4, p)
			} else {
				pools6 = append(pools6, p)
			}
		}
		switch {
		case len(ev.VNIs) == 0 || len(ev.Gateways) != len(ev.VNIs):
			return fmt.Errorf("CreateNetwork %s: %d VNIs, %d gateways", ev.Network, len(ev.VNIs), len(ev.Gateways))
		case len(pools6) > 0 && (len(ev.VNIs) != 1 || len(pools4) > 1 || len(pools4) == 1 && ev.Pools[0] != pools4[0]):
			return fmt.Errorf("CreateNetwork %s: VNIs %v pools %v: a network with IPv6 has one segment, its IPv4 subnet (if any) first", ev.Network, ev.VNIs, ev.Pools)
		case len(pools6) == 0 && len(pools4) != len(ev.VNIs):
			return fmt.Errorf("CreateNetwork %s: %d VNIs, %d pools", ev.Network, len(ev.VNIs), len(pools4))
		}
		if old := m.nets[ev.Network]; old != nil {
			m.inferDelete(old, ev.TraceEvent)
		}
		for _, v := range ev.VNIs {
			if old := m.owner(v); old != nil {
				m.inferDelete(old, ev.TraceEvent)
			}
		}
		n := &mNetwork{id: ev.Network, mtu: ev.MTU, internal: ev.Internal, encrypted: ev.Encrypted, eps: map[string]*mEndpoint{},
			remote: map[peerdb.Peer]struct{}{}, pulled: map[uint32]bool{}}
		for i := range ev.VNIs {
			sub := mSubnet{vni: ev.VNIs[i], gw: ev.Gateways[i]}
			if i < len(pools4) {
				sub.pool = pools4[i]
			}
			if i == 0 && len(pools6) > 0 {
				// The IPv6 gateways are the workload's (enrich): the
				// trace has none.
				sub.pools6, sub.gws6 = pools6, slices.Clone(ev.SpecGateways6)
				if len(sub.gws6) != len(pools6) {
					return fmt.Errorf("CreateNetwork %s: IPv6 subnets %v, gateways %v from the workload's request", ev.Network, pools6, sub.gws6)
				}
			}
			n.subnets = append(n.subnets, sub)
		}
		m.nets[n.id] = n
		m.stats.creates++
		if n.encrypted {
			m.stats.encryptedCreates++
		}
	case driver.TraceDeleteNetwork:
		if m.owed[ev.Network] > 0 {
			if m.owed[ev.Network]--; m.owed[ev.Network] == 0 {
				delete(m.owed, ev.Network)
			}
			m.note(fmt.Sprintf("trace #%d DeleteNetwork %s: the inferred deletion arrives", m.seq, ev.Network))
			m.stats.deletes++
			return nil
		}
		n := m.nets[ev.Network]
		if n == nil {
			return fmt.Errorf("DeleteNetwork %s: no such network", ev.Network)
		}
		m.deleteNet(n)
		m.stats.deletes++
	case driver.TraceCreateEndpoint:
		n := m.nets[ev.Network]
		if n == nil {
			return fmt.Errorf("CreateEndpoint %s/%s: no such network", ev.Network, ev.Endpoint)
		}
		if n.eps[ev.Endpoint] != nil {
			return fmt.Errorf("CreateEndpoint %s/%s: endpoint exists", ev.Network, ev.Endpoint)
		}
		ep := &mEndpoint{id: ev.Endpoint, addr: ev.Addr, addr6: ev.SpecAddr6, traced: ev.Addr, mac: ev.MAC}
		if !ev.Addr.Addr().Is4() {
			// An IPv6-only endpoint: the trace names no address or its
			// IPv6 one.
			if ev.Addr.IsValid() && ev.Addr != ev.SpecAddr6 {
				return fmt.Errorf("CreateEndpoint %s/%s: traced address %s, the workload gave IPv6 %s and no IPv4", ev.Network, ev.Endpoint, ev.Addr, ev.SpecAddr6)
			}
			ep.addr = netip.Prefix{}
		}
		var sub int
		var ok bool
		if ep.addr.IsValid() {
			sub, ok = n.subnetOf(ep.addr.Addr())
			ok = ok && n.subnets[sub].pool.Contains(ep.addr.Addr())
		} else if ep.addr6.IsValid() {
			sub, ok = n.subnetOf(ep.addr6.Addr())
			ok = ok && !n.subnets[sub].pool.IsValid()
		}
		if !ok {
			return fmt.Errorf("CreateEndpoint %s/%s: address %s (IPv6 %s) in no subnet", ev.Network, ev.Endpoint, ev.Addr, ev.SpecAddr6)
		}
		if has6 := len(n.subnets[sub].pools6) > 0; has6 != ep.addr6.IsValid() {
			return fmt.Errorf("CreateEndpoint %s/%s: IPv6 %s on a network with IPv6 subnets %v (the workload gives every endpoint of one an IPv6 address of them, others none)", ev.Network, ev.Endpoint, ep.addr6, n.subnets[sub].pools6)
		}
		if ep.addr6.IsValid() {
			if s6, ok := n.subnetOf(ep.addr6.Addr()); !ok || s6 != sub {
				return fmt.Errorf("CreateEndpoint %s/%s: IPv6 %s is not in the segment of %s", ev.Network, ev.Endpoint, ep.addr6, ev.Addr)
			}
		}
		if ev.MAC == (peerdb.MAC{}) || ev.MAC[0]&1 != 0 {
			return fmt.Errorf("CreateEndpoint %s/%s: MAC %s is not unicast", ev.Network, ev.Endpoint, ev.MAC)
		}
		ep.subnet = sub
		n.eps[ev.Endpoint] = ep
		m.stats.epCreates++
	case driver.TraceDeleteEndpoint:
		n := m.nets[ev.Network]
		if n == nil || n.eps[ev.Endpoint] == nil {
			return fmt.Errorf("DeleteEndpoint %s/%s: no such endpoint", ev.Network, ev.Endpoint)
		}
		if n.eps[ev.Endpoint].joined {
			return fmt.Errorf("DeleteEndpoint %s/%s: endpoint still joined (no Leave traced)", ev.Network, ev.Endpoint)
		}
		delete(n.eps, ev.Endpoint)
		m.stats.epDeletes++
	case driver.TraceJoin:
		n := m.nets[ev.Network]
		if n == nil || n.eps[ev.Endpoint] == nil {
			return fmt.Errorf("Join %s/%s: no such endpoint", ev.Network, ev.Endpoint)
		}
		ep := n.eps[ev.Endpoint]
		if ep.joined {
			return fmt.Errorf("Join %s/%s: already joined", ev.Network, ev.Endpoint)
		}
		if ev.Addr != ep.traced || ev.MAC != ep.mac {
			return fmt.Errorf("Join %s/%s: traced %s %s, endpoint was created with %s %s", ev.Network, ev.Endpoint, ev.Addr, ev.MAC, ep.traced, ep.mac)
		}
		if n.joined() == 0 {
			m.stats.sandboxesBuilt++
		}
		ep.joined = true
		m.stats.joins++
		if ep.addr6.IsValid() {
			m.stats.joins6++
		}
	case driver.TraceLeave:
		n := m.nets[ev.Network]
		if n == nil || n.eps[ev.Endpoint] == nil || !n.eps[ev.Endpoint].joined {
			return fmt.Errorf("Leave %s/%s: no such joined endpoint", ev.Network, ev.Endpoint)
		}
		n.eps[ev.Endpoint].joined = false
		m.stats.leaves++
	case driver.TracePull:
		n := m.nets[ev.Network]
		if n == nil {
			return fmt.Errorf("Pull by %s (VNI %d): no such network", ev.Network, ev.VNI)
		}
		if _, ok := n.hasVNI(ev.VNI); !ok || m.owner(ev.VNI) != n {
			return fmt.Errorf("Pull by %s: VNI %d is not one of its VNIs", ev.Network, ev.VNI)
		}
		for _, r := range ev.Read {
			if r.Key.VNI != ev.VNI {
				return fmt.Errorf("Pull by %s of VNI %d read the record of %s, of another VNI", ev.Network, ev.VNI, fmtKey(r.Key))
			}
		}
		if !n.pulled[ev.VNI] && ev.Full {
			// The network's first pull of the VNI (CreateNetwork's): what
			// it found at the source.
			n.pulled[ev.VNI] = true
			for _, r := range ev.Read {
				if r.Peer != nil && n.validFor(r.Key, *r.Peer) {
					m.stats.takenAtCreate++
				} else if r.Peer != nil {
					m.stats.refusedAtCreate++
				}
			}
		}
		m.stats.pulls++
		m.stats.readsPulled += len(ev.Read)
		if ev.Full {
			m.stats.fullPulls++
		}
		if n.joined() > 0 {
			m.stats.pullsOnSandbox++
		}
	default:
		return fmt.Errorf("unknown trace event kind %d", ev.Kind)
	}
	return nil
}

// describe lists the model's state of network id, for failure reports.
func (m *model) describe(id string) []string {
	n := m.nets[id]
	if n == nil {
		return []string{"(no such network)"}
	}
	var out []string
	for i, s := range n.subnets {
		out = append(out, fmt.Sprintf("subnet %d: vni %d pool %s gateway %v ipv6 %v gateways %v", i, s.vni, s.pool, s.gw, s.pools6, s.gws6))
	}
	var eps, remotes []string
	for _, ep := range n.eps {
		eps = append(eps, fmt.Sprintf("endpoint %s %s %s %s joined=%v", ep.id, ep.addr, ep.addr6, ep.mac, ep.joined))
	}
	for p := range n.remote {
		remotes = append(remotes, "remote "+fmtPeer(&p))
	}
	sort.Strings(eps)
	sort.Strings(remotes)
	out = append(append(out, eps...), remotes...)
	for _, k := range n.rejected {
		out = append(out, "refused "+fmtKey(k))
	}
	return out
}

// settled returns an error if a delete the model inferred was never traced.
// Call it at quiet points, when every operation has returned.
func (m *model) settled() error {
	if len(m.owed) == 0 {
		return nil
	}
	var ids []string
	for id, c := range m.owed {
		ids = append(ids, fmt.Sprintf("%s (%d)", id, c))
	}
	sort.Strings(ids)
	return fmt.Errorf("the trace implied deletions of networks %s that were never traced: events for them were traced as if they no longer existed", strings.Join(ids, ", "))
}

// vethNames recomputes the driver's veth names of an endpoint (driver's
// linkNames): sha256 of "netID/epID", hex, first 12 digits, prefixed "ovd"
// (host end) and "ovs" (sandbox end).
func vethNames(netID, epID string) (host, sb string) {
	sum := sha256.Sum256([]byte(netID + "/" + epID))
	h := hex.EncodeToString(sum[:])
	return "ovd" + h[:12], "ovs" + h[:12]
}

// Names of the links of a subnet inside a sandbox (internal/sandbox).
func bridgeName(vni uint32) string { return fmt.Sprintf("ovbr-%d", vni) }
func vxlanName(vni uint32) string  { return fmt.Sprintf("ovvx-%d", vni) }

// desiredPeers computes the neighbour and FDB lines of n from scratch.
func (n *mNetwork) desiredPeers() []string {
	type claim struct {
		local   bool
		remotes []peerdb.Peer
	}
	claims := map[netip.Addr]*claim{}
	get := func(ip netip.Addr) *claim {
		c := claims[ip]
		if c == nil {
			c = &claim{}
			claims[ip] = c
		}
		return c
	}
	// localMAC[subnet][mac]: a joined endpoint of that subnet has the MAC.
	localMAC := map[int]map[peerdb.MAC]bool{}
	for _, ep := range n.eps {
		if !ep.joined {
			continue
		}
		for _, a := range []netip.Prefix{ep.addr, ep.addr6} {
			if a.IsValid() {
				get(a.Addr()).local = true
			}
		}
		if localMAC[ep.subnet] == nil {
			localMAC[ep.subnet] = map[peerdb.MAC]bool{}
		}
		localMAC[ep.subnet][ep.mac] = true
	}
	for p := range n.remote {
		for _, a := range []netip.Addr{p.IP, p.IPv6} {
			if a.IsValid() {
				c := get(a)
				c.remotes = append(c.remotes, p)
			}
		}
	}
	type fdbKey struct {
		subnet int
		mac    peerdb.MAC
	}
	type proposal struct{ ip, vtep netip.Addr }
	fdb := map[fdbKey]proposal{}
	var lines []string
	for ip, c := range claims {
		if c.local || len(c.remotes) == 0 {
			continue
		}
		best := c.remotes[0]
		for _, q := range c.remotes[1:] {
			if remoteLess(q, best) {
				best = q
			}
		}
		sub, ok := n.subnetOf(ip)
		if !ok {
			lines = append(lines, fmt.Sprintf("MODEL BUG: remote %s outside the subnets of %s", best, n.id))
			continue
		}
		vx := vxlanName(n.subnets[sub].vni)
		lines = append(lines, fmt.Sprintf("%s neigh %s %s lladdr %s permanent", n.id, vx, ip, best.MAC))
		if ip.Is6() {
			n.neigh6++
		}
		k := fdbKey{sub, best.MAC}
		if cur, ok := fdb[k]; !ok || ip.Less(cur.ip) {
			fdb[k] = proposal{ip, best.VTEP}
		}
	}
	for k, p := range fdb {
		if localMAC[k.subnet][k.mac] {
			continue
		}
		lines = append(lines, fmt.Sprintf("%s fdb %s %s dst %s self permanent", n.id, vxlanName(n.subnets[k.subnet].vni), k.mac, p.vtep))
	}
	return lines
}

// remoteLess is the conflict rule among remote claimants of one IP:
// EndpointID (byte-wise), then MAC (byte-wise), then VTEP.
func remoteLess(a, b peerdb.Peer) bool {
	if a.EndpointID != b.EndpointID {
		return a.EndpointID < b.EndpointID
	}
	if c := bytes.Compare(a.MAC[:], b.MAC[:]); c != 0 {
		return c < 0
	}
	return a.VTEP.Less(b.VTEP)
}

// desired returns the kernel state the model implies, in the line format of
// dumpKernel: the host namespace's links, the sandbox directory, and every
// sandbox's links, addresses, forwarding, neighbours and FDB entries.
func (m *model) desired(underlay []string) []string {
	lines := append([]string(nil), underlay...)
	for _, n := range m.nets {
		if n.joined() == 0 {
			continue
		}
		lines = append(lines,
			"sandbox "+n.id,
			n.id+" link lo device up",
			n.id+" addr lo 127.0.0.1/8")
		for _, s := range n.subnets {
			br, vx := bridgeName(s.vni), vxlanName(s.vni)
			lines = append(lines,
				fmt.Sprintf("%s sysctl net.ipv4.conf.%s.forwarding=1", n.id, br),
				fmt.Sprintf("%s link %s bridge up mtu=%d", n.id, br, n.mtu),
				fmt.Sprintf("%s link %s vxlan up mtu=%d master=%s vni=%d port=%d learning=false proxy=true l2miss=false l3miss=false",
					n.id, vx, n.mtu, br, s.vni, driver.DefaultVXLANPort))
			if s.gw.IsValid() {
				lines = append(lines, fmt.Sprintf("%s addr %s %s", n.id, br, s.gw))
			}
			for _, gw := range s.gws6 {
				if gw.IsValid() {
					lines = append(lines, fmt.Sprintf("%s addr %s %s", n.id, br, gw))
				}
			}
		}
		for _, ep := range n.eps {
			if !ep.joined {
				continue
			}
			host, sb := vethNames(n.id, ep.id)
			lines = append(lines,
				fmt.Sprintf("host link %s veth down mtu=%d mac=%s", host, n.mtu, ep.mac),
				fmt.Sprintf("%s link %s veth up mtu=%d master=%s", n.id, sb, n.mtu, bridgeName(n.subnets[ep.subnet].vni)))
		}
		lines = append(lines, n.desiredPeers()...)
		m.stats.neigh6 += n.neigh6
		n.neigh6 = 0
	}
	sort.Strings(lines)
	return lines
}

// diffLines returns "missing: x" for lines of want not in have and
// "unexpected: x" for lines of have not in want (both sorted).
func diffLines(want, have []string) []string {
	wc, hc := map[string]int{}, map[string]int{}
	for _, l := range want {
		wc[l]++
	}
	for _, l := range have {
		hc[l]++
	}
	var out []string
	for l, c := range wc {
		if hc[l] < c {
			out = append(out, "missing:    "+l)
		}
	}
	for l, c := range hc {
		if wc[l] < c {
			out = append(out, "unexpected: "+l)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i][12:] < out[j][12:] || out[i][12:] == out[j][12:] && out[i] < out[j] })
	return out
}

func fmtPeer(p *peerdb.Peer) string {
	if p == nil {
		return "-"
	}
	if p.IPv6.IsValid() {
		return fmt.Sprintf("{%s %s ipv6=%s %s %s}", p.EndpointID, p.IP, p.IPv6, p.MAC, p.VTEP)
	}
	return fmt.Sprintf("{%s %s %s %s}", p.EndpointID, p.IP, p.MAC, p.VTEP)
}

// fmtTrace renders a trace event as one line of the op log; a pull with
// the records it read.
func fmtTrace(ev tev) string {
	switch ev.Kind {
	case driver.TraceCreateNetwork:
		gws := make([]string, len(ev.Gateways))
		for i, g := range ev.Gateways {
			gws[i] = "-"
			if g.IsValid() {
				gws[i] = g.String()
			}
		}
		s := fmt.Sprintf("CreateNetwork %s vnis=%v pools=%v gw=%v mtu=%d internal=%v encrypted=%v", ev.Network, ev.VNIs, ev.Pools, gws, ev.MTU, ev.Internal, ev.Encrypted)
		if len(ev.SpecGateways6) > 0 {
			s += fmt.Sprintf(" gw6=%v", ev.SpecGateways6)
		}
		return s
	case driver.TraceDeleteNetwork:
		return "DeleteNetwork " + ev.Network
	case driver.TraceCreateEndpoint:
		if ev.SpecAddr6.IsValid() {
			return fmt.Sprintf("CreateEndpoint %s/%s %s ipv6=%s %s", ev.Network, ev.Endpoint, ev.Addr, ev.SpecAddr6, ev.MAC)
		}
		return fmt.Sprintf("CreateEndpoint %s/%s %s %s", ev.Network, ev.Endpoint, ev.Addr, ev.MAC)
	case driver.TraceDeleteEndpoint:
		return fmt.Sprintf("DeleteEndpoint %s/%s", ev.Network, ev.Endpoint)
	case driver.TraceJoin:
		return fmt.Sprintf("Join %s/%s %s %s", ev.Network, ev.Endpoint, ev.Addr, ev.MAC)
	case driver.TraceLeave:
		return fmt.Sprintf("Leave %s/%s", ev.Network, ev.Endpoint)
	case driver.TracePull:
		var b strings.Builder
		fmt.Fprintf(&b, "Pull %s vni=%d", ev.Network, ev.VNI)
		if ev.Full {
			b.WriteString(" all:")
		} else {
			b.WriteString(" keys:")
		}
		for _, r := range ev.Read {
			fmt.Fprintf(&b, " %s=%s", fmtKey(r.Key), fmtPeer(r.Peer))
		}
		return b.String()
	}
	return fmt.Sprintf("%+v", ev)
}

// copyTrace deep-copies a trace event (the driver may reuse what it points to).
func copyTrace(ev driver.TraceEvent) driver.TraceEvent {
	ev.VNIs = slices.Clone(ev.VNIs)
	ev.Pools = slices.Clone(ev.Pools)
	ev.Gateways = slices.Clone(ev.Gateways)
	return ev
}

// tev is a driver trace event as the harness keeps it (and writes to the
// trace file): a Pull comes with the records it read from the source
// (Full: every record of the VNI; otherwise the keys it asked for, each
// found or not), which the sequential replay re-creates.
//
// The trace lists a network's subnets of both families but only its IPv4
// gateways, and an endpoint's IPv4 address only; the harness adds the
// IPv6 side from the workload's request (enrich): SpecGateways6 on a
// CreateNetwork of a network with IPv6 (the gateways of its IPv6 subnets,
// in their order), SpecAddr6 on a CreateEndpoint of such a network (the
// IPv6 address addr6For gave it).
type tev struct {
	driver.TraceEvent
	Full bool      `json:",omitempty"`
	Read []srcRead `json:",omitempty"`

	SpecGateways6 []netip.Prefix `json:",omitempty"`
	SpecAddr6     netip.Prefix   `json:",omitzero"`
}
