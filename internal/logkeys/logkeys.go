// Package logkeys is the vocabulary of overlayd's log lines that operators
// may rely on: the value of the "event" key of each state change, and the
// keys that come with it. Every package logs these through these constants
// so that one key means one thing everywhere (a VNI is always "vni",
// another host of the cluster always "member", this one "node") and a grep
// or a log pipeline keyed on event= keeps working when a message's wording
// changes.
//
// Each state change an operator cares about is exactly one line, at INFO,
// with Event and the keys listed with the event below. Two are WARN
// because they need the operator to act (ConflictFound,
// EncryptionUnsupported). ERROR is kept for what overlayd failed to do or
// undo (a rollback that left something behind), never for a condition of
// the host or the cluster it reports and works around; the two IPAM ERROR
// events say that address uniqueness can no longer be promised.
//
//	event                   level  keys
//	member_joined           INFO   member, addr
//	member_failed           INFO   member, grace          (records kept until grace ends)
//	member_left             INFO   member                 (records withdrawn at once)
//	member_expired          INFO   member, grace          (failed member's records dropped)
//	network_created         INFO   network, vnis, mtu, internal, encrypted
//	network_deleted         INFO   network, vnis
//	conflict_found          WARN   kind, network, vni; address, winner_host, winner_endpoint, other_hosts,
//	                               other_endpoints (kind address) or member, vtep, differences (kind definition)
//	conflict_resolved       INFO   kind, network, vni; address (kind address) or member (kind definition)
//	rotation_step           INFO   step, accept, send, target
//	reconcile_repair        INFO   kind, count; network, first (kinds sandbox, ports, peers) or trigger, kernel (kind encryption)
//	encryption_unsupported  WARN   error
//	vtep_changed            INFO   vtep, from, count      (this host's records re-published with it)
//	cluster_joined          INFO   addr, count            (the seed that answered, members known)
//	network_restored        INFO   network, vnis          (from the state file at start)
//	send_generation         INFO   kind                   (encryption: new outbound SPIs; kind says why)
//	ipam_ring_created       INFO   pool, voters           (this host won the pool's claim: it owns the whole ring)
//	ipam_space_moved        INFO   pool, from, to, range, count   (a donation, logged by donor and recipient)
//	ipam_reclaimed          INFO   pool, member, host_id, count   (this host took over a gone host's space)
//	ipam_conflict           ERROR  pool, address, owner   (an allocation of this host in a range it does not own:
//	                               a broken invariant or a wrong reclaim; never expected)
//	ipam_identity_reclaimed ERROR  member                 (another host reclaimed this host's identity: IPAM refuses all requests)
//	names_withheld          WARN   members, records, protocol_needed  (a member speaks a gossip protocol without names)
//	names_published         INFO   records
//	name_conflict           WARN   vni, name, hosts       (containers of several hosts hold one name: all answered)
//	name_conflict_resolved  INFO   name
//	name_refused            WARN   network, endpoint, error  (a name that is no DNS name is not served)
//	names_truncated         WARN   network, endpoint, error  (over 16 names or 512 bytes per endpoint)
//	dns_serve_failed        WARN   network, error         (a network's name server could not be served; retried)
//	dns_served              INFO   network                (served again after dns_serve_failed)
//	engine_unreadable       WARN   error                  (the engine's names cannot be read; the names in force stay)
//	engine_readable         INFO                          (read again after engine_unreadable)
//	netsync_write           INFO   network, live          (a user's create or rm seen here: the cluster's entry written)
//	netsync_create          INFO   network, id            (a replica created through the local engine)
//	netsync_remove          INFO   network, id            (an idle replica removed)
//	netsync_conflict        WARN   network, id, differences  (a network here differs from the cluster's: left alone)
//	netsync_kept            WARN   network, containers    (removed in the cluster, kept here while in use)
//	netsync_used_elsewhere  INFO   network, host, containers  (on the host that removed it: still used there)
package logkeys

// Event is the key whose value names the state change a line reports.
const Event = "event"

// Keys that come with events. The same key has the same meaning (and
// type) in every package.
const (
	Node    = "node"    // this host's node name in the cluster
	Member  = "member"  // node name of another cluster member
	Addr    = "addr"    // gossip address of a member, ip:port
	Network = "network" // Docker network ID
	VNI     = "vni"     // VXLAN network identifier (number)
	VNIs    = "vnis"    // a network's VNIs, one per subnet: "4097,4098"
	VTEP    = "vtep"    // underlay address of a host's VXLAN endpoint
	Address = "address" // a container's (endpoint's) IP address
	Kind    = "kind"    // sub-kind of an event (see the kinds below)
	Count   = "count"   // how many items the event covers (number)
	First   = "first"   // description of the first of those items
	Grace   = "grace"   // the failed-member grace period (duration)
	Step    = "step"    // the rotation step (see the steps below)
	Trigger = "trigger" // what started an encryption reconcile
	Error   = "error"   // the error, as text
	Pool    = "pool"    // an IPAM PoolID, "overlayd:198.51.100.0/24"
	Voters  = "voters"  // how many hosts voted in a claim (number)
	From    = "from"    // the former value: the identity space moved from ("node/hostid"), a VTEP's former address
	To      = "to"      // the identity space moved to, "node/hostid"
	Range   = "range"   // an address range, "198.51.100.2-198.51.100.127"
	HostID  = "host_id" // a host's IPAM identity (16 hex digits)
	Owner   = "owner"   // the identity owning an address, "node/hostid"
)

// Cluster IPAM events (internal/ipam).
const (
	IPAMRingCreated       = "ipam_ring_created"
	IPAMSpaceMoved        = "ipam_space_moved"
	IPAMReclaimed         = "ipam_reclaimed"
	IPAMConflict          = "ipam_conflict"
	IPAMIdentityReclaimed = "ipam_identity_reclaimed"
)

// Member events.
const (
	MemberJoined  = "member_joined"
	MemberFailed  = "member_failed"
	MemberLeft    = "member_left"
	MemberExpired = "member_expired"
	// IPv6Withheld: a member speaks a protocol without IPv6 records, so
	// this node's records go out without their IPv6 addresses;
	// IPv6Published: every member speaks it again.
	IPv6Withheld  = "ipv6_withheld"
	IPv6Published = "ipv6_published"
	// NamesWithheld: a member speaks a protocol without names in records,
	// so this node's go out without them; NamesPublished: every member
	// speaks it again.
	NamesWithheld  = "names_withheld"
	NamesPublished = "names_published"
	// NameConflict: one name of a network is held by endpoints of
	// several hosts (all are answered).
	NameConflict = "name_conflict"
)

// Network events.
const (
	NetworkCreated = "network_created"
	NetworkDeleted = "network_deleted"
)

// Conflict events and their kinds: two hosts with an endpoint of the same
// address on a network, or two hosts defining a VNI differently.
const (
	ConflictFound    = "conflict_found"
	ConflictResolved = "conflict_resolved"
	KindAddress      = "address"
	KindDefinition   = "definition"
)

// Rotation events and their steps: a host learns of a newer epoch asked
// for (target: it asked itself, or a peer did), accepts a new epoch
// inbound (accept), sends with a new epoch (send), stops accepting an old
// one (retire). One line per host and change of its key epochs; a change
// that does several at once names them joined by "+", e.g. "target+accept";
// the first keys of a host are "target+accept+send".
const (
	RotationStep = "rotation_step"
	StepTarget   = "target"
	StepAccept   = "accept"
	StepSend     = "send"
	StepRetire   = "retire"
)

// Reconcile repair events and their kinds: the periodic reconcile found
// the kernel different from what overlayd holds and put it back. One line
// per network, kind and reconcile of the driver, however many entries it
// put back; one per repairing reconcile of the encryption owner.
const (
	ReconcileRepair = "reconcile_repair"
	KindSandbox     = "sandbox"    // what a failed Leave left: a sandbox, removed, or veths awaiting deletion, queued
	KindPorts       = "ports"      // bridge port flags and static entries of local endpoints
	KindPeers       = "peers"      // neighbour and FDB entries of remote peers
	KindEncryption  = "encryption" // xfrm states/policies or nftables rules
)

// EncryptionUnsupported: the kernel cannot install ESP states, so the
// traffic of encrypted networks is dropped (never sent in clear).
const EncryptionUnsupported = "encryption_unsupported"

// Host events: this host's VTEP changed, it joined a cluster (first seed
// that answered while alone), a network came back from the state file, the
// encryption owner started a new send generation.
const (
	VTEPChanged     = "vtep_changed"
	ClusterJoined   = "cluster_joined"
	NetworkRestored = "network_restored"
	SendGeneration  = "send_generation"
)

// Events of names across hosts (docs/names.md).
const (
	NameConflictResolved = "name_conflict_resolved"
	NameRefused          = "name_refused"
	NamesTruncated       = "names_truncated"
	DNSServeFailed       = "dns_serve_failed"
	DNSServed            = "dns_served"
	EngineUnreadable     = "engine_unreadable"
	EngineReadable       = "engine_readable"
)

// Events of networks defined once (docs/networks.md).
const (
	NetsyncWrite    = "netsync_write"
	NetsyncCreate   = "netsync_create"
	NetsyncRemove   = "netsync_remove"
	NetsyncConflict = "netsync_conflict"
	NetsyncKept     = "netsync_kept"
	// NetsyncUsedElsewhere: logged by the host whose user removed a
	// network, once per host that still uses it.
	NetsyncUsedElsewhere = "netsync_used_elsewhere"
)
