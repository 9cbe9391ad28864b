// Package driver implements the libnetwork remote driver: Docker's plugin
// API (through go-plugins-helpers' api.Driver), the networks and endpoints
// it creates, and the owner of the local VTEP.
//
// # Data flow
//
// The control plane is four small interfaces of Config, one per concern
// (controlplane.go). Remote peers are pulled, never pushed: the control
// plane owns them (PeerSource) and tells the driver which records of a VNI may have
// changed (PeersChanged); the network with that VNI pulls their current
// values under its lock into its peer table (peerdb), and programs the
// difference. Networks also pull everything when created and on Reconcile
// (the daemon's periodic level-triggered repair). Encryption is the
// encryption owner's (EncryptionOwner): each network hands it its share.
// Cluster membership is the control plane's too; the driver only relays
// where to join (Membership): nodes DiscoverNew announces, and the gossip
// seeds a swarm network carries (the leader's AllocateNetwork puts them
// there from GossipSeeds, see seeds.go). This host's VTEP, records and
// names go to the LocalPublisher.
// Network definitions (subnets and VNIs, gateways, MTU, encrypted,
// internal) are the control plane's too (DefinitionSource): a network
// publishes its own, a CreateNetwork that contradicts another host's is
// refused, and every pull first compares the other hosts' definitions of
// the VNI and leaves out the records of hosts that contradict it (see
// definitions.go).
//
// # Locking
//
// The driver's locks are Driver.vtepMu (lockorder.LevelVTEP), network.mu
// (LevelNetwork), Driver.allocMu (LevelAlloc) and Driver.mu (LevelDriver);
// their order among themselves and the other packages' locks is the
// hierarchy in internal/lockorder, which test builds (tag lockcheck)
// check at every acquisition. The caller takes a network's lock, not the
// callee: a method named ...Locked runs under the lock of the network it
// is given (lockorder's convention). Operations on distinct networks never
// wait for each other except for the short Driver.mu sections.
package driver

import (
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"

	api "github.com/docker/go-plugins-helpers/network"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/encryption"
	"github.com/overlayd/overlayd/internal/lockorder"
	"github.com/overlayd/overlayd/internal/logkeys"
	"github.com/overlayd/overlayd/internal/nlwrap"
	"github.com/overlayd/overlayd/internal/reaper"
	"github.com/overlayd/overlayd/internal/sandbox"
	"github.com/overlayd/overlayd/internal/statefile"
)

// Defaults shared by the daemon and tests.
const (
	DefaultVXLANPort = sandbox.DefaultVXLANPort // not 4789: Docker's own overlay uses that
	DefaultNetnsDir  = sandbox.DefaultNetnsDir
	DefaultVNIStart  = 4096
	MaxVNI           = 1<<24 - 1
	vxlanOverhead4   = 50
	vxlanOverhead6   = 70
)

// Config holds the driver's settings. The zero value of every field but
// NetnsDir has a usable default.
type Config struct {
	// Scope answered by GetCapabilities: "local" (standalone) or "global" (swarm).
	Scope string
	// AdvertiseAddr is the local VTEP. When invalid it is learned from
	// DiscoverNew (Self), otherwise from the default route's device.
	AdvertiseAddr netip.Addr
	VXLANPort     int
	// NetnsDir is where network sandboxes are mounted.
	NetnsDir string
	// HostNS is the namespace holding the underlay; unset (0 or
	// netns.None()) means the current one. The driver does not close it.
	HostNS netns.NsHandle
	// VNIStart..VNIEnd is the range AllocateNetwork allocates from.
	VNIStart, VNIEnd uint32
	Logger           *slog.Logger
	// The control plane, one interface per concern (controlplane.go), all
	// required: this host's VTEP, records and names go to Publisher; the
	// other hosts' records come from Peers; the network definitions are
	// Definitions'; where to join the cluster goes to Membership.
	Publisher   LocalPublisher
	Peers       PeerSource
	Definitions DefinitionSource
	Membership  Membership
	// Encryption is the host's encryption owner; without one encrypted
	// networks are refused.
	Encryption EncryptionOwner
	// StateFile, if set, persists networks, endpoints and allocations; New
	// restores them and adopts the kernel state an earlier run left.
	StateFile *statefile.File
	// NameServer, if set, serves every network's names: each sandbox with
	// an IPv4 segment gets the address DNSAddress on its bridges and a
	// route to it in one of each container's links (see names.go).
	NameServer NameServer
	// DNSAddress is the name server's address in every sandbox
	// (DefaultDNSAddress when unset); ignored without a NameServer.
	DNSAddress netip.Addr
	// TestHooks are empty in normal builds; test builds (tag testhooks)
	// have the stress harness's trace there.
	TestHooks
}

// Driver is the overlay network driver.
type Driver struct {
	cfg  Config // immutable after New
	log  *slog.Logger
	host *sandbox.Host // immutable after New; its netlink handle is safe for concurrent use
	// reaper runs the kernel deletions Leaves hand over (veths, sandboxes)
	// off the caller's path; immutable after New. The networks keep their
	// pending Jobs (see leaveLocked).
	reaper *reaper.Reaper
	ownsNS bool
	hostNS netns.NsHandle
	// vtepMu serialises VTEP changes with their notification
	// (LocalPublisher.VTEPChanged is called in the order of the changes);
	// lockorder.LevelVTEP.
	vtepMu   *lockorder.Mutex
	allocMu  *lockorder.Mutex    // lockorder.LevelAlloc; guards allocs and allocNet
	allocs   map[uint32]string   // VNIs handed out by AllocateNetwork → network id; guarded by allocMu
	allocNet map[string][]uint32 // the same, by network id; guarded by allocMu
	mu       *lockorder.Mutex    // driver.mu, lockorder.LevelDriver; guards the fields below
	nets     map[string]*network // by network id; guarded by mu
	byVNI    map[uint32]*network // every VNI of every network; guarded by mu
	vtep     vtepState           // the local VTEP and where it came from; guarded by mu
	lastID   uint64              // last encryption.ShareID handed out; guarded by mu
	// adopting: the kernel state of an earlier run is being adopted (see
	// Reconcile and Settle); guarded by mu.
	adopting bool
	// dnsRoutes: by container (Join's SandboxKey), the endpoint
	// ("network/endpoint") whose Join gave it the route to the name
	// server; guarded by mu.
	dnsRoutes map[string]string
	// counts are event counters (atomic: taken under any lock, read by
	// the metrics at scrape time without one).
	counts counters
	// brnfNoted: a sandbox whose bridged traffic keeps passing its
	// netfilter hooks was logged (once per driver; atomic: set under a
	// network's lock). See noteBridgeNetfilter.
	brnfNoted atomic.Bool
}

// noteBridgeNetfilter logs, once per driver, that the bridged traffic of
// n's new sandbox still passes its netfilter hooks (br_netfilter; a
// managed plugin's /proc/sys is read-only): it works, but costs throughput
// and latency (internal/sandbox/brnetfilter.go).
func (d *Driver) noteBridgeNetfilter(n *network) {
	if err := n.sb.BridgeNetfilter(); err != nil && d.brnfNoted.CompareAndSwap(false, true) {
		d.log.Info("bridged traffic in the network sandboxes passes their netfilter hooks (br_netfilter), which costs throughput and latency: they could not be turned off",
			logkeys.Network, n.id, logkeys.Error, err)
	}
}

var _ api.Driver = (*Driver)(nil)

// New returns a driver. It touches the kernel only to open a netlink handle in
// the host namespace.
func New(cfg Config) (*Driver, error) {
	if cfg.Scope == "" {
		cfg.Scope = api.LocalScope
	}
	if cfg.Scope != api.LocalScope && cfg.Scope != api.GlobalScope {
		return nil, fmt.Errorf("invalid scope %q: must be %q or %q", cfg.Scope, api.LocalScope, api.GlobalScope)
	}
	if cfg.VXLANPort == 0 {
		cfg.VXLANPort = DefaultVXLANPort
	}
	if cfg.VXLANPort < 1 || cfg.VXLANPort > 65535 {
		return nil, fmt.Errorf("invalid VXLAN port %d: must be in 1..65535", cfg.VXLANPort)
	}
	if cfg.NetnsDir == "" {
		cfg.NetnsDir = DefaultNetnsDir
	}
	if !filepath.IsAbs(cfg.NetnsDir) {
		return nil, fmt.Errorf("invalid netns directory %q: must be an absolute path", cfg.NetnsDir)
	}
	if cfg.VNIStart == 0 {
		cfg.VNIStart = DefaultVNIStart
	}
	if cfg.VNIEnd == 0 {
		cfg.VNIEnd = MaxVNI
	}
	if cfg.VNIStart > cfg.VNIEnd || cfg.VNIEnd > MaxVNI {
		return nil, fmt.Errorf("invalid VNI range %d..%d: must lie within 1..%d", cfg.VNIStart, cfg.VNIEnd, MaxVNI)
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.AdvertiseAddr.IsValid() {
		cfg.AdvertiseAddr = cfg.AdvertiseAddr.Unmap()
	}
	if err := checkControlPlane(&cfg); err != nil {
		return nil, err
	}
	if err := checkDNSAddress(&cfg); err != nil {
		return nil, err
	}
	d := &Driver{
		cfg:       cfg,
		log:       cfg.Logger,
		reaper:    reaper.New(0, cfg.Logger),
		mu:        lockorder.New(lockorder.LevelDriver),
		allocMu:   lockorder.New(lockorder.LevelAlloc),
		vtepMu:    lockorder.New(lockorder.LevelVTEP),
		nets:      map[string]*network{},
		byVNI:     map[uint32]*network{},
		allocs:    map[uint32]string{},
		allocNet:  map[string][]uint32{},
		dnsRoutes: map[string]string{},
	}
	d.hostNS = cfg.HostNS
	if d.hostNS <= 0 { // unset (the zero value is fd 0, never a namespace) or netns.None()
		ns, err := netns.Get()
		if err != nil {
			return nil, fmt.Errorf("failed to open the host network namespace: %w", err)
		}
		d.hostNS, d.ownsNS = ns, true
	}
	h, err := nlwrap.NewHandleAt(d.hostNS, unix.NETLINK_ROUTE)
	if err != nil {
		d.closeNS()
		return nil, fmt.Errorf("failed to open a netlink handle in the host namespace: %w", err)
	}
	d.host = &sandbox.Host{NS: d.hostNS, Handle: h, Dir: cfg.NetnsDir, VXLANPort: cfg.VXLANPort}
	d.initVTEP()
	if d.VTEP().Is6() {
		d.host.IPv6 = true
	}
	if cfg.StateFile != nil {
		if err := d.restore(); err != nil {
			d.Close()
			return nil, err
		}
		d.handRestoredSeeds()
	}
	return d, nil
}

// Close finishes the deletions Leaves handed over (veths and sandboxes no
// container uses any more), then releases the driver's handles. The rest
// of the kernel state is left in place: the sandboxes keep serving running
// containers.
func (d *Driver) Close() error {
	d.reaper.Close()
	d.eachNetwork(func(n *network) {
		d.settleTeardownLocked(n, true)
		if n.sb != nil {
			n.sb.Close()
		}
	})
	d.host.Handle.Close()
	d.closeNS()
	return nil
}

// eachNetwork calls fn for every network, each locked in turn (never two
// at once), skipping those deleted meanwhile, in the order of their ids.
func (d *Driver) eachNetwork(fn func(n *network)) {
	d.mu.Lock()
	nets := make([]*network, 0, len(d.nets))
	for _, n := range d.nets {
		nets = append(nets, n)
	}
	d.mu.Unlock()
	slices.SortFunc(nets, func(a, b *network) int { return strings.Compare(a.id, b.id) })
	for _, n := range nets {
		n.mu.Lock()
		if !n.deleted {
			fn(n)
		}
		n.mu.Unlock()
	}
}

// newShareID returns a fresh encryption share id.
func (d *Driver) newShareID() encryption.ShareID {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.lastID++
	return encryption.ShareID(d.lastID)
}

func (d *Driver) closeNS() {
	if d.ownsNS {
		d.hostNS.Close()
	}
}

// lockNetwork returns the network registered under id, locked, and its unlock
// function; or a not-found error. It re-checks after locking that the network
// is still the one registered under id (a concurrent delete may have removed
// it, or a create registered a new one).
func (d *Driver) lockNetwork(id string) (*network, func(), error) {
	for {
		d.mu.Lock()
		n := d.nets[id]
		d.mu.Unlock()
		if n == nil {
			return nil, nil, &notFoundError{what: "network", id: id}
		}
		n.mu.Lock()
		if !n.deleted {
			return n, n.mu.Unlock, nil
		}
		n.mu.Unlock() // deleted meanwhile: look again
	}
}

// lockNetworkByVNI is lockNetwork for a network identified by any of its
// VNIs: it returns the network locked (the caller unlocks n.mu), or nil
// (and no lock held) when no network has vni. It returns no unlock func:
// a method value allocates, and a pull per notification calls this.
func (d *Driver) lockNetworkByVNI(vni uint32) *network {
	for {
		d.mu.Lock()
		n := d.byVNI[vni]
		d.mu.Unlock()
		if n == nil {
			return nil
		}
		n.mu.Lock()
		if !n.deleted {
			return n
		}
		n.mu.Unlock()
	}
}

type notFoundError struct{ what, id string }

func (e *notFoundError) Error() string { return fmt.Sprintf("%s %q not found", e.what, e.id) }

// IsNotFound reports whether err says a network or endpoint does not exist.
func IsNotFound(err error) bool {
	var nf *notFoundError
	return errors.As(err, &nf)
}

// underlayLink is the device that carries a network's VXLAN packets.
type underlayLink struct {
	name string // "" when unknown (no VTEP yet, or no link holds it)
	mtu  int    // 1500 when unknown
	v6   bool   // the VTEP is IPv6
}

// underlay returns the device holding the VTEP address.
func (d *Driver) underlay() underlayLink {
	adv := d.VTEP()
	u := underlayLink{mtu: 1500, v6: adv.Is6()}
	if !adv.IsValid() {
		return u
	}
	family := unix.AF_INET
	if u.v6 {
		family = unix.AF_INET6
	}
	addrs, err := d.host.Handle.AddrList(nil, family)
	if err != nil {
		return u
	}
	for _, a := range addrs {
		if ip, ok := netip.AddrFromSlice(a.IP); ok && ip.Unmap() == adv {
			if l, err := d.host.Handle.LinkByIndex(a.LinkIndex); err == nil && l.Attrs().MTU > 0 {
				u.name, u.mtu = l.Attrs().Name, l.Attrs().MTU
			}
		}
	}
	return u
}

// innerMTU is the largest MTU of a network's links over u: the device's
// MTU minus the VXLAN overhead of its address family, and minus the ESP
// overhead too for an encrypted network. It is also the default.
func (u underlayLink) innerMTU(encrypted bool) int {
	if encrypted {
		return encryption.InnerMTU(u.mtu, u.v6)
	}
	if u.v6 {
		return u.mtu - vxlanOverhead6
	}
	return u.mtu - vxlanOverhead4
}

// GetCapabilities answers dockerd's capability query.
func (d *Driver) GetCapabilities() (*api.CapabilitiesResponse, error) {
	return &api.CapabilitiesResponse{Scope: d.cfg.Scope, ConnectivityScope: api.GlobalScope}, nil
}

// DiscoverNew learns nodes from dockerd (swarm): Self gives the local VTEP
// unless one is configured (see VTEP); others are handed to the control
// plane.
func (d *Driver) DiscoverNew(req *api.DiscoveryNotification) error {
	if req == nil {
		return errors.New("DiscoverNew: empty request")
	}
	const nodeDiscovery = 1
	if req.DiscoveryType != nodeDiscovery {
		d.log.Debug("ignoring discovery notification", "type", req.DiscoveryType)
		return nil
	}
	data, ok := req.DiscoveryData.(map[string]interface{})
	if !ok {
		return fmt.Errorf("DiscoverNew: DiscoveryData is %T, want an object with Address and Self", req.DiscoveryData)
	}
	addrStr, _ := data["Address"].(string)
	addr, err := netip.ParseAddr(addrStr)
	if err != nil || addr.IsUnspecified() || addr.IsMulticast() {
		return fmt.Errorf("DiscoverNew: DiscoveryData.Address %q is not a unicast IP address", addrStr)
	}
	addr = addr.Unmap()
	self, _ := data["Self"].(bool)
	d.log.Info("node discovered", "address", addr, "self", self)
	if self {
		d.discoveredSelf(addr)
		return nil
	}
	d.cfg.Membership.Discovered(addr)
	return nil
}

// DiscoverDelete is informational: membership is the control plane's job.
func (d *Driver) DiscoverDelete(req *api.DiscoveryNotification) error {
	if req != nil {
		d.log.Info("node discovery removed", "type", req.DiscoveryType, "data", req.DiscoveryData)
	}
	return nil
}

// ProgramExternalConnectivity is a no-op: egress goes through docker_gwbridge.
func (d *Driver) ProgramExternalConnectivity(*api.ProgramExternalConnectivityRequest) error {
	return nil
}

// RevokeExternalConnectivity is a no-op, like ProgramExternalConnectivity.
func (d *Driver) RevokeExternalConnectivity(*api.RevokeExternalConnectivityRequest) error {
	return nil
}
