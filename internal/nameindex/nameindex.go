// Package nameindex answers the DNS server's questions (which addresses
// does this name have, for this client) from an immutable snapshot of the
// names in force. The snapshot is derived state, like the kernel's: the
// driver owns the local endpoints and their names, the cluster owns the
// remote ones; the daemon builds a new snapshot from both owners when
// either reports a change and on a tick, and swaps it in. A lookup takes
// no lock and allocates nothing when the client's container is on one
// network.
package nameindex

import (
	"cmp"
	"net/netip"
	"slices"
	"strings"
	"sync/atomic"
)

// Endpoint is one endpoint with names, as its owner reports it.
type Endpoint struct {
	VNI        uint32
	Host       string // the member it is on ("" for this host)
	EndpointID string
	// Network and Container: for this host's endpoints only, the local
	// network ID and the container (sandbox) it belongs to, which scope
	// what its container may resolve.
	Network   string
	Container string
	IP, IPv6  netip.Addr // the zero Addr for none
	Names     []string   // canonical (dnsname)
}

// Conflict is a name of one network held by endpoints of several hosts:
// all are answered, and it is reported once.
type Conflict struct {
	VNI   uint32
	Name  string
	Hosts []string // sorted; "" is this host
}

// Snapshot is an immutable index of the names in force.
type Snapshot struct {
	// names: per VNI, each name's addresses (IPv4 first, then IPv6, each
	// in address order: answers do not depend on map order).
	names map[uint32]map[string][]netip.Addr
	// scopes: per local network, each local endpoint's addresses to the
	// VNIs its container is attached to (sorted).
	scopes    map[string]map[netip.Addr][]uint32
	count     int
	conflicts []Conflict
}

// Build makes a snapshot of eps (local and remote together).
func Build(eps []Endpoint) *Snapshot {
	s := &Snapshot{names: make(map[uint32]map[string][]netip.Addr), scopes: make(map[string]map[netip.Addr][]uint32)}
	type holder struct {
		hosts []string
	}
	holders := make(map[uint32]map[string]*holder)
	containers := make(map[string][]uint32) // local container → its VNIs
	for i := range eps {
		e := &eps[i]
		if e.Container != "" {
			containers[e.Container] = append(containers[e.Container], e.VNI)
		}
		if len(e.Names) == 0 {
			continue
		}
		byName := s.names[e.VNI]
		if byName == nil {
			byName = make(map[string][]netip.Addr)
			s.names[e.VNI] = byName
			holders[e.VNI] = make(map[string]*holder)
		}
		for _, n := range e.Names {
			addrs := byName[n]
			if addrs == nil {
				s.count++
			}
			if e.IP.IsValid() {
				addrs = append(addrs, e.IP)
			}
			if e.IPv6.IsValid() {
				addrs = append(addrs, e.IPv6)
			}
			byName[n] = addrs
			h := holders[e.VNI][n]
			if h == nil {
				h = &holder{}
				holders[e.VNI][n] = h
			}
			if !slices.Contains(h.hosts, e.Host) {
				h.hosts = append(h.hosts, e.Host)
			}
		}
	}
	for vni, byName := range s.names {
		for n, addrs := range byName {
			slices.SortFunc(addrs, compareAddrs)
			byName[n] = slices.Clip(slices.Compact(addrs))
			if h := holders[vni][n]; len(h.hosts) > 1 {
				slices.Sort(h.hosts)
				s.conflicts = append(s.conflicts, Conflict{VNI: vni, Name: n, Hosts: h.hosts})
			}
		}
	}
	slices.SortFunc(s.conflicts, func(a, b Conflict) int { return cmp.Or(cmp.Compare(a.VNI, b.VNI), cmp.Compare(a.Name, b.Name)) })
	for c, vnis := range containers {
		slices.Sort(vnis)
		containers[c] = slices.Compact(vnis)
	}
	for i := range eps {
		e := &eps[i]
		if e.Container == "" || e.Network == "" {
			continue
		}
		sc := s.scopes[e.Network]
		if sc == nil {
			sc = make(map[netip.Addr][]uint32)
			s.scopes[e.Network] = sc
		}
		for _, a := range []netip.Addr{e.IP, e.IPv6} {
			if a.IsValid() {
				sc[a] = containers[e.Container]
			}
		}
	}
	return s
}

// compareAddrs puts IPv4 before IPv6, each in address order.
func compareAddrs(a, b netip.Addr) int {
	if a.Is4() != b.Is4() {
		if a.Is4() {
			return -1
		}
		return 1
	}
	return a.Compare(b)
}

// Lookup returns name's addresses for a client at client that asked the
// server of local network network: the names of every network the
// client's container is attached to. found is false when name is none of
// them, or the client is not a local endpoint of network (then nothing is
// answered from the cluster: the query is forwarded). The returned slice
// is shared: callers must not modify it.
func (s *Snapshot) Lookup(network string, client netip.Addr, name string) ([]netip.Addr, bool) {
	if s == nil {
		return nil, false
	}
	vnis := s.scopes[network][client.Unmap()]
	addrs, found := s.lookup(vnis, name)
	if !found && strings.HasPrefix(name, TasksPrefix) {
		// tasks.NAME: every holder of NAME, as swarm answers it. dockerd
		// answers a name its own containers hold with theirs alone and
		// never asks: this one it does not know, so it asks us.
		return s.lookup(vnis, name[len(TasksPrefix):])
	}
	return addrs, found
}

// TasksPrefix asks for every holder of a name cluster-wide (tasks.web),
// as swarm names the tasks of a service.
const TasksPrefix = "tasks."

func (s *Snapshot) lookup(vnis []uint32, name string) ([]netip.Addr, bool) {
	switch len(vnis) {
	case 0:
		return nil, false
	case 1:
		addrs, ok := s.names[vnis[0]][name]
		return addrs, ok
	}
	var out []netip.Addr
	found := false
	for _, vni := range vnis {
		if addrs, ok := s.names[vni][name]; ok {
			found = true
			out = append(out, addrs...)
		}
	}
	if len(out) > 1 {
		slices.SortFunc(out, compareAddrs)
		out = slices.Compact(out)
	}
	return out, found
}

// Names returns the number of distinct (network, name) pairs.
func (s *Snapshot) Names() int { return s.count }

// Conflicts returns the names held by endpoints of several hosts.
func (s *Snapshot) Conflicts() []Conflict { return s.conflicts }

// NamesOf returns the names of vni with their addresses, sorted by name
// (for overlayd status).
func (s *Snapshot) NamesOf(vni uint32) []NameAddrs {
	byName := s.names[vni]
	out := make([]NameAddrs, 0, len(byName))
	for n, a := range byName {
		out = append(out, NameAddrs{Name: n, Addrs: a})
	}
	slices.SortFunc(out, func(a, b NameAddrs) int { return cmp.Compare(a.Name, b.Name) })
	return out
}

// NameAddrs is one name and its addresses.
type NameAddrs struct {
	Name  string       `json:"name"`
	Addrs []netip.Addr `json:"addresses"`
}

// Index holds the current snapshot; safe for concurrent use. Its zero
// value answers nothing.
type Index struct {
	cur atomic.Pointer[Snapshot]
}

// Store makes s the current snapshot.
func (ix *Index) Store(s *Snapshot) { ix.cur.Store(s) }

// Load returns the current snapshot (nil before the first Store).
func (ix *Index) Load() *Snapshot { return ix.cur.Load() }

// Lookup is the current snapshot's Lookup: it implements dnsserver.Names.
func (ix *Index) Lookup(network string, client netip.Addr, name string) ([]netip.Addr, bool) {
	return ix.cur.Load().Lookup(network, client, name)
}
