// Package netspec is a network as a user defined it on one engine — what
// `docker network create` took: driver options, IPAM, internal, IPv4/IPv6,
// attachable and labels — in a form that another host's engine can create
// again, and that hosts can compare and gossip. It is the unit that
// "networks defined once" replicates (docs/networks.md).
//
// A Spec is built from the origin engine's inspect of the network (dockerd
// never sends a driver the network's name nor its labels), not from the
// request the driver saw: inspect is what the engine will keep, with the
// pools its IPAM chose filled in, so every replica asks for exactly those.
//
// What is not in a Spec, on purpose: the network's ID (each engine makes
// its own), the driver's name (a legacy plugin is "overlayd", a managed one
// "overlayd:latest" or another tag: each host creates replicas with its own
// name of overlayd), the creation time, and the endpoints.
package netspec

import (
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"

	"github.com/moby/moby/api/types/network"
	"github.com/moby/moby/client"
)

// Limits of a Spec: a spec travels in one gossip message and is stored in
// the state file; these are far above what `docker network create` is
// used with, and bound what a peer can make a host store.
const (
	MaxName     = 128 // bytes of a network name
	MaxOptions  = 32  // driver options, and IPAM options, each
	MaxLabels   = 64  // labels
	MaxPools    = 16  // IPAM configs (subnets)
	MaxAux      = 16  // auxiliary addresses per pool
	MaxKeyBytes = 256 // of an option's or label's key
	MaxValBytes = 1024
)

// Pool is one IPAM config: a subnet with its optional range, gateway and
// auxiliary addresses. Invalid prefixes and addresses mean "not given".
type Pool struct {
	Subnet  netip.Prefix
	IPRange netip.Prefix
	Gateway netip.Addr
	Aux     map[string]netip.Addr
}

// Spec is a network's user-given definition. Maps are never nil after
// FromInspect or Decode (empty instead), so that Equal is plain.
type Spec struct {
	Name        string
	Options     map[string]string // driver options (-o)
	IPAMDriver  string            // "" or "default" is the engine's own
	IPAMOptions map[string]string // --ipam-opt
	Pools       []Pool            // in the order given
	Internal    bool
	IPv4        bool // the network has IPv4 (always, before Docker 28's --ipv4=false)
	IPv6        bool
	Attachable  bool
	Labels      map[string]string
}

// Unreplicable says why a network of the engine is not a Spec: it belongs
// to swarm, or is a config-only or config-from network, or the ingress.
// Such networks are never touched; the caller leaves them alone quietly.
type Unreplicable struct {
	Network string
	Why     string
}

func (e *Unreplicable) Error() string {
	return fmt.Sprintf("network %q is not replicated: %s", e.Network, e.Why)
}

// FromInspect is the Spec of a network the engine shows. The caller picks
// the networks of overlayd's driver; FromInspect refuses what another host
// must not create again (swarm scope, config-only, config-from, ingress)
// with an *Unreplicable, and a network outside the Spec's limits with an
// error naming the field.
func FromInspect(n network.Inspect) (Spec, error) {
	switch {
	case n.Scope == "swarm" || n.Scope == "global":
		return Spec{}, &Unreplicable{n.Name, "scope " + n.Scope + " networks are swarm's"}
	case n.ConfigOnly:
		return Spec{}, &Unreplicable{n.Name, "a config-only network"}
	case n.ConfigFrom.Network != "":
		return Spec{}, &Unreplicable{n.Name, "its configuration comes from network " + n.ConfigFrom.Network}
	case n.Ingress:
		return Spec{}, &Unreplicable{n.Name, "the ingress network"}
	}
	s := Spec{
		Name:        n.Name,
		Options:     clone(n.Options),
		IPAMDriver:  n.IPAM.Driver,
		IPAMOptions: clone(n.IPAM.Options),
		Internal:    n.Internal,
		// Engines before 28 have no EnableIPv4 and always give IPv4: the
		// field is then absent, false; a network with IPv4 pools has it.
		IPv4:       n.EnableIPv4 || hasIPv4(n.IPAM.Config),
		IPv6:       n.EnableIPv6,
		Attachable: n.Attachable,
		Labels:     clone(n.Labels),
	}
	for _, c := range n.IPAM.Config {
		s.Pools = append(s.Pools, Pool{Subnet: c.Subnet, IPRange: c.IPRange, Gateway: c.Gateway, Aux: cloneAux(c.AuxAddress)})
	}
	if s.IPAMDriver == "" {
		s.IPAMDriver = "default"
	}
	if err := s.Validate(); err != nil {
		return Spec{}, err
	}
	return s, nil
}

func hasIPv4(cs []network.IPAMConfig) bool {
	for _, c := range cs {
		if c.Subnet.Addr().Is4() {
			return true
		}
	}
	return false
}

// CreateOptions is the request that creates s on an engine whose name of
// overlayd's driver is driver.
func (s *Spec) CreateOptions(driver string) client.NetworkCreateOptions {
	ipv4, ipv6 := s.IPv4, s.IPv6
	o := client.NetworkCreateOptions{
		Driver:     driver,
		EnableIPv6: &ipv6,
		IPAM:       &network.IPAM{Driver: s.IPAMDriver, Options: clone(s.IPAMOptions)},
		Internal:   s.Internal,
		Attachable: s.Attachable,
		Options:    clone(s.Options),
		Labels:     clone(s.Labels),
	}
	// Engines before 28 refuse nothing they do not know, but an IPv4
	// switch set to true is their only behaviour anyway: send it only
	// when it says something (an IPv6-only network).
	if !ipv4 {
		o.EnableIPv4 = &ipv4
	}
	for _, p := range s.Pools {
		o.IPAM.Config = append(o.IPAM.Config, network.IPAMConfig{Subnet: p.Subnet, IPRange: p.IPRange, Gateway: p.Gateway, AuxAddress: cloneAux(p.Aux)})
	}
	return o
}

// Validate checks s is within the limits and well formed, naming the
// field that is not.
func (s *Spec) Validate() error {
	if err := ValidName(s.Name); err != nil {
		return err
	}
	if err := validMap("driver options", s.Options, MaxOptions); err != nil {
		return fmt.Errorf("network %q: %w", s.Name, err)
	}
	if err := validMap("IPAM options", s.IPAMOptions, MaxOptions); err != nil {
		return fmt.Errorf("network %q: %w", s.Name, err)
	}
	if err := validMap("labels", s.Labels, MaxLabels); err != nil {
		return fmt.Errorf("network %q: %w", s.Name, err)
	}
	if len(s.IPAMDriver) == 0 || len(s.IPAMDriver) > MaxName {
		return fmt.Errorf("network %q: IPAM driver %q: must be 1..%d bytes", s.Name, s.IPAMDriver, MaxName)
	}
	if len(s.Pools) > MaxPools {
		return fmt.Errorf("network %q: %d IPAM pools: at most %d", s.Name, len(s.Pools), MaxPools)
	}
	for i, p := range s.Pools {
		if err := p.validate(); err != nil {
			return fmt.Errorf("network %q: pool %d: %w", s.Name, i+1, err)
		}
	}
	if !s.IPv4 && !s.IPv6 {
		return fmt.Errorf("network %q: neither IPv4 nor IPv6", s.Name)
	}
	return nil
}

func (p *Pool) validate() error {
	if !p.Subnet.IsValid() {
		return fmt.Errorf("no subnet")
	}
	if p.Subnet != p.Subnet.Masked() {
		return fmt.Errorf("subnet %s: has host bits set (want %s)", p.Subnet, p.Subnet.Masked())
	}
	if p.IPRange.IsValid() && (p.IPRange.Bits() < p.Subnet.Bits() || !p.Subnet.Contains(p.IPRange.Addr())) {
		return fmt.Errorf("IP range %s: not inside subnet %s", p.IPRange, p.Subnet)
	}
	if p.Gateway.IsValid() && !p.Subnet.Contains(p.Gateway) {
		return fmt.Errorf("gateway %s: not inside subnet %s", p.Gateway, p.Subnet)
	}
	if len(p.Aux) > MaxAux {
		return fmt.Errorf("%d auxiliary addresses: at most %d", len(p.Aux), MaxAux)
	}
	for k, a := range p.Aux {
		if k == "" || len(k) > MaxKeyBytes {
			return fmt.Errorf("auxiliary address name %q: must be 1..%d bytes", k, MaxKeyBytes)
		}
		if !p.Subnet.Contains(a) {
			return fmt.Errorf("auxiliary address %s=%s: not inside subnet %s", k, a, p.Subnet)
		}
	}
	return nil
}

// ValidName checks a network name: 1..MaxName bytes of printable ASCII
// other than '/' and space, not starting with '-' or '.' (what the engine
// creates and a name that cannot be taken for a path or a flag).
func ValidName(name string) error {
	if name == "" || len(name) > MaxName {
		return fmt.Errorf("network name %q: must be 1..%d bytes", name, MaxName)
	}
	if name[0] == '-' || name[0] == '.' {
		return fmt.Errorf("network name %q: must not start with %q", name, name[0])
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c <= ' ' || c >= 0x7f || c == '/' {
			return fmt.Errorf("network name %q: byte %d (%q) is not allowed: printable ASCII other than '/' and space", name, i+1, c)
		}
	}
	return nil
}

func validMap(what string, m map[string]string, most int) error {
	if len(m) > most {
		return fmt.Errorf("%d %s: at most %d", len(m), what, most)
	}
	for k, v := range m {
		if k == "" || len(k) > MaxKeyBytes {
			return fmt.Errorf("%s: key %q must be 1..%d bytes", what, k, MaxKeyBytes)
		}
		if len(v) > MaxValBytes {
			return fmt.Errorf("%s: value of %q is %d bytes: at most %d", what, k, len(v), MaxValBytes)
		}
	}
	return nil
}

// Equal reports whether a and b define the same network.
func Equal(a, b *Spec) bool { return len(Diff(a, b)) == 0 }

// Diff names every field in which a (here) and b (there) differ, with both
// values, in a fixed order; nil when they are the same network.
func Diff(a, b *Spec) []string {
	var d []string
	add := func(field string, here, there any) {
		d = append(d, fmt.Sprintf("%s: %v here, %v there", field, here, there))
	}
	if a.Name != b.Name {
		add("name", a.Name, b.Name)
	}
	if !maps.Equal(a.Options, b.Options) {
		add("driver options", mapString(a.Options), mapString(b.Options))
	}
	if ipamName(a.IPAMDriver) != ipamName(b.IPAMDriver) {
		add("IPAM driver", ipamName(a.IPAMDriver), ipamName(b.IPAMDriver))
	}
	if !maps.Equal(a.IPAMOptions, b.IPAMOptions) {
		add("IPAM options", mapString(a.IPAMOptions), mapString(b.IPAMOptions))
	}
	if !slices.EqualFunc(a.Pools, b.Pools, func(x, y Pool) bool {
		return x.Subnet == y.Subnet && x.IPRange == y.IPRange && x.Gateway == y.Gateway && maps.Equal(x.Aux, y.Aux)
	}) {
		add("IPAM pools", poolsString(a.Pools), poolsString(b.Pools))
	}
	for _, f := range []struct {
		name        string
		here, there bool
	}{{"internal", a.Internal, b.Internal}, {"IPv4", a.IPv4, b.IPv4}, {"IPv6", a.IPv6, b.IPv6}, {"attachable", a.Attachable, b.Attachable}} {
		if f.here != f.there {
			add(f.name, yesNo(f.here), yesNo(f.there))
		}
	}
	if !maps.Equal(a.Labels, b.Labels) {
		add("labels", mapString(a.Labels), mapString(b.Labels))
	}
	return d
}

func ipamName(s string) string {
	if s == "" {
		return "default"
	}
	return s
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}

func mapString(m map[string]string) string {
	keys := slices.Sorted(maps.Keys(m))
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = k + "=" + m[k]
	}
	return "{" + strings.Join(parts, ",") + "}"
}

func poolsString(ps []Pool) string {
	parts := make([]string, len(ps))
	for i, p := range ps {
		s := p.Subnet.String()
		if p.IPRange.IsValid() {
			s += " range " + p.IPRange.String()
		}
		if p.Gateway.IsValid() {
			s += " gw " + p.Gateway.String()
		}
		for _, k := range slices.Sorted(maps.Keys(p.Aux)) {
			s += " aux " + k + "=" + p.Aux[k].String()
		}
		parts[i] = s
	}
	return "[" + strings.Join(parts, "; ") + "]"
}

func clone(m map[string]string) map[string]string {
	if m == nil {
		return map[string]string{}
	}
	return maps.Clone(m)
}

func cloneAux(m map[string]netip.Addr) map[string]netip.Addr {
	if m == nil {
		return map[string]netip.Addr{}
	}
	return maps.Clone(m)
}
