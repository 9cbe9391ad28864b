// Package lockorder provides a mutex that carries its place in a lock
// hierarchy. In normal builds it is a plain sync.Mutex. Built with the
// "lockcheck" tag (the test suite is), every acquisition is checked against
// the hierarchy: a goroutine may only take a lock whose level is greater
// than the level of every lock it already holds, so taking a higher lock
// while holding a lower one, or two locks of one level (two networks) at
// once, is reported as an inversion.
//
// Every Mutex is made by New with its level; there is no zero level. A
// Mutex that was not made by New (a zero value) is reported at its first
// Lock in lockcheck builds, so no lock can escape the check by accident.
//
// # The hierarchy
//
// The Level constants below are overlayd's lock hierarchy, written here
// and nowhere else: the packages, docs/architecture.md and the field
// comments name a lock's level and point here instead of restating the
// order. Locks outside it: memberlist's own, always taken before any of
// these (overlayd never calls into memberlist holding one), and bbolt's,
// a leaf that statefile never holds while taking one of these.
//
// # Caller holds the lock: the Locked suffix
//
// A function whose caller must hold a lock is named with the suffix
// Locked, and its comment does not say so again. The lock is the one that
// guards what the function works on: the receiver's (l.mu for a
// localStore method), or, for an owner's method on one of its parts, that
// part's (a Driver method on a network: n.mu; an Allocator method on a
// pool: p.mu). Where it is another lock, or more than one, the comment
// names it. Functions without the suffix take the locks they need
// themselves, and their comments say which locks they must not be called
// under when it matters.
package lockorder

import "fmt"

// Level is a lock's place in the hierarchy: locks are taken in increasing
// level order.
type Level int

// Levels of overlayd's lock hierarchy, top (taken first) to bottom. Each
// level's comment says what it guards and what may be taken under it.
const (
	// LevelVTEP: serialises changes of the local VTEP with their
	// notification to the control plane and the encryption owner; taken
	// before any other lock, never under one.
	LevelVTEP Level = 5
	// LevelStart: the daemon's control-plane start/stop lock; taken under
	// the VTEP lock (a VTEP change is announced to the running cluster
	// under it) and before network locks (the start publishes the local
	// records).
	LevelStart Level = 7
	// LevelNetwork: network.mu, one per network; held for every
	// operation on that network (create/delete, endpoints, join/leave,
	// pulls and the kernel programming of its sandbox). Never two at once.
	LevelNetwork Level = 10
	// LevelEncryption: the encryption owner's lock (keys, shares, SAs,
	// policies, nftables and their programming). Taken under a network
	// lock when a network's share changes, or alone by the owner's loop.
	LevelEncryption Level = 20
	// LevelAlloc: the driver's VNI allocation lock (swarm leader's
	// AllocateNetwork and FreeNetwork); held while the allocation is
	// persisted.
	LevelAlloc Level = 25
	// LevelIPAMAnnounce: the cluster IPAM's announce lock, held while a
	// rings message's figures are read (under each pool's lock) and its
	// sequence number taken, so that numbers follow the figures' age.
	LevelIPAMAnnounce Level = 26
	// LevelIPAMPool: one pool's lock in the cluster IPAM (its ring, its
	// allocations, its claim); never two at once. Never held while
	// sending to another host or waiting for the state file.
	LevelIPAMPool Level = 27
	// LevelIPAM: the cluster IPAM's maps (pools by id, identities, pending
	// requests); taken alone or under a pool's lock.
	LevelIPAM Level = 28
	// LevelDriver: driver.mu, the driver's maps (networks by id and VNI,
	// the local VTEP). Taken alone or under a network lock; never held
	// while calling out of the driver.
	LevelDriver Level = 30
	// LevelCluster: the control plane's replicated store (cluster.mu).
	// Taken under a network lock when a network pulls its peers, and by
	// memberlist callbacks (memberlist's own locks are outside the
	// hierarchy and always taken before it).
	LevelCluster Level = 40
	// LevelClusterSender: one sender's queue, taken under cluster.mu or
	// alone.
	LevelClusterSender Level = 45
	// LevelClusterLocal: this host's own records, taken under a network
	// lock by PublishLocalPeer, or alone.
	LevelClusterLocal Level = 50
	// LevelLeaf: small leaf locks that guard a few fields and never call
	// out (the daemon's control-plane handle, rate limiters, counters,
	// the reaper's queue: a Leave queues its deletions under its network's
	// lock, and no deletion takes a network's lock).
	LevelLeaf Level = 90
)

var levelNames = map[Level]string{
	LevelVTEP:          "VTEP lock",
	LevelStart:         "control-plane start lock",
	LevelNetwork:       "network.mu",
	LevelEncryption:    "encryption lock",
	LevelAlloc:         "allocation lock",
	LevelIPAMAnnounce:  "IPAM announce lock",
	LevelIPAMPool:      "IPAM pool lock",
	LevelIPAM:          "IPAM lock",
	LevelDriver:        "driver.mu",
	LevelCluster:       "cluster.mu",
	LevelClusterSender: "cluster sender lock",
	LevelClusterLocal:  "cluster local-record lock",
	LevelLeaf:          "leaf lock",
}

// Levels returns every level of the hierarchy, top to bottom.
func Levels() []Level {
	return []Level{LevelVTEP, LevelStart, LevelNetwork, LevelEncryption, LevelAlloc, LevelIPAMAnnounce, LevelIPAMPool, LevelIPAM, LevelDriver, LevelCluster, LevelClusterSender, LevelClusterLocal, LevelLeaf}
}

func (l Level) String() string {
	if n, ok := levelNames[l]; ok {
		return n
	}
	return fmt.Sprintf("level %d", int(l))
}

// New returns an unlocked Mutex at level l. It panics if l is not one of
// the hierarchy's levels: a lock's level is decided where it is made.
func New(l Level) *Mutex {
	if _, ok := levelNames[l]; !ok {
		panic(fmt.Sprintf("lockorder.New: %d is not a level of the hierarchy", int(l)))
	}
	return &Mutex{level: l}
}

// Level returns m's level (0 for a Mutex not made by New).
func (m *Mutex) Level() Level { return m.level }
