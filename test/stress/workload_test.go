//go:build testhooks

package stress

import (
	"fmt"
	"hash/crc32"
	"maps"
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
// the VNI fails, and the source's records of a VNI may not fit the pools of
// the network that has it now (it refuses them; they stay at the source and
// fit a network created later with another spec).
type netSpec struct {
	vnis  []uint32
	pools []netip.Prefix // IPv4; the invalid Prefix for an IPv6-only segment
	// pools6 are the IPv6 subnets of a network with IPv6: it has one
	// segment (one VNI) carrying its IPv4 subnet, if any, and these.
	pools6   []netip.Prefix
	noGW     bool // no gateway (pools get one otherwise: the pool's first address)
	mtu      int  // 0: from the underlay
	internal bool
	// encrypted: created with -o encrypted (the harness's driver has an
	// encryption owner with a stand-in kernel check).
	encrypted bool
}

func (s *netSpec) gateway(i int) netip.Prefix {
	if s.noGW || !s.pools[i].IsValid() {
		return netip.Prefix{}
	}
	return netip.PrefixFrom(s.pools[i].Addr().Next(), s.pools[i].Bits())
}

// gateway6 is the gateway of IPv6 subnet j (its first address after the
// subnet-router anycast one), or none.
func (s *netSpec) gateway6(j int) netip.Prefix {
	if s.noGW {
		return netip.Prefix{}
	}
	return netip.PrefixFrom(s.pools6[j].Addr().Next(), s.pools6[j].Bits())
}

func (s *netSpec) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "vni=%v pools=%v", s.vnis, s.pools)
	if len(s.pools6) > 0 {
		fmt.Fprintf(&b, " pools6=%v", s.pools6)
	}
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
	peer, epCreate, epDelete, join, leave, netCreate, netDelete, discover, info, audit, alloc, reconcile int
}

func (m opMix) total() int {
	return m.peer + m.epCreate + m.epDelete + m.join + m.leave + m.netCreate + m.netDelete + m.discover + m.info + m.audit + m.alloc + m.reconcile
}

// universe is the finite world a workload draws from: small on purpose, so
// that workers collide on ids, addresses, MACs and VNIs all the time.
type universe struct {
	nets      []string
	specs     map[string][]*netSpec
	vnis      []uint32 // every VNI of every spec, and orphans no spec has
	vniPools  map[uint32][]netip.Prefix
	pools     []netip.Prefix
	endpoints []string // local endpoint ids, per network
	remotes   []string // remote endpoint ids
	vteps     []netip.Addr
	origins   []origin   // one per remote VTEP
	localVTEP netip.Addr // the host's underlay address (a stale origin claims it)
	localMax  int        // local endpoints use host numbers 2..localMax of a pool
	remoteMax int        // remote peers use 2..remoteMax
	mix       opMix
	// noLost: no source change goes unnotified (lost notifications are
	// repaired by the quiet point's Reconcile, left out of kernel-only runs).
	noLost bool
}

const underlayMTU = 1500 - 50 // nstest's eth0 has MTU 1500; VXLAN over IPv4 costs 50

var defaultMix = opMix{peer: 46, epCreate: 12, epDelete: 4, join: 12, leave: 5, netCreate: 5, netDelete: 1, discover: 2, info: 5, audit: 1, alloc: 2, reconcile: 1}

func pfx(s string) netip.Prefix { return netip.MustParsePrefix(s) }

// stressUniverse: eight network ids over thirteen specs, single- and
// multi-subnet, sharing VNIs (100, 101 and 103) and a pool, two without
// gateway and internal, three with explicit MTUs, three encrypted (s0 of
// n0, s6 of n2 and s9 of n7, sharing VNIs 100 and 103 with plain specs);
// six with IPv6 (issue 12): dual-stack with two IPv6 subnets (s7),
// IPv6-only (s8), dual-stack on VNI 100 of n0's specs (s9), IPv6-only,
// internal, on VNI 101 of n1's and n5's (s10), so that records of one VNI
// carry addresses of either family that fit one network and not another,
// and the second specs of n3 (dual-stack, s11) and n4 (IPv6-only, s12);
// VNI 999 belongs to no spec.
func stressUniverse(localVTEP netip.Addr) *universe {
	s0 := &netSpec{vnis: []uint32{100}, pools: []netip.Prefix{pfx("198.51.100.0/26")}, encrypted: true}
	s1 := &netSpec{vnis: []uint32{101}, pools: []netip.Prefix{pfx("198.51.100.64/26")}, mtu: 1400}
	s2 := &netSpec{vnis: []uint32{102, 103}, pools: []netip.Prefix{pfx("198.51.100.128/26"), pfx("198.51.100.192/26")}}
	s3 := &netSpec{vnis: []uint32{104}, pools: []netip.Prefix{pfx("203.0.113.0/25")}, noGW: true, internal: true}
	s4 := &netSpec{vnis: []uint32{105, 106, 107}, pools: []netip.Prefix{pfx("203.0.113.128/26"), pfx("198.18.0.0/24"), pfx("198.18.1.0/24")}, mtu: 1300}
	s5 := &netSpec{vnis: []uint32{100}, pools: []netip.Prefix{pfx("198.18.2.0/24")}}
	s6 := &netSpec{vnis: []uint32{108, 103}, pools: []netip.Prefix{pfx("198.18.3.0/24"), pfx("198.51.100.192/26")}, encrypted: true}
	s7 := &netSpec{vnis: []uint32{110}, pools: []netip.Prefix{pfx("198.18.4.0/24")}, pools6: []netip.Prefix{pfx("2001:db8:6::/64"), pfx("2001:db8:6:1::/64")}}
	s8 := &netSpec{vnis: []uint32{111}, pools: []netip.Prefix{{}}, pools6: []netip.Prefix{pfx("2001:db8:7::/64")}}
	s9 := &netSpec{vnis: []uint32{100}, pools: []netip.Prefix{pfx("198.18.5.0/24")}, pools6: []netip.Prefix{pfx("2001:db8:9::/64")}, mtu: 1400, encrypted: true}
	s10 := &netSpec{vnis: []uint32{101}, pools: []netip.Prefix{{}}, pools6: []netip.Prefix{pfx("2001:db8:a::/120")}, noGW: true, internal: true}
	s11 := &netSpec{vnis: []uint32{112}, pools: []netip.Prefix{pfx("198.18.6.0/24")}, pools6: []netip.Prefix{pfx("2001:db8:b::/64")}}
	s12 := &netSpec{vnis: []uint32{113}, pools: []netip.Prefix{{}}, pools6: []netip.Prefix{pfx("2001:db8:c::/64")}, mtu: 1280}
	return newUniverse(localVTEP, map[string][]*netSpec{
		"n0": {s0, s5},
		"n1": {s1},
		"n2": {s2, s6},
		"n3": {s3, s11},
		"n4": {s4, s12},
		"n5": {s5, s1},
		"n6": {s7, s8},
		"n7": {s9, s10},
	})
}

// newUniverse is the world of specs (network ids in sorted order), with
// the usual endpoints, remotes and hosts, and VNI 999 that no spec has.
func newUniverse(localVTEP netip.Addr, specs map[string][]*netSpec) *universe {
	u := &universe{
		nets:      slices.Sorted(maps.Keys(specs)),
		specs:     specs,
		endpoints: []string{"e0", "e1", "e2", "e3", "e4", "e5"},
		remotes:   []string{"e1", "r0", "r1", "r2", "r3", "r4", "r5", "r6"},
		vteps:     remoteVTEPs,
		localVTEP: localVTEP,
		localMax:  9,
		remoteMax: 12,
		mix:       defaultMix,
	}
	u.index([]uint32{999})
	return u
}

// ipv6Universe: the world of TestStressIPv6, where nearly every network
// has IPv6: six ids over nine specs, dual-stack (one with two IPv6
// subnets, one encrypted) and IPv6-only (one internal without gateway, a
// /120), sharing VNIs with each other and with IPv4-only specs (n2's and
// n4's second ones), and an IPv6 pool shared by n2 and n5; VNI 999
// belongs to no spec.
func ipv6Universe(localVTEP netip.Addr) *universe {
	s0 := &netSpec{vnis: []uint32{100}, pools: []netip.Prefix{pfx("198.51.100.0/26")}, pools6: []netip.Prefix{pfx("2001:db8:10::/64")}}
	s0b := &netSpec{vnis: []uint32{100}, pools: []netip.Prefix{{}}, pools6: []netip.Prefix{pfx("2001:db8:11::/64")}}
	s1 := &netSpec{vnis: []uint32{101}, pools: []netip.Prefix{{}}, pools6: []netip.Prefix{pfx("2001:db8:12::/64")}, mtu: 1400}
	s2 := &netSpec{vnis: []uint32{102}, pools: []netip.Prefix{pfx("198.51.100.64/26")}, pools6: []netip.Prefix{pfx("2001:db8:13::/64"), pfx("2001:db8:14::/64")}}
	s2b := &netSpec{vnis: []uint32{102, 103}, pools: []netip.Prefix{pfx("198.51.100.128/26"), pfx("198.51.100.192/26")}}
	s3 := &netSpec{vnis: []uint32{104}, pools: []netip.Prefix{{}}, pools6: []netip.Prefix{pfx("2001:db8:15::/120")}, noGW: true, internal: true}
	s4 := &netSpec{vnis: []uint32{105}, pools: []netip.Prefix{pfx("203.0.113.128/26")}, pools6: []netip.Prefix{pfx("2001:db8:16::/64")}, encrypted: true}
	s4b := &netSpec{vnis: []uint32{105}, pools: []netip.Prefix{pfx("203.0.113.192/26")}}
	s5 := &netSpec{vnis: []uint32{106}, pools: []netip.Prefix{pfx("203.0.113.0/25")}, pools6: []netip.Prefix{pfx("2001:db8:13::/64")}, mtu: 1300}
	return newUniverse(localVTEP, map[string][]*netSpec{"n0": {s0, s0b}, "n1": {s1}, "n2": {s2, s2b}, "n3": {s3}, "n4": {s4, s4b}, "n5": {s5}})
}

// remoteVTEPs are the hosts the source's records come from.
var remoteVTEPs = []netip.Addr{netip.MustParseAddr("192.0.2.50"), netip.MustParseAddr("192.0.2.51"), netip.MustParseAddr("192.0.2.52"), netip.MustParseAddr("192.0.2.53")}

// benchUniverse: n networks with one spec each (own VNI and pool), the
// workload of the benchmarks.
func benchUniverse(n int, localVTEP netip.Addr) *universe {
	u := &universe{
		specs:     map[string][]*netSpec{},
		endpoints: []string{"e0", "e1", "e2", "e3", "e4", "e5"},
		remotes:   []string{"e1", "r0", "r1", "r2", "r3", "r4", "r5", "r6"},
		vteps:     remoteVTEPs,
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
	for _, v := range u.vteps {
		u.origins = append(u.origins, originOf(v))
	}
	u.vniPools = map[uint32][]netip.Prefix{}
	for _, id := range u.nets {
		for _, s := range u.specs[id] {
			for i, v := range s.vnis {
				pools := []netip.Prefix{s.pools[i]}
				if i == 0 {
					pools = append(pools, s.pools6...) // a network with IPv6 has one segment
				}
				for _, p := range pools {
					if !p.IsValid() {
						continue // an IPv6-only segment
					}
					if !slices.Contains(u.vniPools[v], p) {
						u.vniPools[v] = append(u.vniPools[v], p)
					}
					if !slices.Contains(u.pools, p) {
						u.pools = append(u.pools, p)
					}
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
// local VTEP (the encryption owner refuses encrypted shares until it knows
// it, and every share's Update fails while one is registered), so runs
// that learn the advertise address from DiscoverNew while the workload
// runs do without.
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
// workload could have made for that id (VNIs, pools, gateways, internal,
// encrypted), and that the MTU is the requested one or the underlay's minus
// the VXLAN (and, encrypted, ESP) overhead; it returns that request's spec.
// The trace lists every subnet of each segment (its IPv4 one first, then
// its IPv6 ones) and each segment's IPv4 gateway (none for an IPv6-only
// segment); it has no IPv6 gateways (enrich adds the spec's).
func (u *universe) checkCreate(ev driver.TraceEvent) (*netSpec, error) {
	for _, s := range u.specs[ev.Network] {
		if !slices.Equal(s.vnis, ev.VNIs) || !slices.Equal(s.tracedPools(), ev.Pools) || s.internal != ev.Internal || s.encrypted != ev.Encrypted {
			continue
		}
		ok := len(ev.Gateways) == len(s.pools)
		for i := 0; ok && i < len(s.pools); i++ {
			ok = ev.Gateways[i] == s.gateway(i)
		}
		if !ok {
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
			return s, fmt.Errorf("%s: MTU %d, want %d", fmtTrace(tev{TraceEvent: ev}), ev.MTU, want)
		}
		return s, nil
	}
	return nil, fmt.Errorf("%s: no CreateNetwork request of the workload had these settings", fmtTrace(tev{TraceEvent: ev}))
}

// tracedPools are the subnets of the spec as the driver's trace lists them:
// per segment its IPv4 subnet, if any, then its IPv6 ones.
func (s *netSpec) tracedPools() []netip.Prefix {
	var out []netip.Prefix
	for i, p := range s.pools {
		if p.IsValid() {
			out = append(out, p)
		}
		if i == 0 {
			out = append(out, s.pools6...)
		}
	}
	return out
}

// addr6For is the IPv6 address the workload gives an endpoint of a network
// of spec s that has IPv6 (dockerd gives every endpoint of a dual-stack
// network both): with an IPv4 address, the same host number in the IPv6
// subnet that number picks; without (an IPv6-only network), a host number
// of the endpoint id's. The trace carries the IPv4 address only, so the
// harness recomputes the IPv6 one from it (enrich). Endpoints of one
// network may share either address, as they may share the IPv4 one.
func addr6For(s *netSpec, v4 netip.Addr, ep string) netip.Prefix {
	var host byte
	if v4.Is4() {
		host = v4.As4()[3]
	} else {
		host = byte(2 + crc32.ChecksumIEEE([]byte(ep))%8)
	}
	p := s.pools6[int(host)%len(s.pools6)]
	a := p.Addr().As16()
	a[15] += host
	return netip.PrefixFrom(netip.AddrFrom16(a), p.Bits())
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
		if !p.IsValid() {
			continue // IPv6-only
		}
		d := &api.IPAMData{AddressSpace: "GlobalDefault", Pool: p.String()}
		if gw := s.gateway(i); gw.IsValid() {
			d.Gateway = gw.String()
		}
		req.IPv4Data = append(req.IPv4Data, d)
	}
	if len(s.pools6) > 0 {
		req.Options[driver.OptEnableV6] = true
	}
	for j, p := range s.pools6 {
		d := &api.IPAMData{AddressSpace: "GlobalDefault", Pool: p.String()}
		if gw := s.gateway6(j); gw.IsValid() {
			d.Gateway = gw.String()
		}
		req.IPv6Data = append(req.IPv6Data, d)
	}
	return req
}

// op is one call into the driver (a source op: a change of the source's
// records and the notifications that follow it).
type op struct {
	desc string
	run  func(d *driver.Driver) error
	// ok says whether err is a possible outcome; an impossible one is a
	// failure of the run.
	ok func(err error) bool
	// detail, if set, is filled in by run: what a source op drew and did
	// (the records depend on what the source holds then).
	detail *string
}

// gen draws a worker's operations from its own seeded source.
type gen struct {
	u    *universe
	src  *source
	rng  *rand.Rand
	last []notification // the last notifications sent, re-sent as duplicates
	// count counts what the worker did, by kind (see workStats).
	count map[string]int
	// announce is told of a DiscoverNew Self address before the call.
	announce func(netip.Addr)
}

func newGen(u *universe, src *source, seed int64, announce func(netip.Addr)) *gen {
	return &gen{u: u, src: src, rng: rand.New(rand.NewSource(seed)), count: map[string]int{}, announce: announce}
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
	if p.Addr().Is6() {
		a := p.Addr().As16()
		a[15] += byte(2 + g.pick(max-1))
		return netip.AddrFrom16(a)
	}
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
	case r < u.mix.peer+u.mix.epCreate+u.mix.epDelete+u.mix.join+u.mix.leave+u.mix.netCreate+u.mix.netDelete+u.mix.discover+u.mix.info+u.mix.audit+u.mix.alloc:
		return g.allocOp()
	default:
		// The daemon's periodic repair, concurrent with everything: a full
		// pull of every network, then a kernel dump and diff. Each network
		// is handled under its lock, where its kernel state is what its
		// table says, so it must find nothing to fix.
		return op{desc: "Reconcile", ok: noError, run: func(d *driver.Driver) error {
			g.count["reconcile"]++
			fixed, err := d.Reconcile()
			if len(fixed) > 0 {
				return fmt.Errorf("Reconcile fixed what its networks' locks should have kept in line: %s", strings.Join(fixed, "; "))
			}
			return err
		}}
	}
}

// createEndpoint draws a request that fits one of the specs of id (the
// network may have another one now: then it is refused): an IPv4 address
// of a segment, and on a network with IPv6 the IPv6 address addr6For
// gives (only that on an IPv6-only network).
func (g *gen) createEndpoint(id, ep string) op {
	specs := g.u.specs[id]
	s := specs[g.pick(len(specs))]
	seg := g.pick(len(s.vnis))
	iface := &api.EndpointInterface{}
	desc := fmt.Sprintf("CreateEndpoint %s/%s", id, ep)
	var v4 netip.Addr
	if pool := s.pools[seg]; pool.IsValid() {
		v4 = g.hostAddr(pool, g.u.localMax)
		iface.Address = netip.PrefixFrom(v4, pool.Bits()).String()
		desc += " " + iface.Address
	}
	if seg == 0 && len(s.pools6) > 0 {
		iface.AddressIPv6 = addr6For(s, v4, ep).String()
		desc += " " + iface.AddressIPv6
		g.count["endpoint requests with IPv6"]++
	}
	// A request for another spec of the id than the network's is refused;
	// the driver names the field (Interface.Address, .AddressIPv6).
	refusals := []string{"not found", "already exists in network", "is not in any subnet", "Interface.Address"}
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
	case r < 24: // invalid: an IPv6 address in no IPv6 subnet of any spec
		iface.AddressIPv6 = "2001:db8::5/64"
		return op{desc: desc + " (ipv6 outside the subnets)", ok: mustFail, run: func(d *driver.Driver) error {
			_, err := d.CreateEndpoint(&api.CreateEndpointRequest{NetworkID: id, EndpointID: ep, Interface: iface})
			return err
		}}
	}
	return op{desc: desc,
		ok: func(err error) bool {
			return errHas(err, refusals...)
		},
		run: func(d *driver.Driver) error {
			resp, err := d.CreateEndpoint(&api.CreateEndpointRequest{NetworkID: id, EndpointID: ep, Interface: iface})
			if err != nil {
				return err
			}
			want := peerdb.MACFromEndpointID(ep).String()
			if iface.MacAddress != "" {
				if resp.Interface != nil && resp.Interface.MacAddress != "" {
					return fmt.Errorf("CreateEndpoint returned MAC %q although dockerd gave one", resp.Interface.MacAddress)
				}
			} else if resp.Interface == nil || resp.Interface.MacAddress != want {
				return fmt.Errorf("CreateEndpoint returned %+v, want the MAC derived from the endpoint id, %s", resp.Interface, want)
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

// The source ops: the control plane's side. Each changes the source's
// records in one critical section and then notifies the driver of the keys
// it touched, per VNI, as internal/cluster's delivery does (records first,
// then PeersChanged); some notify spuriously, repeat themselves, or say
// "every record of the VNI" (keys nil); a few never notify (a lost
// notification: the quiet point's Reconcile repairs it).

// origin draws the origin of a record: one of the remote hosts, or rarely
// a stale member with this host's address.
func (g *gen) origin() origin {
	if g.pick(30) == 0 {
		return staleSelf(g.u.localVTEP)
	}
	return g.u.origins[g.pick(len(g.u.origins))]
}

func (g *gen) originNamed(name string) origin {
	for _, o := range g.u.origins {
		if o.name == name {
			return o
		}
	}
	return staleSelf(g.u.localVTEP)
}

// randomKey draws a key of vni (it may or may not exist at the source).
func (g *gen) randomKey(vni uint32) peerdb.Key {
	return peerdb.Key{VNI: vni, Origin: g.origin().name, EndpointID: g.u.remotes[g.pick(len(g.u.remotes))]}
}

// randomIPs draws the addresses of a record of vni: usually in the pools
// of that VNI, sometimes in any pool (the record does not fit the network
// that has the VNI now, and may fit one created later). Where the pools
// have both families, a record has an IPv4 address, an IPv6 one or both
// (a dual-stack endpoint); never neither.
func (g *gen) randomIPs(vni uint32) (v4, v6 netip.Addr) {
	pools := g.u.vniPools[vni]
	if g.pick(10) == 0 {
		pools = g.u.pools
	}
	var p4, p6 []netip.Prefix
	for _, p := range pools {
		if p.Addr().Is4() {
			p4 = append(p4, p)
		} else {
			p6 = append(p6, p)
		}
	}
	want4, want6 := len(p4) > 0, len(p6) > 0
	if want4 && want6 {
		switch g.pick(3) {
		case 0:
			want6 = false
		case 1:
			want4 = false
		}
	}
	if want4 {
		v4 = g.hostAddr(p4[g.pick(len(p4))], g.u.remoteMax)
	}
	if want6 {
		v6 = g.hostAddr(p6[g.pick(len(p6))], g.u.remoteMax)
	}
	return v4, v6
}

// randomMAC draws a record's MAC: derived from one of its addresses, or
// one shared among records and local endpoints.
func (g *gen) randomMAC(v4, v6 netip.Addr) peerdb.MAC {
	if g.pick(10) < 6 {
		if !v4.IsValid() {
			return peerdb.MACFromIP(v6)
		}
		return peerdb.MACFromIP(v4)
	}
	return peerdb.MAC{0x02, 0xbb, 0, 0, 0, byte(g.pick(4))}
}

// record draws the record of k: its origin's VTEP, its endpoint id.
func (g *gen) record(k peerdb.Key) peerdb.Peer {
	v4, v6 := g.randomIPs(k.VNI)
	if v6.IsValid() {
		g.count["records with IPv6 drawn"]++
	}
	return peerdb.Peer{EndpointID: k.EndpointID, IP: v4, IPv6: v6, MAC: g.randomMAC(v4, v6), VTEP: g.originNamed(k.Origin).vtep}
}

// variant is an update of p under the same key: another MAC, or the
// endpoint another IP (the VTEP is its origin's).
func (g *gen) variant(k peerdb.Key, p peerdb.Peer) peerdb.Peer {
	q := p
	switch g.pick(3) {
	case 0:
		q.MAC = peerdb.MAC{0x02, 0xbb, 0, 0, 0, byte(g.pick(4))}
	case 1:
		q.IP, q.IPv6 = g.randomIPs(k.VNI)
	default:
		q.IP, q.IPv6 = g.randomIPs(k.VNI)
		q.MAC = g.randomMAC(q.IP, q.IPv6)
	}
	return q
}

// existingLocked draws a record of vni the source holds (ok false if
// none); expects the source locked.
func (g *gen) existingLocked(vni uint32) (peerdb.Key, peerdb.Peer, bool) {
	keys := g.src.keysLocked(vni)
	if len(keys) == 0 {
		return peerdb.Key{}, peerdb.Peer{}, false
	}
	k := keys[g.pick(len(keys))]
	return k, g.src.recs[vni][k], true
}

// change makes one random change of vni's records: create or replace,
// update, delete (also of an absent key) or a move of an IP to another
// host (a delete under one origin and a create under another). It returns
// the keys touched and describes the change; expects the source locked.
func (g *gen) changeLocked(vni uint32, b *strings.Builder) []peerdb.Key {
	set := func(k peerdb.Key, p peerdb.Peer) {
		g.src.setLocked(k, p)
		fmt.Fprintf(b, " set %s=%s", fmtKey(k), fmtPeer(&p))
	}
	del := func(k peerdb.Key) {
		g.src.delLocked(k)
		fmt.Fprintf(b, " del %s", fmtKey(k))
	}
	switch r := g.pick(100); {
	case r < 40:
		g.count["record set"]++
		k := g.randomKey(vni)
		set(k, g.record(k))
		return []peerdb.Key{k}
	case r < 65:
		g.count["record updated"]++
		k, p, ok := g.existingLocked(vni)
		if !ok {
			k = g.randomKey(vni)
			p = g.record(k)
		}
		set(k, g.variant(k, p))
		return []peerdb.Key{k}
	case r < 85:
		g.count["record deleted"]++
		k, _, ok := g.existingLocked(vni)
		if !ok || g.pick(5) == 0 {
			k = g.randomKey(vni) // usually absent: a delete of nothing
		}
		del(k)
		return []peerdb.Key{k}
	default:
		g.count["record moved to another host"]++
		k, p, ok := g.existingLocked(vni)
		if !ok {
			k = g.randomKey(vni)
			p = g.record(k)
		}
		to := g.origin()
		for to.name == k.Origin {
			to = g.u.origins[g.pick(len(g.u.origins))]
		}
		k2 := peerdb.Key{VNI: vni, Origin: to.name, EndpointID: k.EndpointID}
		if g.pick(3) == 0 {
			k2.EndpointID = g.u.remotes[g.pick(len(g.u.remotes))] // a new container with the address
		}
		p2 := p
		p2.EndpointID, p2.VTEP = k2.EndpointID, to.vtep
		del(k)
		set(k2, p2)
		return []peerdb.Key{k, k2}
	}
}

// invalidLocked stores a record the networks must refuse (it stays at the
// source): a bad field, or an EndpointID that is not its key's. Expects
// the source locked.
func (g *gen) invalidLocked(vni uint32, b *strings.Builder) []peerdb.Key {
	k := g.randomKey(vni)
	p := g.record(k)
	var why string
	switch g.pick(14) {
	case 0:
		p.MAC, why = peerdb.MAC{}, "zero MAC"
	case 1:
		p.MAC, why = peerdb.MAC{0x03, 0, 0, 0, 0, 1}, "multicast MAC"
	case 2:
		p.EndpointID, why = "", "empty EndpointID"
	case 3:
		p.EndpointID, why = k.EndpointID+"-other", "EndpointID not the key's"
	case 4:
		p.VTEP, why = netip.IPv4Unspecified(), "unspecified VTEP"
	case 5:
		p.VTEP, why = netip.MustParseAddr("224.0.0.5"), "multicast VTEP"
	case 6:
		p.IP, why = netip.MustParseAddr("2001:db8::1"), "IPv6 address"
	case 7:
		p.IP, why = netip.AddrFrom16(netip.MustParseAddr("198.51.100.7").As16()), "IPv4-mapped IPv6 address"
	case 8:
		p.IP, p.IPv6, why = netip.Addr{}, netip.Addr{}, "no address"
	case 9:
		p.IPv6, why = netip.MustParseAddr("198.51.100.7"), "IPv4 address as IPv6"
	case 10:
		p.IPv6, why = netip.AddrFrom16(netip.MustParseAddr("198.51.100.7").As16()), "IPv4-mapped address as IPv6"
	case 11:
		p.IPv6, why = netip.MustParseAddr("ff02::1"), "multicast IPv6"
	case 12:
		p.IPv6, why = netip.MustParseAddr("fe80::5"), "link-local IPv6"
	default:
		k.EndpointID = strings.Repeat("x", peerdb.MaxEndpointIDLen+1)
		p.EndpointID, why = k.EndpointID, "EndpointID too long"
	}
	g.src.setLocked(k, p)
	g.count["invalid record set"]++
	fmt.Fprintf(b, " set %s=%s (invalid: %s)", fmtKey(k), fmtPeer(&p), why)
	return []peerdb.Key{k}
}

// notify sends ns (and remembers them, to repeat them later).
func (g *gen) notify(d *driver.Driver, b *strings.Builder, ns []notification) {
	for _, n := range ns {
		if n.keys == nil {
			g.count["notification of a whole VNI"]++
		} else {
			g.count["notification of keys"]++
		}
		fmt.Fprintf(b, "; %s", n)
		d.PeersChanged(n.vni, n.keys)
	}
	g.last = ns
}

func (g *gen) peerOp() op {
	u := g.u
	vni := u.vnis[g.pick(len(u.vnis))]
	var detail strings.Builder
	var s string
	o := op{desc: fmt.Sprintf("source vni=%d", vni), ok: noError, detail: &s}
	done := func() { s = detail.String() }
	switch r := g.pick(100); {
	case r < 55: // one change
		o.run = func(d *driver.Driver) error {
			defer done()
			var keys []peerdb.Key
			g.src.mutate(func() { keys = g.changeLocked(vni, &detail) })
			g.notify(d, &detail, byVNI(keys))
			return nil
		}
	case r < 68: // a batch, over one VNI or several, notified per VNI in any order
		n := 2 + g.pick(6)
		mixed := g.pick(3) == 0
		o.desc = fmt.Sprintf("source batch of %d vni=%d (mixed %v)", n, vni, mixed)
		o.run = func(d *driver.Driver) error {
			defer done()
			g.count["batch"]++
			var keys []peerdb.Key
			g.src.mutate(func() {
				for i := 0; i < n; i++ {
					v := vni
					if mixed {
						v = u.vnis[g.pick(len(u.vnis))]
					}
					keys = append(keys, g.changeLocked(v, &detail)...)
				}
			})
			g.notify(d, &detail, shuffled(g.rng, byVNI(keys)))
			return nil
		}
	case r < 74: // an invalid record
		o.run = func(d *driver.Driver) error {
			defer done()
			var keys []peerdb.Key
			g.src.mutate(func() { keys = g.invalidLocked(vni, &detail) })
			g.notify(d, &detail, byVNI(keys))
			return nil
		}
	case r < 81: // a notification of nothing that changed
		o.desc = fmt.Sprintf("source spurious vni=%d", vni)
		o.run = func(d *driver.Driver) error {
			defer done()
			g.count["spurious notification"]++
			var ns []notification
			switch g.pick(4) {
			case 0: // gossip replayed: the last notifications again
				ns = g.last
				detail.WriteString(" (repeated)")
			case 1: // keys of the VNI, changed or not
				var keys []peerdb.Key
				g.src.mutate(func() {
					for i := 0; i < 1+g.pick(4); i++ {
						k, _, ok := g.existingLocked(vni)
						if !ok {
							k = g.randomKey(vni)
						}
						keys = append(keys, k, k) // a key twice
					}
				})
				ns = byVNI(keys)
			case 2: // keys of another VNI under this one: the driver must ignore them
				other := u.vnis[g.pick(len(u.vnis))]
				keys := []peerdb.Key{g.randomKey(other)}
				if other != vni {
					detail.WriteString(" (keys of another VNI)")
					ns = []notification{{vni: vni, keys: keys}}
				}
			default: // no keys at all
				ns = []notification{{vni: vni, keys: []peerdb.Key{}}}
			}
			g.notify(d, &detail, ns)
			return nil
		}
	case r < 90: // changes, then "every record of the VNI may have changed"
		o.desc = fmt.Sprintf("source resync vni=%d", vni)
		o.run = func(d *driver.Driver) error {
			defer done()
			g.src.mutate(func() {
				for i := g.pick(3); i > 0; i-- {
					g.changeLocked(vni, &detail)
				}
			})
			g.notify(d, &detail, []notification{{vni: vni}})
			return nil
		}
	case r < 95: // a host leaves: all its records go, on every VNI
		from := g.origin()
		o.desc = fmt.Sprintf("source %s left", from.name)
		o.run = func(d *driver.Driver) error {
			defer done()
			g.count["host left"]++
			var keys []peerdb.Key
			g.src.mutate(func() {
				for _, v := range u.vnis {
					for _, k := range g.src.keysLocked(v) {
						if k.Origin == from.name {
							g.src.delLocked(k)
							keys = append(keys, k)
						}
					}
				}
			})
			fmt.Fprintf(&detail, " %d records deleted", len(keys))
			ns := byVNI(keys)
			if g.pick(2) == 0 {
				for i := range ns {
					ns[i].keys = nil
				}
			}
			g.notify(d, &detail, shuffled(g.rng, ns))
			return nil
		}
	default: // a change nobody is told of (lost): the periodic reconcile repairs it
		o.desc = fmt.Sprintf("source vni=%d", vni)
		o.run = func(d *driver.Driver) error {
			defer done()
			var keys []peerdb.Key
			g.src.mutate(func() {
				keys = g.changeLocked(vni, &detail)
				if u.noLost {
					return
				}
				g.src.lost++
			})
			if u.noLost {
				g.notify(d, &detail, byVNI(keys))
			} else {
				g.count["change not notified"]++
				detail.WriteString(" (not notified)")
			}
			return nil
		}
	}
	return o
}

// workStats counts what the workers did beyond what the trace shows.
type workStats struct {
	counts          map[string]int // by kind (see gen.count)
	quietReconciles int            // Reconciles at quiet points, after lost notifications
}

func (w *workStats) add(c map[string]int) {
	if w.counts == nil {
		w.counts = map[string]int{}
	}
	for k, n := range c {
		w.counts[k] += n
	}
}

func (w workStats) String() string {
	var parts []string
	for _, k := range slices.Sorted(maps.Keys(w.counts)) {
		parts = append(parts, fmt.Sprintf("%s %d", k, w.counts[k]))
	}
	return fmt.Sprintf("%s; Reconciles at quiet points %d", strings.Join(parts, ", "), w.quietReconciles)
}
