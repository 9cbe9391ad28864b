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

type subnetSpec struct {
	vni     uint32
	pool    netip.Prefix
	gateway netip.Prefix // gateway address with the pool's length; invalid if none given
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

// parsePools validates IPv4Data: at least one pool, IPv4, disjoint, gateway
// (if any) inside its pool.
func parsePools(data []*api.IPAMData) ([]subnetSpec, error) {
	if len(data) == 0 {
		return nil, fmt.Errorf("IPv4Data is empty: an overlayd network needs at least one IPv4 subnet (--subnet)")
	}
	var subs []subnetSpec
	for i, d := range data {
		if d == nil {
			return nil, fmt.Errorf("IPv4Data[%d] is null: each entry needs a Pool", i)
		}
		pool, err := netip.ParsePrefix(d.Pool)
		if err != nil || !pool.Addr().Is4() {
			return nil, fmt.Errorf("IPv4Data[%d].Pool %q is not an IPv4 prefix (like 192.0.2.0/24)", i, d.Pool)
		}
		if pool.Bits() > 30 {
			return nil, fmt.Errorf("IPv4Data[%d].Pool %q is too small: the prefix length must be at most 30", i, d.Pool)
		}
		pool = pool.Masked()
		s := subnetSpec{pool: pool}
		if d.Gateway != "" {
			gw, err := parseAddrOrPrefix(d.Gateway)
			if err != nil || !gw.Is4() {
				return nil, fmt.Errorf("IPv4Data[%d].Gateway %q is not an IPv4 address (like 192.0.2.1/24)", i, d.Gateway)
			}
			if !pool.Contains(gw) {
				return nil, fmt.Errorf("IPv4Data[%d].Gateway %s is outside its pool %s: the gateway must be an address of the pool", i, gw, pool)
			}
			s.gateway = netip.PrefixFrom(gw, pool.Bits())
		}
		for j, o := range subs {
			if o.pool.Overlaps(pool) {
				return nil, fmt.Errorf("IPv4Data[%d].Pool %s overlaps IPv4Data[%d].Pool %s: the subnets of a network must be disjoint", i, pool, j, o.pool)
			}
		}
		subs = append(subs, s)
	}
	return subs, nil
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
	if v6, err := boolOption(req.Options, OptEnableV6); err != nil {
		return nil, err
	} else if v6 || len(req.IPv6Data) > 0 {
		return nil, fmt.Errorf("IPv6 is not supported yet by overlayd: create the network without --ipv6 (option %s must be false and IPv6Data empty)", OptEnableV6)
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
	subs, err := parsePools(req.IPv4Data)
	if err != nil {
		return nil, err
	}
	vnis, ok, err := parseVNIs(generic)
	if err != nil {
		return nil, err
	}
	if !ok {
		return nil, fmt.Errorf("option %s is missing: outside swarm every overlayd network needs -o %s=N (1..%d, the same on every host; a comma-separated list for several subnets)", OptVNI, OptVNI, MaxVNI)
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
