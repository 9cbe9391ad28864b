package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/miekg/dns"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/internal/cluster"
	"github.com/overlayd/overlayd/internal/config"
	"github.com/overlayd/overlayd/internal/dnsserver"
	"github.com/overlayd/overlayd/internal/engine"
	"github.com/overlayd/overlayd/internal/logkeys"
	"github.com/overlayd/overlayd/internal/nameindex"
	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/overlayd/overlayd/internal/nlwrap"
	"github.com/overlayd/overlayd/peerdb"
)

// Timings of the names service.
const (
	// namesTick: the index is rebuilt from its owners and resolv.conf
	// checked at least this often, whatever was notified.
	namesTick = time.Second
	// engineTick: the engine's names are re-read at least this often
	// (events make it sooner).
	engineTick = 10 * time.Second
	// engineRetry: how soon a broken event stream is reopened.
	engineRetry = 2 * time.Second
	// clientCacheTTL: how long the host listener trusts its verdict on a
	// client address.
	clientCacheTTL = 10 * time.Second
)

// nameService serves names across hosts (docs/names.md): it owns the name
// index, rebuilt from the driver (local endpoints) and the cluster (remote
// ones) whenever either reports a change and on a tick; the DNS server
// answering from it in every sandbox; the host listener that forwards for
// containers of other networks; and the reading of the local engine's
// names. It keeps no copy of what the driver or the cluster owns: each
// rebuild asks them.
type nameService struct {
	log     *slog.Logger
	addr    netip.Addr
	srv     *dnsserver.Server
	ix      nameindex.Index
	eng     *engine.Engine
	resolv  string
	hostNS  netns.NsHandle // not owned
	hostNL  *nlwrap.Handle // the host listener's, in hostNS
	cluster func() *cluster.Cluster
	d       atomic.Pointer[driver.Driver]

	ctx    context.Context
	cancel context.CancelFunc
	done   sync.WaitGroup
	// rebuild and reread are kicks (capacity 1): rebuild the index, read
	// the engine's names again.
	rebuild, reread chan struct{}

	upstreams atomic.Pointer[[]netip.AddrPort]
	// Touched by the run loop only.
	resolvStamp string
	engineErr   string
	conflicts   map[string]bool
	// status is the last rebuild's summary, for overlayd status.
	status atomic.Pointer[NamesStatus]
}

// NamesStatus is the names section of overlayd status.
type NamesStatus struct {
	Address   string   `json:"address"`
	Engine    string   `json:"engine"`
	EngineErr string   `json:"engine_error,omitempty"`
	Upstreams []string `json:"upstreams"`
	Names     int      `json:"names"`
	// Networks: per local network ID, its names and their addresses.
	Networks  map[string][]nameindex.NameAddrs `json:"networks,omitempty"`
	Conflicts []nameindex.Conflict             `json:"conflicts,omitempty"`
}

// newNameService makes the service (nil when names are off); it serves
// nothing until start.
func newNameService(st *config.Settings, log *slog.Logger, hostNS netns.NsHandle, c func() *cluster.Cluster) (*nameService, error) {
	if !st.DNSAddress.IsValid() {
		log.Info("names across hosts are off (--dns-address off)")
		return nil, nil
	}
	eng, err := engine.Open(st.EngineSocket, log.With("component", "engine"))
	if err != nil {
		return nil, &config.Invalid{Err: fmt.Errorf("%s %q: %v", st.Source("engine-socket"), st.EngineSocket, err)}
	}
	ns := &nameService{
		log: log.With("component", "names"), addr: st.DNSAddress, eng: eng, resolv: st.ResolvConf, hostNS: hostNS, cluster: c,
		rebuild: make(chan struct{}, 1), reread: make(chan struct{}, 1), conflicts: map[string]bool{},
	}
	ns.ctx, ns.cancel = context.WithCancel(context.Background())
	srv, err := dnsserver.New(dnsserver.Config{Names: &ns.ix, Upstreams: ns.currentUpstreams, Logger: ns.log})
	if err != nil {
		return nil, err
	}
	ns.srv = srv
	ns.readResolvConf()
	return ns, nil
}

// Serve implements driver.NameServer: it answers a sandbox's sockets from
// its own goroutine (whose thread is in the host's namespace, where the
// forwarded queries go out) until the sandbox closes them.
func (ns *nameService) Serve(network string, pc net.PacketConn, ln net.Listener) {
	ns.done.Add(1)
	go func() {
		defer ns.done.Done()
		if err := ns.srv.Serve(ns.ctx, network, pc, ln); err != nil {
			ns.log.Warn("a network's name server stopped; the next reconcile serves it again", logkeys.Network, network, "error", err)
		}
	}()
}

// NamesChanged implements driver.NameServer: it asks for a rebuild of the
// index; it never blocks (the driver calls it under a network's lock, the
// cluster from its delivery).
func (ns *nameService) NamesChanged() { kick(ns.rebuild) }

func kick(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}

// PeersChanged relays the cluster's notifications to the driver and
// rebuilds the index (remote names travel in the records).
type namesWatcher struct {
	d  *driver.Driver
	ns *nameService
}

func (w namesWatcher) PeersChanged(vni uint32, keys []peerdb.Key) {
	w.d.PeersChanged(vni, keys)
	w.ns.NamesChanged()
}

// start serves the host listener and begins the loops.
func (ns *nameService) start(d *driver.Driver) {
	ns.d.Store(d)
	// The names restored with the endpoints are served before the engine
	// is read again: a restart leaves no gap for this host's names.
	ns.build()
	if err := ns.serveHost(); err != nil {
		ns.log.Warn("the name server does not forward for containers of other networks (they need the second \"dns\" entry of daemon.json)",
			logkeys.Event, "dns_host_listener_failed", "address", ns.addr, "error", err)
	}
	ns.done.Add(2)
	go func() {
		defer ns.done.Done()
		ns.eng.Watch(ns.ctx, engineRetry, func() { kick(ns.reread) })
	}()
	go func() {
		defer ns.done.Done()
		ns.run()
	}()
}

func (ns *nameService) close() {
	if ns == nil {
		return
	}
	ns.cancel()
	ns.done.Wait()
	ns.eng.Close()
	if ns.hostNL != nil {
		ns.hostNL.Close()
	}
}

func (ns *nameService) run() {
	tick := time.NewTicker(namesTick)
	defer tick.Stop()
	lastRead := time.Time{}
	for {
		reread := false
		select {
		case <-ns.ctx.Done():
			return
		case <-ns.rebuild:
		case <-ns.reread:
			reread = true
		case <-tick.C:
			ns.readResolvConf()
			reread = time.Since(lastRead) >= engineTick
		}
		if reread {
			lastRead = time.Now()
			ns.readEngine()
		}
		ns.build()
	}
}

// readEngine hands the driver the names the engine has now. An engine
// that cannot be read changes nothing (the names in force stay), and is
// logged once per distinct error.
func (ns *nameService) readEngine() {
	ctx, cancel := context.WithTimeout(ns.ctx, 10*time.Second)
	defer cancel()
	eps, err := ns.eng.Names(ctx)
	if err != nil {
		if ns.ctx.Err() != nil {
			return
		}
		if msg := err.Error(); msg != ns.engineErr {
			ns.engineErr = msg
			ns.log.Warn("cannot read the containers' names from the engine; the names in force stay, retried on events and every "+engineTick.String(),
				logkeys.Event, logkeys.EngineUnreadable, "error", err)
		}
		return
	}
	if ns.engineErr != "" {
		ns.engineErr = ""
		ns.log.Info("reading the containers' names from the engine again", logkeys.Event, logkeys.EngineReadable)
	}
	byEP := make(map[string][]string, len(eps))
	for id, e := range eps {
		byEP[id] = e.Names
	}
	ns.d.Load().SetNames(byEP)
}

// build makes a new index from the owners and swaps it in.
func (ns *nameService) build() {
	d := ns.d.Load()
	eps := d.LocalNames()
	var vnis []uint32
	for _, e := range eps {
		vnis = append(vnis, e.VNI)
	}
	slices.Sort(vnis)
	vnis = slices.Compact(vnis)
	if c := ns.cluster(); c != nil {
		for _, vni := range vnis {
			for _, r := range c.Names(vni) {
				eps = append(eps, nameindex.Endpoint{VNI: vni, Host: r.Origin, EndpointID: r.EndpointID, IP: r.IP, IPv6: r.IPv6, Names: r.Names})
			}
		}
	}
	snap := nameindex.Build(eps)
	ns.ix.Store(snap)
	ns.noteConflicts(snap.Conflicts())
	st := &NamesStatus{Address: ns.addr.String(), Engine: ns.engSocket(), EngineErr: ns.engineErr, Names: snap.Names(),
		Networks: map[string][]nameindex.NameAddrs{}, Conflicts: snap.Conflicts()}
	for _, u := range ns.currentUpstreams() {
		st.Upstreams = append(st.Upstreams, u.String())
	}
	for _, n := range d.Status().Networks {
		var names []nameindex.NameAddrs
		for _, vni := range n.VNIs {
			names = append(names, snap.NamesOf(vni)...)
		}
		if len(names) > 0 {
			st.Networks[n.ID] = names
		}
	}
	ns.status.Store(st)
}

func (ns *nameService) engSocket() string { return ns.eng.Socket() }

// noteConflicts logs each name held on several hosts once, and once more
// when it is resolved.
func (ns *nameService) noteConflicts(cs []nameindex.Conflict) {
	now := map[string]bool{}
	for _, c := range cs {
		k := fmt.Sprintf("%d/%s", c.VNI, c.Name)
		now[k] = true
		if !ns.conflicts[k] {
			hosts := slices.Clone(c.Hosts)
			for i, h := range hosts {
				if h == "" {
					hosts[i] = "(this host)"
				}
			}
			ns.log.Warn("a name is held by containers on several hosts: all their addresses are answered", logkeys.Event, logkeys.NameConflict,
				logkeys.VNI, c.VNI, "name", c.Name, "hosts", strings.Join(hosts, ","))
		}
	}
	for k := range ns.conflicts {
		if !now[k] {
			ns.log.Info("a name is held on one host again", logkeys.Event, logkeys.NameConflictResolved, "name", k)
		}
	}
	ns.conflicts = now
}

// readResolvConf (re)reads the upstream resolvers when the file changed.
// Our own address is left out (forwarding to it would loop), and so is
// dockerd's embedded resolver (reachable only inside containers). A file
// that cannot be read keeps the resolvers last read.
func (ns *nameService) readResolvConf() {
	fi, err := os.Stat(ns.resolv)
	stamp := ""
	if err == nil {
		stamp = fmt.Sprint(fi.ModTime().UnixNano(), fi.Size())
	}
	if stamp == ns.resolvStamp && ns.upstreams.Load() != nil {
		return
	}
	ns.resolvStamp = stamp
	cc, err := dns.ClientConfigFromFile(ns.resolv)
	if err != nil {
		ns.log.Warn("cannot read the resolvers to forward to; keeping the last ones read", logkeys.Event, "resolv_conf_unreadable", "file", ns.resolv, "error", err)
		if ns.upstreams.Load() == nil {
			ns.upstreams.Store(&[]netip.AddrPort{})
		}
		return
	}
	port := uint16(53)
	var ups []netip.AddrPort
	for _, s := range cc.Servers {
		a, err := netip.ParseAddr(s)
		if err != nil || a.Unmap() == ns.addr || a == netip.MustParseAddr("127.0.0.11") {
			continue
		}
		ups = append(ups, netip.AddrPortFrom(a.Unmap(), port))
	}
	ns.upstreams.Store(&ups)
	ns.log.Info("forwarding other names to the host's resolvers", logkeys.Event, "upstreams", "file", ns.resolv, "upstreams", fmt.Sprint(ups))
}

func (ns *nameService) currentUpstreams() []netip.AddrPort {
	if p := ns.upstreams.Load(); p != nil {
		return *p
	}
	return nil
}

// serveHost puts the name server's address on the host's loopback and
// forwards the queries that reach it there: from containers of other
// networks whose resolv.conf (or dockerd's embedded resolver) lists it
// first. Without it such a query would leave the host by its default
// route. The address stays when overlayd stops: then the host answers
// "port unreachable" and resolvers go on to daemon.json's next entry at
// once. Only containers of this host are answered (see hostClients).
func (ns *nameService) serveHost() error {
	nl, err := nlwrap.NewHandleAt(ns.hostNS, unix.NETLINK_ROUTE)
	if err != nil {
		return fmt.Errorf("a netlink handle in the host's namespace: %w", err)
	}
	lo, err := nl.LinkByName("lo")
	if err != nil {
		nl.Close()
		return fmt.Errorf("the host's loopback: %w", err)
	}
	p := &net.IPNet{IP: ns.addr.AsSlice(), Mask: net.CIDRMask(32, 32)}
	if err := nl.AddrAdd(lo, &netlink.Addr{IPNet: p, Scope: unix.RT_SCOPE_HOST}); err != nil && !errors.Is(err, unix.EEXIST) {
		nl.Close()
		return fmt.Errorf("failed to add %s to the host's loopback: %w", ns.addr, err)
	}
	ap := netip.AddrPortFrom(ns.addr, 53)
	pc, ln, err := netnsutil.ListenPair(ns.hostNS, ap)
	if err != nil {
		nl.Close()
		return err
	}
	ns.hostNL = nl
	hc := newHostClients(ns.addr, nl)
	ns.Serve(dnsserver.HostListener, &filteredPacketConn{PacketConn: pc, ok: hc.allowed}, &filteredListener{Listener: ln, ok: hc.allowed})
	return nil
}
