// Package metrics serves overlayd's Prometheus metrics and health
// endpoints. It keeps no copy of anybody's state: the plugin calls are
// counted as they pass (the only instruments it owns), and everything else
// is read from its owner at scrape time by a collector (the driver's
// status and counters, the control plane's status, the encryption owner's,
// the state file's and netlink's counters). Each Metrics has its own
// registry, so tests can make several in one process.
package metrics

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/overlayd/overlayd/driver"
	"github.com/overlayd/overlayd/internal/cluster"
	"github.com/overlayd/overlayd/internal/ipam"
	"github.com/overlayd/overlayd/internal/latency"
)

// PluginMethods are the remote driver API's methods (the address
// management's with their "IpamDriver." prefix: both APIs have a
// GetCapabilities), each reported from zero so that a rate over them is
// defined before the first call.
var PluginMethods = []string{
	"GetCapabilities", "CreateNetwork", "AllocateNetwork", "DeleteNetwork", "FreeNetwork",
	"CreateEndpoint", "DeleteEndpoint", "EndpointInfo", "Join", "Leave",
	"DiscoverNew", "DiscoverDelete", "ProgramExternalConnectivity", "RevokeExternalConnectivity",
	"IpamDriver.GetCapabilities", "IpamDriver.GetDefaultAddressSpaces", "IpamDriver.RequestPool",
	"IpamDriver.ReleasePool", "IpamDriver.RequestAddress", "IpamDriver.ReleaseAddress",
}

// Outcomes of a plugin call.
const (
	OutcomeOK    = "ok"
	OutcomeError = "error"
)

// Sources are the owners the collector asks at scrape time. A nil field
// leaves its metrics out (a test without a control plane, say); a func
// returning nil (the control plane not started) reports it as absent.
type Sources struct {
	Driver         func() driver.Status
	DriverCounters func() driver.Counters
	Cluster        func() *cluster.Status
	// IPAM is the cluster address management's status (free and used
	// addresses per pool).
	IPAM func() *ipam.Status
	// Rotations are the completed key rotations' durations.
	Rotations func() latency.Snapshot
	// StateWrites are the state file's write transactions' durations.
	StateWrites func() latency.Snapshot
	// Netlink is the kernel messages sent to program peers.
	Netlink func() (messages, datagrams, failures uint64)
	// Audit compares the kernel with the driver's state (driver.Audit):
	// each difference it returns is one that the reconcile has not
	// repaired (yet), or cannot.
	Audit func() ([]string, error)
	// Ready says whether the daemon is ready (nil) or why not: the
	// overlayd_ready gauge, and /readyz.
	Ready func() error
	// Version labels overlayd_build_info.
	Version string
}

// Metrics is one registry with overlayd's metrics.
type Metrics struct {
	reg      *prometheus.Registry
	calls    *prometheus.CounterVec
	duration *prometheus.HistogramVec
	refused  *prometheus.CounterVec
	ready    func() error
}

// New registers overlayd's metrics on a new registry.
func New(src Sources) *Metrics {
	m := &Metrics{
		reg: prometheus.NewRegistry(),
		calls: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "overlayd_plugin_calls_total",
			Help: "Remote driver API calls from dockerd, by method and outcome (ok, or error: the call was refused or failed).",
		}, []string{"method", "outcome"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "overlayd_plugin_call_duration_seconds",
			Help: "How long remote driver API calls took, by method.",
			// A Join programs a sandbox (tens of ms); a CreateNetwork may
			// wait for the state file; seconds mean something is wrong.
			Buckets: []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10},
		}, []string{"method"}),
		refused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "overlayd_ipam_refused_total",
			Help: "Address management requests from dockerd that were refused, by reason (other: a reason the allocator does not name).",
		}, []string{"reason"}),
		ready: src.Ready,
	}
	for _, meth := range PluginMethods {
		m.calls.WithLabelValues(meth, OutcomeOK)
		m.calls.WithLabelValues(meth, OutcomeError)
		m.duration.WithLabelValues(meth)
	}
	m.reg.MustRegister(m.calls, m.duration, m.refused, &collector{src: src},
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Register adds the metrics of another owner (the DNS server's).
func (m *Metrics) Register(c prometheus.Collector) { m.reg.MustRegister(c) }

// ObserveCall records one plugin call. Safe for concurrent use; it never
// blocks on anything but the instruments' own atomics.
func (m *Metrics) ObserveCall(method string, err error, took time.Duration) {
	outcome := OutcomeOK
	if err != nil {
		outcome = OutcomeError
	}
	m.calls.WithLabelValues(method, outcome).Inc()
	m.duration.WithLabelValues(method).Observe(took.Seconds())
}

// ObserveIPAMRefusal counts one refused address management request.
// Safe for concurrent use; it never blocks.
func (m *Metrics) ObserveIPAMRefusal(reason string) {
	m.refused.WithLabelValues(reason).Inc()
}

// Gatherer is the registry, for tests and promhttp.
func (m *Metrics) Gatherer() prometheus.Gatherer { return m.reg }

// Handler serves /metrics (Prometheus text or protobuf, as the scraper
// asks), /healthz (200 while the process serves) and /readyz (200 when
// Sources.Ready says so, else 503 with the reason).
func (m *Metrics) Handler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		io.WriteString(w, "ok\n")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		err := errors.New("no readiness source")
		if m.ready != nil {
			err = m.ready()
		}
		if err != nil {
			w.WriteHeader(http.StatusServiceUnavailable)
			fmt.Fprintf(w, "not ready: %v\n", err)
			return
		}
		io.WriteString(w, "ready\n")
	})
	return mux
}

// collector reads the owners at scrape time.
type collector struct{ src Sources }

// descs are the collector's descriptors, in the order desc made them.
var descs []*prometheus.Desc

func desc(name, help string, labels ...string) *prometheus.Desc {
	d := prometheus.NewDesc(name, help, labels, nil)
	descs = append(descs, d)
	return d
}

var (
	dBuild        = desc("overlayd_build_info", "Always 1; the version of the running overlayd.", "version")
	dReady        = desc("overlayd_ready", "1 when the control plane has joined and a reconcile has run since (what /readyz answers), else 0.")
	dNetworks     = desc("overlayd_networks", "Networks this host has (created by dockerd, or restored).")
	dEndpoints    = desc("overlayd_endpoints", "Local endpoints by VNI and state (created, or joined to a container).", "vni", "state")
	dRemotePeers  = desc("overlayd_remote_peers", "Remote peers in the networks' peer tables by VNI and state: active (programmed), or shadowed (its IP is claimed by another record that wins the conflict).", "vni", "state")
	dAddresses    = desc("overlayd_endpoint_addresses", "Addresses of joined local endpoints and of remote peers by VNI, family (ipv4, ipv6) and kind (local, remote_active, remote_shadowed): each address is a claim of its own.", "vni", "family", "kind")
	dConflicts    = desc("overlayd_address_conflicts", "IP addresses claimed by more than one endpoint, by VNI.", "vni")
	dPeerChanges  = desc("overlayd_peer_changes_total", "Neighbour and FDB entries set or deleted in the networks' sandboxes.")
	dNlMessages   = desc("overlayd_netlink_messages_total", "Netlink requests sent to the kernel to program peers.")
	dNlBatches    = desc("overlayd_netlink_batches_total", "Netlink datagrams (batches of requests) sent to program peers.")
	dNlFailures   = desc("overlayd_netlink_send_failures_total", "Netlink datagrams the kernel refused as a whole.")
	dReconciles   = desc("overlayd_reconcile_runs_total", "Runs of the periodic level-triggered reconcile.")
	dRepairs      = desc("overlayd_reconcile_repairs_total", "Differences between the kernel and the desired state the reconcile repaired, by kind (sandbox, bridge_port, peer_entry).", "kind")
	dAudit        = desc("overlayd_audit_differences", "Differences between the kernel and the driver's state found by an audit at this scrape (links, MTUs, bridge ports, neighbours, FDB entries, stray sandboxes, encryption); 0 when they agree.")
	dUp           = desc("overlayd_gossip_up", "1 when the control plane (gossip) runs, else 0 (no VTEP known yet, or left).")
	dMembers      = desc("overlayd_gossip_members", "Cluster members as this host sees them, itself included, by state.", "state")
	dMsgsSent     = desc("overlayd_gossip_messages_sent_total", "Control-plane messages sent.")
	dBytesSent    = desc("overlayd_gossip_sent_bytes_total", "Bytes of control-plane messages sent.")
	dSendErrors   = desc("overlayd_gossip_send_errors_total", "Control-plane messages that could not be sent.")
	dMsgsRecv     = desc("overlayd_gossip_messages_received_total", "Control-plane messages received.")
	dDropped      = desc("overlayd_gossip_dropped_total", "Control-plane messages or records dropped, by reason.", "reason")
	dFailures     = desc("overlayd_gossip_member_failures_total", "Members declared dead (dead detections).")
	dReturns      = desc("overlayd_gossip_member_returns_total", "Dead members that came back within the failed grace (detections that were false, or a restart).")
	dHealth       = desc("overlayd_gossip_health_score", "Memberlist's awareness score of this host: 0 is healthy, higher means its own probes are slow.")
	dRemoteRecs   = desc("overlayd_gossip_remote_records", "Remote records in force, by VNI.", "vni")
	dEncEpoch     = desc("overlayd_encryption_key_epoch", "Key epochs: the one this host sends with (send) and the one the cluster rotates to (target).", "kind")
	dEncAccepted  = desc("overlayd_encryption_accepted_epochs", "Key epochs this host accepts (2 during a rotation).")
	dEncSAs       = desc("overlayd_encryption_sas", "IPsec SAs installed in the kernel, by direction.", "direction")
	dEncPolicies  = desc("overlayd_encryption_policies", "Remote hosts whose outbound IPsec policy is installed.")
	dEncRemotes   = desc("overlayd_encryption_remotes", "Remote hosts this host has encryption state with.")
	dEncRotating  = desc("overlayd_encryption_rotating", "1 while a key rotation asked here is not installed yet.")
	dEncRepairs   = desc("overlayd_encryption_repairs_total", "Encryption reconciles that found and fixed drift in the kernel.")
	dEncReconcile = desc("overlayd_encryption_reconciles_total", "Encryption reconciles run.")
	dRotations    = desc("overlayd_encryption_rotation_duration_seconds", "Completed key rotations (count) and how long each took, from the raised target to the old epoch retired.")
	dStateWrites  = desc("overlayd_state_write_duration_seconds", "State-file write transactions (each fsynced) and how long they took.")
	dIPAM         = desc("overlayd_ipam_addresses", "Addresses of each address management pool in the ranges this host owns, by state (free, or used: allocated here).", "pool", "state")
)

// Describe sends every descriptor (the registry checks names once).
func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range descs {
		ch <- d
	}
}

// Collect asks the owners.
func (c *collector) Collect(ch chan<- prometheus.Metric) {
	s := c.src
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	gauge(dBuild, 1, s.Version)
	if s.Ready != nil {
		gauge(dReady, b2f(s.Ready() == nil))
	}
	if s.Driver != nil {
		collectDriver(s.Driver(), gauge, counter)
	}
	if s.DriverCounters != nil {
		dc := s.DriverCounters()
		counter(dPeerChanges, dc.PeerChanges)
		counter(dReconciles, dc.Reconciles)
		for _, k := range driver.RepairKinds {
			counter(dRepairs, dc.Repaired[k], k)
		}
	}
	if s.Audit != nil {
		if diffs, err := s.Audit(); err != nil {
			ch <- prometheus.NewInvalidMetric(dAudit, fmt.Errorf("audit: %w", err))
		} else {
			gauge(dAudit, float64(len(diffs)))
		}
	}
	if s.Netlink != nil {
		msgs, batches, fails := s.Netlink()
		counter(dNlMessages, msgs)
		counter(dNlBatches, batches)
		counter(dNlFailures, fails)
	}
	if s.Cluster != nil {
		collectCluster(s.Cluster(), gauge, counter)
	}
	if s.IPAM != nil {
		if st := s.IPAM(); st != nil {
			for _, p := range st.Pools {
				gauge(dIPAM, float64(p.LocalFree), p.PoolID, "free")
				gauge(dIPAM, float64(p.LocalUsed), p.PoolID, "used")
			}
		}
	}
	if s.Rotations != nil {
		ch <- histogram(dRotations, s.Rotations())
	}
	if s.StateWrites != nil {
		ch <- histogram(dStateWrites, s.StateWrites())
	}
}

type emit func(d *prometheus.Desc, v float64, labels ...string)
type emitCount func(d *prometheus.Desc, v uint64, labels ...string)

func collectDriver(st driver.Status, gauge emit, counter emitCount) {
	gauge(dNetworks, float64(len(st.Networks)))
	type key struct {
		vni   uint32
		state string
	}
	type addrKey struct {
		vni          uint32
		family, kind string
	}
	eps, peers, conflicts, addrs := map[key]int{}, map[key]int{}, map[uint32]int{}, map[addrKey]int{}
	for _, n := range st.Networks {
		// Every VNI is reported, from zero: a network's series exist as
		// long as the network does.
		for _, v := range n.VNIs {
			eps[key{v, "created"}] += 0
			eps[key{v, "joined"}] += 0
			peers[key{v, "active"}] += 0
			peers[key{v, "shadowed"}] += 0
			conflicts[v] += 0
			for _, fam := range []string{"ipv4", "ipv6"} {
				for _, kind := range []string{"local", "remote_active", "remote_shadowed"} {
					addrs[addrKey{v, fam, kind}] += 0
				}
			}
		}
		for _, ep := range n.Endpoints {
			state := "created"
			if ep.Joined {
				state = "joined"
				if ep.Address != "" {
					addrs[addrKey{ep.VNI, "ipv4", "local"}]++
				}
				if ep.AddressIPv6 != "" {
					addrs[addrKey{ep.VNI, "ipv6", "local"}]++
				}
			}
			eps[key{ep.VNI, state}]++
		}
		remoteKind := func(active bool) string {
			if active {
				return "remote_active"
			}
			return "remote_shadowed"
		}
		for _, p := range n.RemotePeers {
			// A record is active when one of its addresses is.
			state := "shadowed"
			if p.Active || p.ActiveIPv6 {
				state = "active"
			}
			peers[key{p.VNI, state}]++
			if p.IP != "" {
				addrs[addrKey{p.VNI, "ipv4", remoteKind(p.Active)}]++
			}
			if p.IPv6 != "" {
				addrs[addrKey{p.VNI, "ipv6", remoteKind(p.ActiveIPv6)}]++
			}
		}
		for _, cf := range n.Conflicts {
			conflicts[cf.VNI]++
		}
	}
	for k, v := range eps {
		gauge(dEndpoints, float64(v), vniLabel(k.vni), k.state)
	}
	for k, v := range peers {
		gauge(dRemotePeers, float64(v), vniLabel(k.vni), k.state)
	}
	for k, v := range addrs {
		gauge(dAddresses, float64(v), vniLabel(k.vni), k.family, k.kind)
	}
	for vni, v := range conflicts {
		gauge(dConflicts, float64(v), vniLabel(vni))
	}
	e := st.Encryption
	if e == nil {
		return
	}
	gauge(dEncEpoch, float64(e.Send), "send")
	gauge(dEncEpoch, float64(e.Target), "target")
	gauge(dEncAccepted, float64(len(e.Accept)))
	in, out, policies := 0, 0, 0
	for _, p := range e.Pairs {
		if p.SendSA.Installed {
			out++
		}
		for _, sa := range p.Inbound {
			if sa.Installed {
				in++
			}
		}
		if p.PolicyFound {
			policies++
		}
	}
	gauge(dEncSAs, float64(in), "in")
	gauge(dEncSAs, float64(out), "out")
	gauge(dEncPolicies, float64(policies))
	gauge(dEncRemotes, float64(len(e.Pairs)))
	gauge(dEncRotating, b2f(e.Rotating))
	counter(dEncRepairs, uint64(e.Repairs))
	counter(dEncReconcile, uint64(e.Reconciles))
}

// memberStates are reported from zero, so that "members dead" is 0, not
// absent, in a healthy cluster.
var memberStates = []cluster.MemberState{cluster.StateAlive, cluster.StateSuspect, cluster.StateDead, cluster.StateLeft}

func collectCluster(st *cluster.Status, gauge emit, counter emitCount) {
	if st == nil {
		gauge(dUp, 0)
		return
	}
	gauge(dUp, 1)
	members := map[cluster.MemberState]int{}
	for _, s := range memberStates {
		members[s] = 0
	}
	for _, m := range st.Members {
		members[m.State]++
	}
	for s, n := range members {
		gauge(dMembers, float64(n), string(s))
	}
	counter(dMsgsSent, st.Stats.MessagesSent)
	counter(dBytesSent, st.Stats.BytesSent)
	counter(dSendErrors, st.Stats.SendErrors)
	counter(dMsgsRecv, st.Stats.MessagesReceived)
	for r, n := range st.Dropped {
		counter(dDropped, n, string(r))
	}
	counter(dFailures, st.Stats.MemberFailures)
	counter(dReturns, st.Stats.MemberReturns)
	gauge(dHealth, float64(st.Node.HealthScore))
	for _, v := range st.VNIs {
		gauge(dRemoteRecs, float64(v.Remote), vniLabel(v.VNI))
	}
}

func histogram(d *prometheus.Desc, s latency.Snapshot) prometheus.Metric {
	return prometheus.MustNewConstHistogram(d, s.Count, s.SumSeconds, s.Cumulative)
}

func vniLabel(v uint32) string { return strconv.FormatUint(uint64(v), 10) }

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
