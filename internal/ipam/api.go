package ipam

import (
	"net/netip"
	"time"
)

// Option keys dockerd puts in RequestAddress options, and the values the
// allocator understands.
const (
	// OptionRequestAddressType with value RequestAddressTypeGateway asks
	// for the pool's gateway (network create).
	OptionRequestAddressType  = "RequestAddressType"
	RequestAddressTypeGateway = "com.docker.network.gateway"
	// OptionMACAddress carries the endpoint's MAC when the plugin's
	// capabilities set RequiresMACAddress.
	OptionMACAddress = "com.docker.network.endpoint.macaddress"
)

// AddressSpace is the only address space the allocator serves; it answers
// GetDefaultAddressSpaces with it as both the local and the global space.
const AddressSpace = "overlayd"

// PoolIDPrefix starts every PoolID the allocator hands to dockerd:
// "overlayd:198.51.100.0/24" or, with a range (--ip-range),
// "overlayd:198.51.100.0/24:198.51.100.128/25".
const PoolIDPrefix = "overlayd:"

// Capabilities is what the plugin's IpamDriver.GetCapabilities answers.
type Capabilities struct {
	// RequiresMACAddress: dockerd passes the endpoint's MAC with
	// RequestAddress, which makes a replayed request idempotent.
	RequiresMACAddress bool
	// RequiresRequestReplay: dockerd re-requests pools and addresses of
	// existing networks and endpoints when it restarts.
	RequiresRequestReplay bool
}

// PoolRequest is dockerd's RequestPool.
type PoolRequest struct {
	AddressSpace string
	Pool         string // the --subnet; required
	SubPool      string // the --ip-range; "" for the whole subnet
	V6           bool
	Options      map[string]string
}

// PoolResponse answers RequestPool. The gateway is always Pool's first
// address (network + 1), the same on every host.
type PoolResponse struct {
	PoolID  string
	Pool    netip.Prefix
	Gateway netip.Prefix // the gateway with the pool's prefix length
}

// AddressRequest is dockerd's RequestAddress: Address is "" for any free
// address or the one --ip asked for; the gateway and the endpoint's MAC
// come in Options (OptionRequestAddressType, OptionMACAddress).
type AddressRequest struct {
	PoolID  string
	Address string
	Options map[string]string
}

// ReclaimResult says what Reclaim took over.
type ReclaimResult struct {
	Node string `json:"node"`
	// Identities are the reclaimed host ids of Node (hex), one per
	// installation of it this host knew of.
	Identities []string `json:"identities"`
	// Pools lists, per pool, how many addresses became this host's.
	Pools []ReclaimedPool `json:"pools"`
}

// ReclaimedPool is one pool's share of a reclaim.
type ReclaimedPool struct {
	PoolID    string `json:"pool_id"`
	Addresses uint64 `json:"addresses"`
}

// Status is the allocator's state for `overlayd status` (and --json).
type Status struct {
	Node   string `json:"node"`
	HostID string `json:"host_id"` // hex
	// Reclaimed lists the identities reclaimed cluster-wide, "node/hostid".
	Reclaimed []string     `json:"reclaimed,omitempty"`
	Pools     []PoolStatus `json:"pools"`
	// DroppedMessages counts messages dropped because a queue was full
	// (inbound, or outbound to one member); exchanges recover from them.
	DroppedMessages uint64 `json:"dropped_messages"`
}

// PoolStatus is one pool's part of Status. Counts are addresses.
type PoolStatus struct {
	PoolID  string `json:"pool_id"`
	Prefix  string `json:"prefix"`
	Range   string `json:"range"`
	Gateway string `json:"gateway"`
	// InUse: how many RequestPool without ReleasePool this host holds.
	InUse int `json:"in_use"`
	// Size: allocatable addresses (the range minus network, gateway and
	// broadcast addresses).
	Size uint64 `json:"size"`
	// Ranges are the ranges this host owns, with their free/used counts.
	Ranges []RangeStatus `json:"ranges"`
	// LocalOwned, LocalFree, LocalUsed: this host's totals.
	LocalOwned uint64 `json:"local_owned"`
	LocalFree  uint64 `json:"local_free"`
	LocalUsed  uint64 `json:"local_used"`
	// Owners: every identity owning part of the ring, this host included.
	Owners []OwnerStatus `json:"owners"`
	// ClusterFree, ClusterUsed: sums over Owners of what they last
	// reported (this host's own figures are exact).
	ClusterFree uint64 `json:"cluster_free"`
	ClusterUsed uint64 `json:"cluster_used"`
	// Unreported: addresses owned by owners that never reported figures.
	Unreported uint64 `json:"unreported,omitempty"`
	// Conflicts: allocations of this host in ranges it does not own
	// (should never happen; each is logged at ERROR).
	Conflicts []string `json:"conflicts,omitempty"`
	// PendingClaim describes this host's claim of the pool's ring while it
	// runs, or the claim of another host it voted for and awaits.
	PendingClaim string `json:"pending_claim,omitempty"`
}

// RangeStatus is one range this host owns.
type RangeStatus struct {
	First string `json:"first"`
	Last  string `json:"last"`
	Size  uint64 `json:"size"`
	Free  uint64 `json:"free"`
	Used  uint64 `json:"used"`
}

// OwnerStatus is one owner of part of a pool's ring.
type OwnerStatus struct {
	Node   string `json:"node"`
	HostID string `json:"host_id"`
	Owned  uint64 `json:"owned"`
	// Reported: Free and Used are the owner's own figures (always for
	// this host); otherwise unknown.
	Reported bool      `json:"reported"`
	Free     uint64    `json:"free"`
	Used     uint64    `json:"used"`
	Since    time.Time `json:"since,omitzero"` // when the figures were reported
	// State: "self", "alive", "suspect", "dead", "gone" (not a member),
	// "reclaimed".
	State string `json:"state"`
}
