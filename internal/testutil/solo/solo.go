// Package solo is the control plane of a host alone, for tests that make
// a driver without the daemon's: it implements each of the driver's
// control-plane interfaces (driver.LocalPublisher, PeerSource,
// DefinitionSource, Membership) fully, as a host that is the only member
// of its cluster sees it: nothing remote, nowhere to join, what is
// published goes nowhere. A test that needs one concern to behave
// otherwise passes its own implementation of that interface only.
package solo

import (
	"net/netip"

	"github.com/overlayd/overlayd/internal/netdef"
	"github.com/overlayd/overlayd/peerdb"
)

// ControlPlane is a host alone's control plane.
type ControlPlane struct{}

// PublishLocalPeer publishes nowhere.
func (ControlPlane) PublishLocalPeer(uint32, *peerdb.Peer, *peerdb.Peer) {}

// PublishLocalNames publishes nowhere.
func (ControlPlane) PublishLocalNames(uint32, string, string) error { return nil }

// VTEPChanged announces nothing.
func (ControlPlane) VTEPChanged(netip.Addr) {}

// Peer finds no remote record.
func (ControlPlane) Peer(peerdb.Key) (peerdb.Peer, bool) { return peerdb.Peer{}, false }

// PeersOf finds no remote record.
func (ControlPlane) PeersOf(keys []peerdb.Key, found []peerdb.Found) { clear(found[:len(keys)]) }

// Peers has no remote record.
func (ControlPlane) Peers(uint32) map[peerdb.Key]peerdb.Peer { return nil }

// Definitions has no other host's definition.
func (ControlPlane) Definitions(uint32) []netdef.Remote { return nil }

// DefinitionOf has no other host's definition.
func (ControlPlane) DefinitionOf(uint32, string) (netdef.Remote, bool) { return netdef.Remote{}, false }

// PublishDefinition publishes nowhere.
func (ControlPlane) PublishDefinition(uint32, *netdef.Definition) error { return nil }

// Discovered joins nobody.
func (ControlPlane) Discovered(netip.Addr) {}

// AddSeeds joins nobody.
func (ControlPlane) AddSeeds([]string) {}

// GossipSeeds has none: the control plane has not started.
func (ControlPlane) GossipSeeds() []string { return nil }
