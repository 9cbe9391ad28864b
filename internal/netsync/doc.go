// Package netsync makes an overlayd network defined on one host's engine
// exist on every host's engine: "networks defined once" (docs/networks.md).
//
// # What is replicated
//
// The cluster holds one entry per network name: the definition
// (netspec.Spec) and whether the network is live or removed, stamped with
// when and by which host the user's act that wrote it happened. Entries
// merge by that stamp (the later act wins; the host's name breaks a tie),
// so every host that has seen the same acts holds the same entries,
// whatever order it saw them in. A removed entry (a tombstone) is kept
// for TombstoneTTL, then forgotten.
//
// Only a user's act writes an entry, never a replica: a network created on
// a host's engine by anyone but netsync ("docker network create", compose)
// writes a live entry if the cluster has none live for that name; a
// network removed on a host's engine by anyone but netsync writes a
// tombstone if it was the cluster's network (the same definition). A
// network created by hand with another definition than the live entry's is
// a conflict: it is left alone and reported, and writes nothing.
//
// # What each host does with the entries (Plan)
//
//   - A live entry and no network of that name here: create a replica
//     through the local engine, with the entry's definition.
//   - A live entry and a network of that name with the same definition:
//     nothing (whoever made it). With another definition: a conflict, left
//     alone and reported (status, one WARN, a metric).
//   - A tombstone, or no entry at all, and a replica here: remove the
//     replica once no container uses it here; until then keep it and say so.
//     A network the user made here is never removed by netsync.
//
// Because a replica never writes an entry, no host resurrects a removed
// network: a host that was partitioned during a removal keeps its replica
// until it hears the tombstone, then removes it when idle. Because only
// idle replicas are removed, no network in use anywhere is deleted there.
//
// # Level-triggered
//
// Plan takes the engine's networks as they are now, the entries as they
// are now and the ledger of replicas netsync made; the caller runs it on a
// tick, on the engine's network events and on every new entry, so a lost
// event, an engine restart or an overlayd restart converges.
package netsync
