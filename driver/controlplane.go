package driver

import (
	"errors"
	"net/netip"

	"github.com/overlayd/overlayd/internal/netdef"
	"github.com/overlayd/overlayd/peerdb"
)

// The control plane, as the driver sees it: one interface per concern,
// each a Config field, all required (New refuses a Config without one).
// The daemon's control plane implements all four on one object; a host
// without one, in tests, passes stand-ins that implement them fully
// (internal/testutil/solo). Nothing is type-asserted: what the driver
// calls is what the interfaces say.
//
//   - LocalPublisher (Config.Publisher): this host's own state — its VTEP,
//     its endpoints' records and their names.
//   - PeerSource (Config.Peers): the other hosts' records, which networks
//     pull.
//   - DefinitionSource (Config.Definitions): the network definitions hosts
//     gossip, this host's published and the others' read.
//   - Membership (Config.Membership): where the cluster is joined (swarm's
//     DiscoverNew, a network's gossip seeds) and the seeds a swarm
//     leader hands out.
//
// The control plane reaches the driver only through the Driver's own
// methods (PeersChanged, LocalPeers, LocalDefinitions, VTEP, Reconcile,
// Settle), given the Driver once it exists: the driver never hands itself
// to the control plane, and nothing closes the loop after construction.
//
// Thread safety: the methods are called concurrently (for different
// networks). Those the interfaces say are called with a network's lock
// held (lockorder.LevelNetwork) must return promptly, take only locks
// below the driver's in the hierarchy and never call into the Driver.

// LocalPublisher receives this host's own state as it changes.
type LocalPublisher interface {
	// PublishLocalPeer is told of a local endpoint joining (prev nil) or
	// leaving (next nil), as (prev, next) pairs like remote events. Called
	// with the network's lock held: it must not block.
	PublishLocalPeer(vni uint32, prev, next *peerdb.Peer)
	// PublishLocalNames is told of the DNS names of a local endpoint
	// (SetNames), which travel with its record. Called with the network's
	// lock held: it must not block.
	PublishLocalNames(vni uint32, endpointID, packed string) error
	// VTEPChanged is told of the local VTEP whenever it is settled or
	// changes (see VTEP), in order, under the driver's VTEP lock
	// (lockorder.LevelVTEP) and no other: the control plane re-announces
	// the local records with it (or starts), the encryption state follows
	// it. It must not call back into the driver's VTEP methods.
	VTEPChanged(vtep netip.Addr)
}

// PeerSource is the one owner of remote endpoints' records (the control
// plane). A network pulls from it, under its own lock: when told that
// records of one of its VNIs changed (PeersChanged), when it is created, and
// on the driver's periodic reconcile. Nothing is pushed into a network, so
// nothing it rejected or could not place is lost: it stays at the source
// and is pulled again.
//
// Every method is called with a network's lock held.
type PeerSource interface {
	// Peer returns the record in force for k, if any (never one of this
	// host's own).
	Peer(k peerdb.Key) (peerdb.Peer, bool)
	// PeersOf sets found[i] to what Peer(keys[i]) returns, for every i
	// (len(found) == len(keys)). A pull of many keys (a burst of gossip)
	// takes the source's lock once per batch instead of once per key, so
	// it neither pays a lock handover per record nor makes the source's
	// writers (the gossip receive path, taking the same lock per message)
	// wait behind it key by key.
	PeersOf(keys []peerdb.Key, found []peerdb.Found)
	// Peers returns every record in force for vni, by key.
	Peers(vni uint32) map[peerdb.Key]peerdb.Peer
}

// DefinitionSource is the one owner of the network definitions hosts
// gossip (the control plane): this host's, which the driver publishes, and
// the other hosts', which it asks for. Nobody else keeps a copy.
//
// Every method is called with a network's lock held.
type DefinitionSource interface {
	// Definitions returns the definitions of vni that other hosts have in
	// force (never this host's). Full pulls (PeersChanged(vni, nil), a
	// network's creation, Reconcile) compare every host's with the
	// network's and log contradictions.
	Definitions(vni uint32) []netdef.Remote
	// DefinitionOf returns host's entry in Definitions(vni); ok is false
	// when it has none. Def is read, never modified, and not kept. A pull
	// of some records (PeersChanged with keys) asks only about their
	// origins: its cost follows the records, not the cluster's size
	// (listing every member's definition on every pull cost ~70 µs at 100
	// members). The control plane must call PeersChanged(vni, nil)
	// whenever the definitions in force of vni may have changed: those
	// full pulls compare every host's; the keyed pulls between refuse the
	// same hosts' records.
	DefinitionOf(vni uint32, host string) (r netdef.Remote, ok bool)
	// PublishDefinition sets (def non-nil) or withdraws (nil) this host's
	// definition of vni. It never blocks.
	PublishDefinition(vni uint32, def *netdef.Definition) error
}

// Membership is where the control plane joins the cluster. Its methods
// are called without driver locks held.
type Membership interface {
	// Discovered is told of every other node DiscoverNew announces
	// (swarm): the control plane joins them.
	Discovered(addr netip.Addr)
	// AddSeeds is told of the gossip seeds a network carries (option
	// overlayd.seeds) when it is created or restored: the control plane
	// joins them unless it is in a cluster with them already.
	AddSeeds(seeds []string)
	// GossipSeeds returns the gossip addresses ("IP:port") of this node
	// and of the members it knows, which the swarm leader's
	// AllocateNetwork hands to every node (option overlayd.seeds); none
	// while the control plane has not started. It may wait briefly for
	// the start.
	GossipSeeds() []string
}

// checkControlPlane refuses a Config without one of the control plane's
// interfaces, naming the field.
func checkControlPlane(cfg *Config) error {
	var missing []error
	if cfg.Publisher == nil {
		missing = append(missing, errors.New("missing Config.Publisher: a LocalPublisher is required"))
	}
	if cfg.Peers == nil {
		missing = append(missing, errors.New("missing Config.Peers: a PeerSource is required"))
	}
	if cfg.Definitions == nil {
		missing = append(missing, errors.New("missing Config.Definitions: a DefinitionSource is required"))
	}
	if cfg.Membership == nil {
		missing = append(missing, errors.New("missing Config.Membership: a Membership is required"))
	}
	return errors.Join(missing...)
}
