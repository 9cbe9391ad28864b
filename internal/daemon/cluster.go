package daemon

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/encryption"
	"github.com/overlayd/overlayd/internal/cluster"
	"github.com/overlayd/overlayd/internal/config"
	"github.com/overlayd/overlayd/internal/ipam"
	"github.com/overlayd/overlayd/internal/lockorder"
	"github.com/overlayd/overlayd/internal/netdef"
	"github.com/overlayd/overlayd/internal/netsync"
	"github.com/overlayd/overlayd/internal/statefile"
	"github.com/overlayd/overlayd/peerdb"
)

// Timings of the daemon's level-triggered loops (variables for tests).
var (
	// reconcileInterval: the driver pulls every network's records from the
	// control plane and makes every sandbox's kernel state match (repairing
	// anything a notification missed or someone changed); local records
	// are re-published.
	reconcileInterval = 5 * time.Second
	// settleDelay: after the control plane starts, how long the driver
	// keeps the kernel peers an earlier run programmed that nobody has
	// re-announced (the cluster re-delivers its records meanwhile).
	settleDelay = 10 * time.Second
	// rememberInterval: how often the alive members are saved, so that a
	// restarted plugin finds the cluster again.
	rememberInterval = 15 * time.Second
)

// The control plane in two parts, made in this order, so that neither
// refers back to the other nor to a half-built driver:
//
//   - clusterLink, the driver's side: what the driver calls (its
//     driver.LocalPublisher, PeerSource, DefinitionSource and Membership),
//     forwarded to the cluster once it runs. It is made before the driver
//     and knows none.
//   - controlPlane, made after the driver with the driver and the link: it
//     starts the cluster into the link, runs the periodic reconcile and
//     stops it all.
//
// The one thing the link tells the controlPlane, that a VTEP was settled
// while the cluster is down, goes through a channel (wake) that the
// controlPlane's loop receives from.

// clusterLink is the driver's side of the control plane. Before the
// cluster runs, reads find nothing and what is published waits: the start
// publishes the driver's local records and definitions (and every
// reconcile makes the published ones exactly the driver's).
type clusterLink struct {
	log        *slog.Logger
	enc        *encryption.Owner // follows the VTEP
	gossipPort int

	c atomic.Pointer[cluster.Cluster] // nil until started, and again once left

	// mu serialises the cluster's start, close and leave with the
	// announcement of a new VTEP (lockorder.LevelStart: taken under the
	// driver's VTEP lock, held while publishing local records under
	// network locks and starting the cluster). A VTEP changed while the
	// cluster is being started is announced once it runs.
	mu      *lockorder.Mutex
	closed  bool        // guarded by mu
	left    bool        // guarded by mu: `overlayd leave` ran
	hasLeft atomic.Bool // left, readable without mu
	seedMu  *lockorder.Mutex
	seeds   []string      // seeds learned before the start; guarded by seedMu
	started chan struct{} // closed once the cluster has started
	stop    chan struct{} // closed by controlPlane.close
	// wake (buffered 1): a VTEP was settled while the cluster is down;
	// the controlPlane's loop starts it.
	wake chan struct{}
}

func newClusterLink(st *config.Settings, log *slog.Logger, enc *encryption.Owner) *clusterLink {
	return &clusterLink{log: log, enc: enc, gossipPort: st.GossipPort,
		mu: lockorder.New(lockorder.LevelStart), seedMu: lockorder.New(lockorder.LevelLeaf),
		started: make(chan struct{}), stop: make(chan struct{}), wake: make(chan struct{}, 1)}
}

// The link is every interface of the driver's control plane.
var (
	_ driver.LocalPublisher   = (*clusterLink)(nil)
	_ driver.PeerSource       = (*clusterLink)(nil)
	_ driver.DefinitionSource = (*clusterLink)(nil)
	_ driver.Membership       = (*clusterLink)(nil)
)

// Peer implements driver.PeerSource.
func (l *clusterLink) Peer(k peerdb.Key) (peerdb.Peer, bool) {
	if c := l.c.Load(); c != nil {
		return c.Peer(k)
	}
	return peerdb.Peer{}, false
}

// PeersOf implements driver.PeerSource.
func (l *clusterLink) PeersOf(keys []peerdb.Key, found []peerdb.Found) {
	if c := l.c.Load(); c != nil {
		c.PeersOf(keys, found)
		return
	}
	clear(found[:len(keys)])
}

// Peers implements driver.PeerSource.
func (l *clusterLink) Peers(vni uint32) map[peerdb.Key]peerdb.Peer {
	if c := l.c.Load(); c != nil {
		return c.Peers(vni)
	}
	return nil
}

// PublishLocalPeer implements driver.LocalPublisher. Records published
// before the cluster starts are published by the start (and every
// reconcile).
func (l *clusterLink) PublishLocalPeer(vni uint32, prev, next *peerdb.Peer) {
	if c := l.c.Load(); c != nil {
		c.PublishLocalPeer(vni, prev, next)
	}
}

// PublishLocalNames implements driver.LocalPublisher: the names of a
// local endpoint go to the cluster; before it starts, its first records
// carry them (localRecords).
func (l *clusterLink) PublishLocalNames(vni uint32, endpointID, packed string) error {
	if c := l.c.Load(); c != nil {
		return c.PublishLocalNames(vni, endpointID, packed)
	}
	return nil
}

// VTEPChanged implements driver.LocalPublisher: the encryption state
// follows the VTEP; a running cluster re-announces every local record
// with it; else the controlPlane is woken to start the cluster.
func (l *clusterLink) VTEPChanged(vtep netip.Addr) {
	if err := l.enc.SetLocal(vtep); err != nil {
		l.log.Warn("encryption state for the new VTEP (retried by its loop)", "vtep", vtep, "error", err)
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if c := l.c.Load(); c != nil {
		if err := c.SetVTEP(vtep); err != nil {
			l.log.Error("re-announcing local records with the new VTEP", "vtep", vtep, "error", err)
		}
		return
	}
	select {
	case l.wake <- struct{}{}:
	default: // a wake is pending already
	}
}

// Definitions implements driver.DefinitionSource.
func (l *clusterLink) Definitions(vni uint32) []netdef.Remote {
	if c := l.c.Load(); c != nil {
		return c.Definitions(vni)
	}
	return nil
}

// DefinitionOf implements driver.DefinitionSource.
func (l *clusterLink) DefinitionOf(vni uint32, host string) (netdef.Remote, bool) {
	if c := l.c.Load(); c != nil {
		return c.DefinitionOf(vni, host)
	}
	return netdef.Remote{}, false
}

// PublishDefinition implements driver.DefinitionSource. Definitions
// published before the cluster starts are published by the start (and
// every reconcile).
func (l *clusterLink) PublishDefinition(vni uint32, def *netdef.Definition) error {
	if c := l.c.Load(); c != nil {
		return c.PublishDefinition(vni, def)
	}
	return nil
}

// Discovered implements driver.Membership: another swarm node
// (DiscoverNew) is a seed at the gossip port.
func (l *clusterLink) Discovered(addr netip.Addr) {
	l.AddSeeds([]string{net.JoinHostPort(addr.String(), strconv.Itoa(l.gossipPort))})
}

// AddSeeds implements driver.Membership: gossip addresses to join go to
// the cluster, or are kept for its start. The cluster joins a seed only
// if it is not the address of an alive member already (nor this node's
// own).
func (l *clusterLink) AddSeeds(seeds []string) {
	if c := l.c.Load(); c != nil {
		c.AddSeeds(seeds...)
		return
	}
	l.seedMu.Lock()
	l.seeds = append(l.seeds, seeds...)
	l.seedMu.Unlock()
	if c := l.c.Load(); c != nil { // started meanwhile: hand them over too
		c.AddSeeds(seeds...)
	}
}

// takeSeeds returns the seeds kept for the start, and forgets them.
func (l *clusterLink) takeSeeds() (seeds []string) {
	l.seedMu.Lock()
	seeds, l.seeds = l.seeds, nil
	l.seedMu.Unlock()
	return seeds
}

// seedWait bounds how long the swarm leader's AllocateNetwork waits for
// the control plane to start so that its answer carries gossip seeds: a
// restarted leader's dockerd re-sends AllocateNetwork while swarm is
// announcing this node's address (DiscoverNew) at about the same time.
const seedWait = 2 * time.Second

// GossipSeeds implements driver.Membership: where other nodes join this
// cluster (this node's gossip address first, then the alive members'),
// waiting up to seedWait for the control plane to start; nil if it has
// not.
func (l *clusterLink) GossipSeeds() []string {
	t := time.NewTimer(seedWait)
	defer t.Stop()
	select {
	case <-l.started:
	case <-l.stop:
	case <-t.C:
	}
	c := l.c.Load()
	if c == nil {
		return nil
	}
	var out []string
	for _, a := range c.SeedAddrs() {
		out = append(out, a.String())
	}
	return out
}

// status is the cluster's status, nil while it does not run.
func (l *clusterLink) status() *cluster.Status {
	c := l.c.Load()
	if c == nil {
		return nil
	}
	st := c.Status()
	return &st
}

// controlPlane owns the cluster's lifetime: it starts it once the driver
// has settled the local VTEP (at once when configured or found on the
// default route; in swarm when DiscoverNew announces it), and runs the
// daemon's periodic reconcile.
//
// Stopping is safe at every point of starting: close marks the link
// closed under its lock, so a start in progress finishes first and a
// later one does nothing.
type controlPlane struct {
	st   *config.Settings
	db   *statefile.File // remembers members, so a restarted plugin finds the cluster again
	log  *slog.Logger
	key  []byte
	enc  *encryption.Owner
	link *clusterLink
	d    *driver.Driver
	// names is the names service (nil when off): it hears of remote
	// changes with the driver.
	names *nameService
	// alloc is the cluster address management (nil in tests of the
	// control plane alone): it gets the cluster as its transport when the
	// control plane starts, and the cluster's application messages and
	// membership changes.
	alloc *ipam.Allocator
	// netsync is networks defined once (nil when off): it gets its
	// application messages and membership changes.
	netsync *netSyncService

	done sync.WaitGroup

	// startErr is the last start failure logged (guarded by link.mu).
	startErr string

	// For readiness (atomic: read by /readyz and the status without a
	// lock): hadSeeds, the cluster started with somewhere to join (else a
	// host alone is joined); reconciled, a reconcile has run since the
	// cluster started.
	hadSeeds   atomic.Bool
	reconciled atomic.Bool
}

// newControlPlane returns the control plane of driver d, which was made
// with link as its control plane.
func newControlPlane(st *config.Settings, db *statefile.File, log *slog.Logger, key []byte, enc *encryption.Owner, alloc *ipam.Allocator,
	link *clusterLink, d *driver.Driver, names *nameService, nsync *netSyncService) *controlPlane {
	return &controlPlane{st: st, db: db, log: log, key: key, enc: enc, alloc: alloc, link: link, d: d, names: names, netsync: nsync}
}

// tryStart starts the cluster if the VTEP is known and the plane is not
// closed.
func (cp *controlPlane) tryStart() {
	l := cp.link
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closed || l.left || l.c.Load() != nil {
		return
	}
	vtep := cp.d.VTEP()
	if !vtep.IsValid() {
		return
	}
	bind := cp.st.GossipAddr
	if !bind.IsValid() {
		bind = vtep
	}
	all := append(append(append([]string(nil), cp.st.Join...), l.takeSeeds()...), cp.rememberedMembers()...)
	// Endpoints restored from the state file, or joined before the start,
	// are the node's records before anything is gossiped (a snapshot
	// without them would end the others' restart grace and flap them).
	// Changes racing with the start are caught by the SyncLocal below.
	c, err := cluster.New(cluster.Config{
		Local:            localRecords(cp.d),
		LocalDefinitions: cp.d.LocalDefinitions(),
		// The driver publishes a definition of every VNI of every local
		// network: the records this host needs are exactly theirs.
		Interest:      true,
		NodeName:      cp.st.NodeName,
		BindAddr:      bind,
		BindPort:      cp.st.GossipPort,
		AdvertiseAddr: bind,
		VTEP:          vtep,
		Key:           cp.key,
		Profile:       cp.st.GossipProfile,
		Seeds:         all,
		Watcher:       cp.watcher(),
		Logger:        cp.log,
		// Members or their adverts changed: the encryption owner steps
		// the key rotation soon, the address management re-reads the
		// members (neither blocks).
		OnMembersChange: func() {
			cp.enc.Poke()
			if cp.alloc != nil {
				cp.alloc.MembersChanged()
			}
			if cp.netsync != nil {
				cp.netsync.membersChanged()
			}
		},
		// The address management's messages and netsync's (both queue
		// them, never block).
		OnAppMessage: func(from string, payload []byte) {
			if netsync.Is(payload) {
				if cp.netsync != nil {
					cp.netsync.handleMessage(from, payload)
				}
				return
			}
			if cp.alloc != nil {
				cp.alloc.HandleMessage(from, payload)
			}
		},
	})
	if err != nil {
		// Once per distinct error, not every second: the retry goes on
		// (an address coming back, a port freed), the log stays readable.
		if msg := err.Error(); msg != cp.startErr {
			cp.startErr = msg
			cp.log.Error("control plane failed to start; retrying every second (logged again only if the error changes)", "error", err)
		} else {
			cp.log.Debug("control plane still fails to start; retrying", "error", err)
		}
		return
	}
	if cp.startErr != "" {
		cp.log.Info("control plane starts after failing", "last_error", cp.startErr)
		cp.startErr = ""
	}
	mark := c.LocalMark()
	l.c.Store(c)
	c.SyncLocal(mark, localRecords(cp.d))
	c.SyncDefinitions(mark, cp.d.LocalDefinitions())
	// Seeds learned while the cluster was being made.
	late := l.takeSeeds()
	c.AddSeeds(late...)
	cp.enc.AttachGossip(keyGossip{c})
	if cp.alloc != nil {
		cp.alloc.SetTransport(ipamTransport{c})
	}
	cp.hadSeeds.Store(len(all)+len(late) > 0)
	cp.log.Info("control plane started", "node", cp.st.NodeName, "gossip", net.JoinHostPort(bind.String(), strconv.Itoa(cp.st.GossipPort)),
		"vtep", vtep, "seeds", len(all)+len(late), "key_fingerprint", cluster.Fingerprint(cp.key))
	close(l.started)
}

// run retries the start until the VTEP is known, then runs the periodic
// reconcile until stop.
func (cp *controlPlane) run() {
	defer cp.done.Done()
	retry := time.NewTicker(time.Second)
	defer retry.Stop()
	reconcile := time.NewTicker(reconcileInterval)
	defer reconcile.Stop()
	remember := time.NewTicker(rememberInterval)
	defer remember.Stop()
	var settle <-chan time.Time
	started := cp.link.started
	for {
		select {
		case <-cp.link.stop:
			return
		case <-cp.link.wake: // the VTEP was settled
			if cp.link.c.Load() == nil {
				cp.tryStart()
			}
		case <-retry.C:
			if cp.link.c.Load() == nil {
				cp.tryStart()
			}
		case <-started:
			started = nil
			settle = time.After(settleDelay)
		case <-settle:
			if err := cp.d.Settle(); err != nil {
				cp.log.Warn("settling the encryption state after the restart", "error", err)
			}
			cp.reconcile()
		case <-reconcile.C:
			cp.reconcile()
		case <-remember.C:
			cp.rememberMembers()
		}
	}
}

// reconcile runs the driver's level-triggered repair and makes the
// published local records exactly the joined endpoints ("nothing changed
// on our side" is no reason to skip).
func (cp *controlPlane) reconcile() {
	started := cp.link.c.Load() != nil
	// The driver logs each repair itself, by network and kind.
	_, err := cp.d.Reconcile()
	if err != nil {
		cp.log.Warn("reconcile failed; retrying on the next tick", "error", err)
	}
	if c := cp.link.c.Load(); c != nil {
		mark := c.LocalMark()
		c.SyncLocal(mark, localRecords(cp.d))
		c.SyncDefinitions(mark, cp.d.LocalDefinitions())
	}
	if started && err == nil {
		cp.reconciled.Store(true)
	}
}

// ready returns nil when this host is ready to serve containers across
// hosts, else why not: the control plane runs, has joined the cluster
// (another member is alive, unless it had nobody to join: the first
// host), and a reconcile has run since it started (the kernel holds what
// the cluster said). It takes no lock the gossip or a network holds long.
func (cp *controlPlane) ready() error {
	c := cp.link.c.Load()
	switch {
	case c == nil && cp.link.hasLeft.Load():
		return errors.New("this host left the cluster (overlayd leave)")
	case c == nil:
		return errors.New("the control plane has not started (this host's address, the VTEP, is not known yet)")
	case cp.hadSeeds.Load() && len(c.SeedAddrs()) < 2:
		return errors.New("the control plane has not joined the cluster yet (no other member is alive)")
	case !cp.reconciled.Load():
		return errors.New("no reconcile has completed since the control plane started")
	}
	return nil
}

// watcher is what the cluster tells of changed records: the driver, and
// the names service when on.
func (cp *controlPlane) watcher() cluster.Watcher {
	if cp.names == nil {
		return cp.d
	}
	return namesWatcher{d: cp.d, ns: cp.names}
}

// localRecords lists the driver's joined endpoints for the cluster.
func localRecords(d *driver.Driver) []cluster.LocalRecord {
	lp := d.LocalPeers()
	out := make([]cluster.LocalRecord, len(lp))
	for i, r := range lp {
		out[i] = cluster.LocalRecord{VNI: r.VNI, Peer: r.Peer, Names: r.Names}
	}
	return out
}

const membersKey = "cluster.members"

// rememberedMembers returns the members saved by an earlier run: a plugin
// restarted in swarm hears of no other node (dockerd re-announces only
// itself), so it rejoins through them.
func (cp *controlPlane) rememberedMembers() []string {
	if cp.db == nil {
		return nil
	}
	raw, err := cp.db.GetMeta(membersKey)
	if err != nil || raw == nil {
		return nil
	}
	var seeds []string
	if err := json.Unmarshal(raw, &seeds); err != nil {
		cp.log.Warn("ignoring unreadable remembered members", "error", err)
		return nil
	}
	return seeds
}

// rememberMembers saves the addresses of the alive members.
func (cp *controlPlane) rememberMembers() {
	st := cp.link.status()
	if st == nil || cp.db == nil {
		return
	}
	var seeds []string
	for _, m := range st.Members {
		if !m.Self && m.State == cluster.StateAlive {
			seeds = append(seeds, net.JoinHostPort(m.Addr.String(), strconv.Itoa(int(m.Port))))
		}
	}
	if len(seeds) == 0 {
		return // keep what we had: alone now does not mean alone next time
	}
	sort.Strings(seeds)
	raw, _ := json.Marshal(seeds)
	if old, _ := cp.db.GetMeta(membersKey); string(old) == string(raw) {
		return
	}
	if err := cp.db.PutMeta(membersKey, raw); err != nil {
		cp.log.Warn("failed to remember members", "error", err)
	}
}

// leave decommissions this host (`overlayd leave`): it leaves the cluster,
// so every other host removes its records at once, and stops the control
// plane. The plugin keeps serving; stop the daemon afterwards.
func (cp *controlPlane) leave() (any, error) {
	l := cp.link
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.left {
		return map[string]any{"left": true, "note": "already left"}, nil
	}
	c := l.c.Load()
	if c == nil {
		return nil, errors.New("the control plane has not started (no VTEP known yet): there is no cluster to leave")
	}
	err := c.Leave(5 * time.Second)
	c.Shutdown()
	l.c.Store(nil)
	l.left = true
	l.hasLeft.Store(true)
	if err != nil {
		return nil, fmt.Errorf("leaving the cluster: %w (the control plane is stopped; the others detect the failure)", err)
	}
	cp.log.Info("left the cluster: the other hosts removed this host's records; stop overlayd now")
	return map[string]any{"left": true, "note": "the other hosts removed this host's records; stop overlayd (or disable the plugin) now"}, nil
}

// close stops the control plane WITHOUT leaving the cluster: the other
// hosts see this node fail and keep its records in force for the restart
// grace, so a restart or an upgrade loses no packet. Leaving for good is
// `overlayd leave`.
func (cp *controlPlane) close() {
	l := cp.link
	l.mu.Lock()
	l.closed = true
	l.mu.Unlock()
	close(l.stop)
	cp.done.Wait()
	if c := l.c.Load(); c != nil {
		cp.rememberMembers() // a restart sooner than the next periodic save still finds the cluster
		c.Shutdown()
	}
}

// loadKey reads the cluster key. Only the default path is generated when
// missing: an explicitly given file must exist (CheckHost said so first;
// a file removed since is refused the same way). A key file that cannot
// be used is a refused setting.
func loadKey(st *config.Settings, log *slog.Logger) ([]byte, error) {
	if st.SecretFile != "" {
		key, err := cluster.LoadKey(st.SecretFile)
		if err != nil {
			return nil, &config.Invalid{Err: fmt.Errorf("%s: %w", st.Source("secret-file"), err)}
		}
		return key, nil
	}
	key, created, err := cluster.LoadOrCreateKey(st.SecretPath())
	if err != nil {
		return nil, &config.Invalid{Err: err}
	}
	if created {
		log.Info("generated a new cluster key: copy this file to every other host (mode 0600) and point --secret-file at it",
			"path", st.SecretPath(), "fingerprint", cluster.Fingerprint(key))
	}
	return key, nil
}
