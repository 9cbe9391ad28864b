package cluster

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"time"

	"github.com/hashicorp/memberlist"
	"github.com/overlayd/overlayd/internal/netdef"
	"github.com/overlayd/overlayd/peerdb"
)

// DefaultPort is overlayd's gossip port (TCP and UDP). Docker's swarm uses
// 7946; overlayd must not collide with it.
const DefaultPort = 7947

// DefaultLabel is the memberlist cluster label: packets and streams of
// another label are refused before decryption is even tried.
const DefaultLabel = "overlayd"

// Watcher is told which remote records may have changed; it pulls them
// with Cluster.Peer or Cluster.Peers. It is called from the cluster's own
// delivery goroutines, never from a memberlist callback and with no
// cluster lock held; calls for one VNI are ordered and never concurrent
// (calls for different VNIs may be), and it may block (on a network's
// lock), which delays only the VNIs of its delivery shard. keys are the
// keys marked dirty since the previous call for vni, sorted by origin then
// endpoint id, all of VNI vni and never of this node; a key may be
// reported although its record did not change. keys == nil means: any
// record of vni may have changed (pull them all); this package sends nil
// when the network definitions in force for vni changed (see
// Definitions). The first calls may come
// before New has returned (a member may join at once): a Watcher that
// needs the *Cluster must wait for it, not fail.
type Watcher interface {
	PeersChanged(vni uint32, keys []peerdb.Key)
}

// Config configures a Cluster. Zero values take the defaults shown.
type Config struct {
	NodeName      string     // required, unique in the cluster, at most 255 bytes
	BindAddr      netip.Addr // gossip bind address; default 0.0.0.0
	BindPort      int        // gossip port (TCP+UDP); default DefaultPort (7947)
	AdvertiseAddr netip.Addr // address others reach us at; default BindAddr, else a private address of the host
	AdvertisePort int        // default BindPort
	VTEP          netip.Addr // our VXLAN tunnel endpoint (node metadata); default AdvertiseAddr
	Key           []byte     // cluster key, 16, 24 or 32 bytes (AES-128/192/256-GCM); required
	Label         string     // memberlist cluster label; default DefaultLabel
	Seeds         []string   // "host[:port]" to join, retried in the background with backoff
	// Local are this node's records at start (a restarted daemon's
	// endpoints), in place before anything is gossiped.
	Local []LocalRecord
	// LocalDefinitions are this node's network definitions at start, by
	// VNI (see SyncDefinitions).
	LocalDefinitions map[uint32]netdef.Definition
	// Interest: this node's network definitions are its interest. It
	// advertises so (node metadata), members that also do send it only
	// the records of the VNIs it has a definition of, and it sends them
	// only theirs (interest.go). Off, it is sent every record, as by
	// overlayd before interest. The daemon turns it on; a node that
	// publishes records without definitions must leave it off.
	Interest     bool
	TombstoneTTL time.Duration
	Watcher      Watcher // required
	// OnMembersChange, if set, is called when a member joins, leaves, dies
	// or changes its metadata (its VTEP or application state, see
	// SetAppState and MemberApps). It is called from memberlist's callbacks
	// (memberlist's node lock held, no cluster lock held): it must not
	// block (signal a goroutine) and must not call into the Cluster or
	// memberlist.
	OnMembersChange func()
	// OnAppMessage, if set, receives every application message (SendApp
	// on another node) accepted from an alive member's current
	// incarnation: the sender's node name and the payload, a copy that is
	// the callee's to keep. It is called on memberlist's goroutines (its
	// stream and packet handlers) with no cluster lock held: it must not
	// block (hand the work to a goroutine) and must not send (SendApp
	// waits for a stream). Messages from one sender may be delivered
	// concurrently and out of order.
	OnAppMessage func(from string, payload []byte)
	Logger       *slog.Logger
	// Transport replaces memberlist's NetTransport (tests wrap it to drop,
	// delay or count traffic). BindAddr/BindPort are then only used to
	// advertise.
	Transport memberlist.Transport

	// Profile: the failure detector's and gossip's timings (LANProfile,
	// WANProfile or ParseProfile's explicit timings); the zero Profile is
	// LANProfile, and its zero fields take its base's values. The timing
	// fields below, when set, win over it (tests tune single timings).
	Profile Profile

	// Timing. The defaults (see DefaultConfig) are LANProfile's: they
	// detect a dead node in about 2-3.5 s with 50 nodes (under 5 s in the
	// worst case measured) and leave a suspected node at least 0.9 s (3
	// nodes) to 1.5 s (50 nodes) to refute, which a busy host does easily.

	// ProbeInterval: each node probes one other node per interval
	// (memberlist SWIM). Default 300 ms.
	ProbeInterval time.Duration
	// ProbeTimeout: wait for a direct ack before indirect probes; the
	// probe as a whole may take ProbeInterval. Default 150 ms.
	ProbeTimeout time.Duration
	// SuspicionMult: a suspect is declared dead after
	// SuspicionMult*max(1,log10(N))*ProbeInterval once another node
	// confirms the suspicion. Default 3.
	SuspicionMult int
	// SuspicionMaxTimeoutMult bounds the suspicion time without
	// confirmations (multiple of the above). Default 4.
	SuspicionMaxTimeoutMult int
	// GossipInterval and GossipNodes: membership gossip (alive, suspect,
	// dead) goes to GossipNodes random nodes every GossipInterval.
	// Defaults 100 ms and 4.
	GossipInterval time.Duration
	GossipNodes    int
	// PushPullInterval: memberlist's full state exchange with one random
	// node (membership anti-entropy: repairs a lost join or alive
	// broadcast; carries this node's record snapshot too). Memberlist
	// doubles it beyond 32 nodes and so on. Default 5 s.
	PushPullInterval time.Duration
	// DigestInterval and DigestMaxInterval: a node sends every member a
	// 40-byte digest of its records (clock, count, hash) DigestInterval
	// after it changed them, then at doubling intervals up to
	// DigestMaxInterval, which is also the rate while nothing changes. A
	// member whose view differs asks for a snapshot: a lost update is
	// repaired about DigestInterval after the change, and the digest
	// traffic follows the rate of change, not the cluster's size squared.
	// Defaults 1 s and 30 s (jittered ±20%).
	DigestInterval    time.Duration
	DigestMaxInterval time.Duration
	// ReconnectInterval: how often a node tries to re-join a failed
	// member (heals partitions) and retries unanswered seeds. Default 5 s.
	ReconnectInterval time.Duration
	// ReconnectTimeout: how long a failed member is retried, and its
	// records kept (not in force once FailedGrace is over) for a quick
	// restore. Default 24 h.
	ReconnectTimeout time.Duration
	// FailedGrace: a member declared dead (failed, not left: a stopped
	// daemon does not leave) keeps its records in force this long after
	// its death, so a restart, a stalled host or a false detection that
	// comes back within it changes nothing for the consumers. A member
	// that left (Leave) loses its records at once. Default 10 s; negative:
	// no grace (records out of force at the death).
	FailedGrace time.Duration
	// TCPTimeout: dial and I/O timeout of streams (push/pull, records sent
	// reliably). Default 5 s.
	TCPTimeout time.Duration
	// RestartGrace: when a member comes back with a new incarnation while
	// its records are in force (a restart seen while it was alive, or
	// within FailedGrace after its death), or advertises a new VTEP, its
	// previous records stay in force until its first complete view (a
	// snapshot or a matching digest) arrives, at most this long after its
	// return. Default 5 s.
	RestartGrace time.Duration
	// DeliveryShards: number of delivery goroutines; a VNI always maps to
	// the same one. Default 4.
	DeliveryShards int
}

// Defaults.
const (
	DefaultTombstoneTTL            = time.Minute
	DefaultProbeInterval           = 300 * time.Millisecond
	DefaultProbeTimeout            = 150 * time.Millisecond
	DefaultSuspicionMult           = 3
	DefaultSuspicionMaxTimeoutMult = 4
	DefaultGossipInterval          = 100 * time.Millisecond
	DefaultGossipNodes             = 4
	DefaultPushPullInterval        = 5 * time.Second
	DefaultDigestInterval          = time.Second
	DefaultDigestMaxInterval       = 30 * time.Second
	DefaultReconnectInterval       = 5 * time.Second
	DefaultReconnectTimeout        = 24 * time.Hour
	DefaultTCPTimeout              = 5 * time.Second
	DefaultRestartGrace            = 5 * time.Second
	DefaultFailedGrace             = 10 * time.Second
	DefaultDeliveryShards          = 4

	// udpBufferSize is memberlist's packet size; a message up to
	// packetBudget is sent as one UDP packet, a larger one over TCP.
	udpBufferSize = 1400
	// largeChunk bounds a delta sent over TCP.
	largeChunk = 1 << 20

	// deadNodeReclaimTime: memberlist refuses an alive message that gives
	// a member another address unless that member has been dead (or left)
	// this long. Node names are unique per host, so the only node that
	// claims a dead member's name at another address is that host
	// restarted with a new underlay address: it is accepted as soon as
	// the old address is declared dead. The short wait lets gossip that
	// was already in flight about the old address settle first.
	deadNodeReclaimTime = 200 * time.Millisecond
)

func setDefault[T comparable](p *T, def T) {
	var zero T
	if *p == zero {
		*p = def
	}
}

// normalize validates c and fills in defaults.
func (c *Config) normalize() error {
	if err := checkName(c.NodeName); err != nil {
		return fmt.Errorf("cluster: NodeName: %w", err)
	}
	switch len(c.Key) {
	case 16, 24, 32:
	case 0:
		return errors.New("cluster: a cluster key is required (gossip is always encrypted)")
	default:
		return fmt.Errorf("cluster: the key has %d bytes; it must have 16, 24 or 32", len(c.Key))
	}
	if c.Watcher == nil {
		return errors.New("cluster: Watcher is required")
	}
	if !c.BindAddr.IsValid() {
		c.BindAddr = netip.IPv4Unspecified()
	}
	c.BindAddr, c.AdvertiseAddr = c.BindAddr.Unmap(), c.AdvertiseAddr.Unmap()
	setDefault(&c.BindPort, DefaultPort)
	if c.BindPort < 0 || c.BindPort > 65535 {
		return fmt.Errorf("cluster: bad gossip port %d", c.BindPort)
	}
	setDefault(&c.AdvertisePort, c.BindPort)
	if c.AdvertisePort < 0 || c.AdvertisePort > 65535 {
		return fmt.Errorf("cluster: bad advertise port %d", c.AdvertisePort)
	}
	if !c.AdvertiseAddr.IsValid() && !c.BindAddr.IsUnspecified() {
		c.AdvertiseAddr = c.BindAddr
	}
	if !c.VTEP.IsValid() {
		c.VTEP = c.AdvertiseAddr // may still be invalid: New learns it
	}
	if c.VTEP.IsValid() && !validVTEP(c.VTEP.Unmap()) {
		return fmt.Errorf("cluster: VTEP %v is not a unicast address", c.VTEP)
	}
	c.VTEP = c.VTEP.Unmap()
	setDefault(&c.Label, DefaultLabel)
	if len(c.Label) > 255 {
		return errors.New("cluster: label longer than 255 bytes")
	}
	setDefault(&c.TombstoneTTL, DefaultTombstoneTTL)
	base := LANProfile
	if c.Profile.Name == "wan" {
		base = WANProfile
	}
	setDefault(&c.Profile.Name, base.Name)
	setDefault(&c.Profile.ProbeInterval, base.ProbeInterval)
	setDefault(&c.Profile.ProbeTimeout, base.ProbeTimeout)
	setDefault(&c.Profile.SuspicionMult, base.SuspicionMult)
	setDefault(&c.Profile.SuspicionMaxTimeoutMult, base.SuspicionMaxTimeoutMult)
	setDefault(&c.Profile.GossipInterval, base.GossipInterval)
	setDefault(&c.Profile.PushPullInterval, base.PushPullInterval)
	setDefault(&c.Profile.TCPTimeout, base.TCPTimeout)
	if err := c.Profile.validate(); err != nil {
		return fmt.Errorf("cluster: gossip profile: %w", err)
	}
	setDefault(&c.ProbeInterval, c.Profile.ProbeInterval)
	setDefault(&c.ProbeTimeout, c.Profile.ProbeTimeout)
	setDefault(&c.SuspicionMult, c.Profile.SuspicionMult)
	setDefault(&c.SuspicionMaxTimeoutMult, c.Profile.SuspicionMaxTimeoutMult)
	setDefault(&c.GossipInterval, c.Profile.GossipInterval)
	setDefault(&c.GossipNodes, DefaultGossipNodes)
	setDefault(&c.PushPullInterval, c.Profile.PushPullInterval)
	setDefault(&c.DigestInterval, DefaultDigestInterval)
	setDefault(&c.DigestMaxInterval, DefaultDigestMaxInterval)
	c.DigestMaxInterval = max(c.DigestMaxInterval, c.DigestInterval)
	setDefault(&c.ReconnectInterval, DefaultReconnectInterval)
	setDefault(&c.ReconnectTimeout, DefaultReconnectTimeout)
	setDefault(&c.TCPTimeout, c.Profile.TCPTimeout)
	setDefault(&c.RestartGrace, DefaultRestartGrace)
	setDefault(&c.FailedGrace, DefaultFailedGrace)
	c.FailedGrace = max(c.FailedGrace, 0)
	setDefault(&c.DeliveryShards, DefaultDeliveryShards)
	if c.ProbeTimeout >= c.ProbeInterval {
		return fmt.Errorf("cluster: ProbeTimeout %v must be shorter than ProbeInterval %v", c.ProbeTimeout, c.ProbeInterval)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	c.Seeds = append([]string(nil), c.Seeds...)
	c.Key = append([]byte(nil), c.Key...)
	return nil
}

// DefaultConfig returns a Config with every timing default filled in (the
// zero Config means the same); callers set the identity, key and Watcher.
func DefaultConfig() Config {
	return Config{
		Profile:                 LANProfile,
		BindPort:                DefaultPort,
		Label:                   DefaultLabel,
		TombstoneTTL:            DefaultTombstoneTTL,
		ProbeInterval:           DefaultProbeInterval,
		ProbeTimeout:            DefaultProbeTimeout,
		SuspicionMult:           DefaultSuspicionMult,
		SuspicionMaxTimeoutMult: DefaultSuspicionMaxTimeoutMult,
		GossipInterval:          DefaultGossipInterval,
		GossipNodes:             DefaultGossipNodes,
		PushPullInterval:        DefaultPushPullInterval,
		DigestInterval:          DefaultDigestInterval,
		DigestMaxInterval:       DefaultDigestMaxInterval,
		ReconnectInterval:       DefaultReconnectInterval,
		ReconnectTimeout:        DefaultReconnectTimeout,
		TCPTimeout:              DefaultTCPTimeout,
		RestartGrace:            DefaultRestartGrace,
		FailedGrace:             DefaultFailedGrace,
		DeliveryShards:          DefaultDeliveryShards,
	}
}

// memberlistConfig builds memberlist's configuration.
func (c *Config) memberlistConfig(d *delegate, logw *mlLogWriter) *memberlist.Config {
	mc := c.Profile.baseMemberlistConfig()
	mc.Name = c.NodeName
	mc.BindAddr = c.BindAddr.String()
	mc.BindPort = c.BindPort
	mc.AdvertiseAddr = c.AdvertiseAddr.String()
	mc.AdvertisePort = c.AdvertisePort
	mc.Transport = c.Transport
	mc.Label = c.Label
	mc.SecretKey = c.Key
	mc.GossipVerifyIncoming = true
	mc.GossipVerifyOutgoing = true
	mc.EnableCompression = false // our records are compact; LZW costs CPU on every packet
	mc.ProbeInterval = c.ProbeInterval
	mc.ProbeTimeout = c.ProbeTimeout
	mc.SuspicionMult = c.SuspicionMult
	mc.SuspicionMaxTimeoutMult = c.SuspicionMaxTimeoutMult
	mc.GossipInterval = c.GossipInterval
	mc.GossipNodes = c.GossipNodes
	if c.Profile.Name != "wan" {
		mc.GossipToTheDeadTime = 30 * time.Second // the WAN config's is 60 s
	}
	mc.PushPullInterval = c.PushPullInterval
	mc.TCPTimeout = c.TCPTimeout
	mc.DeadNodeReclaimTime = deadNodeReclaimTime
	mc.HandoffQueueDepth = 4096
	mc.UDPBufferSize = udpBufferSize
	// memberlist requires every node's current version to lie within
	// every node's [min, max]: advertising 2 as current would make it
	// refuse protocol-1 nodes. The version actually used per member is
	// chosen from its metadata (ProtoMax), so the current one is the
	// oldest still spoken.
	mc.DelegateProtocolVersion = protocolVersionMin
	mc.DelegateProtocolMin = protocolVersionMin
	mc.DelegateProtocolMax = ProtocolVersion
	mc.Delegate = d
	mc.Events = d
	mc.Ping = d
	mc.Conflict = d
	mc.Logger = logw.logger()
	return mc
}

// packetBudget is the largest message sent as one UDP packet: memberlist's
// packet size minus the label header, encryption (version, nonce, tag),
// CRC and user-message byte, with some margin.
func (c *Config) packetBudget() int {
	return udpBufferSize - (2 + len(c.Label)) - 29 - 5 - 1 - 16
}
