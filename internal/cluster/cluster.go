package cluster

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	sockaddr "github.com/hashicorp/go-sockaddr"
	"github.com/hashicorp/memberlist"
	"github.com/overlayd/overlayd/peerdb"
)

// Cluster is this node's membership in the overlayd control plane.
//
// Locks (see doc.go): mu guards the replicated store, the senders and the
// delivery state; local.mu guards our own records; each sender has its own
// queue lock taken under mu or alone. Memberlist calls the event delegate
// with its node lock held, so nothing here calls into memberlist while
// holding mu (memberlist's lock is always taken first).
type Cluster struct {
	cfg    Config
	log    *slog.Logger
	rl     *rateLimiter
	ml     *memberlist.Memberlist
	inc    uint64
	meta   atomic.Pointer[[]byte] // our node metadata; replaced by SetAppState
	budget int                    // packetBudget
	now    func() time.Time
	local  *localStore

	mu        sync.Mutex
	store     *store
	dests     map[string]*dest
	delivered map[uint32]map[pkey]peerdb.Peer
	shards    []*shard

	dropMu  sync.Mutex
	dropped map[DropReason]uint64

	sinkErrors   atomic.Uint64
	eventsOut    atomic.Uint64
	msgsSent     atomic.Uint64
	bytesSent    atomic.Uint64
	msgsReceived atomic.Uint64
	sendErrors   atomic.Uint64

	joiner  *joiner
	pubWake chan struct{}
	changed chan struct{} // publisher -> periodic loop: digest soon
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
		budget:    cfg.packetBudget(),
		now:       time.Now,
		store:     newStore(cfg.NodeName),
		dests:     make(map[string]*dest),
		delivered: make(map[uint32]map[pkey]peerdb.Peer),
		dropped:   make(map[DropReason]uint64),
		pubWake:   make(chan struct{}, 1),
		changed:   make(chan struct{}, 1),
		localErrs: make(chan localErr, 16),
		ready:     make(chan struct{}),
		stop:      make(chan struct{}),
	}
	meta := encodeMeta(c.metaOf(nil))
	c.meta.Store(&meta)
	c.local = newLocalStore(cfg.NodeName, c.inc, cfg.VTEP, c.now)
	c.store.grace = cfg.RestartGrace
	c.store.dirty = c.markDirtyLocked
	c.store.requestSync = func(name string) { c.destFlagLocked(name, func(d *dest) { d.syncReq = true }) }
	c.store.sendSnapshot = func(name string) { c.destFlagLocked(name, func(d *dest) { d.snapshot = true }) }
	for range cfg.DeliveryShards {
		c.shards = append(c.shards, &shard{dirty: make(map[uint32]map[pkey]struct{}), wake: make(chan struct{}, 1)})
	}
	logw := &mlLogWriter{log: cfg.Logger, rl: c.rl, dropped: c.countDrop, suspected: c.suspected}
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
	c.joiner = newJoiner(c, cfg.Seeds)
	c.start(c.publishLoop)
	c.start(c.periodicLoop)
	for _, sh := range c.shards {
		c.start(func() { c.deliveryLoop(sh) })
	}
	c.start(c.joiner.run)
	c.log.Info("gossip started", "node", cfg.NodeName, "bind", netip.AddrPortFrom(cfg.BindAddr, uint16(cfg.BindPort)),
		"advertise", netip.AddrPortFrom(cfg.AdvertiseAddr, uint16(cfg.AdvertisePort)), "vtep", cfg.VTEP,
		"key", Fingerprint(cfg.Key), "seeds", cfg.Seeds)
	return c, nil
}

func (c *Cluster) start(f func()) {
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		f()
	}()
}

// PublishLocalPeer publishes a change of one of this node's endpoints:
// create (nil, next), update (prev, next) or delete (prev, nil). Records
// are keyed by (VNI, EndpointID); next.VTEP must be this node's VTEP. It
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
		select {
		case c.pubWake <- struct{}{}:
		default:
		}
	}
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

// Leave announces this node's departure: every member removes its records
// at once instead of after failure detection. Call Shutdown afterwards.
func (c *Cluster) Leave(timeout time.Duration) error {
	if c.closed.Load() {
		return errors.New("cluster: shut down")
	}
	if c.leaving.Swap(true) {
		return nil
	}
	// Tell the members it is a leave (memberlist's event does not say).
	b, err := encodeMessage(&message{Type: msgLeave, Origin: c.cfg.NodeName, Incarnation: c.inc})
	if err == nil {
		for _, n := range c.aliveNodes() {
			_ = c.ml.SendBestEffort(n, b)
		}
	}
	return c.ml.Leave(timeout)
}

// Shutdown stops gossiping without leaving (the others detect the failure)
// and stops the background work, waiting for a Sink call in progress.
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
// (memberlist user message or push/pull state). It never blocks on the Sink.
func (c *Cluster) handleMessage(b []byte) {
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
	reason, detail := c.store.apply(m, c.now())
	c.mu.Unlock()
	if reason != "" {
		c.drop(reason, detail)
	}
}

func (c *Cluster) metaOf(app []byte) nodeMeta {
	return nodeMeta{ProtoMin: protocolVersionMin, ProtoMax: ProtocolVersion, Incarnation: c.inc, VTEP: c.cfg.VTEP, App: app}
}

// SetAppState advertises app (at most MaxAppState bytes, opaque to the
// cluster: overlayd puts its encryption key epochs there) in this node's
// metadata and gossips the update. Every node's Config.OnMembersChange is
// then called; AppStates reads the states.
func (c *Cluster) SetAppState(app []byte) error {
	if len(app) > MaxAppState {
		return fmt.Errorf("application state of %d bytes is larger than %d", len(app), MaxAppState)
	}
	meta := encodeMeta(c.metaOf(append([]byte{}, app...)))
	c.meta.Store(&meta)
	<-c.ready
	if c.closed.Load() {
		return errors.New("cluster is shut down")
	}
	return c.ml.UpdateNode(c.cfg.TCPTimeout)
}

// AppStates returns the application state of every alive member (this node
// included) whose metadata is valid, by node name.
func (c *Cluster) AppStates() map[string][]byte {
	c.mu.Lock()
	defer c.mu.Unlock()
	out := map[string][]byte{}
	for name, m := range c.store.members {
		if m.state == StateAlive && m.metaErr == nil {
			out[name] = append([]byte(nil), m.meta.App...)
		}
	}
	if _, ok := out[c.cfg.NodeName]; !ok {
		if self, err := decodeMeta(*c.meta.Load()); err == nil {
			out[c.cfg.NodeName] = self.App
		}
	}
	return out
}

func (c *Cluster) membersChanged() {
	if f := c.cfg.OnMembersChange; f != nil {
		f()
	}
}

// memberAlive handles memberlist's join and update events (called with
// memberlist's node lock held: no calls into memberlist here).
func (c *Cluster) memberAlive(n *memberlist.Node) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if n.Name != c.cfg.NodeName && !c.closed.Load() {
		d := c.dests[n.Name]
		if d == nil {
			d = newDest(n)
			c.dests[n.Name] = d
			c.start(func() { c.sendLoop(d) })
		} else {
			d.setNode(n)
		}
	}
	c.store.memberAlive(n, c.now())
	c.membersChanged()
}

// memberGone handles memberlist's leave event (a node dead or left).
func (c *Cluster) memberGone(n *memberlist.Node) {
	c.mu.Lock()
	defer c.mu.Unlock()
	state := c.store.memberGone(n, c.now())
	if d := c.dests[n.Name]; d != nil {
		close(d.stop)
		delete(c.dests, n.Name)
	}
	if n.Name != c.cfg.NodeName {
		c.log.Info("member gone", "node", n.Name, "state", state)
	}
	c.membersChanged()
}

// suspected records that this node's probe of name failed.
func (c *Cluster) suspected(name string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if m := c.store.members[name]; m != nil && m.state == StateAlive {
		m.suspectSince = c.now()
	}
}

// destFlagLocked sets a flag on the sender to name and wakes it. Expects
// c.mu held.
func (c *Cluster) destFlagLocked(name string, f func(*dest)) {
	if d := c.dests[name]; d != nil {
		d.mu.Lock()
		f(d)
		d.mu.Unlock()
		d.signal()
	}
}

// delegate implements memberlist's Delegate and EventDelegate.
type delegate struct{ c *Cluster }

func (d *delegate) NodeMeta(limit int) []byte { return *d.c.meta.Load() }

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

func (d *delegate) MergeRemoteState(b []byte, join bool) { d.c.handleMessage(b) }

func (d *delegate) NotifyJoin(n *memberlist.Node) {
	if n.Name != d.c.cfg.NodeName {
		d.c.log.Info("member joined", "node", n.Name, "addr", net.JoinHostPort(n.Addr.String(), fmt.Sprint(n.Port)))
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
	if m := c.store.members[other.Name]; m != nil {
		m.suspectSince = time.Time{}
		m.rtt = rtt
	}
}
