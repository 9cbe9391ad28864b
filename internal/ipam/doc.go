// Package ipam is overlayd's cluster address management: every host of an
// overlayd network hands out addresses from one subnet, and no address is
// ever handed out twice, also during partitions and restarts, with no
// central store.
//
// # Model
//
// A pool is a subnet (and optionally a range of it, docker's --ip-range),
// named the same on every host. Its allocatable addresses (the range minus
// the network, gateway and broadcast addresses) form a ring, split into
// ranges by tokens: a token is a start address with an owner identity and
// a version. An identity is (node name, host id): the host id is random,
// made on a host's first start and kept in the state file, so a reinstalled
// host (empty state directory) is a new identity.
//
// # Invariants
//
//  1. Only the current owner of a range allocates from it, splits it, or
//     changes its owner.
//  2. A token changes only by its owner, and every change increments its
//     version; merging two views of a ring keeps, per token, the higher
//     version (a CRDT: commutative, idempotent, associative). Tokens are
//     never deleted.
//  3. Ownership moves only by donation: the owner marks a free sub-range
//     (no allocation in it) as owned by the recipient and sends the
//     recipient its ring; it stops allocating from it at that moment. So an
//     owner's knowledge of its own ranges is exact.
//  4. A host allocates only from ranges it owns; with none free it asks a
//     reachable owner with free space (most free first); if none answers it
//     refuses with an error saying so. It never guesses.
//  5. A pool's ring is created once, by a claim accepted by a majority of
//     the voters (this host and every member known, alive, suspect or
//     dead, not left and not reclaimed); each voter accepts at most one
//     claim per pool until that claim is committed or aborted, so two
//     majorities cannot both win. The winner owns the whole ring.
//  6. Reclaim of a node (gone for good) is refused while a member of that
//     name and identity is alive or suspect; otherwise the reclaiming host
//     becomes owner of every token of the node's identity, and the
//     identity is marked reclaimed cluster-wide: its messages are ignored
//     and it never votes again.
//
// Allocations live only on the allocating host; everything (ring, own
// allocations, pool use counts, claim state, host id) is written to the
// Store before an answer depends on it.
package ipam
