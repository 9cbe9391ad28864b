package encryption

import "net/netip"

// ShareID identifies one network's share of the encryption state. The
// driver chooses it, one per network instance (a network deleted and
// created again under the same id gets a new ShareID), so a late update of
// a deleted network can never touch its successor's share.
type ShareID uint64

// Share is what one network contributes to the host's desired encryption
// state.
type Share struct {
	// VNIs of the network.
	VNIs []uint32
	// Encrypted networks' VNIs are encrypted between hosts and dropped when
	// they would cross in clear; the others are let through in clear.
	Encrypted bool
	// Remotes are the VTEPs of the network's active remote peers: the hosts
	// it needs SAs and policies with. Only meaningful for an encrypted
	// network with a sandbox; nil otherwise.
	Remotes []netip.Addr
}
