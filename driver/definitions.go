package driver

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/overlayd/overlayd/internal/logkeys"
	"github.com/overlayd/overlayd/internal/netdef"
	"github.com/overlayd/overlayd/peerdb"
)

// definitionLocked returns n's definition, the same for each of its VNIs
// (its fields are immutable: the lock is the convention's, not a need).
func (n *network) definitionLocked() netdef.Definition {
	return definitionOf(n.subnets, n.mtu, n.encrypted, n.internal)
}

// definitionOf returns the definition of a network of these segments.
func definitionOf(subnets []subnetSpec, mtu int, encrypted, internal bool) netdef.Definition {
	def := definitionIn(nil, subnets, mtu, encrypted, internal)
	for i := range def.Subnets {
		def.Subnets[i].IPv6 = slices.Clone(def.Subnets[i].IPv6)
	}
	return def
}

// definitionIn is definitionOf with the subnet list built in room's space
// (no allocation when the segments fit) and the segments' own IPv6 lists,
// not copies: a definition only to compare with, never to hand out.
func definitionIn(room []netdef.Subnet, subnets []subnetSpec, mtu int, encrypted, internal bool) netdef.Definition {
	def := netdef.Definition{Subnets: room[:0], MTU: mtu, Encrypted: encrypted, Internal: internal}
	for _, s := range subnets {
		def.Subnets = append(def.Subnets, netdef.Subnet{VNI: s.vni, Pool: s.pool, Gateway: s.gateway, IPv6: s.v6})
	}
	return def
}

// contradiction is another host's definition of one of a network's VNIs
// that differs from the network's.
type contradiction struct {
	vni   uint32
	other netdef.Remote
	diffs []string
}

func (c *contradiction) String() string {
	return fmt.Sprintf("VNI %d on host %q (VTEP %v): %s", c.vni, c.other.Host, c.other.VTEP, strings.Join(c.diffs, "; "))
}

// contradictions returns the definitions other hosts have in force for vni
// that differ from def, by host, and the hosts whose definition of vni
// has not arrived (see netdef.Remote.Pending).
func (d *Driver) contradictions(def *netdef.Definition, vni uint32) (out map[string]contradiction, pending []string) {
	return contradictionsIn(def, vni, d.remoteDefinitions(vni))
}

// remoteDefinitions returns the definitions of vni other hosts have.
func (d *Driver) remoteDefinitions(vni uint32) []netdef.Remote {
	return d.cfg.Definitions.Definitions(vni)
}

// contradictionsIn is contradictions among the definitions remotes.
func contradictionsIn(def *netdef.Definition, vni uint32, remotes []netdef.Remote) (out map[string]contradiction, pending []string) {
	for _, r := range remotes {
		if r.Pending {
			pending = append(pending, r.Host)
			continue
		}
		if diffs := netdef.Diff(def, &r.Def); len(diffs) > 0 {
			if out == nil {
				out = map[string]contradiction{}
			}
			out[r.Host] = contradiction{vni: vni, other: r, diffs: diffs}
		}
	}
	return out, pending
}

// checkDefinitions refuses a new network whose definition contradicts
// what another host has for one of its VNIs, naming each host, its VTEP
// and what differs.
func (d *Driver) checkDefinitions(def *netdef.Definition, mtuGiven bool) error {
	var found []string
	for _, s := range def.Subnets {
		cs, _ := d.contradictions(def, s.VNI)
		for _, host := range slices.Sorted(maps.Keys(cs)) {
			c := cs[host]
			found = append(found, c.String())
		}
	}
	if len(found) == 0 {
		return nil
	}
	hint := ""
	if !mtuGiven {
		hint = fmt.Sprintf(" (without -o %s the MTU is taken from this host's underlay: give the same -o %s on every host)", OptMTU, OptMTU)
	}
	return fmt.Errorf("option %s: this network contradicts the definition another host has: %s; every host must define a VNI the same way (the same --subnet, --gateway, -o %s, -o %s and --internal)%s, or use another VNI",
		OptVNI, strings.Join(found, "; "), OptMTU, OptEncrypted, hint)
}

// checkRemoteDefinitionsLocked compares n's definition of vni with the other
// hosts' and returns the hosts whose records of vni are refused: those
// whose definition contradicts n's, and those whose definition has not
// arrived yet (their records wait for it; a host only has records of a
// VNI it has a network for). A new contradiction is logged at WARN once,
// and its end at INFO.
func (d *Driver) checkRemoteDefinitionsLocked(n *network, vni uint32) map[string]bool {
	var cs map[string]contradiction
	var pending []string
	// This runs on every pull, one per peer notification: n's definition
	// is built only when there is something to compare it with, and then
	// on the stack (a network has one segment unless it spans several
	// VNIs).
	if remotes := d.remoteDefinitions(vni); len(remotes) > 0 {
		var room [1]netdef.Subnet
		def := definitionIn(room[:], n.subnets, n.mtu, n.encrypted, n.internal)
		cs, pending = contradictionsIn(&def, vni, remotes)
	}
	old := n.contra[vni]
	for host, c := range cs {
		if o, ok := old[host]; ok && slices.Equal(o.diffs, c.diffs) && o.other.VTEP == c.other.VTEP {
			continue
		}
		d.log.Warn("another host defines this network's VNI differently; its peers of the VNI are refused until the definitions agree",
			logkeys.Event, logkeys.ConflictFound, logkeys.Kind, logkeys.KindDefinition,
			logkeys.Network, n.id, logkeys.VNI, vni, logkeys.Member, host, logkeys.VTEP, c.other.VTEP, "differences", strings.Join(c.diffs, "; "))
	}
	for host := range old {
		if _, ok := cs[host]; !ok {
			d.log.Info("another host's definition of this network's VNI no longer contradicts it (agrees, or is gone)",
				logkeys.Event, logkeys.ConflictResolved, logkeys.Kind, logkeys.KindDefinition,
				logkeys.Network, n.id, logkeys.VNI, vni, logkeys.Member, host)
		}
	}
	if len(cs) == 0 {
		delete(n.contra, vni)
	} else {
		if n.contra == nil {
			n.contra = map[uint32]map[string]contradiction{}
		}
		n.contra[vni] = cs
	}
	if len(cs)+len(pending) == 0 {
		return nil
	}
	refused := make(map[string]bool, len(cs)+len(pending))
	for host := range cs {
		refused[host] = true
	}
	for _, host := range pending {
		refused[host] = true
	}
	return refused
}

// publishDefinitionLocked publishes (or, for a deleted network, withdraws)
// n's definition of each of its VNIs.
func (d *Driver) publishDefinitionLocked(n *network, withdraw bool) {
	src := d.cfg.Definitions
	def := n.definitionLocked()
	for _, s := range n.subnets {
		p := &def
		if withdraw {
			p = nil
		}
		if err := src.PublishDefinition(s.vni, p); err != nil {
			d.log.Error("publishing the network's definition", "network", n.id, "vni", s.vni, "error", err)
		}
	}
}

// LocalDefinitions returns the definition of every VNI of every network,
// for the control plane (at start, and periodically: it makes the
// published definitions exactly these).
func (d *Driver) LocalDefinitions() map[uint32]netdef.Definition {
	out := map[uint32]netdef.Definition{}
	d.eachNetwork(func(n *network) {
		def := n.definitionLocked()
		for _, s := range n.subnets {
			out[s.vni] = def
		}
	})
	return out
}

// originCheck answers, for a keyed pull of n's records of vni, whether
// an origin's records are refused — exactly as checkRemoteDefinitionsLocked
// would (its definition contradicts n's, or has not arrived) — asking the
// source about that origin only. It remembers the last origin asked about
// (a pull's keys come sorted by origin); it allocates nothing.
type originCheck struct {
	look    DefinitionSource
	n       *network
	vni     uint32
	last    string
	refused bool
	asked   bool
}

func (c *originCheck) refuses(origin string) bool {
	if c.asked && origin == c.last {
		return c.refused
	}
	r, ok := c.look.DefinitionOf(c.vni, origin)
	refused := false
	if ok && r.Pending {
		refused = true
	} else if ok {
		// n's definition, on the stack: only to compare.
		var room [1]netdef.Subnet
		def := definitionIn(room[:], c.n.subnets, c.n.mtu, c.n.encrypted, c.n.internal)
		refused = !netdef.Equal(&def, &r.Def)
	}
	c.last, c.refused, c.asked = origin, refused, true
	return refused
}

// withoutHosts returns peers without the records of the given hosts.
func withoutHosts(peers map[peerdb.Key]peerdb.Peer, hosts map[string]bool) map[peerdb.Key]peerdb.Peer {
	if len(hosts) == 0 {
		return peers
	}
	out := make(map[peerdb.Key]peerdb.Peer, len(peers))
	for k, p := range peers {
		if !hosts[k.Origin] {
			out[k] = p
		}
	}
	return out
}

// DefinitionConflictStatus is another host whose definition of one of
// the network's VNIs contradicts the network's; its records of that VNI
// are refused.
type DefinitionConflictStatus struct {
	VNI            uint32   `json:"vni"`
	Host           string   `json:"host"`
	VTEP           string   `json:"vtep"`
	Differences    []string `json:"differences"`
	RefusedRecords int      `json:"refused_records"`
}

// definitionStatusLocked lists n's contradicting definitions.
func (d *Driver) definitionStatusLocked(n *network) []DefinitionConflictStatus {
	var out []DefinitionConflictStatus
	for _, vni := range slices.Sorted(maps.Keys(n.contra)) {
		peers := d.cfg.Peers.Peers(vni)
		cs := n.contra[vni]
		for _, host := range slices.Sorted(maps.Keys(cs)) {
			c := cs[host]
			refused := 0
			for k := range peers {
				if k.Origin == host {
					refused++
				}
			}
			out = append(out, DefinitionConflictStatus{VNI: vni, Host: host, VTEP: c.other.VTEP.String(), Differences: c.diffs, RefusedRecords: refused})
		}
	}
	return out
}
