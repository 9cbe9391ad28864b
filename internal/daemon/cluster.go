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
	"time"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/internal/cluster"
	"github.com/overlayd/overlayd/internal/config"
	"github.com/overlayd/overlayd/internal/store"
	"github.com/overlayd/overlayd/peerdb"
)

// resyncDelay is how long after joining the daemon waits for the control
// plane to re-deliver the cluster's records before it makes every sandbox
// match its peer DB (removing peers that nobody announced while overlayd
// was down). auditInterval repeats that reconcile as a safety net.
var (
	resyncDelay   = 10 * time.Second
	auditInterval = 5 * time.Minute
)

// sink hands the control plane's events to the driver.
type sink struct{ d *driver.Driver }

func (s sink) ApplyPeerEvents(evs []cluster.Event) error {
	out := make([]driver.PeerEvent, len(evs))
	for i, e := range evs {
		out[i] = driver.PeerEvent{VNI: e.VNI, Prev: e.Prev, Next: e.Next}
	}
	return s.d.ApplyPeerEvents(out)
}

// controlPlane starts the cluster once the local address is known (at once
// when configured or found on the default route; in swarm, when DiscoverNew
// announces it) and connects it to the driver.
type controlPlane struct {
	st  *config.Settings
	db  *store.Store // remembers members, so a restarted plugin finds the cluster again
	log *slog.Logger
	key []byte
	d   *driver.Driver
	// startMu serialises starts; mu guards c and seed. mu is a leaf lock:
	// PublishLocalPeer takes it under a network lock, so nothing that
	// takes a driver lock may run while it is held.
	startMu sync.Mutex
	mu      sync.Mutex
	c       *cluster.Cluster // guarded by mu; nil until started
	km      *keyManager      // guarded by mu; nil until started
	seed    []string         // seeds learned before the start; guarded by mu
	stop    chan struct{}
	done    sync.WaitGroup
}

// PublishLocalPeer implements driver.PeerPublisher. Records published before
// the cluster starts are republished by start.
func (cp *controlPlane) PublishLocalPeer(vni uint32, prev, next *peerdb.Peer) {
	cp.mu.Lock()
	c := cp.c
	cp.mu.Unlock()
	if c != nil {
		c.PublishLocalPeer(vni, prev, next)
	}
}

// discovered is told of swarm nodes by the driver (DiscoverNew).
func (cp *controlPlane) discovered(addr netip.Addr, self bool) {
	if self {
		cp.tryStart()
		return
	}
	seed := net.JoinHostPort(addr.String(), strconv.Itoa(cp.st.GossipPort))
	cp.mu.Lock()
	c := cp.c
	if c == nil {
		cp.seed = append(cp.seed, seed)
	}
	cp.mu.Unlock()
	if c != nil {
		c.AddSeeds(seed)
	}
}

// tryStart starts the cluster if the advertise address is known.
func (cp *controlPlane) tryStart() {
	cp.startMu.Lock()
	defer cp.startMu.Unlock()
	cp.mu.Lock()
	started, seeds := cp.c != nil, append([]string(nil), cp.seed...)
	cp.mu.Unlock()
	if started {
		return
	}
	adv := cp.d.AdvertiseAddr()
	if !adv.IsValid() {
		return
	}
	bind := cp.st.GossipAddr
	if !bind.IsValid() {
		bind = adv
	}
	c, err := cluster.New(cluster.Config{
		NodeName:      cp.st.NodeName,
		BindAddr:      bind,
		BindPort:      cp.st.GossipPort,
		AdvertiseAddr: adv,
		VTEP:          adv,
		Key:           cp.key,
		Seeds:         append(append(append([]string(nil), cp.st.Join...), seeds...), cp.rememberedMembers()...),
		Sink:          sink{cp.d},
		Logger:        cp.log,
		OnMembersChange: func() {
			cp.mu.Lock()
			km := cp.km
			cp.mu.Unlock()
			if km != nil {
				km.poke()
			}
		},
	})
	if err != nil {
		cp.log.Error("control plane failed to start; retrying", "error", err)
		return
	}
	km := newKeyManager(cp.d, c, cp.st.NodeName, cp.st.KeyRotationInterval, cp.log.With("component", "keys"))
	cp.mu.Lock()
	cp.c, cp.km = c, km
	late := cp.seed[len(seeds):]
	cp.mu.Unlock()
	km.start()
	c.AddSeeds(late...)
	// Endpoints restored from the state file, or joined before the start:
	// published under each network's lock, so ordered with Join/Leave
	// publications that now go to c directly.
	cp.d.ForEachLocalPeer(func(vni uint32, p peerdb.Peer) { c.PublishLocalPeer(vni, nil, &p) })
	cp.log.Info("control plane started", "node", cp.st.NodeName, "gossip", net.JoinHostPort(bind.String(), strconv.Itoa(cp.st.GossipPort)),
		"advertise", adv, "seeds", len(cp.st.Join)+len(seeds)+len(late), "key_fingerprint", cluster.Fingerprint(cp.key))
	cp.done.Add(1)
	go cp.reconcileLoop()
}

// run retries the start until the address is known, then waits for stop.
func (cp *controlPlane) run() {
	defer cp.done.Done()
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		cp.mu.Lock()
		started := cp.c != nil
		cp.mu.Unlock()
		if started {
			return
		}
		cp.tryStart()
		select {
		case <-cp.stop:
			return
		case <-t.C:
		}
	}
}

// reconcileLoop makes the kernel match the peer DBs once the cluster has
// had time to re-deliver its records, then periodically.
func (cp *controlPlane) reconcileLoop() {
	defer cp.done.Done()
	wait := resyncDelay
	remember := time.NewTicker(rememberInterval)
	defer remember.Stop()
	for {
		select {
		case <-cp.stop:
			return
		case <-remember.C:
			cp.rememberMembers()
			continue
		case <-time.After(wait):
		}
		fixed, err := cp.d.ReconcileAll()
		if err != nil {
			cp.log.Warn("reconcile failed", "error", err)
		}
		if len(fixed) > 0 {
			cp.log.Info("reconciled kernel peer state", "corrected", len(fixed), "first", fixed[0])
		}
		wait = auditInterval
	}
}

const membersKey = "cluster.members"

var rememberInterval = 15 * time.Second

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
	st := cp.status()
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

// rotate starts a cluster-wide key rotation (`overlayd keys rotate`).
func (cp *controlPlane) rotate() (any, error) {
	cp.mu.Lock()
	km := cp.km
	cp.mu.Unlock()
	if km == nil {
		return nil, errors.New("the control plane has not started yet (no advertise address known)")
	}
	return km.Rotate()
}

func (cp *controlPlane) memberKeys() map[string]string {
	cp.mu.Lock()
	km := cp.km
	cp.mu.Unlock()
	if km == nil {
		return nil
	}
	return km.memberKeys()
}

func (cp *controlPlane) status() *cluster.Status {
	cp.mu.Lock()
	c := cp.c
	cp.mu.Unlock()
	if c == nil {
		return nil
	}
	st := c.Status()
	return &st
}

// close leaves the cluster (so others drop our records at once rather than
// after failure detection) and stops.
func (cp *controlPlane) close() {
	close(cp.stop)
	cp.mu.Lock()
	c, km := cp.c, cp.km
	cp.mu.Unlock()
	if km != nil {
		km.close()
	}
	if c != nil {
		cp.rememberMembers() // a restart sooner than the next periodic save still finds the cluster
		if err := c.Leave(2 * time.Second); err != nil {
			cp.log.Warn("leaving the cluster", "error", err)
		}
		c.Shutdown()
	}
	cp.done.Wait()
}

func loadKey(st *config.Settings, log *slog.Logger) ([]byte, error) {
	key, created, err := cluster.LoadOrCreateKey(st.SecretPath())
	if err != nil {
		return nil, fmt.Errorf("cluster key: %w", err)
	}
	if created {
		log.Info("generated a new cluster key: copy this file to every other host (mode 0600) and point --secret-file at it",
			"path", st.SecretPath(), "fingerprint", cluster.Fingerprint(key))
	}
	return key, nil
}
