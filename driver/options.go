package driver

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"regexp"
	"sort"
	"strconv"
	"strings"

	api "github.com/docker/go-plugins-helpers/network"

	"github.com/overlayd/overlayd/internal/netdef"
)

// Option names read from CreateNetwork / AllocateNetwork. The top-level
// ones (generic, enable_ipv6, internal) are dockerd's own and never
// checked for strangers: that is where dockerd adds what it adds. The -o
// options inside com.docker.network.generic are the user's, and only the
// keys of knownOptions are accepted there.
const (
	OptGeneric        = "com.docker.network.generic"
	OptEnableV6       = "com.docker.network.enable_ipv6"
	OptInternal       = "com.docker.network.internal"
	OptMTU            = "com.docker.network.driver.mtu"
	OptMTUAlias       = "mtu"
	OptVNI            = "vni"
	OptVXLANList      = "com.docker.network.driver.overlay.vxlanid_list"
	OptEncrypted      = "encrypted"
	OptExplicitSubnet = "explicit-subnet"
	OptSeeds          = "overlayd.seeds"
)

const (
	minMTU = 576
	maxMTU = 9000
)

var idPattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$`)

func checkID(field, id string) error {
	if id == "" {
		return fmt.Errorf("%s is empty: a non-empty id is required", field)
	}
	if !idPattern.MatchString(id) {
		return fmt.Errorf("%s %q is invalid: allowed are 1 to 128 characters from [A-Za-z0-9_.-], starting with a letter or digit", field, id)
	}
	return nil
}

// netSpec is a validated CreateNetwork request.
type netSpec struct {
	id          string
	subnets     []subnetSpec
	internal    bool
	genericSpec                   // mtu 0: from the underlay
	options     map[string]string // the generic options as given
}

// genericSpec is what the -o options say, validated.
type genericSpec struct {
	mtu       int    // 0: not given
	mtuKey    string // mtu or com.docker.network.driver.mtu, as given
	encrypted bool
	// explicitSubnet: the user vouches that the pools were given with
	// --subnet, although they look like dockerd's default pools.
	explicitSubnet bool
}

// parseGeneric validates the -o options of a CreateNetwork or
// AllocateNetwork request: only known keys, and values each key allows.
// The VNIs are parsed by parseVNIs.
func parseGeneric(opts map[string]string) (genericSpec, error) {
	var g genericSpec
	if err := checkOptionKeys(opts); err != nil {
		return g, err
	}
	var err error
	if g.encrypted, err = flagOption(opts, OptEncrypted); err != nil {
		return g, err
	}
	if g.explicitSubnet, err = flagOption(opts, OptExplicitSubnet); err != nil {
		return g, err
	}
	alias, hasAlias := opts[OptMTUAlias]
	full, hasFull := opts[OptMTU]
	if hasAlias && hasFull && strings.TrimSpace(alias) != strings.TrimSpace(full) {
		return g, fmt.Errorf("options %s=%q and %s=%q both set the MTU, to different values: give only one of them", OptMTUAlias, alias, OptMTU, full)
	}
	key, v := OptMTU, full
	if hasAlias {
		key, v = OptMTUAlias, alias
	}
	if hasAlias || hasFull {
		mtu, err := strconv.Atoi(strings.TrimSpace(v))
		if err != nil {
			return g, fmt.Errorf("option %s=%q is not a number: the MTU must be an integer in %d..%d", key, v, minMTU, maxMTU)
		}
		if mtu < minMTU || mtu > maxMTU {
			return g, fmt.Errorf("option %s=%d is out of range: the MTU must be an integer in %d..%d", key, mtu, minMTU, maxMTU)
		}
		g.mtu, g.mtuKey = mtu, key
	}
	return g, nil
}

// flagOption reads an option given as a bare flag (-o encrypted) or with
// true/false.
func flagOption(opts map[string]string, key string) (bool, error) {
	v, ok := opts[key]
	if !ok {
		return false, nil
	}
	switch strings.ToLower(strings.TrimSpace(v)) {
	case "", "true", "1", "yes":
		return true, nil
	case "false", "0", "no":
		return false, nil
	}
	return false, fmt.Errorf("option %s=%q: give -o %s (or %s=true/false)", key, v, key, key)
}

// subnetSpec is one L2 segment of a network (see netdef.Subnet): a network
// without IPv6 has one per IPv4 subnet, a network with IPv6 exactly one.
type subnetSpec struct {
	vni     uint32
	pool    netip.Prefix // IPv4; invalid when the segment has IPv6 subnets only
	gateway netip.Prefix // gateway address with the pool's length; invalid if none given
	v6      []netdef.Subnet6
}

// prefixes returns the segment's subnets of both families, IPv4 first.
func (s *subnetSpec) prefixes() []netip.Prefix {
	return (&netdef.Subnet{Pool: s.pool, IPv6: s.v6}).Prefixes()
}

// contains reports whether a lies in one of the segment's subnets.
func (s *subnetSpec) contains(a netip.Addr) bool {
	if a.Is4() {
		return s.pool.IsValid() && s.pool.Contains(a)
	}
	for _, v := range s.v6 {
		if v.Pool.Contains(a) {
			return true
		}
	}
	return false
}

// hasIPv6 reports whether the network has IPv6 subnets.
func (s *netSpec) hasIPv6() bool {
	return len(s.subnets) == 1 && len(s.subnets[0].v6) > 0
}

// genericOptions returns the -o options of a request as strings.
func genericOptions(opts map[string]interface{}) (map[string]string, error) {
	out := map[string]string{}
	raw, ok := opts[OptGeneric]
	if !ok || raw == nil {
		return out, nil
	}
	m, ok := raw.(map[string]interface{})
	if !ok {
		return nil, fmt.Errorf("option %s is a %T: it must be an object of option names to values", OptGeneric, raw)
	}
	for k, v := range m {
		switch v := v.(type) {
		case string:
			out[k] = v
		case bool:
			out[k] = strconv.FormatBool(v)
		case float64:
			out[k] = strconv.FormatFloat(v, 'f', -1, 64)
		case json.Number:
			out[k] = v.String()
		case nil:
			out[k] = ""
		default:
			return nil, fmt.Errorf("option %s=%v is a %T: option values must be strings", k, v, v)
		}
	}
	return out, nil
}

func boolOption(opts map[string]interface{}, key string) (bool, error) {
	v, ok := opts[key]
	if !ok || v == nil {
		return false, nil
	}
	switch v := v.(type) {
	case bool:
		return v, nil
	case string:
		b, err := strconv.ParseBool(v)
		if err != nil {
			return false, fmt.Errorf("option %s=%q is not a boolean: use true or false", key, v)
		}
		return b, nil
	}
	return false, fmt.Errorf("option %s is a %T: it must be a boolean", key, v)
}

// parseVNIs reads the VNIs from the vni option or the built-in driver's
// vxlanid_list (both only if they agree); ok is false when neither is
// present.
func parseVNIs(opts map[string]string) (vnis []uint32, ok bool, err error) {
	key := OptVNI
	val, ok := opts[OptVNI]
	if list, both := opts[OptVXLANList]; ok && both && strings.TrimSpace(list) != strings.TrimSpace(val) {
		return nil, true, fmt.Errorf("options %s=%q and %s=%q both set the VNIs, to different values: give only one of them", OptVNI, val, OptVXLANList, list)
	}
	if !ok {
		key = OptVXLANList
		val, ok = opts[OptVXLANList]
	}
	if !ok {
		return nil, false, nil
	}
	if strings.TrimSpace(val) == "" {
		return nil, true, fmt.Errorf("option %s is empty: give a VNI in 1..%d, or a comma-separated list with one per IPv4 subnet", key, MaxVNI)
	}
	seen := map[uint32]bool{}
	for _, f := range strings.Split(val, ",") {
		f = strings.TrimSpace(f)
		n, perr := strconv.ParseUint(f, 10, 32)
		if perr != nil {
			return nil, true, fmt.Errorf("option %s=%q: %q is not a number; a VNI is an integer in 1..%d (a comma-separated list gives one per IPv4 subnet)", key, val, f, MaxVNI)
		}
		if n < 1 || n > MaxVNI {
			return nil, true, fmt.Errorf("option %s=%q: VNI %d is out of range; a VNI is an integer in 1..%d", key, val, n, MaxVNI)
		}
		if seen[uint32(n)] {
			return nil, true, fmt.Errorf("option %s=%q: VNI %d is listed twice; each IPv4 subnet needs its own VNI", key, val, n)
		}
		seen[uint32(n)] = true
		vnis = append(vnis, uint32(n))
	}
	return vnis, true, nil
}

func formatVNIs(vnis []uint32) string {
	s := make([]string, len(vnis))
	for i, v := range vnis {
		s[i] = strconv.FormatUint(uint64(v), 10)
	}
	return strings.Join(s, ",")
}

// parsePools validates IPv4Data: IPv4, disjoint, gateway (if any) inside
// its pool. It may be empty only when the network has IPv6 (v6).
func parsePools(data []*api.IPAMData, v6 bool) ([]subnetSpec, error) {
	if len(data) == 0 && !v6 {
		return nil, fmt.Errorf("IPv4Data is empty: an overlayd network needs at least one subnet (--subnet)")
	}
	pools, gws, err := parseIPAMData(data, ipamFamily{
		field: "IPv4Data", family: "IPv4", poolExample: "192.0.2.0/24", gwExample: "192.0.2.1/24",
		is: netip.Addr.Is4,
		checkPool: func(p netip.Prefix) error {
			if !p.Addr().Is4() {
				return fmt.Errorf("%v is not an IPv4 prefix (like 192.0.2.0/24)", p)
			}
			if p.Bits() > 30 {
				return fmt.Errorf("%v is too small: the prefix length must be at most 30", p)
			}
			return nil
		},
	})
	if err != nil {
		return nil, err
	}
	subs := make([]subnetSpec, len(pools))
	for i := range pools {
		subs[i] = subnetSpec{pool: pools[i], gateway: gws[i]}
	}
	return subs, nil
}

// parsePools6 validates IPv6Data: plain IPv6 prefixes at most
// netdef.MaxPrefix6 long, no link-local, multicast, loopback or
// unspecified range, disjoint, gateway (if any) inside its pool and not
// its subnet-router anycast address.
func parsePools6(data []*api.IPAMData) ([]netdef.Subnet6, error) {
	pools, gws, err := parseIPAMData(data, ipamFamily{
		field: "IPv6Data", family: "IPv6", poolExample: "2001:db8:1::/64", gwExample: "2001:db8:1::1/64",
		is:        func(a netip.Addr) bool { return a.Is6() && !a.Is4In6() },
		checkPool: netdef.CheckPool6,
		checkGateway: func(gw netip.Addr, pool netip.Prefix) error {
			if gw == pool.Addr() {
				return fmt.Errorf("%s is the subnet-router anycast address of %s (all zeros after the prefix): give another address of the pool", gw, pool)
			}
			return nil
		},
	})
	if err != nil {
		return nil, err
	}
	subs := make([]netdef.Subnet6, len(pools))
	for i := range pools {
		subs[i] = netdef.Subnet6{Pool: pools[i], Gateway: gws[i]}
	}
	return subs, nil
}

// ipamFamily is what parseIPAMData checks of the subnets of one family.
type ipamFamily struct {
	field, family          string // IPv4Data, IPv4
	poolExample, gwExample string
	is                     func(netip.Addr) bool // of the family
	// checkPool says what is wrong with a pool of the family, or nil.
	checkPool func(netip.Prefix) error
	// checkGateway, when set, says what else is wrong with a gateway
	// inside its pool.
	checkGateway func(gw netip.Addr, pool netip.Prefix) error
}

// parseIPAMData validates one family's IPAMData: each entry's pool (masked)
// and gateway (with the pool's length; invalid when none is given, else
// inside its pool), the pools disjoint. Errors name the entry's field.
func parseIPAMData(data []*api.IPAMData, f ipamFamily) (pools, gateways []netip.Prefix, _ error) {
	for i, d := range data {
		if d == nil {
			return nil, nil, fmt.Errorf("%s[%d] is null: each entry needs a Pool", f.field, i)
		}
		pool, err := netip.ParsePrefix(d.Pool)
		if err != nil {
			return nil, nil, fmt.Errorf("%s[%d].Pool %q is not an %s prefix (like %s)", f.field, i, d.Pool, f.family, f.poolExample)
		}
		if err := f.checkPool(pool); err != nil {
			return nil, nil, fmt.Errorf("%s[%d].Pool: %w", f.field, i, err)
		}
		pool = pool.Masked()
		var gwPrefix netip.Prefix
		if d.Gateway != "" {
			gw, err := parseAddrOrPrefix(d.Gateway)
			if err != nil || !f.is(gw) {
				return nil, nil, fmt.Errorf("%s[%d].Gateway %q is not an %s address (like %s)", f.field, i, d.Gateway, f.family, f.gwExample)
			}
			if !pool.Contains(gw) {
				return nil, nil, fmt.Errorf("%s[%d].Gateway %s is outside its pool %s: the gateway must be an address of the pool", f.field, i, gw, pool)
			}
			if f.checkGateway != nil {
				if err := f.checkGateway(gw, pool); err != nil {
					return nil, nil, fmt.Errorf("%s[%d].Gateway %w", f.field, i, err)
				}
			}
			gwPrefix = netip.PrefixFrom(gw, pool.Bits())
		}
		for j, o := range pools {
			if o.Overlaps(pool) {
				return nil, nil, fmt.Errorf("%s[%d].Pool %s overlaps %s[%d].Pool %s: the subnets of a network must be disjoint", f.field, i, pool, f.field, j, o)
			}
		}
		pools, gateways = append(pools, pool), append(gateways, gwPrefix)
	}
	return pools, gateways, nil
}

// ipv6Requested reads com.docker.network.enable_ipv6 and IPv6Data: a
// network has IPv6 when it has IPv6 subnets. The flag without subnets (or
// subnets without the flag, which dockerd never sends) is refused, saying
// which.
func ipv6Requested(req *api.CreateNetworkRequest) (bool, error) {
	flag, err := boolOption(req.Options, OptEnableV6)
	if err != nil {
		return false, err
	}
	switch {
	case flag && len(req.IPv6Data) == 0:
		return false, fmt.Errorf("option %s is true but IPv6Data is empty: give an IPv6 subnet (docker network create --ipv6 --subnet 2001:db8:1::/64)", OptEnableV6)
	case !flag && len(req.IPv6Data) > 0:
		if _, given := req.Options[OptEnableV6]; given {
			return false, fmt.Errorf("IPv6Data has %d subnet(s) but option %s is false: give --ipv6 with IPv6 subnets", len(req.IPv6Data), OptEnableV6)
		}
	}
	return len(req.IPv6Data) > 0, nil
}

func parseAddrOrPrefix(s string) (netip.Addr, error) {
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return netip.Addr{}, err
		}
		return p.Addr().Unmap(), nil
	}
	a, err := netip.ParseAddr(s)
	return a.Unmap(), err
}

// parseCreateNetwork validates a CreateNetwork request without touching any
// state.
func parseCreateNetwork(req *api.CreateNetworkRequest) (*netSpec, error) {
	if req == nil {
		return nil, fmt.Errorf("CreateNetwork: empty request")
	}
	if err := checkID("NetworkID", req.NetworkID); err != nil {
		return nil, err
	}
	if req.Options == nil {
		req.Options = map[string]interface{}{}
	}
	generic, err := genericOptions(req.Options)
	if err != nil {
		return nil, err
	}
	v6, err := ipv6Requested(req)
	if err != nil {
		return nil, err
	}
	internal, err := boolOption(req.Options, OptInternal)
	if err != nil {
		return nil, err
	}
	opts, err := parseGeneric(generic)
	if err != nil {
		return nil, err
	}
	spec := &netSpec{id: req.NetworkID, internal: internal, genericSpec: opts, options: generic}
	subs, err := parsePools(req.IPv4Data, v6)
	if err != nil {
		return nil, err
	}
	if v6 {
		// One segment for every subnet (see netdef.Subnet).
		if len(subs) > 1 {
			return nil, fmt.Errorf("IPv4Data has %d subnets: a network with IPv6 has at most one IPv4 subnet (one L2 segment carries all its subnets); create the network with one IPv4 --subnet beside the IPv6 ones", len(subs))
		}
		if opts.mtu != 0 && opts.mtu < netdef.MinMTU6 {
			return nil, fmt.Errorf("option %s=%d is below %d: a network with IPv6 needs an MTU of at least %d (IPv6's minimum link MTU)", opts.mtuKey, opts.mtu, netdef.MinMTU6, netdef.MinMTU6)
		}
		seg := subnetSpec{}
		if len(subs) == 1 {
			seg = subs[0]
		}
		if seg.v6, err = parsePools6(req.IPv6Data); err != nil {
			return nil, err
		}
		subs = []subnetSpec{seg}
	}
	vnis, ok, err := parseVNIs(generic)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, fmt.Errorf("option %s is missing: outside swarm every overlayd network needs -o %s=N (1..%d, the same on every host; a comma-separated list for several subnets)", OptVNI, OptVNI, MaxVNI)
	}
	if v6 && len(vnis) != 1 {
		return nil, fmt.Errorf("option %s=%s gives %d VNIs for a network with IPv6: give one VNI (all its subnets share one L2 segment)", OptVNI, formatVNIs(vnis), len(vnis))
	}
	if len(vnis) != len(subs) {
		return nil, fmt.Errorf("option %s=%s gives %d VNI(s) for %d IPv4 subnet(s): give exactly one VNI per subnet, comma-separated, in the order of the subnets", OptVNI, formatVNIs(vnis), len(vnis), len(subs))
	}
	for i := range subs {
		subs[i].vni = vnis[i]
	}
	spec.subnets = subs
	return spec, nil
}

// sortedKeys returns the keys of m in order (for stable messages).
func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

// isDockerDefaultPool reports whether pool is one that dockerd's default
// IPAM hands out when a network is created without --subnet, with the
// engine's built-in default address pools (the same in Docker 20.10 and
// 26.1): 172.17.0.0/16 … 172.31.0.0/16, and 192.168.0.0/16 cut into /20s.
// Only those exact prefixes: a --subnet 192.168.5.0/24 is certainly the
// user's. An engine configured with other default-address-pools cannot be
// recognised.
func isDockerDefaultPool(pool netip.Prefix) bool {
	if !pool.Addr().Is4() {
		return false
	}
	a := pool.Masked().Addr().As4()
	switch pool.Bits() {
	case 16:
		return a[0] == 172 && a[1] >= 17 && a[1] <= 31
	case 20:
		return a[0] == 192 && a[1] == 168
	}
	return false
}
