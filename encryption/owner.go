package encryption

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

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

// Owner is the single owner of this host's encryption state: the key
// epochs and send generation, every network's share, the Programmer that
// holds the kernel to them, the rotation state machine and their
// persistence. See the package documentation for the design.
//
// Its state is in four parts, each with its one job: the shares (idx, the
// planner's input from the networks; planner.go turns the inputs into the
// desired state), the ledger (led: the persisted part — keys, VTEP, send
// generation, the outbound SAs installed under it, the remotes'
// generations), the tracker (trk: the desired state against the kernel's,
// with the remotes marked dirty and whether to resync) and the Programmer
// (prog: the kernel's sockets). Every change of an input marks the
// tracker; applyLocked (apply.go) is the one path that programs.
//
// All methods are safe for concurrent use. Update, AddRemotes,
// RemoveRemotes and Remove are called with a network's lock held
// (lockorder.LevelNetwork, above the Owner's LevelEncryption); the Owner
// never calls out of the package with its lock held (KeyGossip is called
// without it).
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

	// mu guards every field below (lockorder.LevelEncryption: under a
	// network's lock, above nothing the Owner calls while holding it).
	mu *lockorder.Mutex

	prog *Programmer // nil once closed
	idx  shareIndex  // the shares and their counts
	led  ledger      // the persisted part of the state
	trk  tracker     // desired against the kernel: record, dirty remotes, resync
	// wantEnc and wantClear are the desired encrypted and clear VNIs
	// (planner.go), computed again when vnisStale.
	wantEnc, wantClear []uint32
	vnisStale          bool
	verified           bool      // the first kernel check after loading happened
	noESP              error     // the kernel could not install ESP states (wraps ErrKernelUnsupported)
	noESPAt            time.Time //
	held               bool      // the kernel holds keys and gen (last apply succeeded)
	applyErr           error     // error of the last reconcile (nil: kernel matches)
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

	history // what Status reports of the past
}

// history is what the Owner reports of its past in Status.
type history struct {
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
		mu:  lockorder.New(lockorder.LevelEncryption),
		idx: newShareIndex(), led: ledger{store: cfg.Store},
		vnisStale: true,
	}
	if err := o.led.load(); err != nil {
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
	if o.led.local == vtep && o.prog != nil && o.applyErr == nil && o.trk.last != nil {
		o.mu.Unlock()
		return nil
	}
	if o.led.local.IsValid() && o.led.local != vtep {
		o.newGenLocked(fmt.Sprintf("local VTEP changed from %v to %v", o.led.local, vtep))
	}
	o.led.local = vtep
	o.trk.markResync()
	o.applyLocked("local VTEP")
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
	if o.led.local.IsValid() {
		for _, r := range sh.remotes {
			if r.Is4() != o.led.local.Is4() {
				o.mu.Unlock()
				return fmt.Errorf("encryption: share %d: remote VTEP %v is not of the local VTEP's (%v) address family", id, r, o.led.local)
			}
		}
	}
	if old := o.idx.shares[id]; widen && old != nil && sh.encrypted {
		sh.remotes = unionSorted(old.remotes, sh.remotes)
	}
	o.setShareLocked(id, sh)
	o.applyLocked(fmt.Sprintf("share %d", id))
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
// other remotes of the host are not visited (see applyLocked). The
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
	sh := o.idx.shares[id]
	switch {
	case sh == nil:
		return fmt.Errorf("encryption: share %d: cannot %s remotes %v: the share is not registered (Update first)", id, verb, in)
	case !sh.encrypted:
		return fmt.Errorf("encryption: share %d: cannot %s remotes %v: the share is not encrypted (only encrypted shares have remotes)", id, verb, in)
	}
	if sign > 0 && o.led.local.IsValid() {
		for _, r := range in {
			if r.Is4() != o.led.local.Is4() {
				return fmt.Errorf("encryption: share %d: remote VTEP %v is not of the local VTEP's (%v) address family", id, r, o.led.local)
			}
		}
	}
	o.markLocked(o.idx.changeRemotes(sh, in, sign)...)
	o.applyLocked(fmt.Sprintf("share %d: %s %d remotes", id, verb, len(in)))
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
	if _, ok := o.idx.shares[id]; !ok {
		o.mu.Unlock()
		return nil
	}
	o.setShareLocked(id, nil)
	o.applyLocked(fmt.Sprintf("share %d removed", id))
	err := o.closedErr
	poke := o.advertStaleLocked()
	o.mu.Unlock()
	if poke {
		o.Poke()
	}
	return err
}

// setShareLocked registers sh as the share of id (nil: removes it) and
// marks what changed: the remotes whose need crossed zero, the VNIs.
func (o *Owner) setShareLocked(id ShareID, sh *share) {
	crossed, vnis := o.idx.set(id, sh)
	o.markLocked(crossed...)
	if vnis {
		o.vnisStale = true
	}
}

// markLocked marks remotes dirty in the tracker: their desired state may
// have changed. Our own VTEP and remotes of the other family are never a
// pair (see pairLocked): nothing to mark; a change of the local VTEP marks
// everything anyway.
func (o *Owner) markLocked(rs ...netip.Addr) {
	for _, r := range rs {
		if !o.led.local.IsValid() || o.pairLocked(r) {
			o.trk.markDirty(r)
		}
	}
}

// Restored tells the Owner that the driver has registered the share of
// every network it restored after a restart. Until then the Owner keeps
// what the previous run programmed (persisted), so that a restart never
// removes a rule, policy or SA that a running container needs; from now on
// only the shares count.
func (o *Owner) Restored() error {
	o.mu.Lock()
	defer o.mu.Unlock()
	if !o.led.adopting {
		return nil
	}
	o.markLocked(o.led.adopted.remotes...)
	o.led.adopting, o.led.adopted = false, programmed{}
	o.vnisStale = true
	o.trk.markResync()
	return o.applyLocked("restored")
}

// Rotate starts a cluster-wide key rotation and returns the epoch asked
// for. It fails while keys are not established or gossip is not attached.
func (o *Owner) Rotate() (uint32, error) {
	o.mu.Lock()
	switch {
	case o.gossip == nil:
		o.mu.Unlock()
		return 0, errors.New("encryption: key rotation needs the control plane, which is not attached yet")
	case o.led.keys.Send == 0:
		o.mu.Unlock()
		return 0, errors.New("encryption: keys are not established yet; retry in a moment")
	}
	o.rotate = true
	target := StartRotation(o.led.keys).Target
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
		v6 := o.led.local.IsValid() && o.led.local.Is6()
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

// newGenLocked moves to a new random send generation: every outbound SA is
// re-created under it (new keys, new SPIs) and it is advertised, so peers
// install the matching inbound SAs.
func (o *Owner) newGenLocked(reason string) {
	old, err := o.led.newGen()
	if err != nil {
		o.noteErrLocked(err)
	}
	o.genChanges++
	o.genReason = reason
	o.held = false
	o.trk.markAll()
	o.log.Info("new send generation", logkeys.Event, logkeys.SendGeneration, logkeys.Kind, reason, "gen", fmt.Sprintf("%016x", o.led.gen), "previous", fmt.Sprintf("%016x", old))
}

func (o *Owner) noteErrLocked(err error) {
	o.lastErr, o.lastErrAt = err, time.Now()
}

// advertStaleLocked reports whether what is gossiped differs from what the
// kernel holds (a new generation, new keys).
func (o *Owner) advertStaleLocked() bool {
	return o.held && (!o.published || !o.advertised.Equal(Advert{Keys: o.led.keys, Gen: o.led.gen}))
}
