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
// third party can replay stale ones):
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
// asks it for its snapshot, and answers such requests from others: a
// joining or restarted node converges in one round trip.
//
// # Membership
//
// Node metadata carries a metadata version, the protocol versions the node
// speaks, its incarnation and its VTEP. A message is accepted only from an
// alive member with usable metadata, for its current incarnation, and only
// if every record's VTEP is the VTEP that member advertises; otherwise the
// whole message is dropped and counted. When memberlist declares a node
// dead or it leaves, its records stop being in force and are delivered as
// deletes everywhere; a dead node's records are kept (not in force) for
// ReconnectTimeout, so when it comes back (healed partition, false
// positive) they are in force again at once and a sync request fetches
// what changed. A node that restarts before it is declared dead keeps its
// old records in force until its new snapshot replaces them (at most
// RestartGrace): peers that did not change see no event at all.
//
// Memberlist does not probe dead nodes, so a background joiner re-joins a
// random failed member every ReconnectInterval (this heals partitions),
// and retries seeds with backoff until one answers, and again whenever the
// node finds itself alone. After a join it does two more push/pulls with
// random members, catching alive broadcasts that raced with the join. New
// never waits for joining.
//
// # Delivery
//
// The cluster keeps, per VNI, the effective view (records of alive
// origins, never our own) and what it delivered. Every change marks keys
// dirty and wakes the delivery shard of the key's VNI (DeliveryShards
// goroutines; a VNI always maps to the same one). The shard takes all its
// dirty keys, computes (prev = delivered, next = effective) for each,
// skips equal pairs, records next as delivered and calls
// Sink.ApplyPeerEvents once with the batch (sorted by VNI; deletes, then
// updates, then creates). So events of one VNI are ordered and never
// concurrent, bursts coalesce into one event per key, and memberlist
// callbacks (NotifyMsg, MergeRemoteState, NotifyJoin/Leave/Update) only
// mark keys dirty: they never wait for the Sink. A Sink error is counted
// and logged (rate-limited); events are not redelivered (the Sink applied
// the valid ones, and repeating a rejected one would carry a prev it never
// had). Every ResyncInterval all keys are recomputed, repairing any
// bookkeeping slip level-triggered.
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
// Memberlist calls the event delegate with its node lock held, so the
// cluster never calls into memberlist while holding Cluster.mu. Lock
// order: memberlist's node lock -> Cluster.mu -> a sender's queue lock.
// The local record lock (PublishLocalPeer) is a leaf taken alone. The
// Sink is called with no lock held.
package cluster
