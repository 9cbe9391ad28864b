// Package cluster is overlayd's control plane: hosts find each other with
// github.com/hashicorp/memberlist (SWIM membership and failure detection)
// and replicate the peer records of their local endpoints, which the
// driver turns into neighbour and FDB entries.
//
// # Records and versions
//
// Each node owns the records of its local endpoints, keyed by (origin node,
// VNI, EndpointID); the value is a peerdb.Peer plus a version and a
// deleted flag. A node publishes changes with PublishLocalPeer.
//
// Versions are issued by the origin: max(last+1, wall clock in ns), so
// they order every change of one record even if the clock steps back.
// Every process start picks a new incarnation (the wall clock in ns at
// start), advertised in the node's memberlist metadata and carried by
// every message; records of any incarnation other than the one the origin
// currently advertises are discarded, so versions never need to outlive a
// process and a restarted node cannot be shadowed by its former self.
//
// Merging is a last-writer-wins register per key ordered by version:
// keep the record with the higher version. Deletes are tombstones (a
// record with the deleted flag and its own version), kept TombstoneTTL
// (default 1 min; or until a complete view supersedes them, below) so that
// an older record arriving late cannot resurrect the key. The merge is
// idempotent and commutative: reordered, duplicated or coalesced messages
// converge to the same state everywhere.
//
// # Dissemination
//
// Three message kinds carry records, all sent directly from the origin to
// every member (not relayed: only the origin speaks for its records, so no
// third party can replay stale ones) — or, between nodes that advertise
// interest (Config.Interest), only to the members that have a network
// definition of the record's VNI, with digests and snapshots over those
// VNIs only (see interest.go):
//
//   - delta: the records that changed since the last delta. A publisher
//     goroutine takes everything changed since its last run (a burst of
//     1,000 endpoints becomes a handful of messages); up to four packets'
//     worth goes as UDP packets of ~1.3 kB, more as one TCP message (up to
//     1 MiB each). Each member has its own sender goroutine and queue, so
//     a slow or unreachable member delays nobody else.
//   - snapshot: the origin's complete live set as of its clock value H.
//     A receiver removes the origin's records it holds with version <= H
//     that the snapshot lacks (they were deleted, maybe reaped, at the
//     origin) and remembers H as a floor: a record of that origin with
//     version <= floor whose key it does not hold is stale. Snapshots are
//     sent on request (sync request) and as memberlist's push/pull user
//     state (on join and every PushPullInterval).
//   - digest: (H, live count, sum of the live records' 64-bit FNV hashes),
//     sent to every member DigestInterval (1 s) after the node's records
//     changed, then at doubling intervals up to DigestMaxInterval (30 s),
//     which is also the idle rate: the digest traffic follows the rate of
//     change. A receiver holding no record newer than H compares: equal
//     means its view is complete as of H (the floor rises to H and older
//     tombstones go); different means it missed something, and it asks the
//     origin for a snapshot (sync request, at most one per 500 ms per
//     origin). A lost UDP delta is thus repaired about a second after the
//     change.
//
// A node that learns of a member (join, return from dead, new incarnation)
// asks it for its snapshot, sends it its digest first (a member back from
// a false death missed our changes meanwhile), and answers such requests
// from others: a joining or restarted node converges in one round trip. A
// restarted node's own requests may reach members before they know its new
// incarnation (refused): when a member's first message is its own sync
// request (it has just learnt us) and ours to it is older than 50 ms, it
// is asked again at once rather than at the 1 s retry.
//
// # Network definitions
//
// Each node also owns one network definition (internal/netdef) per VNI it
// has a network for, published with PublishDefinition and SyncDefinitions.
// They travel as the node's complete set (a defs message, protocol version
// 2, sent only to members that advertise it), on change, before every
// snapshot and with every digest; a receiver keeps the newest set of the
// origin's current incarnation, in force exactly when its records are
// (FailedGrace included; a restarted node's former set until its new one
// arrives). Definitions(vni) lists them, and as Pending every member of
// protocol 2 that has none of vni, whose records the driver holds back
// until it has. A change of what is in force for a VNI is delivered as
// Watcher.PeersChanged(vni, nil). See defs.go.
//
// # Application messages
//
// Other parts of overlayd (the cluster address management) exchange their
// own messages through the cluster: SendApp sends an opaque payload (up
// to 1 MiB) reliably to one member (type 7, protocol version 3, sent only
// to members that advertise it), and the receiver hands it to
// Config.OnAppMessage once it has been validated like every message
// (alive member, current incarnation, sizes). AppMembers lists the members
// with their states and Joined says whether this node has met the cluster
// (see app.go).
//
// # Membership
//
// Node metadata carries a metadata version, the protocol versions the node
// speaks, its incarnation, its VTEP and its application state. A message
// is accepted only from an alive member with usable metadata, for its
// current incarnation, and only if every record's VTEP is the VTEP that
// member advertises; otherwise the whole message is dropped and counted.
//
// Leaving is explicit. Shutdown stops the node without leaving: the others
// see a failure. Leave (the decommissioning of a host) first sends every
// member a leave message (reliably, falling back to a packet), then
// leaves memberlist; a member that had declared the node dead before the
// leave message arrived still honours it. Nothing else leaves.
//
// When memberlist declares a member dead (failed, not left), its records
// stay in force for FailedGrace (default 10 s) after its death, and the
// consumers are told nothing. If it returns within the grace with the
// same incarnation (a false detection, a stalled host, a healed
// partition) nothing changes for them; a sync request fetches what it
// changed meanwhile. If it returns with a new incarnation (it restarted),
// the records that were in force stay so, as the previous set, until the
// new incarnation's first complete view (snapshot or matching digest), at
// most RestartGrace (default 5 s) after its return: records that did not
// change are never out of force, and only keys whose value changes are
// reported. The same holds for a restart seen while the member was still
// alive. If the grace ends without its return, its records go out of force
// (reported to the consumers) but are kept until ReconnectTimeout, so a
// later return with the same incarnation restores them at once. A member
// that left loses its records at once and is forgotten. A member that
// advertises a new VTEP (SetVTEP) keeps its records of the former VTEP in
// force until its records of the new one arrive (a delta per record, its
// snapshot for all), at most RestartGrace; it is asked for its snapshot at
// once.
//
// A host restarted with another underlay address keeps its node name:
// memberlist refuses an alive message that moves a member to another
// address unless the member has been dead for deadNodeReclaimTime
// (200 ms). Members that refused such a message (NotifyConflict) remember
// the new address, and once the old one is declared dead they join the
// new one, so the host is accepted there about deadNodeReclaimTime after
// its old address is declared dead (the restarted node's follow-up
// push/pulls, below, are the fallback). In the tests (3 nodes on
// loopback, the old process stopped just before the new one starts) the
// node is alive again at its new address everywhere 1.6-2 s after its new
// process started, about 250 ms after the old address was declared dead.
//
// Memberlist does not probe dead nodes, so a background joiner re-joins a
// random failed member every ReconnectInterval (this heals partitions),
// and retries seeds with backoff (0.5 s doubling to 30 s) until one
// answers, and again whenever the node finds itself alone. After a join it
// pushes/pulls state once a second, for up to 30 s, with a member that has
// sent this process nothing yet (each member that accepts this incarnation
// asks for its snapshot at once, so the others have not accepted it); the
// first two go to a random member if every member has, catching alive
// broadcasts that raced with the join. New never waits for joining.
//
// # Delivery
//
// The cluster is the one owner of the remote records; it pushes no
// values. Every change of what may be in force marks its key dirty (per
// VNI) and wakes the delivery shard of the VNI (DeliveryShards goroutines;
// a VNI always maps to the same one). The shard takes all its dirty keys
// and calls Watcher.PeersChanged(vni, keys) once per VNI, in VNI order,
// with the keys sorted (origin, endpoint id), without holding any cluster
// lock. So calls for one VNI are ordered and never concurrent, and any
// number of changes between two runs coalesce into one call. The Watcher
// pulls the values with Peer or Peers, which take Cluster.mu briefly and
// compute what is in force on the spot: there is no copy of what was
// delivered, and nothing to redeliver. Peers visits only the keys of its
// VNI (an index by VNI of every key the replica holds: records, tombstones
// and previous records; kept on every merge, snapshot, digest, reap,
// grace end, restart and origin removal). Keys are marked when their
// value may change; a merge that keeps the value (a restarted node
// re-sending an unchanged record) marks nothing. Repairing a consumer that
// lost track is the consumer's business (it pulls Peers on its own tick);
// memberlist callbacks (NotifyMsg, MergeRemoteState, NotifyJoin/Leave/
// Update/Conflict) only mark keys dirty and never wait for the Watcher.
//
// # Bad input
//
// Everything from the network is decoded and validated completely before
// anything is applied (decode.go): version, type, lengths, limits, VNI in
// 1..16777215, IPv4 unicast IP, unicast MAC, unicast VTEP, no duplicate
// keys, nothing trailing. A refused message is counted by DropReason
// (Status().Dropped) and logged at most once per reason per 10 s. Memberlist
// drops what fails authentication itself; those are counted from its log.
//
// # Security
//
// Gossip is encrypted and authenticated with the cluster key (AES-GCM,
// memberlist keyring, GossipVerifyIncoming and GossipVerifyOutgoing) and
// carries the cluster label (authenticated data). A node with another key
// can neither join nor inject records: memberlist cannot decrypt its
// packets or streams. Status shows the key's fingerprint, never the key.
//
// # Locks
//
// Every lock is a *lockorder.Mutex made with its level; their order is
// the hierarchy in internal/lockorder (the lockcheck build checks it).
// What each guards and who takes it:
//
//   - Cluster.mu (LevelCluster): the replica (remote records), the senders map and
//     the shards' dirty sets. Taken by memberlist callbacks, the
//     periodic loop, Status, and by Peer/Peers under the caller's network
//     lock (LevelNetwork, above it).
//   - dest.mu (LevelClusterSender): one sender's queue; under Cluster.mu or
//     alone.
//   - localStore.mu (LevelClusterLocal): this node's records, VTEP and
//     application state; by PublishLocalPeer under the caller's network
//     lock, under Cluster.mu (a new member's first digest), or alone.
//   - the drop counters, the log rate limiter and the joiner's seeds and
//     claims (LevelLeaf): nothing is taken or called while they are held.
//
// Memberlist's own locks are outside the hierarchy: it calls its delegates
// with its node lock held, so nothing here calls into memberlist while
// holding any of these locks (memberlist's lock is always taken first).
// OnMembersChange is called from those callbacks with no cluster lock
// held; the Watcher is called with no lock held at all, and may block on a
// network's lock, which delays only the VNIs of its shard.
package cluster
