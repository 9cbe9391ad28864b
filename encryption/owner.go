package encryption

import (
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/countmap"
	"github.com/overlayd/overlayd/internal/latency"
	"github.com/overlayd/overlayd/internal/lockorder"
	"github.com/overlayd/overlayd/internal/logkeys"
)

// DefaultTick is the default period of the Owner's unconditional reconcile.
const DefaultTick = 500 * time.Millisecond

// debounce is how long the Owner waits after a kernel notification before
// reconciling, so that a burst (a flush, or our own transaction echoed
// back) costs one reconcile.
const debounce = 20 * time.Millisecond

// espRetry is how often a host whose kernel could not install ESP states
// tries again (a module may have been loaded since).
const espRetry = time.Minute

// OwnerConfig configures an Owner.
type OwnerConfig struct {
	// NS is the namespace holding the underlay and the VXLAN sockets (the
	// Owner keeps its own reference; the caller may close NS).
	NS netns.NsHandle
	// Port is the VXLAN UDP port.
	Port int
	// Secret is the cluster secret keys derive from; nil: encrypted shares
	// are refused.
	Secret []byte
	// Store persists the key state; nil: in memory only (tests).
	Store  MetaStore
	Logger *slog.Logger
	// Tick is the period of the unconditional reconcile (default
	// DefaultTick).
	Tick time.Duration
	// CheckKernel reports whether the kernel can encrypt (default
	// CheckKernelSupport, or CheckKernelSupportIPv6 for an IPv6 VTEP).
	CheckKernel func() error
	// RotateEvery starts a cluster-wide key rotation periodically once
	// gossip is attached (0: only on Rotate).
	RotateEvery time.Duration
}

// MetaStore persists small records by key. The Owner's record is a core
// under MetaKey and an entry per remote under keys starting with
// MetaKey+"/remote/".
type MetaStore interface {
	GetMeta(key string) ([]byte, error) // nil, nil when absent
	// UpdateMeta writes every key of puts in one transaction, all or
	// none; a nil value deletes its key.
	UpdateMeta(puts map[string][]byte) error
	// ListMeta returns every key starting with prefix, with its value.
	ListMeta(prefix string) (map[string][]byte, error)
}

// MetaKey is the MetaStore key of the Owner's persisted state.
const MetaKey = "encryption"

// share is one network's registered share.
type share struct {
	vnis      []uint32 // sorted, unique
	encrypted bool
	// remotes the share counts in Owner.need, sorted and unique: its
	// Share.Remotes, plus those kept by a widening Update or added by
	// AddRemotes.
	remotes []netip.Addr
}

// Owner is the single owner of this host's encryption state: the key
// epochs and send generation, every network's share, the Programmer that
// holds the kernel to them, the rotation state machine and their
// persistence. See the package documentation for the design.
//
// All methods are safe for concurrent use. Update, AddRemotes,
// RemoveRemotes and Remove are called with a network's lock held
// (lockorder.LevelNetwork, above the Owner's LevelEncryption); the Owner never calls out of the package with its lock
// held (KeyGossip is called without it).
type Owner struct {
	cfg OwnerConfig
	log *slog.Logger
	// rotations times each rotation this host took part in, from the
	// step that raised the target to the one that retired the old epoch
	// (atomic: read by the metrics without the lock); rotStart is when
	// the one in progress began (zero: none), guarded by mu.
	rotations latency.Recorder
	rotStart  time.Time
	ns        netns.NsHandle // our own duplicate of cfg.NS, for the watchers
	notify    bool           // kernel notifications on (a test hook turns them off before Start)

	wake    chan struct{} // Poke
	kev     chan struct{} // kernel notifications
	stop    chan struct{}
	done    sync.WaitGroup
	started atomic.Bool
	closed  atomic.Bool

	mu *lockorder.Mutex // guards every field below

	prog   *Programmer // nil once closed
	local  netip.Addr
	shares map[ShareID]*share
	// need counts, for every remote VTEP, the shares that need it;
	// encVNIs and clearVNIs count the shares that have each VNI.
	need countmap.Map[netip.Addr]
	// needSorted is need's keys, sorted: an index kept with need (by
	// recountLocked), so that the desired state of thousands of remotes is
	// not sorted again on every change.
	needSorted []netip.Addr
	encVNIs    countmap.Map[uint32]
	clearVNIs  countmap.Map[uint32]

	keys NodeKeys // held by the kernel (or being installed)
	gen  uint64   // send generation
	// installed records, per epoch, the remotes an outbound SA under
	// (epoch, gen) was installed for (reserved and persisted before the
	// add). Such an SA is never added a second time: if it vanishes, the
	// Owner moves to a new gen instead.
	installed  map[uint32]map[netip.Addr]bool
	remoteGens map[netip.Addr]uint64 // advertised generations of remotes (last known)
	fresh      bool                  // gen was chosen by this process (no persisted gen)
	// adopted is what the previous run programmed, kept in the desired
	// state (adopting) until Restored: a restart never removes what a
	// running container needs before the driver registered its shares.
	adopted    programmed
	adopting   bool
	programmed programmed // what the last successful reconcile programmed
	verified   bool       // the first kernel check after loading happened
	// savedCore and savedRemotes are the persisted record as last
	// written: its core under MetaKey and each remote's entry (see
	// persist.go), so that a change writes only what differs.
	// persistAll: the next write must compare every remote (loaded from
	// an older record, or generations changed by adverts).
	savedCore    string
	savedRemotes map[netip.Addr]string
	persistAll   bool

	noESP   error     // the kernel could not install ESP states (wraps ErrKernelUnsupported)
	noESPAt time.Time //
	applied string    // fingerprint of the last Desired applied without error
	// appliedDigest is applied's digest of the remotes, kept so that a
	// change of a few remotes updates applied without visiting the others.
	appliedDigest remoteDigest
	// gensDirty: a needed remote's advertised generation changed since the
	// last full reconcile that succeeded (a change of the remotes alone
	// would not see it: the next change takes the full path).
	gensDirty bool
	held      bool  // the kernel holds keys and gen (last apply succeeded)
	applyErr  error // error of the last reconcile (nil: kernel matches)
	// closedErr is the part of applyErr that can let traffic cross in
	// clear (the rules or a policy missing): what Update, Remove and
	// SetLocal return. SA errors (a kernel without ESP, an SPI collision)
	// only drop the traffic of the pairs concerned: they are reported in
	// Status and retried, and must not fail another network's operation.
	closedErr error

	gossip     KeyGossip
	rotate     bool // a rotation was asked and not yet installed
	advertised Advert
	published  bool // advertised has been gossiped by this process

	lastErr        error
	lastErrAt      time.Time
	repairs        int
	lastRepair     time.Time
	lastRepairWhat string
	reconciles     int
	lastReconcile  time.Time
	genChanges     int
	genReason      string
	// deltaFailures counts incremental changes the kernel refused (each
	// followed by a full reconcile).
	deltaFailures int
}

// NewOwner returns an Owner for cfg. It loads the persisted state (a fresh
// host starts with a new random send generation) and opens the kernel
// sockets, but changes nothing in the kernel until Start, SetLocal or
// Update.
func NewOwner(cfg OwnerConfig) (*Owner, error) {
	if !cfg.NS.IsOpen() {
		return nil, errors.New("encryption owner: no network namespace")
	}
	if cfg.Port <= 0 || cfg.Port > 65535 {
		return nil, fmt.Errorf("encryption owner: invalid VXLAN port %d", cfg.Port)
	}
	if len(cfg.Secret) == 0 {
		cfg.Secret = nil
	} else if len(cfg.Secret) < MinSecretLen {
		return nil, fmt.Errorf("encryption owner: %w", ErrBadSecret)
	}
	if cfg.Tick <= 0 {
		cfg.Tick = DefaultTick
	}
	log := cfg.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	o := &Owner{
		cfg: cfg, log: log, notify: true,
		wake: make(chan struct{}, 1), kev: make(chan struct{}, 1), stop: make(chan struct{}),
		mu:         lockorder.New(lockorder.LevelEncryption),
		shares:     map[ShareID]*share{},
		installed:  map[uint32]map[netip.Addr]bool{},
		remoteGens: map[netip.Addr]uint64{},
	}
	if err := o.load(); err != nil {
		return nil, err
	}
	fd, err := unix.FcntlInt(uintptr(cfg.NS), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("encryption owner: failed to duplicate the namespace handle: %w", err)
	}
	o.ns = netns.NsHandle(fd)
	p, err := NewProgrammer(cfg.NS)
	if err != nil {
		o.ns.Close()
		return nil, fmt.Errorf("encryption owner: %w", err)
	}
	o.prog = p
	return o, nil
}

// Start starts the reconcile loop: every Tick, at once on kernel
// notifications (nftables and xfrm changes in NS), on Poke, and the key
// rotation once AttachGossip was called. Calling it again does nothing.
func (o *Owner) Start() {
	if o.closed.Load() || !o.started.CompareAndSwap(false, true) {
		return
	}
	if o.notify {
		o.startWatchers()
	}
	o.done.Add(1)
	go o.loop()
}

// Close stops the loop and releases the kernel sockets. It leaves the
// kernel state in place: encryption stays in force (and fails closed) while
// overlayd is down.
func (o *Owner) Close() {
	if !o.closed.CompareAndSwap(false, true) {
		return
	}
	close(o.stop)
	o.done.Wait()
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.prog != nil {
		o.prog.Close()
		o.prog = nil
	}
	o.ns.Close()
}

// Poke asks for a rotation step (and reconcile) soon: the members or their
// adverts changed. It never blocks.
func (o *Owner) Poke() {
	select {
	case o.wake <- struct{}{}:
	default:
	}
}

// AttachGossip connects the Owner to the control plane: from now on the
// loop steps the key rotation with what g returns and advertises through
// it.
func (o *Owner) AttachGossip(g KeyGossip) {
	o.mu.Lock()
	o.gossip = g
	o.published = false
	o.mu.Unlock()
	o.Poke()
}

// SetLocal sets the local VTEP, from the daemon's VTEP owner, and programs
// the kernel for it. Every key derives from it, so a change starts a new
// send generation.
func (o *Owner) SetLocal(vtep netip.Addr) error {
	vtep = vtep.Unmap()
	if !vtep.IsValid() || vtep.IsUnspecified() || vtep.Zone() != "" || vtep.IsMulticast() {
		return fmt.Errorf("encryption: invalid local VTEP address %v", vtep)
	}
	o.mu.Lock()
	if o.local == vtep && o.prog != nil && o.applyErr == nil && o.applied != "" {
		o.mu.Unlock()
		return nil
	}
	if o.local.IsValid() && o.local != vtep {
		o.newGenLocked(fmt.Sprintf("local VTEP changed from %v to %v", o.local, vtep))
	}
	o.local = vtep
	o.applyLocked("local VTEP", false)
	err := o.closedErr
	o.mu.Unlock()
	o.Poke()
	return err
}

// Update sets the share of id and programs the kernel before returning.
// With widen, the remotes the share had are kept until a later Update
// without widen: SAs and policies must exist before peers are programmed,
// and go only after their neighbours are gone. Called with the network's
// lock held (LevelNetwork → LevelEncryption).
//
// An invalid share (a VNI out of range, an invalid remote address, an
// encrypted share without cluster secret) is refused and changes nothing.
// A valid one is recorded even when programming fails, and the loop keeps
// trying. Update returns only the errors that could let traffic cross in
// clear (the rules or a policy could not be installed); SA errors (a kernel
// without ESP, an SPI collision) only drop the traffic of the pairs
// concerned, whatever network they belong to: they are in Status, not
// returned, so one network's trouble never fails another's operation.
func (o *Owner) Update(id ShareID, s Share, widen bool) error {
	sh, err := normShare(id, s)
	if err != nil {
		return err
	}
	if sh.encrypted && o.cfg.Secret == nil {
		return fmt.Errorf("encryption: share %d: encrypted networks need the cluster secret, which this host was started without", id)
	}
	o.mu.Lock()
	if o.prog == nil {
		o.mu.Unlock()
		return errors.New("encryption: Update on a closed Owner")
	}
	if o.local.IsValid() {
		for _, r := range sh.remotes {
			if r.Is4() != o.local.Is4() {
				o.mu.Unlock()
				return fmt.Errorf("encryption: share %d: remote VTEP %v is not of the local VTEP's (%v) address family", id, r, o.local)
			}
		}
	}
	old := o.shares[id]
	if widen && old != nil && sh.encrypted {
		sh.remotes = unionSorted(old.remotes, sh.remotes)
	}
	remotesOnly := old != nil && old.encrypted == sh.encrypted && slices.Equal(old.vnis, sh.vnis)
	crossed := o.recountLocked(old, sh)
	o.shares[id] = sh
	why := fmt.Sprintf("share %d", id)
	if remotesOnly {
		o.changeRemotesLocked(why, crossed)
	} else {
		o.applyLocked(why, true)
	}
	err = o.closedErr
	poke := o.advertStaleLocked()
	o.mu.Unlock()
	if poke {
		o.Poke()
	}
	return err
}

// AddRemotes adds remote VTEPs to the share of id (an encrypted network,
// registered by Update) and programs the kernel before returning; remotes
// the share has already are ignored. It costs what the change costs: the
// other remotes of the host are not visited (see changeRemotesLocked). The
// driver calls it before programming peers on new VTEPs. Errors as Update;
// an invalid address refuses the whole call and changes nothing.
func (o *Owner) AddRemotes(id ShareID, remotes ...netip.Addr) error {
	return o.changeShareRemotes(id, remotes, +1)
}

// RemoveRemotes removes remote VTEPs from the share of id and programs the
// kernel before returning; remotes the share does not have are ignored.
// The driver calls it once the peers on those VTEPs are gone.
func (o *Owner) RemoveRemotes(id ShareID, remotes ...netip.Addr) error {
	return o.changeShareRemotes(id, remotes, -1)
}

func (o *Owner) changeShareRemotes(id ShareID, remotes []netip.Addr, sign int) error {
	verb := "add"
	if sign < 0 {
		verb = "remove"
	}
	in := make([]netip.Addr, 0, len(remotes))
	for _, r := range remotes {
		if err := checkRemote(id, r); err != nil {
			return err
		}
		in = append(in, r.Unmap())
	}
	in = sortedUnique(in)
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.prog == nil {
		return fmt.Errorf("encryption: share %d: %s remotes on a closed Owner", id, verb)
	}
	sh := o.shares[id]
	switch {
	case sh == nil:
		return fmt.Errorf("encryption: share %d: cannot %s remotes %v: the share is not registered (Update first)", id, verb, in)
	case !sh.encrypted:
		return fmt.Errorf("encryption: share %d: cannot %s remotes %v: the share is not encrypted (only encrypted shares have remotes)", id, verb, in)
	}
	if sign > 0 && o.local.IsValid() {
		for _, r := range in {
			if r.Is4() != o.local.Is4() {
				return fmt.Errorf("encryption: share %d: remote VTEP %v is not of the local VTEP's (%v) address family", id, r, o.local)
			}
		}
	}
	var crossed []netip.Addr
	for _, r := range in {
		i, has := slices.BinarySearchFunc(sh.remotes, r, netip.Addr.Compare)
		switch {
		case sign > 0 && !has:
			sh.remotes = slices.Insert(sh.remotes, i, r)
		case sign < 0 && has:
			sh.remotes = slices.Delete(sh.remotes, i, i+1)
		default:
			continue
		}
		if o.needLocked(r, sign, true) {
			crossed = append(crossed, r)
		}
	}
	o.changeRemotesLocked(fmt.Sprintf("share %d: %s %d remotes", id, verb, len(in)), crossed)
	err := o.closedErr
	if o.advertStaleLocked() {
		o.Poke()
	}
	return err
}

// Remove drops the share of id and programs the kernel before returning.
func (o *Owner) Remove(id ShareID) error {
	o.mu.Lock()
	if o.prog == nil {
		o.mu.Unlock()
		return errors.New("encryption: Remove on a closed Owner")
	}
	old, ok := o.shares[id]
	if !ok {
		o.mu.Unlock()
		return nil
	}
	o.recountLocked(old, nil)
	delete(o.shares, id)
	o.applyLocked(fmt.Sprintf("share %d removed", id), true)
	err := o.closedErr
	poke := o.advertStaleLocked()
	o.mu.Unlock()
	if poke {
		o.Poke()
	}
	return err
}

func normShare(id ShareID, s Share) (*share, error) {
	sh := &share{encrypted: s.Encrypted}
	for _, v := range s.VNIs {
		if v == 0 || v > 1<<24-1 {
			return nil, fmt.Errorf("encryption: share %d: invalid VNI %d", id, v)
		}
	}
	sh.vnis = sortedVNIs(s.VNIs)
	if !s.Encrypted {
		return sh, nil
	}
	// Room to grow: AddRemotes inserts in place.
	sh.remotes = make([]netip.Addr, 0, len(s.Remotes)+len(s.Remotes)/8+4)
	for _, r := range s.Remotes {
		if err := checkRemote(id, r); err != nil {
			return nil, err
		}
		sh.remotes = append(sh.remotes, r.Unmap())
	}
	sh.remotes = sortedUnique(sh.remotes)
	return sh, nil
}

func checkRemote(id ShareID, r netip.Addr) error {
	r = r.Unmap()
	if !r.IsValid() || r.IsUnspecified() || r.Zone() != "" || r.IsMulticast() {
		return fmt.Errorf("encryption: share %d: invalid remote VTEP address %v", id, r)
	}
	return nil
}

// sortedUnique sorts l in place (unless it is sorted already, as the
// driver passes it) and drops duplicates.
func sortedUnique(l []netip.Addr) []netip.Addr {
	if !slices.IsSortedFunc(l, netip.Addr.Compare) {
		slices.SortFunc(l, netip.Addr.Compare)
	}
	return slices.Compact(l)
}

// unionSorted merges two sorted, unique lists into a new one.
func unionSorted(a, b []netip.Addr) []netip.Addr {
	out := make([]netip.Addr, 0, max(len(a), len(b)))
	i, j := 0, 0
	for i < len(a) || j < len(b) {
		switch {
		case j == len(b) || (i < len(a) && a[i].Compare(b[j]) < 0):
			out = append(out, a[i])
			i++
		case i == len(a) || b[j].Compare(a[i]) < 0:
			out = append(out, b[j])
			j++
		default:
			out = append(out, a[i])
			i, j = i+1, j+1
		}
	}
	return out
}

// diffSorted returns what is in b and not in a (added) and what is in a
// and not in b (gone), for sorted, unique lists: one merge, no map.
func diffSorted(a, b []netip.Addr) (added, gone []netip.Addr) {
	i, j := 0, 0
	for i < len(a) || j < len(b) {
		switch {
		case j == len(b) || (i < len(a) && a[i].Compare(b[j]) < 0):
			gone = append(gone, a[i])
			i++
		case i == len(a) || b[j].Compare(a[i]) < 0:
			added = append(added, b[j])
			j++
		default:
			i, j = i+1, j+1
		}
	}
	return added, gone
}

// needLocked counts remote r as needed by one share more (delta +1) or
// fewer (-1), keeping needSorted when index is set, and reports whether
// r's need crossed zero (it is needed now and was not, or the reverse).
func (o *Owner) needLocked(r netip.Addr, delta int, index bool) bool {
	before := o.need.Get(r)
	n := o.need.Add(r, delta)
	if (before == 0) == (n == 0) {
		return false
	}
	if index {
		i, found := slices.BinarySearchFunc(o.needSorted, r, netip.Addr.Compare)
		if n > 0 && !found {
			o.needSorted = slices.Insert(o.needSorted, i, r)
		} else if n == 0 && found {
			o.needSorted = slices.Delete(o.needSorted, i, i+1)
		}
	}
	return true
}

// recountLocked replaces share old (nil: none) by sh (nil: none) in the
// counts and returns, sorted, the remotes whose need crossed zero. Only
// the remotes that differ between them are counted again (found by
// merging the sorted lists), so a network of 1,000 remotes gaining one
// costs one count.
func (o *Owner) recountLocked(old, sh *share) []netip.Addr {
	for _, x := range []struct {
		sh    *share
		delta int
	}{{old, -1}, {sh, +1}} {
		if x.sh == nil {
			continue
		}
		for _, v := range x.sh.vnis {
			if x.sh.encrypted {
				o.encVNIs.Add(v, x.delta)
			} else {
				o.clearVNIs.Add(v, x.delta)
			}
		}
	}
	var before, after []netip.Addr
	if old != nil {
		before = old.remotes
	}
	if sh != nil {
		after = sh.remotes
	}
	added, gone := diffSorted(before, after)
	// Many changes at once (a network gone): re-sort the index once
	// rather than move it for each.
	bulk := len(gone)+len(added) > 16
	var crossed []netip.Addr
	for _, r := range gone {
		if o.needLocked(r, -1, !bulk) {
			crossed = append(crossed, r)
		}
	}
	for _, r := range added {
		if o.needLocked(r, +1, !bulk) {
			crossed = append(crossed, r)
		}
	}
	if bulk {
		o.needSorted = slices.SortedFunc(func(yield func(netip.Addr) bool) {
			o.need.Range(func(r netip.Addr, _ int) bool { return yield(r) })
		}, netip.Addr.Compare)
	}
	slices.SortFunc(crossed, netip.Addr.Compare)
	return crossed
}

// Restored tells the Owner that the driver has registered the share of
// every network it restored after a restart. Until then the Owner keeps
// what the previous run programmed (persisted), so that a restart never
// removes a rule, policy or SA that a running container needs; from now on
// only the shares count.
func (o *Owner) Restored() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if !o.adopting {
		return nil
	}
	o.adopting, o.adopted = false, programmed{}
	return o.applyLocked("restored", false)
}

// Rotate starts a cluster-wide key rotation and returns the epoch asked
// for. It fails while keys are not established or gossip is not attached.
func (o *Owner) Rotate() (uint32, error) {
	o.mu.Lock()
	switch {
	case o.gossip == nil:
		o.mu.Unlock()
		return 0, errors.New("encryption: key rotation needs the control plane, which is not attached yet")
	case o.keys.Send == 0:
		o.mu.Unlock()
		return 0, errors.New("encryption: keys are not established yet; retry in a moment")
	}
	o.rotate = true
	target := StartRotation(o.keys).Target
	o.mu.Unlock()
	o.Poke()
	return target, nil
}

// CheckSupport reports whether encrypted networks can work on this host:
// the cluster secret is present and the kernel can encrypt. The error says
// what is missing.
func (o *Owner) CheckSupport() error {
	if o.cfg.Secret == nil {
		return errors.New("encrypted networks need the cluster secret, which this host was started without")
	}
	check := o.cfg.CheckKernel
	if check == nil {
		o.mu.Lock()
		v6 := o.local.IsValid() && o.local.Is6()
		o.mu.Unlock()
		check = CheckKernelSupport
		if v6 {
			check = CheckKernelSupportIPv6
		}
	}
	if err := check(); err != nil {
		return fmt.Errorf("this host cannot encrypt, so encrypted networks are refused (never sent in clear): %w", err)
	}
	return nil
}

// Audit compares the kernel with the desired state, one line per
// difference; empty means the kernel holds exactly what the shares, keys
// and generations ask for.
func (o *Owner) Audit() []string {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.prog == nil {
		return []string{"encryption: Audit on a closed Owner"}
	}
	if !o.local.IsValid() {
		if o.encVNIs.Len() > 0 {
			return []string{"encryption: encrypted VNIs but no local VTEP yet (SetLocal not called)"}
		}
		return nil
	}
	ax, err := o.prog.xfrmDump()
	if err != nil {
		return []string{err.Error()}
	}
	d := o.desiredLocked()
	d.KeepOutbound = o.keptLocked(&d, ax)
	return o.prog.Audit(d)
}

// Status is the Owner's state for `overlayd status` (JSON-able, never key
// bytes).
type Status struct {
	Local         netip.Addr   `json:"local"`
	Port          int          `json:"port"`
	Accept        []uint32     `json:"accept"`
	Send          uint32       `json:"send"`
	Target        uint32       `json:"target"`
	Gen           uint64       `json:"gen,string"`
	GenChanges    int          `json:"gen_changes"`          // new generations chosen by this process
	GenReason     string       `json:"gen_reason,omitempty"` // why the last one was chosen
	EncryptedVNIs []uint32     `json:"encrypted_vnis"`
	ClearVNIs     []uint32     `json:"clear_vnis"`
	Shares        int          `json:"shares"`
	Pairs         []PairStatus `json:"pairs"`
	// ESPUnsupported: the kernel cannot install ESP states; encrypted VNIs
	// are dropped both ways.
	ESPUnsupported bool `json:"esp_unsupported,omitempty"`
	GossipAttached bool `json:"gossip_attached"`
	Advertised     bool `json:"advertised"` // the current keys and generation are gossiped
	Rotating       bool `json:"rotating"`   // a rotation was asked and is not installed yet
	// Error is the error of the last reconcile ("": the kernel holds the
	// desired state); LastError the last error of any kind and when.
	Error         string    `json:"error,omitempty"`
	LastError     string    `json:"last_error,omitempty"`
	LastErrorAt   time.Time `json:"last_error_at,omitzero"`
	Repairs       int       `json:"repairs"` // reconciles that found and fixed drift
	LastRepair    time.Time `json:"last_repair,omitzero"`
	LastRepairWas string    `json:"last_repair_was,omitempty"`
	Reconciles    int       `json:"reconciles"`
	LastReconcile time.Time `json:"last_reconcile,omitzero"`
	// DeltaFailures counts incremental changes (Update, Remove) the kernel
	// refused; each was followed at once by a full reconcile.
	DeltaFailures int `json:"delta_failures,omitempty"`
}

// Status returns the Owner's state, with SA counters read from the kernel.
func (o *Owner) Status() Status {
	o.mu.Lock()
	defer o.mu.Unlock()
	d := o.desiredLocked()
	st := Status{
		Local: o.local, Port: o.cfg.Port,
		Accept: slices.Clone(o.keys.Accept), Send: o.keys.Send, Target: o.keys.Target,
		Gen: o.gen, GenChanges: o.genChanges, GenReason: o.genReason,
		EncryptedVNIs: d.VNIs, ClearVNIs: d.ClearVNIs, Shares: len(o.shares),
		ESPUnsupported: o.noESP != nil,
		GossipAttached: o.gossip != nil,
		Advertised:     o.published && o.advertised.Equal(Advert{Keys: o.keys, Gen: o.gen}),
		Rotating:       o.rotate,
		Repairs:        o.repairs, LastRepair: o.lastRepair, LastRepairWas: o.lastRepairWhat,
		Reconciles: o.reconciles, LastReconcile: o.lastReconcile,
		DeltaFailures: o.deltaFailures,
	}
	if st.EncryptedVNIs == nil {
		st.EncryptedVNIs = sortedVNIs(o.encVNIs.Keys())
	}
	if st.ClearVNIs == nil {
		st.ClearVNIs = minus(sortedVNIs(o.clearVNIs.Keys()), st.EncryptedVNIs)
	}
	if o.applyErr != nil {
		st.Error = o.applyErr.Error()
	} else if err := o.unsupportedFor(&d); err != nil {
		st.Error = err.Error()
	}
	if o.lastErr != nil {
		st.LastError, st.LastErrorAt = o.lastErr.Error(), o.lastErrAt
	}
	if st.Accept == nil {
		st.Accept = []uint32{}
	}
	if st.ClearVNIs == nil {
		st.ClearVNIs = []uint32{}
	}
	if st.EncryptedVNIs == nil {
		st.EncryptedVNIs = []uint32{}
	}
	st.Pairs = []PairStatus{}
	if o.prog != nil && o.local.IsValid() && !d.Empty() {
		if ax, err := o.prog.xfrmDump(); err == nil {
			d.KeepOutbound = o.keptLocked(&d, ax)
		}
		pairs, err := o.prog.Status(d)
		if err != nil && st.Error == "" {
			st.Error = err.Error()
		}
		for i := range pairs {
			pairs[i].Shares = o.need.Get(pairs[i].Remote)
		}
		if pairs != nil {
			st.Pairs = pairs
		}
	}
	return st
}

// desiredLocked is the kernel state the shares, keys and generations ask
// for, without KeepOutbound (which depends on what the kernel holds).
func (o *Owner) desiredLocked() Desired {
	enc, clear, remotes := o.encVNIs.Keys(), o.clearVNIs.Keys(), o.needSorted
	if o.adopting {
		enc = append(enc, o.adopted.enc...)
		clear = append(clear, o.adopted.clear...)
		remotes = sortedAddrs(slices.Concat(remotes, o.adopted.remotes))
	}
	enc = sortedVNIs(enc)
	if len(enc) == 0 || !o.local.IsValid() {
		return Desired{}
	}
	d := Desired{
		Local: o.local, Port: o.cfg.Port,
		VNIs: enc, ClearVNIs: minus(sortedVNIs(clear), enc),
		Accept: slices.Clone(o.keys.Accept), Send: o.keys.Send, Gen: o.gen,
		Secret: o.cfg.Secret, NoSAs: o.noESP != nil,
		Remotes:    make([]netip.Addr, 0, len(remotes)),
		RemoteGens: make(map[netip.Addr]uint64, len(remotes)),
	}
	// remotes is sorted, and so d.Remotes.
	for _, r := range remotes {
		// A remote claiming our own VTEP (our own endpoint seen through
		// another network) is no pair to encrypt; one of the other family
		// was refused by Update.
		if r == o.local || r.Is4() != o.local.Is4() {
			continue
		}
		d.Remotes = append(d.Remotes, r)
		if g, ok := o.remoteGens[r]; ok {
			d.RemoteGens[r] = g
		}
	}
	return d
}

// outboundOK reports whether the kernel holds, intact, the outbound SA to r
// for (d.Send, d.Gen).
func (o *Owner) outboundOK(d *Desired, ax *actualXfrm, r netip.Addr) bool {
	var cache *deriveCache
	if o.prog != nil {
		cache = o.prog.derived
	}
	w, err := outboundWantCached(d, r, cache)
	if err != nil {
		return false
	}
	got, ok := ax.states[w.key]
	return ok && stateDiff(&got, w, d.Port) == ""
}

func outboundWant(d *Desired, r netip.Addr) (*wantState, error) { return outboundWantCached(d, r, nil) }

// outboundWantCached is outboundWant with the SPI and key from cache (nil:
// derived).
func outboundWantCached(d *Desired, r netip.Addr, cache *deriveCache) (*wantState, error) {
	spi, k, err := cache.derive(d.Secret, d.Local, r, d.Send, d.Gen)
	if err != nil {
		return nil, err
	}
	return &wantState{key: stateKey{r, spi}, src: d.Local, epoch: d.Send, gen: d.Gen, remote: r, outbound: true, aeadKey: k}, nil
}

// keptLocked returns the remotes no longer needed whose outbound SA for
// (Send, gen) this Owner installed and the kernel still holds: they are
// kept (never re-created) until the epoch or generation changes.
func (o *Owner) keptLocked(d *Desired, ax *actualXfrm) []netip.Addr {
	if d.Empty() || d.Send == 0 || d.NoSAs {
		return nil
	}
	var keep []netip.Addr
	for r := range o.installed[d.Send] {
		// d.Remotes is sorted (desiredLocked): no quadratic scan with
		// thousands of remotes.
		if _, needed := slices.BinarySearchFunc(d.Remotes, r, netip.Addr.Compare); !needed && r != d.Local && r.Is4() == d.Local.Is4() && o.outboundOK(d, ax, r) {
			keep = append(keep, r)
		}
	}
	slices.SortFunc(keep, netip.Addr.Compare)
	return keep
}

// newGenLocked moves to a new random send generation: every outbound SA is
// re-created under it (new keys, new SPIs) and it is advertised, so peers
// install the matching inbound SAs.
func (o *Owner) newGenLocked(reason string) {
	old := o.gen
	o.gen = randomGen(old)
	o.installed = map[uint32]map[netip.Addr]bool{}
	o.genChanges++
	o.genReason = reason
	o.held = false
	if err := o.persistLocked(); err != nil {
		o.noteErrLocked(err)
	}
	o.log.Info("new send generation", logkeys.Event, logkeys.SendGeneration, logkeys.Kind, reason, "gen", fmt.Sprintf("%016x", o.gen), "previous", fmt.Sprintf("%016x", old))
}

func randomGen(not uint64) uint64 {
	var b [8]byte
	for {
		if _, err := rand.Read(b[:]); err != nil {
			// crypto/rand does not fail on Linux; never fall back to
			// something predictable.
			panic(fmt.Sprintf("encryption: no randomness for a send generation: %v", err))
		}
		if g := binary.BigEndian.Uint64(b[:]); g != 0 && g != not {
			return g
		}
	}
}

var errNoLocal = errors.New("encryption: the local VTEP is not known yet (SetLocal not called); nothing programmed")

// applyLocked makes the kernel hold the desired state. It is the one path
// every change and every reconcile takes. With fromUpdate, it skips the
// kernel when the desired state is the one last applied without error (the
// loop reconciles it anyway).
func (o *Owner) applyLocked(why string, fromUpdate bool) error {
	if o.prog == nil {
		return errors.New("encryption: the Owner is closed")
	}
	if !o.local.IsValid() {
		if o.encVNIs.Len() == 0 {
			o.closedErr = nil
			return nil
		}
		o.applyErr, o.closedErr = errNoLocal, errNoLocal
		return errNoLocal
	}
	if o.noESP != nil && time.Since(o.noESPAt) > espRetry {
		o.noESP = nil // try again: a module may have been loaded
	}
	base := o.desiredLocked()
	fp := base.fingerprint()
	if fromUpdate && o.applyErr == nil && fp == o.applied {
		o.closedErr = nil
		return o.unsupportedFor(&base)
	}
	// A change (Update, Remove) is planned against the Programmer's
	// record of the kernel: no dump, only the difference is sent. The loop
	// (tick, kernel notifications) and everything else dump and compare.
	ax, delta := (*actualXfrm)(nil), false
	if fromUpdate {
		ax, delta = o.prog.knownXfrm(base.Local, base.Port)
	}
	if !delta {
		var err error
		if ax, err = o.prog.xfrmDump(); err != nil {
			o.applyErr, o.closedErr = err, err
			o.noteErrLocked(err)
			return err
		}
	}
	drift := false
	if !o.verified && base.Send != 0 && !base.NoSAs && len(base.Remotes) > 0 {
		o.verified = true
		if !o.fresh && !o.anyOutboundLocked(ax) {
			o.newGenLocked("the kernel holds no outbound SA of this host (first start on this kernel, reboot, or a restored state file)")
			drift = true
			base = o.desiredLocked()
			fp = base.fingerprint()
		}
	}
	d := base
	var blocked []netip.Addr
	if !d.Empty() && d.Send != 0 && !d.NoSAs {
		// The remotes to check against the kernel: all of them, or for a
		// change planned against the record with the same keys and
		// generation, those whose state changes (the others were checked
		// against the same record by the apply that made it).
		scope := d.Remotes
		if delta {
			if s, ok := o.prog.changedRemotes(&base); ok {
				scope = s
			}
		}
		// An outbound SA this Owner installed under (Send, gen) and that is
		// needed but gone (flushed, host rebooted) is never added again:
		// move to a new generation.
		for _, r := range scope {
			if o.installed[d.Send][r] && !o.outboundOK(&d, ax, r) {
				w, _ := outboundWant(&d, r)
				spi := uint32(0)
				if w != nil {
					spi = w.key.spi
				}
				o.newGenLocked(fmt.Sprintf("outbound SA to %v (epoch %d, spi 0x%08x) vanished from the kernel", r, d.Send, spi))
				drift = true
				base = o.desiredLocked()
				fp = base.fingerprint()
				d = base
				scope = d.Remotes
				break
			}
		}
		// Reserve (and persist) before adding: an SA is added at most once
		// per (epoch, remote, gen).
		var reserve []netip.Addr
		for _, r := range scope {
			if !o.installed[d.Send][r] && !o.outboundOK(&d, ax, r) {
				reserve = append(reserve, r)
			}
		}
		if len(reserve) > 0 {
			if o.installed[d.Send] == nil {
				o.installed[d.Send] = map[netip.Addr]bool{}
			}
			for _, r := range reserve {
				o.installed[d.Send][r] = true
			}
			if err := o.persistLocked(); err != nil {
				for _, r := range reserve {
					delete(o.installed[d.Send], r)
				}
				blocked = reserve
				o.noteErrLocked(fmt.Errorf("%w; outbound SAs to %v not installed (their traffic is dropped)", err, reserve))
			}
		}
		// An SA the kernel holds intact under (Send, gen) is ours even if
		// the record missed it (adopted): remember it.
		if o.installed[d.Send] == nil {
			o.installed[d.Send] = map[netip.Addr]bool{}
		}
		for _, r := range scope {
			if !o.installed[d.Send][r] && !slices.Contains(blocked, r) && o.outboundOK(&d, ax, r) {
				o.installed[d.Send][r] = true
			}
		}
		d.KeepOutbound = o.keptLocked(&d, ax)
		d.Blocked = blocked
	}
	before, statsBefore := o.prog.changed, o.prog.Stats()
	var res execResult
	var err error
	if delta {
		var done bool
		res, err, done = o.prog.applyDelta(&d)
		// A kernel without ESP is handled below (a full apply without SAs).
		if done && err != nil && !res.unsupported {
			// The kernel refused part of the change (or our record of it
			// was wrong): reconcile in full at once, from dumps, so the
			// kernel is never left half-programmed. Everything the
			// attempt decided from the record (reservations, kept SAs,
			// a vanished SA) is decided again from the dumps.
			for _, r := range res.failedOut {
				delete(o.installed[d.Send], r)
			}
			o.deltaFailures++
			o.log.Info("an incremental encryption change failed; reconciling in full", "trigger", why, "error", err)
			return o.applyLocked(why+" (full reconcile after a failed change)", false)
		}
		if !done {
			res, err = o.prog.apply(&d, nil)
		}
	} else {
		res, err = o.prog.apply(&d, ax)
	}
	changes := o.prog.changed - before
	now := time.Now()
	o.reconciles++
	o.lastReconcile = now
	for _, r := range res.failedOut {
		// The kernel never held it, so its key was never used.
		delete(o.installed[d.Send], r)
	}
	if res.unsupported && o.noESP == nil {
		o.noESP, o.noESPAt = err, now
		// WARN, not ERROR: a property of the host, the same on every
		// reconcile, that overlayd cannot fix; the traffic fails closed
		// (dropped, never sent in clear), and the daemon said at start
		// that encrypted networks are unavailable here.
		o.log.Warn(ESPUnsupportedWarning, logkeys.Event, logkeys.EncryptionUnsupported, logkeys.Error, err)
		// Program the fail-closed state without SAs at once.
		d.NoSAs = true
		d.KeepOutbound = nil
		res, err = o.prog.apply(&d, nil)
		changes = o.prog.changed - before
		base.NoSAs = true
		fp = base.fingerprint()
	}
	if err == nil && len(blocked) > 0 {
		err = fmt.Errorf("encryption: outbound SAs to %v not installed: their reservation could not be persisted", blocked)
	}
	if err == nil && len(res.collisions) == 0 {
		// A repair: the kernel had to change although nothing we want
		// did (or only our generation, because the kernel lost an SA).
		if (fp == o.applied || drift) && changes > 0 {
			o.repairs++
			o.lastRepair = now
			o.lastRepairWhat = fmt.Sprintf("%s: %v", why, o.prog.Stats().Sub(statsBefore))
			o.log.Info("repaired encryption state that changed behind overlayd's back", logkeys.Event, logkeys.ReconcileRepair,
				logkeys.Kind, logkeys.KindEncryption, logkeys.Trigger, why, logkeys.Count, changes,
				"kernel", o.prog.Stats().Sub(statsBefore).String())
		}
		o.applied, o.appliedDigest = fp, base.digest()
		o.gensDirty = false
	}
	o.held = err == nil
	o.closedErr = errors.Join(res.failClosed...)
	if err == nil && len(res.collisions) > 0 {
		// A collision loses one pair's traffic in one epoch (dropped);
		// everything else is held, and keys may advance.
		err = errors.Join(res.collisions...)
	}
	if err != nil {
		if o.applyErr == nil || o.applyErr.Error() != err.Error() {
			o.log.Error("encryption state not fully programmed", "trigger", why, "error", err)
		}
		o.noteErrLocked(err)
	} else if o.applyErr != nil {
		o.log.Info("encryption state programmed again", "trigger", why)
	}
	o.applyErr = err
	if err != nil {
		// Reservations may have changed without being written: the next
		// write compares every remote's entry.
		o.persistAll = true
	}
	if err == nil {
		o.programmed = programmed{enc: d.VNIs, clear: d.ClearVNIs, remotes: withRoom(d.Remotes)}
		o.pruneLocked()
		if perr := o.persistLocked(); perr != nil {
			o.noteErrLocked(perr)
		}
	}
	if err == nil {
		return o.unsupportedFor(&base)
	}
	return err
}

// changeRemotesLocked programs a change of the shares' remotes alone (no
// VNI changed, nor keys, generation or VTEP): crossed are the remotes,
// sorted, whose need went from zero or to zero. When the Programmer has a
// record of the last reconcile that holds everything else as now, the
// change is planned from the crossed remotes alone (applyRemotesLocked):
// its cost does not depend on how many remotes the host has. Otherwise it
// takes the path of every change (applyLocked).
func (o *Owner) changeRemotesLocked(why string, crossed []netip.Addr) {
	if len(crossed) == 0 && o.applyErr == nil && o.applied != "" && !o.gensDirty {
		// The desired state did not change and the kernel held it.
		o.closedErr = nil
		return
	}
	if !o.applyRemotesLocked(why, crossed) {
		o.applyLocked(why, true)
	}
}

// applyRemotesLocked is applyLocked for a change of the remotes in crossed
// alone, planned against the Programmer's record: only those remotes are
// looked at (their need, generation, outbound SA reservation, whether
// their outbound SA is kept), the record's Desired is patched for them,
// and the fingerprint of what is applied is updated through its digest.
// It reports false, having changed nothing, when the change cannot be
// planned that way (no record, the last reconcile failed, a generation
// changed since, adoption after a restart, the first check of the kernel
// still to do, an outbound SA of a crossed remote missing from the record
// (the full path moves to a new generation), an SPI collision, a
// reservation that could not be persisted); the caller then takes the
// full path.
func (o *Owner) applyRemotesLocked(why string, crossed []netip.Addr) bool {
	p := o.prog
	if p == nil || !o.local.IsValid() || o.encVNIs.Len() == 0 || o.adopting || o.applyErr != nil || o.applied == "" || o.gensDirty {
		return false
	}
	if (!o.verified && o.keys.Send != 0 && o.noESP == nil) || (o.noESP != nil && time.Since(o.noESPAt) > espRetry) {
		return false
	}
	k := p.known
	if k == nil || k.last == nil || len(k.last.Blocked) > 0 {
		return false
	}
	last := k.last
	m := Desired{
		Local: o.local, Port: o.cfg.Port, VNIs: last.VNIs, ClearVNIs: last.ClearVNIs,
		Accept: slices.Clone(o.keys.Accept), Send: o.keys.Send, Gen: o.gen, Secret: o.cfg.Secret, NoSAs: o.noESP != nil,
		RemoteGens: map[netip.Addr]uint64{},
	}
	sas := m.Send != 0 && !m.NoSAs
	dig := o.appliedDigest
	var touched, reserve, adopt []netip.Addr
	for _, r := range crossed {
		// Never a pair (see desiredLocked).
		if r == o.local || r.Is4() != o.local.Is4() {
			continue
		}
		_, inLast := slices.BinarySearchFunc(last.Remotes, r, netip.Addr.Compare)
		needed := o.need.Get(r) > 0
		if needed == inLast {
			return false // the record does not hold what the counts say it held
		}
		touched = append(touched, r)
		if !needed {
			g, ok := last.RemoteGens[r]
			dig.add(r, g, ok, -1)
			if sas && o.installed[m.Send][r] && o.outboundOK(&m, k.x, r) {
				m.KeepOutbound = append(m.KeepOutbound, r)
			}
			continue
		}
		m.Remotes = append(m.Remotes, r)
		g, ok := o.remoteGens[r]
		if ok {
			m.RemoteGens[r] = g
		}
		dig.add(r, g, ok, +1)
		if !sas {
			continue
		}
		switch installed, intact := o.installed[m.Send][r], o.outboundOK(&m, k.x, r); {
		case installed && !intact:
			return false
		case !installed && intact:
			adopt = append(adopt, r)
		case !installed:
			reserve = append(reserve, r)
		}
	}
	if len(touched) == 0 {
		// Only remotes that are never a pair crossed (our own VTEP seen
		// through another network, or one of the other family): the
		// desired state, its digest and the kernel are what they were.
		// The Programmer must not be asked: without touched remotes its
		// plan would cover every remote, against m that holds none.
		o.closedErr = nil
		return true
	}
	dx, ok := p.remotesApplicable(&m, touched)
	if !ok {
		return false
	}
	// Reserve (and persist) before adding: an SA is added at most once per
	// (epoch, remote, gen).
	if len(reserve)+len(adopt) > 0 {
		if o.installed[m.Send] == nil {
			o.installed[m.Send] = map[netip.Addr]bool{}
		}
		for _, r := range slices.Concat(reserve, adopt) {
			o.installed[m.Send][r] = true
		}
	}
	if len(reserve) > 0 {
		if err := o.persistRemotesLocked(reserve); err != nil {
			for _, r := range reserve {
				delete(o.installed[m.Send], r)
			}
			return false // the full path blocks them and reports it
		}
	}
	res, err := p.applyRemotes(&m, dx, touched)
	for _, r := range res.failedOut {
		// The kernel never held it, so its key was never used.
		delete(o.installed[m.Send], r)
	}
	now := time.Now()
	o.reconciles++
	o.lastReconcile = now
	if err != nil {
		if !res.unsupported {
			o.deltaFailures++
			o.log.Info("an incremental encryption change failed; reconciling in full", "trigger", why, "error", err)
			why += " (full reconcile after a failed change)"
		}
		// The record is gone: this dumps, and decides again from the
		// kernel what the attempt decided from the record.
		o.applyLocked(why, false)
		return true
	}
	// applied is the fingerprint of desiredLocked's state, which has no
	// kept or blocked remotes: hashing the record's lists of them (kept
	// outbound SAs pile up with every host that leaves until the next
	// rotation) would make every change cost O(hosts that left).
	base := *last
	base.KeepOutbound, base.Blocked = nil, nil
	o.applied = base.fingerprintWith(dig)
	o.appliedDigest = dig
	o.held = true
	o.closedErr = errors.Join(res.failClosed...)
	for _, r := range touched {
		o.programmed.remotes = setMember(o.programmed.remotes, r, o.need.Get(r) > 0)
	}
	if o.pruneLocked() {
		o.persistAll = true // every remote's entry may have lost an epoch
	}
	// The touched remotes' entries (reservation, programmed flag): a
	// change writes its own entries, not one per remote of the host.
	if perr := o.persistRemotesLocked(touched); perr != nil {
		o.noteErrLocked(perr)
	}
	return true
}

// unsupportedFor returns the kernel's inability to encrypt when d needs it.
func (o *Owner) unsupportedFor(d *Desired) error {
	if o.noESP != nil && !d.Empty() && len(d.Remotes) > 0 {
		return o.noESP
	}
	return nil
}

// anyOutboundLocked reports whether the kernel holds any SA of ours from
// the local VTEP.
func (o *Owner) anyOutboundLocked(ax *actualXfrm) bool {
	for _, s := range ax.states {
		if addrOf(s.Src) == o.local {
			return true
		}
	}
	return false
}

// pruneLocked forgets installed records of epochs older than Send (Send
// never goes back) and generations of remotes nobody needs or advertises.
func (o *Owner) pruneLocked() (pruned bool) {
	for e := range o.installed {
		if e < o.keys.Send {
			delete(o.installed, e)
			pruned = true
		}
	}
	return pruned
}

func (o *Owner) noteErrLocked(err error) {
	o.lastErr, o.lastErrAt = err, time.Now()
}

// advertStaleLocked reports whether what is gossiped differs from what the
// kernel holds (a new generation, new keys).
func (o *Owner) advertStaleLocked() bool {
	return o.held && (!o.published || !o.advertised.Equal(Advert{Keys: o.keys, Gen: o.gen}))
}

// loop runs the reconcile and the key rotation.
func (o *Owner) loop() {
	defer o.done.Done()
	tick := time.NewTicker(o.cfg.Tick)
	defer tick.Stop()
	var rotate <-chan time.Time
	if o.cfg.RotateEvery > 0 {
		t := time.NewTicker(o.cfg.RotateEvery)
		defer t.Stop()
		rotate = t.C
	}
	var deb *time.Timer
	var debC <-chan time.Time
	defer func() {
		if deb != nil {
			deb.Stop()
		}
	}()
	o.cycle("start")
	for {
		select {
		case <-o.stop:
			return
		case <-tick.C:
			o.cycle("tick")
		case <-o.wake:
			o.cycle("poke")
		case <-o.kev:
			if debC == nil {
				deb = time.NewTimer(debounce)
				debC = deb.C
			}
		case <-debC:
			debC = nil
			o.cycle("kernel notification")
		case <-rotate:
			o.mu.Lock()
			if o.gossip != nil && o.keys.Send != 0 {
				o.rotate = true
				o.log.Info("periodic key rotation")
			}
			o.mu.Unlock()
			o.cycle("periodic rotation")
		}
	}
}

// cycle is one turn of the loop: read the adverts (without the lock), step
// the keys and reconcile the kernel (under the lock), then advertise what
// the kernel holds (without the lock).
func (o *Owner) cycle(why string) {
	o.mu.Lock()
	g := o.gossip
	o.mu.Unlock()
	var adverts map[netip.Addr]Advert
	if g != nil {
		adverts = g.Adverts()
	}
	o.mu.Lock()
	if o.prog == nil {
		o.mu.Unlock()
		return
	}
	if g != nil {
		o.stepLocked(adverts, why)
	} else {
		o.applyLocked(why, false)
	}
	adv := Advert{Keys: o.keys.Clone(), Gen: o.gen}
	send := g != nil && o.advertStaleLocked()
	o.mu.Unlock()
	if !send {
		return
	}
	err := g.Advertise(adv)
	o.mu.Lock()
	defer o.mu.Unlock()
	if err != nil {
		o.noteErrLocked(fmt.Errorf("encryption: advertising %v: %w", adv, err))
		o.log.Warn("advertising the key state", "advert", adv.String(), "error", err)
		return
	}
	if !o.published || !o.advertised.Equal(adv) {
		o.log.Info("advertised key state", "accept", adv.Keys.Accept, "send", adv.Keys.Send, "target", adv.Keys.Target, "gen", fmt.Sprintf("%016x", adv.Gen))
	}
	o.advertised, o.published = adv, true
}

// stepLocked takes one step of the rotation state machine with what the
// others advertise and installs the result; when that fails, the kernel
// goes back to the previous keys.
func (o *Owner) stepLocked(adverts map[netip.Addr]Advert, why string) {
	var others []NodeKeys
	seen := map[netip.Addr]bool{}
	for vtep, a := range adverts {
		vtep = vtep.Unmap()
		if vtep == o.local || !vtep.IsValid() {
			continue
		}
		seen[vtep] = true
		others = append(others, a.Keys)
		if a.Gen != 0 && o.remoteGens[vtep] != a.Gen {
			o.remoteGens[vtep] = a.Gen
			o.gensDirty, o.persistAll = true, true
		}
	}
	for r := range o.remoteGens {
		if !seen[r] && o.need.Get(r) == 0 && !(o.adopting && slices.Contains(o.adopted.remotes, r)) {
			delete(o.remoteGens, r)
			o.persistAll = true
		}
	}
	prev := o.keys
	self := prev.Clone()
	rotating := o.rotate && self.Send != 0
	if rotating {
		self = StartRotation(self)
	}
	next := Step(self, others)
	o.keys = next
	err := o.applyLocked(why, false)
	if err != nil && !o.held && !next.Equal(prev) {
		// Try the part of the step that needs no new outbound SA: accept
		// (and retire) as Step says but keep sending with the previous
		// epoch — always safe, and it lets the others go on (a switch
		// fails, e.g., when the record of a new SA cannot be persisted).
		if next.Send != prev.Send && prev.Send != 0 {
			part := next.Clone()
			part.Send = prev.Send
			if !part.Accepts(prev.Send) {
				part.Accept = normAccept(append(part.Accept, prev.Send))
			}
			o.keys = part
			if perr := o.applyLocked(why+" (keeping the send epoch)", false); perr == nil || o.held {
				err = fmt.Errorf("encryption: cannot switch to send epoch %d, still sending with %d (%v): %w", next.Send, prev.Send, part, err)
				o.applyErr = err
				o.noteErrLocked(err)
				o.logStep(prev, part)
				return
			}
		}
		o.keys = prev
		rerr := o.applyLocked("restore previous keys", false)
		err = fmt.Errorf("encryption: installing key epochs %v failed, kept %v: %w", next, prev, err)
		if rerr != nil {
			err = fmt.Errorf("%w; restoring them: %w", err, rerr)
		}
		o.applyErr = err
		o.noteErrLocked(err)
		return
	}
	if rotating && next.Target > prev.Target {
		o.rotate = false
	}
	o.timeRotationLocked(prev, next)
	o.logStep(prev, next)
}

// logStep logs the change of this host's key epochs from prev to next, if
// any, as one rotation step naming what changed (see logkeys).
func (o *Owner) logStep(prev, next NodeKeys) {
	if prev.Equal(next) {
		return
	}
	o.log.Info("key epochs", logkeys.Event, logkeys.RotationStep, logkeys.Step, rotationStep(prev, next),
		"accept", next.Accept, "send", next.Send, "target", next.Target)
}

// rotationStep names what changed from prev to next: "target" (a newer
// epoch was asked for), "accept" (an epoch is accepted that was not),
// "send", "retire" (an epoch is no longer accepted), joined by "+".
func rotationStep(prev, next NodeKeys) string {
	var steps []string
	if next.Target != prev.Target {
		steps = append(steps, logkeys.StepTarget)
	}
	if slices.ContainsFunc(next.Accept, func(e uint32) bool { return !prev.Accepts(e) }) {
		steps = append(steps, logkeys.StepAccept)
	}
	if next.Send != prev.Send {
		steps = append(steps, logkeys.StepSend)
	}
	if slices.ContainsFunc(prev.Accept, func(e uint32) bool { return !next.Accepts(e) }) {
		steps = append(steps, logkeys.StepRetire)
	}
	return strings.Join(steps, "+")
}

// timeRotationLocked follows a rotation's steps: it starts when the target
// rises above an established one (here or on another host) and is over
// when this host accepts and sends only the target epoch.
func (o *Owner) timeRotationLocked(prev, next NodeKeys) {
	if o.rotStart.IsZero() && prev.Target != 0 && next.Target > prev.Target {
		o.rotStart = time.Now()
	}
	if !o.rotStart.IsZero() && next.Send == next.Target && len(next.Accept) == 1 && next.Accept[0] == next.Target {
		o.rotations.Observe(time.Since(o.rotStart))
		o.rotStart = time.Time{}
	}
}

// RotationDurations returns how long the completed key rotations took;
// its count is the number of rotations. It takes no lock.
func (o *Owner) RotationDurations() latency.Snapshot { return o.rotations.Snapshot() }
