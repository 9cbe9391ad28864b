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
//   - remote entries, pulled from their owner (the control plane) by [Key]
//     (VNI, origin host, endpoint): [DB.SetRemotes] sets what the owner has
//     in force for some keys ([DB.Pull] likewise, asking the owner for each
//     key's record as it goes), [DB.SyncVNI] makes a whole VNI match the
//     owner's set. An update names no previous value: the table knows what
//     each key holds, so repeated, reordered or coalesced notifications
//     converge. Keys with equal records share one entry (it stays while any
//     of them holds it).
//   - local entries, the endpoints joined on this host, keyed by EndpointID
//     ([DB.AddLocal] replaces the previous local entry of that id).
//
// Every entry is validated before it is stored, by one validator
// ([DB.Validate]): it has an IPv4 address (IP), an IPv6 address (IPv6) or
// both, each inside a prefix of one segment of the network, whose index is
// the Subnet of the kernel entries it yields. A network is made of
// segments ([Segment], [NewSegments]: one VNI and VXLAN link each, with
// prefixes of either family); [New] makes one segment per IPv4 subnet. A
// remote record must also carry its key's endpoint id and, for a DB made
// with VNIs, lie on the segment of its key's VNI. A record that fails is not
// held (the key's previous record goes too: it is no longer in force) and
// is listed by [DB.Rejected] until its key is updated: it stays with its
// owner, and is taken as soon as it fits.
//
// The code is split by concern: db.go (the table and its claims),
// keyed.go (remote records by key), held.go (their compact table),
// remote.go (remote claimants),
// local.go, fdb.go (FDB proposals), txn.go (deltas), vtep.go (interned
// VTEPs), views.go (snapshots), validate.go.
//
// # Deterministic conflict resolution
//
// Several entries may claim one IP (an endpoint moved, an address was reused,
// gossip arrived out of order). Each address of an entry is a claim of its
// own: a dual-stack entry claims its IPv4 and its IPv6 address, and may win
// one and lose the other. Exactly one claimant of an address is active,
// chosen by a rule that depends only on the set of claimants, never on
// insertion or map order:
//
//  1. a local entry always wins over remote ones; among several local
//     entries the one with the smallest EndpointID (byte-wise) wins;
//  2. otherwise the smallest remote entry wins, ordered by EndpointID
//     (byte-wise), then MAC (byte-wise), then VTEP ([netip.Addr.Compare]),
//     then its other address (none first).
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
//   - FDB: each active remote claimant proposes FDBKey{Subnet, MAC} -> VTEP
//     (a dual-stack entry once per address it wins: one FDB entry).
//     If several active remote claimants propose the same key (same MAC in
//     the same subnet), the one with the smallest IP wins (IPv4 before
//     IPv6). There is no FDB
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
// do not appear. The slices are sorted by Subnet, then IP (neighbours, IPv4
// before IPv6) or MAC bytes (FDB). Applying the deltas of successive mutations, in order, to the
// desired state before them yields the desired state after them.
//
// A Delta's Set and Del slices belong to the DB: they are valid until its
// next mutation, which reuses them (so a stream of bulk changes allocates
// nothing); copy what must outlive it.
//
// # Cost
//
// The DB keeps indexes (claimants per IP, active remote claimants per FDB
// key, local MACs per subnet) so a mutation costs time proportional to the
// number of claimants of the IPs and MACs it touches, not to the size of the
// DB; [DB.SetRemotes] and [DB.Pull] cost time proportional to the updates,
// [DB.SyncVNI] to the records of the VNI plus those the table holds. A
// remote record takes about 210 bytes of Go heap at rest in all (its held
// record, its claim, its FDB record; and their three index slots at the
// indexes' load); an IPv6 address costs a Go map entry and a slab slot
// more (the IPv4 path keeps its own index). Bulk changes keep scratch
// space until a transaction that changes nothing.
// Snapshots ([DB.Desired], [DB.Remote], [DB.Local], [DB.Conflicts]) are
// proportional to the DB size.
package peerdb
