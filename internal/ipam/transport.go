package ipam

// Transport is how the allocator talks to other hosts; internal/cluster
// implements it (the daemon adapts the cluster's app messages to it). The
// allocator's messages are bytes in and out: Transport knows nothing of them.
type Transport interface {
	// Send delivers payload to the alive member named node, reliably
	// (memberlist TCP stream, encrypted and authenticated with the cluster
	// key). Error if node is not alive or the send fails. May block up to
	// the cluster's TCP timeout: never called holding a lock.
	Send(node string, payload []byte) error
	// Members lists every member the cluster knows other than this node
	// (not left), with state.
	Members() []Member
	// Joined reports whether this node may act on its view of the
	// membership: true once it has been in a cluster with another member,
	// or when no seeds are configured (a first/single host).
	Joined() bool
}

// MemberState is what the cluster knows of a member's liveness.
type MemberState int

// Member states, as memberlist reports them. A member that left gracefully
// is not listed at all.
const (
	Alive MemberState = iota
	Suspect
	Dead
)

func (s MemberState) String() string {
	switch s {
	case Alive:
		return "alive"
	case Suspect:
		return "suspect"
	case Dead:
		return "dead"
	}
	return "unknown"
}

// Member is one other member of the cluster.
type Member struct {
	Name  string
	State MemberState
}

// Store persists the allocator's state; *statefile.File implements it (the
// bbolt table "ipam").
type Store interface {
	// LoadIPAM returns the ipam table.
	LoadIPAM() (map[string][]byte, error)
	// WriteIPAM stores puts atomically and durably; a nil value deletes
	// its key.
	WriteIPAM(puts map[string][]byte) error
}
