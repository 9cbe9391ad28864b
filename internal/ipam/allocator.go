package ipam

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/overlayd/overlayd/internal/lockorder"
	"github.com/overlayd/overlayd/internal/logkeys"
)

// Config configures an Allocator.
type Config struct {
	// NodeName is this host's name in the cluster (the memberlist name).
	NodeName string
	// Store keeps the allocator's state (the state file's ipam table).
	Store Store
	// Logger receives the allocator's log lines; nil: slog.Default().
	Logger *slog.Logger
	// Now is the clock; nil: time.Now.
	Now func() time.Time
}

// timing holds the allocator's timeouts; tests shorten them.
type timing struct {
	request time.Duration // a request's budget when its context has no deadline
	donate  time.Duration // how long to wait for one donor's answer
	vote    time.Duration // how long one claim round waits for votes
	backoff time.Duration // the longest random pause between claim rounds
	gossip  time.Duration // anti-entropy: all rings to one random member
	query   time.Duration // how long a vote for another's claim waits before asking it
}

var defaultTiming = timing{
	request: 5 * time.Second,
	donate:  2 * time.Second,
	vote:    2 * time.Second,
	backoff: 300 * time.Millisecond,
	gossip:  10 * time.Second,
	query:   2 * time.Second,
}

// Limits on what the network can make this host keep.
const (
	maxPools    = 4096 // pools known (from dockerd or other hosts)
	inboxSize   = 1024 // messages waiting for the workers
	workers     = 4    // goroutines handling messages
	sendQueue   = 256  // messages waiting for one member
	maxRedirect = 3    // donation requests sent on to the owner a donor names
)

// Allocator is one host's part of the cluster IPAM.
type Allocator struct {
	log     *slog.Logger
	now     func() time.Time
	self    Identity // immutable
	journal *journal
	timing  timing // immutable after New

	mu *lockorder.Mutex // LevelIPAM: the fields below marked "guarded by mu"
	// pools by PoolID; entries are never removed; guarded by mu.
	pools map[string]*pool
	// transport: nil until the control plane starts; guarded by mu.
	transport Transport
	// peers: the identity each member name last spoke with; guarded by mu.
	peers map[string]Identity
	// reclaimed: reclaimed identity → who reclaimed it; guarded by mu.
	reclaimed map[Identity]Identity
	// reclaimedBy: set when another host reclaimed this host's identity:
	// every request is refused from then on; guarded by mu.
	reclaimedBy *Identity
	// reclaimedC is closed when reclaimedBy is set (under mu), so that a
	// request waiting for other hosts ends with the reclaim's error at
	// once instead of at its deadline: the others drop a reclaimed
	// identity's messages, so no answer is coming.
	reclaimedC chan struct{}
	// waiters: donation requests in flight by id; guarded by mu.
	waiters map[uint64]*waiter
	nextReq uint64 // guarded by mu
	// alive: members last seen alive, to send all rings to those that
	// appear; guarded by mu.
	alive map[string]bool
	// senders: outgoing queues per member; guarded by mu.
	senders map[string]*sender
	// aborts: claims the last process left pending, announced as aborted
	// once the transport is set; guarded by mu.
	aborts []abortNotice
	closed bool // guarded by mu
	// draining: Close is sending what is queued; nothing new is queued;
	// guarded by mu.
	draining bool

	seq atomic.Uint64 // sequence number of this process's messages
	// announceMu (LevelIPAMAnnounce) is held while a rings message reads
	// its figures and takes its sequence number: receivers keep the
	// figures of the highest number, so a message built earlier (older
	// figures) must never get a higher number than one built later.
	announceMu *lockorder.Mutex
	dropped    atomic.Uint64 // messages dropped (inbox or a send queue full)
	inbox      chan inbound
	members    chan struct{} // MembersChanged signals (buffered 1)
	stop       chan struct{}
	wg         sync.WaitGroup // workers and the loop
	drains     sync.WaitGroup // send-queue goroutines
	stopOnce   sync.Once
}

type inbound struct {
	from    string
	payload []byte
}

type abortNotice struct {
	pool  string
	claim claimID
}

// waiter is a donation request waiting for its answer.
type waiter struct {
	to    string // the member asked
	reply chan *message
}

// sender is one member's outgoing queue, drained by one goroutine at a
// time, so a slow member delays only its own messages.
type sender struct {
	queue   [][]byte // guarded by Allocator.mu
	running bool     // guarded by Allocator.mu
}

// pool is one pool as this host knows it.
type pool struct {
	id   string
	spec poolSpec

	mu *lockorder.Mutex // LevelIPAMPool: the fields below
	// ring: this host's view of the pool's ownership; nil until a claim
	// created it or another host sent it; guarded by mu.
	ring *ring
	// allocs: this host's allocations; guarded by mu.
	allocs allocSet
	// refs: RequestPool calls without ReleasePool on this host; guarded by mu.
	refs int
	// next: where the next search for a free address starts (round robin,
	// so a released address is not handed out again at once); guarded by mu.
	next uint32
	// claim: this host's claim of the ring while it runs; guarded by mu.
	claim *claimState
	// vote, voteAt: the claim this host accepted and awaits the outcome
	// of (its own or another host's), and since when; guarded by mu.
	vote   *claimID
	voteAt time.Time
	// reports: other owners' figures, as they sent them; guarded by mu.
	reports map[Identity]report
	// obtaining: a request for free space from other hosts in flight;
	// other requests that need space wait for it; guarded by mu.
	obtaining *obtainCall
	// conflicts: allocations of this host in ranges it does not own, with
	// the owner; guarded by mu.
	conflicts map[uint32]Identity
	// announced: this host's figures as last sent to every member; guarded
	// by mu.
	announced ownerStats
}

type report struct {
	stats ownerStats
	seq   uint64
	at    time.Time
}

// New loads the allocator's state from cfg.Store; on the first start it
// creates and persists this host's identity.
func New(cfg Config) (*Allocator, error) { return newAllocator(cfg, defaultTiming) }

func newAllocator(cfg Config, tm timing) (*Allocator, error) {
	if err := checkName(cfg.NodeName); err != nil {
		return nil, fmt.Errorf("ipam: NodeName: %w", err)
	}
	if cfg.Store == nil {
		return nil, errors.New("ipam: no Store")
	}
	a := &Allocator{
		log:        cfg.Logger,
		now:        cfg.Now,
		journal:    newJournal(cfg.Store),
		timing:     tm,
		mu:         lockorder.New(lockorder.LevelIPAM),
		pools:      map[string]*pool{},
		peers:      map[string]Identity{},
		reclaimed:  map[Identity]Identity{},
		waiters:    map[uint64]*waiter{},
		reclaimedC: make(chan struct{}),
		announceMu: lockorder.New(lockorder.LevelIPAMAnnounce),
		alive:      map[string]bool{},
		senders:    map[string]*sender{},
		inbox:      make(chan inbound, inboxSize),
		members:    make(chan struct{}, 1),
		stop:       make(chan struct{}),
	}
	if a.log == nil {
		a.log = slog.Default()
	}
	if a.now == nil {
		a.now = time.Now
	}
	if err := a.load(cfg); err != nil {
		return nil, err
	}
	a.log = a.log.With(logkeys.Node, a.self.Name)
	a.seq.Store(seqStart(a.now().UnixNano()))
	for range workers {
		a.wg.Go(a.work)
	}
	a.wg.Go(a.loop)
	return a, nil
}

func randomUint64() uint64 {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic("ipam: no randomness: " + err.Error()) // crypto/rand does not fail on Linux
	}
	return binary.BigEndian.Uint64(b[:])
}

// load reads the ipam table. A record that does not decode stops the
// start: guessing could hand out an address twice.
func (a *Allocator) load(cfg Config) error {
	recs, err := cfg.Store.LoadIPAM()
	if err != nil {
		return fmt.Errorf("ipam: failed to load state: %w", err)
	}
	bad := func(k string, err error) error {
		return fmt.Errorf("ipam: state record %q is unreadable: %w (overlayd will not guess which addresses are in use)", k, err)
	}
	var host *Identity
	if b, ok := recs[keyHost]; ok {
		var h hostRecord
		if err := jsonStrict(b, &h); err != nil {
			return bad(keyHost, err)
		}
		id, err := parseIdentity(h.Name + "/" + h.ID)
		if err != nil {
			return bad(keyHost, err)
		}
		host = &id
	}
	poolOf := func(k, id string) (*pool, error) {
		if p := a.pools[id]; p != nil {
			return p, nil
		}
		s, err := parsePoolID(id)
		if err != nil {
			return nil, bad(k, err)
		}
		p := newPool(id, s)
		a.pools[id] = p
		return p, nil
	}
	var pendingClaims []abortNotice
	votes := map[string]claimID{}
	for k, v := range recs {
		switch {
		case k == keyHost:
		case strings.HasPrefix(k, prefixPool):
			p, err := poolOf(k, strings.TrimPrefix(k, prefixPool))
			if err != nil {
				return err
			}
			if p.refs, p.ring, err = decodePoolRecord(p.spec, v); err != nil {
				return bad(k, err)
			}
		case strings.HasPrefix(k, prefixAlloc):
			id, addr, err := splitAllocKey(k)
			if err != nil {
				return bad(k, err)
			}
			p, err := poolOf(k, id)
			if err != nil {
				return err
			}
			if x := u32(addr); x < p.spec.lo || x > p.spec.hi {
				return bad(k, fmt.Errorf("%s is outside the pool's range", addr))
			}
			al, err := decodeAlloc(v)
			if err != nil {
				return bad(k, err)
			}
			p.allocs.put(u32(addr), al)
		case strings.HasPrefix(k, prefixClaim):
			id := strings.TrimPrefix(k, prefixClaim)
			c, err := decodeClaim(v)
			if err != nil {
				return bad(k, err)
			}
			if _, err := poolOf(k, id); err != nil {
				return err
			}
			pendingClaims = append(pendingClaims, abortNotice{pool: id, claim: c})
		case strings.HasPrefix(k, prefixVote):
			id := strings.TrimPrefix(k, prefixVote)
			c, err := decodeClaim(v)
			if err != nil {
				return bad(k, err)
			}
			if _, err := poolOf(k, id); err != nil {
				return err
			}
			votes[id] = c
		case strings.HasPrefix(k, prefixReclaimed):
			id, err := parseIdentity(strings.TrimPrefix(k, prefixReclaimed))
			if err != nil {
				return bad(k, err)
			}
			var rec reclaimRecord
			if err := jsonStrict(v, &rec); err != nil {
				return bad(k, err)
			}
			by, err := parseIdentity(rec.By)
			if err != nil {
				return bad(k, err)
			}
			a.reclaimed[id] = by
		default:
			return bad(k, errors.New("unknown record"))
		}
	}
	puts := map[string][]byte{}
	switch {
	case host == nil:
		a.self = Identity{Name: cfg.NodeName, ID: randomUint64()}
		puts[keyHost] = mustJSON(hostRecord{Name: a.self.Name, ID: a.self.hexID()})
	case host.Name != cfg.NodeName:
		// The node was renamed. Its ranges belong to the old name's
		// identity: with nothing owned or allocated it simply starts as
		// a new identity; otherwise the operator decides.
		for id, p := range a.pools {
			if p.allocs.len() > 0 || p.refs > 0 || (p.ring != nil && p.ring.ownedSize(*host) > 0) {
				return fmt.Errorf("ipam: this state directory belongs to node %q (identity %s), but the node is now named %q, and pool %s has address space or allocations of %q. "+
					"Start overlayd with the node name %q again, or (if the old name is gone for good) move the state directory aside and run `overlayd ipam reclaim %s` on another host",
					host.Name, host, cfg.NodeName, id, host.Name, host.Name, host.Name)
			}
		}
		a.self = Identity{Name: cfg.NodeName, ID: randomUint64()}
		puts[keyHost] = mustJSON(hostRecord{Name: a.self.Name, ID: a.self.hexID()})
	default:
		a.self = *host
	}
	if by, ok := a.reclaimed[a.self]; ok {
		a.setReclaimedByLocked(by)
	}
	// A claim the last process left pending never won (a win writes the
	// ring and removes the claim in one write): abort it.
	for _, c := range pendingClaims {
		puts[prefixClaim+c.pool] = nil
		if v, ok := votes[c.pool]; ok && v == c.claim {
			delete(votes, c.pool)
			puts[prefixVote+c.pool] = nil
		}
		a.aborts = append(a.aborts, c)
	}
	for id, c := range votes {
		p := a.pools[id]
		if p.ring != nil {
			puts[prefixVote+id] = nil // the outcome is known
			continue
		}
		p.vote, p.voteAt = &c, a.now()
	}
	for _, p := range a.pools {
		if p.ring != nil {
			p.checkConflictsLocked(a, nil)
		}
	}
	if len(puts) > 0 {
		if err := a.journal.wait(a.journal.mark(puts)); err != nil {
			return fmt.Errorf("ipam: failed to save state: %w", err)
		}
	}
	return nil
}

func newPool(id string, s poolSpec) *pool {
	return &pool{
		id:        id,
		spec:      s,
		mu:        lockorder.New(lockorder.LevelIPAMPool),
		allocs:    newAllocSet(),
		next:      s.lo,
		reports:   map[Identity]report{},
		conflicts: map[uint32]Identity{},
	}
}

// poolFor returns the pool with this spec, creating it; nil when this
// host already knows maxPools pools.
func (a *Allocator) poolFor(s poolSpec) *pool {
	id := s.id()
	a.mu.Lock()
	defer a.mu.Unlock()
	if p := a.pools[id]; p != nil {
		return p
	}
	if len(a.pools) >= maxPools {
		return nil
	}
	p := newPool(id, s)
	a.pools[id] = p
	return p
}

func (a *Allocator) lookupPool(id string) *pool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.pools[id]
}

// allPools returns the pools sorted by id.
func (a *Allocator) allPools() []*pool {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make([]*pool, 0, len(a.pools))
	for _, p := range a.pools {
		out = append(out, p)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].id < out[j].id })
	return out
}

// SetTransport connects the allocator to the cluster when the control plane
// starts (which may be after New). Until then the allocator allocates from
// the ranges it owns and refuses what needs another host.
func (a *Allocator) SetTransport(t Transport) {
	a.mu.Lock()
	a.transport = t
	aborts := a.aborts
	a.aborts = nil
	a.mu.Unlock()
	for _, ab := range aborts {
		a.broadcastMsg(&message{kind: kindAbort, pool: ab.pool, claim: ab.claim})
	}
	a.MembersChanged()
}

func (a *Allocator) getTransport() Transport {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.transport
}

// closeDrainTime bounds how long Close waits for queued messages (a won
// claim's commit, a changed ring) to go out before it stops.
const closeDrainTime = time.Second

// Close sends what is queued (for up to a second), stops the allocator's
// goroutines and writes what is pending; requests in flight fail.
func (a *Allocator) Close() {
	a.stopOnce.Do(func() {
		a.mu.Lock()
		a.draining = true // no new messages; the queued ones go out
		a.mu.Unlock()
		drained := make(chan struct{})
		go func() { a.drains.Wait(); close(drained) }()
		timer := time.NewTimer(closeDrainTime)
		select {
		case <-drained:
		case <-timer.C:
		}
		timer.Stop()
		a.mu.Lock()
		a.closed = true
		for id, w := range a.waiters {
			close(w.reply)
			delete(a.waiters, id)
		}
		a.mu.Unlock()
		close(a.stop)
		a.wg.Wait()
		if err := a.journal.sync(); err != nil {
			a.log.Warn("ipam: failed to write the last changes at close", logkeys.Error, err)
		}
	})
}

// Capabilities returns what the plugin announces in GetCapabilities:
// dockerd passes the endpoint's MAC (idempotent replays), and replays
// nothing on restart, because everything is in the state file already.
// With RequiresRequestReplay, dockerd 20.10 and 26.1 re-send RequestPool
// for every network and RequestAddress for every gateway and endpoint at
// each start, without the ReleasePool that would balance them.
func (a *Allocator) Capabilities() Capabilities {
	return Capabilities{RequiresMACAddress: true}
}

// HandleMessage takes a message of the allocator's protocol from the member
// named from. It never blocks and keeps no reference to payload: a copy is
// queued for the allocator's workers (and dropped, counted in Status, when
// the queue is full; every exchange recovers from a lost message).
func (a *Allocator) HandleMessage(from string, payload []byte) {
	if len(payload) > maxMessage {
		a.dropped.Add(1)
		return
	}
	// A copy: the caller may reuse its buffer once this returns.
	select {
	case a.inbox <- inbound{from: from, payload: append([]byte(nil), payload...)}:
	default:
		a.dropped.Add(1)
	}
}

// MembersChanged tells the allocator the membership changed (a member
// joined, failed, left or returned). It never blocks.
func (a *Allocator) MembersChanged() {
	select {
	case a.members <- struct{}{}:
	default:
	}
}

// work handles inbound messages until Close.
func (a *Allocator) work() {
	for {
		select {
		case <-a.stop:
			return
		case in := <-a.inbox:
			a.handle(in.from, in.payload)
		}
	}
}

// loop runs anti-entropy and reacts to membership changes.
func (a *Allocator) loop() {
	tick := time.NewTicker(a.timing.gossip)
	defer tick.Stop()
	for {
		select {
		case <-a.stop:
			return
		case <-a.members:
			a.membersChanged()
		case <-tick.C:
			a.antiEntropy()
		}
	}
}

// handle decodes and dispatches one message.
func (a *Allocator) handle(from string, payload []byte) {
	m, err := decodeMessage(payload)
	if err != nil {
		a.log.Debug("ipam: dropped an undecodable message", logkeys.Member, from, logkeys.Error, err)
		return
	}
	if m.from.Name != from {
		a.log.Debug("ipam: dropped a message whose sender differs from the member it came from", logkeys.Member, from, "sender", m.from.String())
		return
	}
	a.mu.Lock()
	if _, gone := a.reclaimed[m.from]; gone || a.closed || m.from.Name == a.self.Name {
		a.mu.Unlock()
		return
	}
	if a.peers[from] != m.from {
		a.peers[from] = m.from
	}
	a.mu.Unlock()
	switch m.kind {
	case kindRings:
		a.handleRings(m)
	case kindPropose:
		a.handlePropose(m)
	case kindVote:
		a.handleVote(m)
	case kindCommit:
		a.handleCommit(m)
	case kindAbort:
		a.handleAbort(m)
	case kindQuery:
		a.handleQuery(m)
	case kindDonateReq:
		a.handleDonateRequest(m)
	case kindDonateReply:
		a.handleDonateReply(m)
	}
}

// encode stamps m with this host's identity and, unless it has one (a
// rings message numbered when its figures were read), the next sequence
// number.
func (a *Allocator) encode(m *message) ([]byte, error) {
	m.from = a.self
	if m.seq == 0 {
		m.seq = a.seq.Add(1)
	}
	return encodeMessage(m)
}

// sendMsg queues m for member to. A message that carries a ring waits
// until everything marked so far is on disk (and is dropped if that
// fails): no host learns of a change this host's disk does not hold.
func (a *Allocator) sendMsg(to string, m *message) {
	if (m.ring != nil || len(m.pools) > 0) && !a.durable() {
		return
	}
	b, err := a.encode(m)
	if err != nil {
		a.log.Warn("ipam: failed to encode a message", logkeys.Member, to, logkeys.Error, err)
		return
	}
	a.enqueue(to, b)
}

func (a *Allocator) enqueue(to string, b []byte) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed || a.draining || a.transport == nil {
		return
	}
	s := a.senders[to]
	if s == nil {
		s = &sender{}
		a.senders[to] = s
	}
	if len(s.queue) >= sendQueue {
		// The oldest goes: rings are re-sent by anti-entropy, and a lost
		// answer ends in its requester's timeout.
		s.queue = s.queue[1:]
		a.dropped.Add(1)
	}
	s.queue = append(s.queue, b)
	if !s.running {
		s.running = true
		t := a.transport
		a.drains.Add(1) // under mu, before draining is set: never concurrent with Wait
		go func() {
			defer a.drains.Done()
			a.drain(to, s, t)
		}()
	}
}

// drain sends to's queue until it is empty or the allocator closes.
func (a *Allocator) drain(to string, s *sender, t Transport) {
	for {
		a.mu.Lock()
		if len(s.queue) == 0 || a.closed {
			s.running = false
			s.queue = nil
			a.mu.Unlock()
			return
		}
		b := s.queue[0]
		s.queue = s.queue[1:]
		a.mu.Unlock()
		if err := t.Send(to, b); err != nil {
			a.log.Debug("ipam: send failed", logkeys.Member, to, logkeys.Error, err)
		}
	}
}

// aliveMembers returns the members the transport lists as alive.
func (a *Allocator) aliveMembers() []string {
	t := a.getTransport()
	if t == nil {
		return nil
	}
	var out []string
	for _, m := range t.Members() {
		if m.State == Alive && m.Name != a.self.Name {
			out = append(out, m.Name)
		}
	}
	return out
}

func (a *Allocator) broadcastMsg(m *message) {
	b, err := a.encode(m)
	if err != nil {
		a.log.Warn("ipam: failed to encode a message", logkeys.Error, err)
		return
	}
	for _, n := range a.aliveMembers() {
		a.enqueue(n, b)
	}
}

// setReclaimedByLocked records that by reclaimed this host's identity and
// wakes the requests waiting for other hosts (also called before the
// Allocator is shared); reclaimedBy is unset.
func (a *Allocator) setReclaimedByLocked(by Identity) {
	a.reclaimedBy = &by
	close(a.reclaimedC)
}

// refuseIfReclaimed returns the error every request gets once another host
// reclaimed this host's identity.
func (a *Allocator) refuseIfReclaimed() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return refuse(ReasonShuttingDown, errors.New("overlayd's address management is shutting down"))
	}
	if a.reclaimedBy == nil {
		return nil
	}
	return refuse(ReasonIdentityReclaimed, fmt.Errorf("this host's address space (identity %s) was reclaimed by %s, which takes this host for gone: it hands out no address any more. "+
		"To bring the host back, stop overlayd, remove its containers and move its state directory aside; it then starts as a new identity",
		a.self, a.reclaimedBy.Name))
}

// memberStates returns the transport's members by name.
func (a *Allocator) memberStates() map[string]MemberState {
	t := a.getTransport()
	out := map[string]MemberState{}
	if t == nil {
		return out
	}
	for _, m := range t.Members() {
		out[m.Name] = m.State
	}
	return out
}

// describeOwner says how this host sees an owner: alive, unreachable...
func describeState(st MemberState, known bool) string {
	if !known {
		return "not a member of the cluster (left, or never joined)"
	}
	switch st {
	case Alive:
		return "alive"
	case Suspect:
		return "suspected down"
	default:
		return "unreachable (dead)"
	}
}

// jsonStrict decodes a record, refusing unknown fields.
func jsonStrict(b []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(b))
	d.DisallowUnknownFields()
	return d.Decode(v)
}

func formatRange(sp span) string {
	if sp.first == sp.last {
		return addrOf(sp.first).String()
	}
	return addrOf(sp.first).String() + "-" + addrOf(sp.last).String()
}

// deadlineOf returns the request's deadline: the context's, or the
// allocator's request budget from now.
func (a *Allocator) deadlineOf(ctxDeadline time.Time, ok bool) time.Time {
	if ok {
		return ctxDeadline
	}
	return time.Now().Add(a.timing.request)
}
