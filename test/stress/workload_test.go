package stress

import (
	"fmt"
	"math/rand"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	api "github.com/docker/go-plugins-helpers/network"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/encryption"
	"github.com/overlayd/overlayd/peerdb"
)

// netSpec is one way a network id is created. Several specs of one id, or of
// different ids, may share VNIs or pools: creating one while another holds
// the VNI fails, and pending peers of a VNI may not fit the pools of the
// network that finally takes them (they are dropped).
type netSpec struct {
	vnis     []uint32
	pools    []netip.Prefix
	noGW     bool // no gateway (pools get one otherwise: the pool's first address)
	mtu      int  // 0: from the underlay
	internal bool
	// encrypted: created with -o encrypted (the harness's driver has a
	// Secret and a stand-in kernel check). Specs of one id differ in VNIs or
	// pools, so checkCreate tells from the trace which spec, and so whether
	// the network is encrypted (the trace does not say).
	encrypted bool
}

func (s *netSpec) gateway(i int) netip.Prefix {
	if s.noGW {
		return netip.Prefix{}
	}
	return netip.PrefixFrom(s.pools[i].Addr().Next(), s.pools[i].Bits())
}

func (s *netSpec) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "vni=%v pools=%v", s.vnis, s.pools)
	if s.noGW {
		b.WriteString(" nogw")
	}
	if s.mtu != 0 {
		fmt.Fprintf(&b, " mtu=%d", s.mtu)
	}
	if s.internal {
		b.WriteString(" internal")
	}
	if s.encrypted {
		b.WriteString(" encrypted")
	}
	return b.String()
}

// opMix weighs the kinds of operation a worker draws.
type opMix struct {
	peer, epCreate, epDelete, join, leave, netCreate, netDelete, discover, info, audit, alloc int
}

func (m opMix) total() int {
	return m.peer + m.epCreate + m.epDelete + m.join + m.leave + m.netCreate + m.netDelete + m.discover + m.info + m.audit + m.alloc
}

// universe is the finite world a workload draws from: small on purpose, so
// that workers collide on ids, addresses, MACs and VNIs all the time.
type universe struct {
	nets      []string
	specs     map[string][]*netSpec
	vnis      []uint32 // every VNI of every spec, and orphans no spec has
	vniPools  map[uint32][]netip.Prefix
	pools     []netip.Prefix
	netPools  map[string][]netip.Prefix
	endpoints []string // local endpoint ids, per network
	remotes   []string // remote endpoint ids
	vteps     []netip.Addr
	localVTEP netip.Addr // the host's underlay address (a remote may claim it)
	localMax  int        // local endpoints use host numbers 2..localMax of a pool
	remoteMax int        // remote peers use 2..remoteMax
	mix       opMix
}

const underlayMTU = 1500 - 50 // nstest's eth0 has MTU 1500; VXLAN over IPv4 costs 50

var defaultMix = opMix{peer: 46, epCreate: 12, epDelete: 4, join: 12, leave: 5, netCreate: 5, netDelete: 1, discover: 2, info: 5, audit: 1, alloc: 2}

func pfx(s string) netip.Prefix { return netip.MustParsePrefix(s) }

// stressUniverse: six network ids over seven specs, single- and
// multi-subnet, sharing VNIs (100 and 103) and a pool, one without gateway
// and internal, two with explicit MTUs, two encrypted (s0 of n0 and s6 of
// n2, sharing VNIs 100 and 103 with plain specs); VNI 999 belongs to no
// spec.
func stressUniverse(localVTEP netip.Addr) *universe {
	s0 := &netSpec{vnis: []uint32{100}, pools: []netip.Prefix{pfx("198.51.100.0/26")}, encrypted: true}
	s1 := &netSpec{vnis: []uint32{101}, pools: []netip.Prefix{pfx("198.51.100.64/26")}, mtu: 1400}
	s2 := &netSpec{vnis: []uint32{102, 103}, pools: []netip.Prefix{pfx("198.51.100.128/26"), pfx("198.51.100.192/26")}}
	s3 := &netSpec{vnis: []uint32{104}, pools: []netip.Prefix{pfx("203.0.113.0/25")}, noGW: true, internal: true}
	s4 := &netSpec{vnis: []uint32{105, 106, 107}, pools: []netip.Prefix{pfx("203.0.113.128/26"), pfx("198.18.0.0/24"), pfx("198.18.1.0/24")}, mtu: 1300}
	s5 := &netSpec{vnis: []uint32{100}, pools: []netip.Prefix{pfx("198.18.2.0/24")}}
	s6 := &netSpec{vnis: []uint32{108, 103}, pools: []netip.Prefix{pfx("198.18.3.0/24"), pfx("198.51.100.192/26")}, encrypted: true}
	specs := map[string][]*netSpec{
		"n0": {s0, s5},
		"n1": {s1},
		"n2": {s2, s6},
		"n3": {s3},
		"n4": {s4},
		"n5": {s5, s1},
	}
	u := &universe{
		nets:      []string{"n0", "n1", "n2", "n3", "n4", "n5"},
		specs:     specs,
		endpoints: []string{"e0", "e1", "e2", "e3", "e4", "e5"},
		remotes:   []string{"e1", "r0", "r1", "r2", "r3", "r4", "r5", "r6"},
		vteps:     []netip.Addr{netip.MustParseAddr("192.0.2.50"), netip.MustParseAddr("192.0.2.51"), netip.MustParseAddr("192.0.2.52"), netip.MustParseAddr("192.0.2.53")},
		localVTEP: localVTEP,
		localMax:  9,
		remoteMax: 12,
		mix:       defaultMix,
	}
	u.index([]uint32{999})
	return u
}

// benchUniverse: n networks with one spec each (own VNI and pool), the
// workload of the benchmarks.
func benchUniverse(n int, localVTEP netip.Addr) *universe {
	u := &universe{
		specs:     map[string][]*netSpec{},
		endpoints: []string{"e0", "e1", "e2", "e3", "e4", "e5"},
		remotes:   []string{"e1", "r0", "r1", "r2", "r3", "r4", "r5", "r6"},
		vteps:     []netip.Addr{netip.MustParseAddr("192.0.2.50"), netip.MustParseAddr("192.0.2.51"), netip.MustParseAddr("192.0.2.52"), netip.MustParseAddr("192.0.2.53")},
		localVTEP: localVTEP,
		localMax:  9,
		remoteMax: 12,
		mix:       defaultMix,
	}
	for i := 0; i < n; i++ {
		id := fmt.Sprintf("b%d", i)
		u.nets = append(u.nets, id)
		u.specs[id] = []*netSpec{{vnis: []uint32{uint32(200 + i)}, pools: []netip.Prefix{netip.PrefixFrom(netip.AddrFrom4([4]byte{198, 18, byte(i), 0}), 24)}}}
	}
	u.index(nil)
	return u
}

func (u *universe) index(orphans []uint32) {
	u.vniPools = map[uint32][]netip.Prefix{}
	u.netPools = map[string][]netip.Prefix{}
	for _, id := range u.nets {
		for _, s := range u.specs[id] {
			for i, v := range s.vnis {
				if !slices.Contains(u.vniPools[v], s.pools[i]) {
					u.vniPools[v] = append(u.vniPools[v], s.pools[i])
				}
				if !slices.Contains(u.netPools[id], s.pools[i]) {
					u.netPools[id] = append(u.netPools[id], s.pools[i])
				}
				if !slices.Contains(u.pools, s.pools[i]) {
					u.pools = append(u.pools, s.pools[i])
				}
				if !slices.Contains(u.vnis, v) {
					u.vnis = append(u.vnis, v)
				}
			}
		}
	}
	for _, v := range orphans {
		u.vnis = append(u.vnis, v)
		u.vniPools[v] = u.pools // whatever the peers claim, no network takes them
	}
}

// plainOnly makes every spec unencrypted: an encrypted network needs the
// local VTEP address (the encryption state is invalid without it), so runs
// that learn the advertise address from DiscoverNew do without.
func (u *universe) plainOnly() {
	for _, id := range u.nets {
		for _, s := range u.specs[id] {
			s.encrypted = false
		}
	}
}

// encryptedMTU is an encrypted network's MTU on nstest's 1500-byte eth0.
var encryptedMTU = encryption.InnerMTU(1500, false)

// checkCreate verifies that a traced CreateNetwork matches a request the
// workload could have made for that id, and that the MTU is the requested
// one or the underlay's minus the VXLAN (and, encrypted, ESP) overhead. It
// returns whether the matching spec is encrypted.
func (u *universe) checkCreate(ev driver.TraceEvent) (bool, error) {
	for _, s := range u.specs[ev.Network] {
		if !slices.Equal(s.vnis, ev.VNIs) || !slices.Equal(s.pools, ev.Pools) || s.internal != ev.Internal {
			continue
		}
		gwOK := len(ev.Gateways) == len(s.pools)
		for i := 0; gwOK && i < len(s.pools); i++ {
			gwOK = ev.Gateways[i] == s.gateway(i)
		}
		if !gwOK {
			continue
		}
		want := s.mtu
		if want == 0 {
			want = underlayMTU
			if s.encrypted {
				want = encryptedMTU
			}
		}
		if ev.MTU != want {
			return s.encrypted, fmt.Errorf("%s: MTU %d, want %d", fmtTrace(ev), ev.MTU, want)
		}
		return s.encrypted, nil
	}
	return false, fmt.Errorf("%s: no CreateNetwork request of the workload had these settings", fmtTrace(ev))
}

// createRequest is the request dockerd would send for s.
func createRequest(id string, s *netSpec) *api.CreateNetworkRequest {
	vnis := make([]string, len(s.vnis))
	for i, v := range s.vnis {
		vnis[i] = strconv.FormatUint(uint64(v), 10)
	}
	generic := map[string]interface{}{driver.OptVNI: strings.Join(vnis, ",")}
	if s.mtu != 0 {
		generic[driver.OptMTU] = strconv.Itoa(s.mtu)
	}
	if s.encrypted {
		generic[driver.OptEncrypted] = "" // -o encrypted
	}
	req := &api.CreateNetworkRequest{NetworkID: id, Options: map[string]interface{}{driver.OptGeneric: generic}}
	if s.internal {
		req.Options[driver.OptInternal] = true
	}
	for i, p := range s.pools {
		d := &api.IPAMData{AddressSpace: "GlobalDefault", Pool: p.String()}
		if gw := s.gateway(i); gw.IsValid() {
			d.Gateway = gw.String()
		}
		req.IPv4Data = append(req.IPv4Data, d)
	}
	return req
}

// op is one call into the driver.
type op struct {
	desc string
	run  func(d *driver.Driver) error
	// ok says whether err is a possible outcome; an impossible one is a
	// failure of the run.
	ok func(err error) bool
}

// gen draws a worker's operations from its own seeded source.
type gen struct {
	u     *universe
	rng   *rand.Rand
	owned map[uint32][]peerdb.Peer // remote peers this worker created, by VNI
	last  []driver.PeerEvent       // the last batch sent, re-sent as a duplicate
	// announce is told of a DiscoverNew Self address before the call.
	announce func(netip.Addr)
}

func newGen(u *universe, seed int64, announce func(netip.Addr)) *gen {
	return &gen{u: u, rng: rand.New(rand.NewSource(seed)), owned: map[uint32][]peerdb.Peer{}, announce: announce}
}

func errHas(err error, subs ...string) bool {
	if err == nil {
		return true
	}
	for _, s := range subs {
		if strings.Contains(err.Error(), s) {
			return true
		}
	}
	return false
}

func mustFail(err error) bool { return err != nil }
func noError(err error) bool  { return err == nil }

func (g *gen) pick(n int) int { return g.rng.Intn(n) }

func (g *gen) hostAddr(p netip.Prefix, max int) netip.Addr {
	a := p.Addr().As4()
	a[3] += byte(2 + g.pick(max-1))
	return netip.AddrFrom4(a)
}

func (g *gen) next() op {
	u := g.u
	r := g.pick(u.mix.total())
	id := u.nets[g.pick(len(u.nets))]
	ep := u.endpoints[g.pick(len(u.endpoints))]
	switch {
	case r < u.mix.peer:
		return g.peerOp()
	case r < u.mix.peer+u.mix.epCreate:
		return g.createEndpoint(id, ep)
	case r < u.mix.peer+u.mix.epCreate+u.mix.epDelete:
		return op{desc: "DeleteEndpoint " + id + "/" + ep, ok: noError, run: func(d *driver.Driver) error {
			return d.DeleteEndpoint(&api.DeleteEndpointRequest{NetworkID: id, EndpointID: ep})
		}}
	case r < u.mix.peer+u.mix.epCreate+u.mix.epDelete+u.mix.join:
		return op{desc: "Join " + id + "/" + ep,
			ok: func(err error) bool { return errHas(err, "not found", "already joined") },
			run: func(d *driver.Driver) error {
				resp, err := d.Join(&api.JoinRequest{NetworkID: id, EndpointID: ep, SandboxKey: "/var/run/docker/netns/stress"})
				if err == nil {
					if host, _ := vethNames(id, ep); resp.InterfaceName.SrcName != host || resp.InterfaceName.DstPrefix != "eth" {
						return fmt.Errorf("Join response names %+v, want SrcName %s DstPrefix eth", resp.InterfaceName, host)
					}
				}
				return err
			}}
	case r < u.mix.peer+u.mix.epCreate+u.mix.epDelete+u.mix.join+u.mix.leave:
		return op{desc: "Leave " + id + "/" + ep, ok: noError, run: func(d *driver.Driver) error {
			return d.Leave(&api.LeaveRequest{NetworkID: id, EndpointID: ep})
		}}
	case r < u.mix.peer+u.mix.epCreate+u.mix.epDelete+u.mix.join+u.mix.leave+u.mix.netCreate:
		return g.createNetwork(id)
	case r < u.mix.peer+u.mix.epCreate+u.mix.epDelete+u.mix.join+u.mix.leave+u.mix.netCreate+u.mix.netDelete:
		return op{desc: "DeleteNetwork " + id, ok: noError, run: func(d *driver.Driver) error {
			return d.DeleteNetwork(&api.DeleteNetworkRequest{NetworkID: id})
		}}
	case r < u.mix.peer+u.mix.epCreate+u.mix.epDelete+u.mix.join+u.mix.leave+u.mix.netCreate+u.mix.netDelete+u.mix.discover:
		return g.discover()
	case r < u.mix.peer+u.mix.epCreate+u.mix.epDelete+u.mix.join+u.mix.leave+u.mix.netCreate+u.mix.netDelete+u.mix.discover+u.mix.info:
		return op{desc: "EndpointInfo " + id + "/" + ep,
			ok: func(err error) bool { return errHas(err, "not found") },
			run: func(d *driver.Driver) error {
				resp, err := d.EndpointInfo(&api.InfoRequest{NetworkID: id, EndpointID: ep})
				if err == nil {
					if host, _ := vethNames(id, ep); resp.Value["veth"] != host {
						return fmt.Errorf("EndpointInfo veth %q, want %q", resp.Value["veth"], host)
					}
				}
				return err
			}}
	case r < u.mix.peer+u.mix.epCreate+u.mix.epDelete+u.mix.join+u.mix.leave+u.mix.netCreate+u.mix.netDelete+u.mix.discover+u.mix.info+u.mix.audit:
		return op{desc: "Audit", ok: noError, run: func(d *driver.Driver) error {
			problems, err := d.Audit()
			if err != nil {
				return err
			}
			var bad []string
			for _, p := range problems {
				// The sandbox-directory check races with concurrent
				// Join/Delete by design; only quiet points judge it.
				if !strings.HasPrefix(p, "sandbox ") {
					bad = append(bad, p)
				}
			}
			if len(bad) > 0 {
				return fmt.Errorf("concurrent Audit found differences within a network: %s", strings.Join(bad, "; "))
			}
			return nil
		}}
	default:
		return g.allocOp()
	}
}

func (g *gen) createEndpoint(id, ep string) op {
	pools := g.u.netPools[id]
	pool := pools[g.pick(len(pools))]
	addr := netip.PrefixFrom(g.hostAddr(pool, g.u.localMax), pool.Bits())
	iface := &api.EndpointInterface{Address: addr.String()}
	desc := fmt.Sprintf("CreateEndpoint %s/%s %s", id, ep, addr)
	switch r := g.pick(100); {
	case r < 20: // a MAC given by dockerd, shared among endpoints and remotes
		iface.MacAddress = fmt.Sprintf("02:bb:00:00:00:%02x", g.pick(4))
		desc += " mac=" + iface.MacAddress
	case r < 22: // invalid: multicast MAC
		iface.MacAddress = "03:00:00:00:00:01"
		return op{desc: desc + " (invalid mac)", ok: mustFail, run: func(d *driver.Driver) error {
			_, err := d.CreateEndpoint(&api.CreateEndpointRequest{NetworkID: id, EndpointID: ep, Interface: iface})
			return err
		}}
	case r < 24: // invalid: IPv6 address given
		iface.AddressIPv6 = "2001:db8::5/64"
		return op{desc: desc + " (ipv6)", ok: mustFail, run: func(d *driver.Driver) error {
			_, err := d.CreateEndpoint(&api.CreateEndpointRequest{NetworkID: id, EndpointID: ep, Interface: iface})
			return err
		}}
	}
	return op{desc: desc,
		ok: func(err error) bool {
			return errHas(err, "not found", "already exists in network", "is not in any subnet")
		},
		run: func(d *driver.Driver) error {
			resp, err := d.CreateEndpoint(&api.CreateEndpointRequest{NetworkID: id, EndpointID: ep, Interface: iface})
			if err != nil {
				return err
			}
			want := peerdb.MACFromIP(addr.Addr()).String()
			if iface.MacAddress != "" {
				if resp.Interface != nil && resp.Interface.MacAddress != "" {
					return fmt.Errorf("CreateEndpoint returned MAC %q although dockerd gave one", resp.Interface.MacAddress)
				}
			} else if resp.Interface == nil || resp.Interface.MacAddress != want {
				return fmt.Errorf("CreateEndpoint returned %+v, want the MAC derived from the IP, %s", resp.Interface, want)
			}
			return nil
		}}
}

func (g *gen) createNetwork(id string) op {
	specs := g.u.specs[id]
	s := specs[g.pick(len(specs))]
	if g.pick(100) < 4 {
		req := createRequest(id, s)
		gen := req.Options[driver.OptGeneric].(map[string]interface{})
		if g.pick(2) == 0 {
			gen[driver.OptMTU] = "100" // out of range
		} else {
			gen[driver.OptEncrypted] = "maybe" // not a boolean
		}
		return op{desc: "CreateNetwork " + id + " (invalid option)", ok: mustFail, run: func(d *driver.Driver) error {
			return d.CreateNetwork(req)
		}}
	}
	return op{desc: "CreateNetwork " + id + " " + s.String(),
		ok:  func(err error) bool { return errHas(err, "already exists on this host", "is already used by network") },
		run: func(d *driver.Driver) error { return d.CreateNetwork(createRequest(id, s)) }}
}

func (g *gen) discover() op {
	var data map[string]interface{}
	var self netip.Addr
	valid := true
	switch r := g.pick(10); {
	case r < 4:
		self = g.u.localVTEP
	case r < 5:
		self = g.u.localVTEP.Next() // an address no device has
	case r < 9:
		data = map[string]interface{}{"Address": g.u.vteps[g.pick(len(g.u.vteps))].String(), "Self": false}
	default:
		valid = false
		data = map[string]interface{}{"Address": "not-an-address", "Self": true}
	}
	if self.IsValid() {
		data = map[string]interface{}{"Address": self.String(), "Self": true}
	}
	req := &api.DiscoveryNotification{DiscoveryType: 1, DiscoveryData: data}
	ok := noError
	if !valid {
		ok = mustFail
	}
	return op{desc: fmt.Sprintf("DiscoverNew %v", data), ok: ok, run: func(d *driver.Driver) error {
		if self.IsValid() {
			g.announce(self)
		}
		return d.DiscoverNew(req)
	}}
}

func (g *gen) allocOp() op {
	id := fmt.Sprintf("a%d", g.pick(3))
	if g.pick(3) == 0 {
		return op{desc: "FreeNetwork " + id, ok: noError, run: func(d *driver.Driver) error {
			return d.FreeNetwork(&api.FreeNetworkRequest{NetworkID: id})
		}}
	}
	n := 1 + g.pick(2)
	req := &api.AllocateNetworkRequest{NetworkID: id, Options: map[string]string{}}
	for i := 0; i < n; i++ {
		req.IPv4Data = append(req.IPv4Data, api.IPAMData{Pool: fmt.Sprintf("198.19.%d.0/24", i)})
	}
	return op{desc: fmt.Sprintf("AllocateNetwork %s (%d subnets)", id, n), ok: noError, run: func(d *driver.Driver) error {
		resp, err := d.AllocateNetwork(req)
		if err == nil && len(strings.Split(resp.Options[driver.OptVNI], ",")) != n {
			return fmt.Errorf("AllocateNetwork returned VNIs %q for %d subnets", resp.Options[driver.OptVNI], n)
		}
		return err
	}}
}

// randomPeer draws a remote record for vni: usually an address in a pool
// of that VNI, sometimes in another pool (it will not fit).
func (g *gen) randomPeer(vni uint32) peerdb.Peer {
	pools := g.u.vniPools[vni]
	if g.pick(10) == 0 {
		pools = g.u.pools
	}
	ip := g.hostAddr(pools[g.pick(len(pools))], g.u.remoteMax)
	p := peerdb.Peer{EndpointID: g.u.remotes[g.pick(len(g.u.remotes))], IP: ip, VTEP: g.u.vteps[g.pick(len(g.u.vteps))]}
	if g.pick(30) == 0 {
		p.VTEP = g.u.localVTEP
	}
	if g.pick(10) < 6 {
		p.MAC = peerdb.MACFromIP(ip)
	} else {
		p.MAC = peerdb.MAC{0x02, 0xbb, 0, 0, 0, byte(g.pick(4))}
	}
	return p
}

// variant is an update of p: the IP moves to another host (VTEP), the
// record gets another MAC, or the endpoint another IP of the VNI's pools.
func (g *gen) variant(vni uint32, p peerdb.Peer) peerdb.Peer {
	q := p
	switch g.pick(4) {
	case 0, 1:
		q.VTEP = g.u.vteps[g.pick(len(g.u.vteps))]
	case 2:
		q.MAC = peerdb.MAC{0x02, 0xbb, 0, 0, 0, byte(g.pick(4))}
	default:
		q.IP = g.randomPeer(vni).IP
	}
	return q
}

func (g *gen) takeOwned(vni uint32) (peerdb.Peer, bool) {
	s := g.owned[vni]
	if len(s) == 0 || g.pick(5) == 0 {
		return g.randomPeer(vni), false // an unknown record: delete of an absent entry
	}
	i := g.pick(len(s))
	p := s[i]
	s[i] = s[len(s)-1]
	g.owned[vni] = s[:len(s)-1]
	return p, true
}

func (g *gen) own(vni uint32, p peerdb.Peer) {
	if len(g.owned[vni]) < 16 {
		g.owned[vni] = append(g.owned[vni], p)
	}
}

// peerEvent draws one create, update or delete for vni.
func (g *gen) peerEvent(vni uint32) driver.PeerEvent {
	switch r := g.pick(10); {
	case r < 4:
		p := g.randomPeer(vni)
		g.own(vni, p)
		return driver.PeerEvent{VNI: vni, Next: &p}
	case r < 7:
		p, _ := g.takeOwned(vni)
		q := g.variant(vni, p)
		g.own(vni, q)
		return driver.PeerEvent{VNI: vni, Prev: &p, Next: &q}
	default:
		p, _ := g.takeOwned(vni)
		return driver.PeerEvent{VNI: vni, Prev: &p}
	}
}

func (g *gen) peerOp() op {
	u := g.u
	vni := u.vnis[g.pick(len(u.vnis))]
	var evs []driver.PeerEvent
	switch r := g.pick(100); {
	case r < 5 && g.last != nil: // gossip replayed: the same events again
		evs = g.last
	case r < 60:
		evs = []driver.PeerEvent{g.peerEvent(vni)}
	case r < 75: // coalesced updates of one record: create, update, update
		p := g.randomPeer(vni)
		q := g.variant(vni, p)
		s := g.variant(vni, q)
		evs = []driver.PeerEvent{{VNI: vni, Next: &p}, {VNI: vni, Prev: &p, Next: &q}, {VNI: vni, Prev: &q, Next: &s}}
		if g.pick(3) == 0 { // delivered out of order
			g.rng.Shuffle(len(evs), func(i, j int) { evs[i], evs[j] = evs[j], evs[i] })
		}
		g.own(vni, s)
	case r < 92: // a batch for one VNI, or spread over several
		n := 2 + g.pick(6)
		mixed := g.pick(3) == 0
		for i := 0; i < n; i++ {
			v := vni
			if mixed {
				v = u.vnis[g.pick(len(u.vnis))]
			}
			evs = append(evs, g.peerEvent(v))
		}
	case r < 97: // an invalid record among valid ones
		bad := g.randomPeer(vni)
		switch g.pick(4) {
		case 0:
			bad.MAC = peerdb.MAC{}
		case 1:
			bad.EndpointID = ""
		case 2:
			bad.VTEP = netip.IPv4Unspecified()
		default:
			bad.IP = netip.MustParseAddr("2001:db8::1")
		}
		good := g.peerEvent(vni)
		evs = []driver.PeerEvent{{VNI: vni, Next: &bad}, good}
		return op{desc: "ApplyPeerEvents " + fmtPeerEvents(evs) + " (one invalid)", ok: mustFail, run: func(d *driver.Driver) error {
			return d.ApplyPeerEvents(evs)
		}}
	default: // an event with neither prev nor next
		evs = []driver.PeerEvent{{VNI: vni}}
		return op{desc: "ApplyPeerEvent " + fmtPeerEvents(evs) + " (empty)", ok: mustFail, run: func(d *driver.Driver) error {
			return d.ApplyPeerEvent(evs[0])
		}}
	}
	g.last = evs
	return op{desc: "ApplyPeerEvents " + fmtPeerEvents(evs),
		// Records outside the subnets of the VNI's network are rejected.
		ok: func(err error) bool { return err == nil || errHas(err, "peer event") && !errHas(err, "failed") },
		run: func(d *driver.Driver) error {
			if len(evs) == 1 {
				return d.ApplyPeerEvent(evs[0])
			}
			return d.ApplyPeerEvents(evs)
		}}
}

func fmtPeerEvents(evs []driver.PeerEvent) string {
	var b strings.Builder
	for i, e := range evs {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "vni=%d %s->%s", e.VNI, fmtPeer(e.Prev), fmtPeer(e.Next))
	}
	return b.String()
}
