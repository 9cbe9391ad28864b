package cluster

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	sockaddr "github.com/hashicorp/go-sockaddr"
	"github.com/hashicorp/memberlist"
	"github.com/overlayd/overlayd/internal/dnsname"
	"github.com/overlayd/overlayd/internal/lockorder"
	"github.com/overlayd/overlayd/internal/logkeys"
	"github.com/overlayd/overlayd/peerdb"
)

// Cluster is this node's membership in the overlayd control plane.
//
// Locks (levels of internal/lockorder; see doc.go): mu (LevelCluster)
// guards the replica (the remote records), the senders map and the shards' dirty sets;
// each sender's queue lock (LevelClusterSender) is taken under mu or
// alone; local.mu (LevelClusterLocal) guards our own records and metadata;
// dropMu, the rate limiter's and the joiner's locks are leaves
// (LevelLeaf). Memberlist calls its delegates with its own node lock held
// (outside the hierarchy, always taken first), so nothing here calls into
// memberlist while holding any of these locks.
type Cluster struct {
	cfg     Config // read-only after New; the current VTEP is local.vtep
	log     *slog.Logger
	rl      *rateLimiter
	ml      *memberlist.Memberlist
	inc     uint64
	started time.Time // process start of this incarnation
	budget  int       // packetBudget
	now     func() time.Time
	local   *localStore // our records and metadata; its own lock

	mu      *lockorder.Mutex // LevelCluster
	replica *replica         // guarded by mu
	dests   map[string]*dest // guarded by mu
	shards  []*shard         // fixed; each shard's dirty set guarded by mu

	dropMu  *lockorder.Mutex      // LevelLeaf
	dropped map[DropReason]uint64 // guarded by dropMu

	changeCalls  atomic.Uint64 // Watcher.PeersChanged calls
	changedKeys  atomic.Uint64 // keys passed to them
	msgsSent     atomic.Uint64
	bytesSent    atomic.Uint64
	msgsReceived atomic.Uint64
	sendErrors   atomic.Uint64
	// Application messages (app.go): sent, failed sends, accepted.
	appSent, appSendErrors, appReceived atomic.Uint64
	// joinedOnce: another member has been alive here (Joined).
	joinedOnce atomic.Bool

	joiner  *joiner
	pubWake chan struct{}
	// defsChanged: our definitions changed since the publisher last sent
	// them.
	defsChanged atomic.Bool
	changed     chan struct{} // publisher -> periodic loop: digest soon
	// localErrs: invalid local records, logged by the publisher.
	localErrs chan localErr
	ready     chan struct{} // closed once ml is set
	stop      chan struct{}
	wg        sync.WaitGroup
	closed    atomic.Bool
	leaving   atomic.Bool
	shutOnce  sync.Once
	shutErr   error
}

var lastIncarnation atomic.Uint64

// newIncarnation returns the wall clock in ns, strictly increasing within
// the process (tests restart nodes in one process).
func newIncarnation() uint64 {
	for {
		last := lastIncarnation.Load()
		v := uint64(time.Now().UnixNano())
		if v <= last {
			v = last + 1
		}
		if lastIncarnation.CompareAndSwap(last, v) {
			return v
		}
	}
}

// New creates the memberlist node, starts the background work (seed
// joining, publishing, digests, delivery) and returns at once: joining
// never blocks New.
func New(cfg Config) (*Cluster, error) {
	if err := cfg.normalize(); err != nil {
		return nil, err
	}
	if !cfg.AdvertiseAddr.IsValid() {
		ip, err := sockaddr.GetPrivateIP()
		if err != nil || ip == "" {
			return nil, fmt.Errorf("cluster: no AdvertiseAddr given and no private address found (%v)", err)
		}
		a, err := netip.ParseAddr(ip)
		if err != nil {
			return nil, fmt.Errorf("cluster: private address %q: %w", ip, err)
		}
		cfg.AdvertiseAddr = a.Unmap()
		if !cfg.VTEP.IsValid() {
			cfg.VTEP = cfg.AdvertiseAddr
		}
	}
	if !validVTEP(cfg.VTEP) {
		return nil, fmt.Errorf("cluster: VTEP %v is not a unicast address", cfg.VTEP)
	}
	c := &Cluster{
		cfg:       cfg,
		log:       cfg.Logger.With("component", "cluster"),
		rl:        newRateLimiter(10 * time.Second),
		inc:       newIncarnation(),
		started:   time.Now(),
		budget:    cfg.packetBudget(),
		now:       time.Now,
		mu:        lockorder.New(lockorder.LevelCluster),
		replica:   newReplica(cfg.NodeName),
		dests:     make(map[string]*dest),
		dropMu:    lockorder.New(lockorder.LevelLeaf),
		dropped:   make(map[DropReason]uint64),
		pubWake:   make(chan struct{}, 1),
		changed:   make(chan struct{}, 1),
		localErrs: make(chan localErr, 16),
		ready:     make(chan struct{}),
		stop:      make(chan struct{}),
	}
	c.local = newLocalStore(cfg.NodeName, c.inc, cfg.VTEP, c.now)
	c.local.advertiseInterest(cfg.Interest)
	// This node's records before anything is gossiped: a restarted node's
	// first snapshot must hold them, or the others' restart grace ends on
	// a snapshot without them and those peers flap.
	if errs, _ := c.local.sync(0, cfg.Local); len(errs) > 0 {
		for _, e := range errs {
			c.countDrop(DropLocalInvalid)
			c.log.Warn("refusing an initial local record", "vni", e.vni, "reason", e.reason, "record", e.rec)
		}
	}
	if errs, _ := c.local.syncDefs(0, cfg.LocalDefinitions); len(errs) > 0 {
		for vni, err := range errs {
			c.countDrop(DropLocalInvalid)
			c.log.Warn("refusing an initial network definition", "vni", vni, "error", err)
		}
	}
	c.replica.grace = cfg.RestartGrace
	c.replica.failedGrace = cfg.FailedGrace
	c.replica.dirty = c.markDirtyLocked
	c.replica.dirtyVNI = c.markVNILocked
	c.replica.requestSync = func(name string) { c.destFlagLocked(name, func(d *dest) { d.syncReq = true }) }
	c.replica.sendSnapshot = func(name string) { c.destFlagLocked(name, func(d *dest) { d.snapshot, d.defs = true, true }) }
	c.replica.interest = cfg.Interest
	c.replica.interestGained = func(name string, vnis []uint32) {
		if c.local.hasLive(vnis) {
			c.destFlagLocked(name, func(d *dest) { d.snapshot = true })
		} else if d := c.dests[name]; d != nil {
			// Nothing to send, but it may hold records of these VNIs it
			// kept from before it lost them, which we deleted since: our
			// next digest must reach it (not be skipped as a repeat).
			d.mu.Lock()
			d.sentRecords = true
			d.mu.Unlock()
		}
		select { // digests soon: they repair a lost snapshot, or the above
		case c.changed <- struct{}{}:
		default:
		}
	}
	for range cfg.DeliveryShards {
		c.shards = append(c.shards, &shard{dirty: make(map[uint32]map[pkey]struct{}), wake: make(chan struct{}, 1)})
	}
	c.joiner = newJoiner(c, cfg.Seeds) // before memberlist: its callbacks use it
	logw := &mlLogWriter{log: cfg.Logger, rl: c.rl, dropped: c.countDrop, suspected: c.suspected, down: c.memberDown, closing: c.closed.Load}
	ml, err := memberlist.Create(cfg.memberlistConfig(&delegate{c}, logw))
	if err != nil {
		c.closed.Store(true)
		c.mu.Lock()
		for _, d := range c.dests {
			close(d.stop)
		}
		c.mu.Unlock()
		c.wg.Wait()
		return nil, fmt.Errorf("cluster: %w", err)
	}
	c.ml = ml
	close(c.ready)
	c.start(c.publishLoop)
	c.start(c.periodicLoop)
	for _, sh := range c.shards {
		c.start(func() { c.deliveryLoop(sh) })
	}
	c.start(c.joiner.run)
	c.log.Info("gossip started", "node", cfg.NodeName, "bind", netip.AddrPortFrom(cfg.BindAddr, uint16(cfg.BindPort)),
		"advertise", netip.AddrPortFrom(cfg.AdvertiseAddr, uint16(cfg.AdvertisePort)), "vtep", cfg.VTEP,
		"key", Fingerprint(cfg.Key), "seeds", cfg.Seeds, "gossip_profile", cfg.Profile.String())
	return c, nil
}

func (c *Cluster) start(f func()) {
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		f()
	}()
}

// LocalMark returns a mark to take before listing the local endpoints for
// SyncLocal: changes published after it win over the list.
func (c *Cluster) LocalMark() uint64 { return c.local.mark() }

// SyncLocal makes this node's records exactly recs, a list of every local
// endpoint taken after mark (LocalMark): each is published (unchanged ones
// cost nothing and are not re-sent) and records of endpoints the list
// lacks are withdrawn, except keys published after mark, which stay as
// they are (a Join or Leave racing with the listing wins). The daemon runs
// it periodically: level-triggered repair of local records. Like
// PublishLocalPeer it never blocks.
func (c *Cluster) SyncLocal(mark uint64, recs []LocalRecord) {
	errs, changed := c.local.sync(mark, recs)
	for _, e := range errs {
		c.countDrop(DropLocalInvalid)
		select {
		case c.localErrs <- e:
		default:
		}
		changed = true
	}
	if changed {
		c.wakePublisher()
	}
}

// PublishLocalPeer publishes a change of one of this node's endpoints:
// create (nil, next), update (prev, next) or delete (prev, nil). Records
// are keyed by (VNI, EndpointID); next.VTEP must be this node's VTEP, or
// zero: then it gets this node's current VTEP (what the driver does, so a
// publication racing with SetVTEP is never refused). It
// never blocks (a short leaf lock, then a wake-up of the publisher) and
// never calls back into the caller, so it may be called under the
// caller's network lock. An invalid next is refused, counted and logged,
// and its key withdrawn.
func (c *Cluster) PublishLocalPeer(vni uint32, prev, next *peerdb.Peer) {
	reason, changed := c.local.publish(vni, prev, next)
	if reason != "" {
		c.countDrop(DropLocalInvalid)
		// Logged by the publisher: no I/O under the caller's locks.
		select {
		case c.localErrs <- localErr{vni: vni, reason: reason, rec: fmtPeer(next)}:
		default:
		}
		changed = true // wake the publisher
	}
	if changed {
		c.wakePublisher()
	}
}

// PublishLocalNames makes packed (dnsname.Pack's form; "" for none) the
// DNS names of this node's endpoint (vni, endpointID): its record goes out
// anew with them (if it is live; names given before the record are kept
// for it), and they go with it when it is deleted. Like PublishLocalPeer
// it never blocks and never calls back, so it may be called under the
// caller's network lock. Names that are not in Pack's form are refused
// with an error and nothing changes.
func (c *Cluster) PublishLocalNames(vni uint32, endpointID string, packed string) error {
	if vni == 0 || vni > MaxVNI {
		return fmt.Errorf("cluster: names of endpoint %q: VNI %d out of 1..%d", endpointID, vni, MaxVNI)
	}
	if !validEndpointID(endpointID) {
		return fmt.Errorf("cluster: names of endpoint %q: endpoint id must be 1..255 bytes of printable UTF-8", endpointID)
	}
	if err := dnsname.ValidPacked(packed); err != nil {
		return fmt.Errorf("cluster: names of endpoint %q of VNI %d: %w", endpointID, vni, err)
	}
	if c.local.setWantNames(recKey{VNI: vni, EndpointID: endpointID}, packed) {
		c.wakePublisher()
	}
	return nil
}

// NamedEndpoint is a remote endpoint in force with DNS names.
type NamedEndpoint struct {
	Origin     string // the member whose endpoint it is
	EndpointID string
	IP, IPv6   netip.Addr // the zero Addr for none
	Names      []string   // canonical (dnsname), sorted
}

// Names returns every record in force for vni that carries names (same
// rules as Peers: never one of this node's own), sorted by origin and
// endpoint. Safe for concurrent use; it takes Cluster.mu for as long as
// the VNI's records take to visit.
func (c *Cluster) Names(vni uint32) []NamedEndpoint {
	c.mu.Lock()
	keys := c.replica.byVNI[vni]
	out := make([]NamedEndpoint, 0, len(keys))
	for k := range keys {
		if r, ok := c.replica.effectiveRecord(vni, k); ok && r.Names != "" {
			out = append(out, NamedEndpoint{Origin: k.Origin, EndpointID: k.EndpointID, IP: r.IP, IPv6: r.IPv6,
				Names: dnsname.Unpack(r.Names)})
		}
	}
	c.mu.Unlock()
	slices.SortFunc(out, func(a, b NamedEndpoint) int {
		return cmp.Or(cmp.Compare(a.Origin, b.Origin), cmp.Compare(a.EndpointID, b.EndpointID))
	})
	return out
}

type localErr struct {
	vni    uint32
	reason DropReason
	rec    string
}

func fmtPeer(p *peerdb.Peer) string {
	if p == nil {
		return "<nil>"
	}
	return p.String()
}

// AddSeeds adds addresses ("host[:port]") to join, e.g. the hosts swarm
// announces through DiscoverNew; they are joined in the background and
// retried with backoff until joined.
func (c *Cluster) AddSeeds(addrs ...string) {
	c.joiner.add(addrs...)
}

// Leave announces this node's departure for good (decommissioning a
// host): every member stops holding its records in force at once, instead
// of keeping them for FailedGrace after detecting a failure. Nothing in
// this package leaves implicitly: a stopping daemon calls Shutdown only.
// Call Shutdown afterwards. timeout bounds the announcement and
// memberlist's leave broadcast, each.
func (c *Cluster) Leave(timeout time.Duration) error {
	if c.closed.Load() {
		return fmt.Errorf("cluster: node %s cannot leave: shut down", c.cfg.NodeName)
	}
	if c.leaving.Swap(true) {
		return nil
	}
	// Tell every member it is a leave (memberlist's event does not say),
	// reliably, before memberlist's own leave broadcast; a member that
	// hears of the death first still honours a leave that follows.
	b, err := encodeMessage(&message{Type: msgLeave, Origin: c.cfg.NodeName, Incarnation: c.inc})
	if err == nil {
		var wg sync.WaitGroup
		for _, n := range c.aliveNodes() {
			wg.Add(1)
			c.start(func() {
				defer wg.Done()
				if c.ml.SendReliable(n, b) != nil {
					_ = c.ml.SendBestEffort(n, b)
				}
			})
		}
		sent := make(chan struct{})
		go func() { wg.Wait(); close(sent) }()
		t := time.NewTimer(timeout)
		select {
		case <-sent:
		case <-t.C:
		}
		t.Stop()
	}
	if err := c.ml.Leave(timeout); err != nil {
		return fmt.Errorf("cluster: node %s leaving: %w", c.cfg.NodeName, err)
	}
	return nil
}

// Shutdown stops gossiping without leaving: the others detect a failure
// and keep this node's records in force for their FailedGrace, so a
// restart within it changes nothing for them. It stops the background
// work, waiting for a Watcher call in progress (so it must not be called
// while holding a lock the Watcher waits for).
func (c *Cluster) Shutdown() error {
	c.shutOnce.Do(func() {
		c.closed.Store(true)
		c.shutErr = c.ml.Shutdown()
		close(c.stop)
		c.mu.Lock()
		for name, d := range c.dests {
			close(d.stop)
			delete(c.dests, name)
		}
		c.mu.Unlock()
		c.wg.Wait()
	})
	return c.shutErr
}

func (c *Cluster) aliveNodes() []*memberlist.Node {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []*memberlist.Node
	for _, d := range c.dests {
		n := d.node
		out = append(out, &n)
	}
	return out
}

// countDrop counts a refused message or record.
func (c *Cluster) countDrop(r DropReason) {
	c.dropMu.Lock()
	c.dropped[r]++
	c.dropMu.Unlock()
}

// drop counts and logs (rate-limited) a refused message.
func (c *Cluster) drop(r DropReason, detail string) {
	c.countDrop(r)
	level := slog.LevelWarn
	switch r {
	case DropUnknownOrig, DropIncarnation:
		level = slog.LevelDebug // expected around joins and restarts
	}
	c.logLimited(level, "drop:"+string(r), "dropped a gossip message", "reason", r, "detail", detail)
}

func (c *Cluster) logLimited(level slog.Level, key, msg string, args ...any) {
	if !c.log.Enabled(context.Background(), level) {
		return
	}
	ok, n := c.rl.allow(key, c.now())
	if !ok {
		return
	}
	if n > 0 {
		args = append(args, "suppressed", n)
	}
	c.log.Log(context.Background(), level, msg, args...)
}

// handleMessage decodes, validates and applies a message from the network
// (memberlist user message or push/pull state). It never waits for the
// Watcher.
func (c *Cluster) handleMessage(b []byte) { c.receive(b, false) }

// receive is handleMessage; pushPull: b is memberlist's push/pull state
// (the origin's complete snapshot, whoever receives it).
func (c *Cluster) receive(b []byte, pushPull bool) {
	if c.closed.Load() || len(b) == 0 {
		return
	}
	c.msgsReceived.Add(1)
	m, derr := decodeMessage(b)
	if derr != nil {
		c.drop(derr.Reason, derr.Detail)
		return
	}
	c.mu.Lock()
	if pushPull {
		c.filterOwnInterestLocked(m)
	}
	// A leave of a member memberlist already declared dead: the only way
	// it becomes "left" (memberGone logs the other).
	mem := c.replica.members[m.Origin]
	leftDead := m.Type == msgLeave && mem != nil && mem.state == StateDead
	reason, detail := c.replica.apply(m, c.now())
	c.mu.Unlock()
	if reason != "" {
		c.drop(reason, detail)
	} else if m.Type == msgApp {
		c.deliverApp(m)
	} else if leftDead {
		c.log.Info("member left; its records are withdrawn", logkeys.Event, logkeys.MemberLeft, logkeys.Member, m.Origin)
	}
}

// SetAppState advertises app (at most MaxAppState bytes, opaque to the
// cluster: overlayd puts its encryption key adverts there) in this node's
// metadata and gossips the update. Every node's Config.OnMembersChange is
// then called; AppStates and MemberApps read the states. It blocks until
// the update is gossiped (at most TCPTimeout): never call it holding a
// lock.
func (c *Cluster) SetAppState(app []byte) error {
	if len(app) > MaxAppState {
		return fmt.Errorf("cluster: application state of %d bytes is larger than %d", len(app), MaxAppState)
	}
	if c.closed.Load() {
		return fmt.Errorf("cluster: node %s cannot set its application state: shut down", c.cfg.NodeName)
	}
	c.local.setApp(append([]byte{}, app...))
	if err := c.updateNode(); err != nil {
		return fmt.Errorf("cluster: gossiping the application state of node %s: %w", c.cfg.NodeName, err)
	}
	return nil
}

// updateNode gossips this node's new metadata and waits until it is sent
// (at most TCPTimeout), or until Shutdown: a stopping daemon must not wait
// the whole timeout for a broadcast that will never go out.
func (c *Cluster) updateNode() error {
	done := make(chan error, 1)
	go func() { done <- c.ml.UpdateNode(c.cfg.TCPTimeout) }()
	select {
	case err := <-done:
		return err
	case <-c.stop:
		return fmt.Errorf("node %s shut down before its metadata was gossiped", c.cfg.NodeName)
	}
}

// SetVTEP changes this node's VTEP: its metadata is updated and gossiped,
// and every local record is re-published with the new VTEP (new
// versions), so every member converges on it (a member refuses records
// whose VTEP is not the one their origin advertises; until the records of
// the new VTEP arrive, it keeps those of the former one in force, at most
// RestartGrace). From then on PublishLocalPeer refuses records of any
// other VTEP. It blocks until the update is gossiped (at most TCPTimeout):
// never call it holding a lock.
func (c *Cluster) SetVTEP(v netip.Addr) error {
	v = v.Unmap()
	if !validVTEP(v) {
		return fmt.Errorf("cluster: new VTEP %v of node %s is not a unicast address", v, c.cfg.NodeName)
	}
	if c.closed.Load() {
		return fmt.Errorf("cluster: node %s cannot change its VTEP to %v: shut down", c.cfg.NodeName, v)
	}
	old, n := c.local.setVTEP(v)
	if old == v {
		return nil
	}
	c.log.Info("VTEP changed; records re-published", logkeys.Event, logkeys.VTEPChanged, logkeys.VTEP, v, logkeys.From, old, logkeys.Count, n)
	err := c.updateNode()
	c.wakePublisher() // the deltas follow the metadata
	if err != nil {
		return fmt.Errorf("cluster: gossiping VTEP %v of node %s: %w", v, c.cfg.NodeName, err)
	}
	return nil
}

func (c *Cluster) wakePublisher() {
	select {
	case c.pubWake <- struct{}{}:
	default:
	}
}

// VTEP returns this node's current VTEP.
func (c *Cluster) VTEP() netip.Addr { return c.local.currentVTEP() }

// AppStates returns the application state of every alive member (this node
// included) whose metadata is valid, by node name.
func (c *Cluster) AppStates() map[string][]byte {
	self := c.local.meta().App
	c.mu.Lock()
	defer c.mu.Unlock()
	out := map[string][]byte{}
	for name, m := range c.replica.members {
		if m.state == StateAlive && m.metaErr == nil && name != c.cfg.NodeName {
			out[name] = append([]byte(nil), m.meta.App...)
		}
	}
	out[c.cfg.NodeName] = append([]byte(nil), self...)
	return out
}

// MemberApp is what an alive member advertises: its name, VTEP and
// application state (SetAppState).
type MemberApp struct {
	Name string
	VTEP netip.Addr
	App  []byte
}

// MemberApps returns, for every alive member other than this node whose
// metadata is valid, its name, VTEP and application state, sorted by name.
func (c *Cluster) MemberApps() []MemberApp {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out []MemberApp
	for name, m := range c.replica.members {
		if name != c.cfg.NodeName && m.state == StateAlive && m.metaErr == nil {
			out = append(out, MemberApp{Name: name, VTEP: m.meta.VTEP, App: append([]byte(nil), m.meta.App...)})
		}
	}
	slices.SortFunc(out, func(a, b MemberApp) int { return strings.Compare(a.Name, b.Name) })
	return out
}

// membersChanged calls OnMembersChange; no cluster lock may be held.
func (c *Cluster) membersChanged() {
	if f := c.cfg.OnMembersChange; f != nil {
		f()
	}
}

// memberAlive handles memberlist's join and update events (called with
// memberlist's node lock held: no calls into memberlist here).
func (c *Cluster) memberAlive(n *memberlist.Node) {
	if n.Name != c.cfg.NodeName {
		c.joinedOnce.Store(true)
	}
	c.mu.Lock()
	var fresh *dest
	if n.Name != c.cfg.NodeName && !c.closed.Load() {
		if d := c.dests[n.Name]; d != nil {
			d.setNode(n)
		} else {
			fresh = newDest(n)
			c.dests[n.Name] = fresh
		}
	}
	c.replica.memberAlive(n, c.now()) // may queue a sync request to it
	if d := c.dests[n.Name]; d != nil {
		m := c.replica.members[n.Name]
		d.mu.Lock()
		d.defsOK = m != nil && m.metaErr == nil && m.meta.ProtoMax >= protoDefs
		d.proto = protocolVersionMin
		if m != nil && m.metaErr == nil {
			d.proto = m.meta.ProtoMax
		}
		d.defs6 = d.defsOK && m.meta.ProtoMax >= protoDefs6
		d.defs = d.defs || fresh != nil
		d.mu.Unlock()
	}
	// Before the new member's first message (its digest below): a member
	// of an older protocol must never be sent a record with IPv6.
	wake := c.gateIPv6Locked()
	if fresh != nil {
		// Then our digest: a member back from dead (same incarnation)
		// missed our changes meanwhile and asks for a snapshot if so.
		if b, err := encodeMessage(c.local.digestFor(c.replica.interestOf(n.Name))); err == nil {
			fresh.mu.Lock()
			fresh.digest = b
			fresh.mu.Unlock()
			fresh.signal()
		}
		c.start(func() { c.sendLoop(fresh) })
	}
	c.mu.Unlock()
	if wake {
		c.wakePublisher()
	}
	c.membersChanged()
}

// gateIPv6Locked lets the local records go out with their IPv6 addresses
// exactly while every alive member speaks ProtocolIPv6 (see wire.go,
// "IPv6"), logging each change with the members in the way. It reports
// whether records were re-published (the publisher must run).
func (c *Cluster) gateIPv6Locked() bool {
	old := c.replica.olderThanIPv6()
	changed, n := c.local.setIPv6(len(old) == 0)
	switch {
	case !changed:
	case len(old) > 0:
		c.log.Warn("a member speaks a protocol without IPv6 records: this node's records go out without their IPv6 addresses (IPv6-only ones withdrawn) until every member speaks it",
			logkeys.Event, logkeys.IPv6Withheld, "members", old, "records", n, "protocol_needed", ProtocolIPv6)
	default:
		c.log.Info("every member speaks IPv6 records: this node's records go out with their IPv6 addresses again",
			logkeys.Event, logkeys.IPv6Published, "records", n)
	}
	namesOld := c.replica.olderThan(ProtocolNames)
	nChanged, nn := c.local.setNames(len(namesOld) == 0)
	switch {
	case !nChanged:
	case len(namesOld) > 0:
		c.log.Warn("a member speaks a protocol without names: this node's records go out without their DNS names until every member speaks it",
			logkeys.Event, logkeys.NamesWithheld, "members", namesOld, "records", nn, "protocol_needed", ProtocolNames)
	default:
		c.log.Info("every member speaks names: this node's records go out with their DNS names again",
			logkeys.Event, logkeys.NamesPublished, "records", nn)
	}
	return changed && n > 0 || nChanged && nn > 0
}

// memberGone handles memberlist's leave event (a node dead or left).
func (c *Cluster) memberGone(n *memberlist.Node) {
	c.mu.Lock()
	state := c.replica.memberGone(n, c.now())
	var until time.Time
	if m := c.replica.members[n.Name]; m != nil && m.failedGrace {
		until = m.failedUntil
	}
	if d := c.dests[n.Name]; d != nil {
		close(d.stop)
		delete(c.dests, n.Name)
	}
	wake := c.gateIPv6Locked()
	c.mu.Unlock()
	if wake {
		c.wakePublisher()
	}
	if n.Name != c.cfg.NodeName {
		switch {
		case state == StateLeft:
			c.log.Info("member left; its records are withdrawn", logkeys.Event, logkeys.MemberLeft, logkeys.Member, n.Name)
		case until.IsZero():
			// No grace (FailedGrace 0, or it had no records in force).
			c.log.Info("member failed; its records are no longer in force",
				logkeys.Event, logkeys.MemberFailed, logkeys.Member, n.Name, logkeys.Grace, time.Duration(0))
		default:
			c.log.Info("member failed; its records stay in force until its return or the grace's end",
				logkeys.Event, logkeys.MemberFailed, logkeys.Member, n.Name, logkeys.Grace, c.cfg.FailedGrace)
		}
		c.joiner.wakeUp() // it may have announced itself at another address
	}
	c.membersChanged()
}

// memberInfo returns what this node knows of member name: its state, the
// time of its last state change and its address ("ip:port").
func (c *Cluster) memberInfo(name string) (MemberState, time.Time, string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	m := c.replica.members[name]
	if m == nil {
		return "", time.Time{}, ""
	}
	return m.state, m.since, net.JoinHostPort(net.IP(m.node.Addr).String(), strconv.Itoa(int(m.node.Port)))
}

// suspected records that this node's probe of name failed.
func (c *Cluster) suspected(name string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if m := c.replica.members[name]; m != nil && m.state == StateAlive {
		m.suspectSince = c.now()
	}
}

// memberDown reports whether name is not an alive, unsuspected member
// here (for the log levels of memberlist's lines about it).
func (c *Cluster) memberDown(name string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	m := c.replica.members[name]
	return m == nil || m.state != StateAlive || !m.suspectSince.IsZero()
}

// destFlagLocked sets a flag on the sender to name and wakes it.
func (c *Cluster) destFlagLocked(name string, f func(*dest)) {
	if d := c.dests[name]; d != nil {
		d.mu.Lock()
		f(d)
		d.mu.Unlock()
		d.signal()
	}
}

// delegate implements memberlist's Delegate, EventDelegate, PingDelegate
// and ConflictDelegate.
type delegate struct{ c *Cluster }

func (d *delegate) NodeMeta(limit int) []byte { return *d.c.local.metaBytes.Load() }

func (d *delegate) NotifyMsg(b []byte) { d.c.handleMessage(b) }

func (d *delegate) GetBroadcasts(overhead, limit int) [][]byte { return nil }

// LocalState is this node's snapshot, sent on joins and push/pulls.
func (d *delegate) LocalState(join bool) []byte {
	b, err := encodeMessage(d.c.local.snapshot())
	if err != nil {
		d.c.logLimited(slog.LevelError, "snapshot", "cannot encode the local snapshot", "error", err)
		return nil
	}
	return b
}

func (d *delegate) MergeRemoteState(b []byte, join bool) { d.c.receive(b, true) }

func (d *delegate) NotifyJoin(n *memberlist.Node) {
	if n.Name != d.c.cfg.NodeName {
		d.c.log.Info("member joined", logkeys.Event, logkeys.MemberJoined, logkeys.Member, n.Name,
			logkeys.Addr, net.JoinHostPort(n.Addr.String(), fmt.Sprint(n.Port)))
	}
	d.c.memberAlive(n)
}

func (d *delegate) NotifyUpdate(n *memberlist.Node) { d.c.memberAlive(n) }

func (d *delegate) NotifyLeave(n *memberlist.Node) { d.c.memberGone(n) }

// AckPayload implements memberlist.PingDelegate.
func (d *delegate) AckPayload() []byte { return nil }

// NotifyPingComplete implements memberlist.PingDelegate: a direct probe of
// other succeeded (called from memberlist's probe goroutine, no lock held).
func (d *delegate) NotifyPingComplete(other *memberlist.Node, rtt time.Duration, _ []byte) {
	c := d.c
	c.mu.Lock()
	defer c.mu.Unlock()
	if m := c.replica.members[other.Name]; m != nil {
		m.suspectSince = time.Time{}
		m.rtt = rtt
	}
}

// NotifyConflict implements memberlist.ConflictDelegate: memberlist refused
// an alive message that gives member existing another address, because
// the member is still alive (or suspect, or dead for less than
// deadNodeReclaimTime) at its known address. Names are unique per host, so
// this is the member restarted at a new address: once its old address is
// declared dead the joiner joins it at the new one, so it is accepted at
// once rather than when its own gossip happens to reach us. Called with
// memberlist's node lock held: no calls into memberlist here.
func (d *delegate) NotifyConflict(existing, other *memberlist.Node) {
	c := d.c
	if existing.Name == c.cfg.NodeName {
		return // our own name at a former address: stale news of our previous process
	}
	addr := net.JoinHostPort(net.IP(other.Addr).String(), strconv.Itoa(int(other.Port)))
	if c.joiner.claim(existing.Name, addr, c.now()) {
		c.logLimited(slog.LevelInfo, "claim:"+existing.Name, "member announced itself at another address; accepted there once its old address is declared dead",
			logkeys.Member, existing.Name, "old", net.JoinHostPort(net.IP(existing.Addr).String(), strconv.Itoa(int(existing.Port))), "new", addr)
	}
}
