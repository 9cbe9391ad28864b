package cluster

import (
	"cmp"
	"fmt"
	"net/netip"
	"slices"
	"time"

	"github.com/overlayd/overlayd/peerdb"
)

// Status is a point-in-time view of this node's control plane, for
// `overlayd status`. It never contains the key, only its fingerprint.
type Status struct {
	Node    NodeStatus            `json:"node"`
	Members []MemberStatus        `json:"members"`
	VNIs    []VNIStatus           `json:"vnis"`
	Dropped map[DropReason]uint64 `json:"dropped"`
	Stats   Stats                 `json:"stats"`
}

// NodeStatus describes this node.
type NodeStatus struct {
	Name           string     `json:"name"`
	BindAddr       netip.Addr `json:"bind_addr"`
	BindPort       int        `json:"bind_port"`
	AdvertiseAddr  netip.Addr `json:"advertise_addr"`
	AdvertisePort  int        `json:"advertise_port"`
	VTEP           netip.Addr `json:"vtep"`
	Incarnation    uint64     `json:"incarnation"`
	Protocol       uint8      `json:"protocol"`
	Label          string     `json:"label"`
	KeyFingerprint string     `json:"key_fingerprint"`
	HealthScore    int        `json:"health_score"` // memberlist's awareness: 0 is healthy
	Seeds          []string   `json:"seeds,omitempty"`
	// IPv6Withheld is set while a member speaks a protocol below
	// ProtocolIPv6: this node's records then go out without their IPv6
	// addresses (IPv6-only records withdrawn).
	IPv6Withheld *IPv6Withheld `json:"ipv6_withheld,omitempty"`
}

// IPv6Withheld says why and how many local records go out without their
// IPv6 addresses.
type IPv6Withheld struct {
	Records int      `json:"records"` // local records with an IPv6 address
	Members []string `json:"members"` // the alive members below ProtocolIPv6
	Reason  string   `json:"reason"`
}

// MemberStatus describes a member as this node sees it (this node
// included).
type MemberStatus struct {
	Name        string      `json:"name"`
	Addr        netip.Addr  `json:"addr"`
	Port        uint16      `json:"port"`
	VTEP        netip.Addr  `json:"vtep"`
	State       MemberState `json:"state"`
	Protocol    uint8       `json:"protocol"` // highest protocol version it speaks
	Incarnation uint64      `json:"incarnation,omitempty"`
	Records     int         `json:"records"` // its live records held here (this node: the records it publishes)
	Since       time.Time   `json:"since"`
	// InForceUntil: a dead member's records stay in force until then
	// (FailedGrace), unless it returns or leaves first.
	InForceUntil time.Time `json:"in_force_until,omitzero"`
	LastHeard    time.Time `json:"last_heard,omitzero"` // last control-plane message from it
	RTT          string    `json:"rtt,omitempty"`       // last direct probe round trip
	Error        string    `json:"error,omitempty"`     // unusable metadata
	Self         bool      `json:"self,omitempty"`
}

// VNIStatus counts the records of one VNI.
type VNIStatus struct {
	VNI    uint32 `json:"vni"`
	Local  int    `json:"local"`  // records this node publishes
	Remote int    `json:"remote"` // remote records in force
}

// Stats are counters since start.
type Stats struct {
	MessagesSent        uint64 `json:"messages_sent"`
	BytesSent           uint64 `json:"bytes_sent"`
	SendErrors          uint64 `json:"send_errors"`
	MessagesReceived    uint64 `json:"messages_received"`
	Deltas              uint64 `json:"deltas"`
	Snapshots           uint64 `json:"snapshots"`
	StaleSnapshots      uint64 `json:"stale_snapshots"`
	Digests             uint64 `json:"digests"`
	DigestMatches       uint64 `json:"digest_matches"`
	DigestMismatches    uint64 `json:"digest_mismatches"`
	StaleRecords        uint64 `json:"stale_records"` // older than held: reordered or duplicated
	SyncRequests        uint64 `json:"sync_requests"`
	IncarnationChanges  uint64 `json:"incarnation_changes"`
	MemberFailures      uint64 `json:"member_failures"`       // members declared dead
	MemberReturns       uint64 `json:"member_returns"`        // dead members back within FailedGrace
	FailedGraceExpired  uint64 `json:"failed_grace_expired"`  // dead members whose records went out of force
	RestartGraceExpired uint64 `json:"restart_grace_expired"` // previous records dropped at RestartGrace, not by a complete view
	PeersChangedCalls   uint64 `json:"peers_changed_calls"`   // Watcher.PeersChanged calls
	PeersChangedKeys    uint64 `json:"peers_changed_keys"`    // keys passed in them
	Definitions         uint64 `json:"definitions"`           // definition sets applied
	StaleDefinitions    uint64 `json:"stale_definitions"`     // definition sets older than held
	AppMessagesSent     uint64 `json:"app_messages_sent"`     // application messages (SendApp), also in MessagesSent
	AppSendErrors       uint64 `json:"app_send_errors"`       // failed SendApp streams, also in SendErrors
	AppMessagesReceived uint64 `json:"app_messages_received"` // application messages accepted and delivered
	RecordsReceived     uint64 `json:"records_received"`      // records in the deltas and snapshots applied
}

// Status returns the current status.
func (c *Cluster) Status() Status {
	st := Status{
		Node: NodeStatus{
			Name: c.cfg.NodeName, BindAddr: c.cfg.BindAddr, BindPort: c.cfg.BindPort,
			AdvertiseAddr: c.cfg.AdvertiseAddr, AdvertisePort: c.cfg.AdvertisePort,
			VTEP: c.local.currentVTEP(), Incarnation: c.inc, Protocol: ProtocolVersion, Label: c.cfg.Label,
			KeyFingerprint: Fingerprint(c.cfg.Key),
		},
		Dropped: make(map[DropReason]uint64),
	}
	if !c.closed.Load() {
		st.Node.HealthScore = c.ml.GetHealthScore()
	}
	c.joiner.mu.Lock()
	for a := range c.joiner.seed {
		st.Node.Seeds = append(st.Node.Seeds, a)
	}
	c.joiner.mu.Unlock()
	slices.Sort(st.Node.Seeds)
	local := c.local.counts()
	vnis := make(map[uint32]*VNIStatus)
	vs := func(vni uint32) *VNIStatus {
		v := vnis[vni]
		if v == nil {
			v = &VNIStatus{VNI: vni}
			vnis[vni] = v
		}
		return v
	}
	ownRecords := 0
	for vni, n := range local {
		vs(vni).Local = n
		ownRecords += n
	}
	now := c.now()

	c.mu.Lock()
	if ok, n := c.local.ipv6State(); !ok {
		st.Node.IPv6Withheld = &IPv6Withheld{Records: n, Members: c.replica.olderThanIPv6(),
			Reason: fmt.Sprintf("members speak a protocol below %d, which cannot carry IPv6 addresses: upgrade them", ProtocolIPv6)}
	}
	suspicionMax := c.suspicionMaxLocked()
	for name, m := range c.replica.members {
		ms := MemberStatus{Name: name, Port: m.node.Port, State: m.state, Since: m.since,
			LastHeard: m.lastHeard, Self: name == c.cfg.NodeName}
		if ip, ok := netip.AddrFromSlice(m.node.Addr); ok {
			ms.Addr = ip.Unmap()
		}
		if m.metaErr != nil {
			ms.Error = m.metaErr.Error()
		} else {
			ms.VTEP, ms.Protocol, ms.Incarnation = m.meta.VTEP, m.meta.ProtoMax, m.meta.Incarnation
		}
		if ms.Self {
			ms.Protocol, ms.Incarnation, ms.VTEP, ms.LastHeard = ProtocolVersion, c.inc, st.Node.VTEP, time.Time{}
		} else if m.suspected(now, suspicionMax) {
			ms.State = StateSuspect
		}
		if m.failedGrace {
			ms.InForceUntil = m.failedUntil
		}
		if m.rtt > 0 {
			ms.RTT = m.rtt.String()
		}
		if o := c.replica.origins[name]; o != nil {
			ms.Records = o.live
		}
		if ms.Self { // its own records are not in the replica
			ms.Records = ownRecords
		}
		st.Members = append(st.Members, ms)
	}
	c.replica.eachEffective(func(vni uint32, _ pkey, _ peerdb.Peer) { vs(vni).Remote++ })
	ss := c.replica.stats
	c.mu.Unlock()

	slices.SortFunc(st.Members, func(a, b MemberStatus) int { return cmp.Compare(a.Name, b.Name) })
	for _, v := range vnis {
		st.VNIs = append(st.VNIs, *v)
	}
	slices.SortFunc(st.VNIs, func(a, b VNIStatus) int { return cmp.Compare(a.VNI, b.VNI) })
	c.dropMu.Lock()
	for r, n := range c.dropped {
		st.Dropped[r] = n
	}
	c.dropMu.Unlock()
	st.Stats = Stats{
		MessagesSent: c.msgsSent.Load(), BytesSent: c.bytesSent.Load(), SendErrors: c.sendErrors.Load(),
		MessagesReceived: c.msgsReceived.Load(),
		Deltas:           ss.Deltas, Snapshots: ss.Snapshots, StaleSnapshots: ss.StaleSnapshots,
		Digests: ss.Digests, DigestMatches: ss.DigestMatches, DigestMismatches: ss.DigestMismatches,
		StaleRecords: ss.StaleRecords, SyncRequests: ss.SyncRequests, IncarnationChanges: ss.IncarnationChanges,
		MemberFailures: ss.MemberFailures, MemberReturns: ss.MemberReturns,
		FailedGraceExpired: ss.FailedGraceExpired, RestartGraceExpired: ss.GraceExpired,
		PeersChangedCalls: c.changeCalls.Load(), PeersChangedKeys: c.changedKeys.Load(),
		Definitions: ss.Defs, StaleDefinitions: ss.StaleDefs,
		AppMessagesSent: c.appSent.Load(), AppSendErrors: c.appSendErrors.Load(), AppMessagesReceived: c.appReceived.Load(),
		RecordsReceived: ss.Records,
	}
	return st
}
