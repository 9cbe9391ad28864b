// Package peerdb holds one network's peer table and derives from it the
// neighbour and FDB entries the network's sandbox must hold.
//
// The package is pure Go: it never touches the kernel. A DB is not safe for
// concurrent use; its owner (the driver's network, under network.mu) serialises
// access, reads included.
//
// # Entries
//
// A DB holds two kinds of entry, each a [Peer]:
//
//   - remote entries, learnt from the cluster as events (prev, next) and kept
//     as a set: an entry is present or not, adding it twice or removing it
//     when absent changes nothing ([DB.Apply] has set semantics, so replayed
//     or reordered gossip is harmless);
//   - local entries, the endpoints joined on this host, keyed by EndpointID
//     ([DB.AddLocal] replaces the previous local entry of that id).
//
// Every entry is validated before it is stored ([DB.Validate]): its IP must
// be IPv4 and inside one of the network's subnets, whose index is the Subnet
// of the kernel entries it yields.
//
// # Deterministic conflict resolution
//
// Several entries may claim one IP (an endpoint moved, an address was reused,
// gossip arrived out of order). Exactly one claimant is active, chosen by a
// rule that depends only on the set of claimants, never on insertion or map
// order:
//
//  1. a local entry always wins over remote ones; among several local
//     entries the one with the smallest EndpointID (byte-wise) wins;
//  2. otherwise the smallest remote entry wins, ordered by EndpointID
//     (byte-wise), then MAC (byte-wise), then VTEP ([netip.Addr.Compare]).
//
// [DB.Active] reports the winner of an IP and [DB.Conflicts] every IP with
// more than one claimant.
//
// # Desired kernel state
//
// The desired state ([DB.Desired]) is a pure function of the entries:
//
//   - Local entries never produce kernel state: the local endpoint is reached
//     through the bridge, not the VXLAN link. An IP whose active claimant is
//     local has no neighbour entry.
//   - Neighbours: for each IP whose active claimant is remote,
//     Neigh{Subnet: subnet of IP, IP, MAC of the claimant}.
//   - FDB: each active remote claimant proposes FDBKey{Subnet, MAC} -> VTEP.
//     If several active remote claimants propose the same key (same MAC in
//     the same subnet), the one with the smallest IP wins. There is no FDB
//     entry for a (Subnet, MAC) that belongs to any local entry in that
//     subnet, active or not, so traffic to a local MAC is never sent into the
//     tunnel.
//
// Only active claimants count: a shadowed entry contributes nothing, neither
// a neighbour nor an FDB proposal.
//
// # Deltas
//
// Every mutation returns the [Delta] between the desired state before and
// after it. A key appears at most once per kind and never in both Set and Del;
// a key whose value changes is only in Set (the kernel write replaces); a Del
// carries the value that was desired before; keys whose value did not change
// do not appear. The slices are sorted by Subnet, then IP (neighbours) or MAC
// bytes (FDB). Applying the deltas of successive mutations, in order, to the
// desired state before them yields the desired state after them.
//
// # Cost
//
// The DB keeps indexes (claimants per IP, active remote claimants per FDB
// key, local MACs per subnet) so a mutation costs time proportional to the
// number of claimants of the IPs and MACs it touches, not to the size of the
// DB; [DB.ApplyAll] costs time proportional to the keys its events touch.
// Snapshots ([DB.Desired], [DB.Remote], [DB.Local], [DB.Conflicts]) are
// proportional to the DB size.
package peerdb
