package docker

import (
	"crypto/rand"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Swarm across engines: three engines of a lab (h1 manager, h2 and h3
// workers) form a swarm; overlayd runs on each as the managed plugin with
// scope global and one shared cluster key, and swarm services and attachable
// containers on an overlayd network talk across hosts over overlayd's VXLAN.
//
// Addresses: the underlay is 198.51.100.0/24 (lab), docker0 and the local
// pools (docker_gwbridge) are in 203.0.113.0/25 (engine flags); swarm's own
// pool (the ingress network) is 192.0.2.0/25 and the overlayd networks are
// 203.0.113.128/25 and 192.0.2.128/26.

const (
	swarmNet     = "swnet"
	swarmSubnet  = "203.0.113.128/25"
	swarmNet2    = "swnet2"
	swarmSubnet2 = "192.0.2.128/26"
	swarmSvc     = "swsvc"
	// swarmKeyFile is the cluster key as the plugin sees it: in its state
	// mount, the same key on every host.
	swarmKeyFile = "/var/lib/overlayd/swarm.key"
	// rememberWait: overlayd saves the alive members every 15 s
	// (internal/daemon rememberInterval); a plugin killed sooner after the
	// cluster formed would have nothing to rejoin through.
	rememberWait = 16 * time.Second
)

// swarmHost is an engine of the swarm with its managed overlayd.
type swarmHost struct {
	*engine
	pluginID string
	enabled  time.Time // when the plugin was enabled
}

// ovdStatus is the part of `overlayd status --json` the swarm test reads.
type ovdStatus struct {
	Cluster *struct {
		Node struct {
			Name  string   `json:"name"`
			VTEP  string   `json:"vtep"`
			Seeds []string `json:"seeds"`
		} `json:"node"`
		Members []struct {
			Name  string `json:"name"`
			Addr  string `json:"addr"`
			State string `json:"state"`
			Self  bool   `json:"self"`
		} `json:"members"`
	} `json:"cluster"`
	Driver struct {
		AdvertiseAddr string `json:"advertise_addr"`
		Scope         string `json:"scope"`
		Networks      []struct {
			ID        string   `json:"id"`
			VNIs      []uint32 `json:"vnis"`
			Subnets   []string `json:"subnets"`
			Sandbox   string   `json:"sandbox"`
			Endpoints []struct {
				Address string `json:"address"`
				Joined  bool   `json:"joined"`
			} `json:"endpoints"`
			RemotePeers []struct {
				IP     string `json:"ip"`
				VTEP   string `json:"vtep"`
				Active bool   `json:"active"`
			} `json:"remote_peers"`
		} `json:"networks"`
	} `json:"driver"`
}

// alive lists the names of the members in state alive.
func (s *ovdStatus) alive() []string {
	var out []string
	if s.Cluster != nil {
		for _, m := range s.Cluster.Members {
			if m.State == "alive" {
				out = append(out, m.Name)
			}
		}
	}
	sort.Strings(out)
	return out
}

// seeds returns the control plane's seeds (nil before it started).
func (s *ovdStatus) seeds() []string {
	if s.Cluster == nil {
		return nil
	}
	return s.Cluster.Node.Seeds
}

// status asks the host's managed overlayd for `overlayd status --json`
// through its control socket in the engine's /run/docker/plugins/<id>/.
func (h *swarmHost) status() (*ovdStatus, error) {
	out, err := h.inMount(overlayd, "status", "--json", "--control-socket", "/run/docker/plugins/"+h.pluginID+"/control.sock")
	if err != nil {
		return nil, fmt.Errorf("overlayd status on %s: %v: %s", h.name, err, out)
	}
	var st ovdStatus
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		return nil, fmt.Errorf("overlayd status on %s: %v: %s", h.name, err, out)
	}
	return &st, nil
}

// eventually calls cond every 100ms until it returns "" and returns how long
// that took; after timeout it fails the test with cond's last answer.
func eventually(t *testing.T, timeout time.Duration, what string, cond func() string) time.Duration {
	t.Helper()
	start := time.Now()
	for {
		why := cond()
		if why == "" {
			return time.Since(start)
		}
		if time.Since(start) > timeout {
			t.Fatalf("%s: not within %v: %s", what, timeout, why)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// tasks returns the ids of the running containers of service svc on the
// engine.
func (e *engine) tasks(svc string) []string {
	out, _ := e.docker("ps", "-q", "--filter", "label=com.docker.swarm.service.name="+svc, "--filter", "status=running")
	return strings.Fields(out)
}

// netIP returns container c's address on network n ("" if none).
func (e *engine) netIP(c, n string) string {
	out, _ := e.docker("inspect", "-f", `{{with index .NetworkSettings.Networks "`+n+`"}}{{.IPAddress}}{{end}}`, c)
	return strings.TrimSpace(out)
}

// netOptions returns the driver options docker network inspect shows.
func (e *engine) netOptions(n string) map[string]string {
	e.t.Helper()
	var opts map[string]string
	out := e.must("network", "inspect", "-f", "{{json .Options}}", n)
	if err := json.Unmarshal([]byte(out), &opts); err != nil {
		e.t.Fatalf("engine %s: network inspect %s options %q: %v", e.name, n, out, err)
	}
	return opts
}

// allocatedOptions waits up to 10 s for swarm network n to show the driver
// options AllocateNetwork gave it, and returns them. The swarm allocator
// runs after `docker network create` has returned: Docker 26.1 has been
// seen to show the network with no options yet.
func (e *engine) allocatedOptions(n string) map[string]string {
	e.t.Helper()
	var opts map[string]string
	eventually(e.t, 10*time.Second, fmt.Sprintf("engine %s: network %s allocated (a vni option)", e.name, n), func() string {
		if opts = e.netOptions(n); opts["vni"] == "" {
			return fmt.Sprintf("options %v", opts)
		}
		return ""
	})
	return opts
}

// waitPing waits until one echo from c to dst is answered, then measures
// the RTT with three more (none may be lost).
func (e *engine) waitPing(c, dst string) time.Duration {
	e.t.Helper()
	var last error
	eventually(e.t, 15*time.Second, fmt.Sprintf("engine %s: first echo %s -> %s", e.name, c, dst), func() string {
		if _, last = e.pingFrom(c, dst, 1); last != nil {
			return last.Error()
		}
		return ""
	})
	return e.mustPing(c, dst)
}

// countInLog counts the lines of the engine's dockerd log (which holds the
// managed plugin's output) that contain all of subs.
func (e *engine) countInLog(subs ...string) int {
	b, _ := os.ReadFile(filepath.Join(e.dir, "dockerd.log"))
	n := 0
lines:
	for _, l := range strings.Split(string(b), "\n") {
		for _, s := range subs {
			if !strings.Contains(l, s) {
				continue lines
			}
		}
		n++
	}
	return n
}

// clusterKey returns a fresh cluster key as the plugin reads it (base64).
func clusterKey() []byte {
	raw := make([]byte, 32)
	rand.Read(raw)
	return []byte(base64.StdEncoding.EncodeToString(raw) + "\n")
}

// formSwarm makes a new swarm: the first host its manager, the others
// workers; it waits until every node is ready.
func formSwarm(t *testing.T, hosts ...*swarmHost) {
	t.Helper()
	m := hosts[0]
	start := time.Now()
	m.must("swarm", "init", "--advertise-addr", m.addr.String(),
		"--default-addr-pool", "192.0.2.0/25", "--default-addr-pool-mask-length", "26")
	timing(t, "docker swarm init", time.Since(start))
	for _, h := range hosts[1:] {
		joinSwarm(t, m, h)
	}
	d := eventually(t, 30*time.Second, fmt.Sprintf("%d swarm nodes ready", len(hosts)), readyNodes(m, len(hosts)))
	timing(t, "swarm nodes ready after the last join", d)
}

// joinSwarm joins h to manager m's swarm as a worker.
func joinSwarm(t *testing.T, m, h *swarmHost) {
	t.Helper()
	token := m.must("swarm", "join-token", "-q", "worker")
	start := time.Now()
	h.must("swarm", "join", "--token", token, "--advertise-addr", h.addr.String(), m.addr.String()+":2377")
	timing(t, "docker swarm join "+h.name, time.Since(start))
}

// readyNodes is a condition for eventually: manager m lists n ready nodes.
func readyNodes(m *swarmHost, n int) func() string {
	return func() string {
		out, err := m.docker("node", "ls", "--format", "{{.Hostname}} {{.Status}}")
		if err != nil {
			return err.Error()
		}
		if strings.Count(out, "Ready") != n {
			return out
		}
		return ""
	}
}

// taskAddrs is a condition for eventually: every host runs one task of
// swarmSvc with an address on swarmNet; it fills tasks and ips (host name
// → task id, address).
func taskAddrs(hosts []*swarmHost, tasks, ips map[string]string) func() string {
	return func() string {
		for _, h := range hosts {
			ts := h.tasks(swarmSvc)
			if len(ts) != 1 {
				return fmt.Sprintf("%s runs %d tasks", h.name, len(ts))
			}
			ip := h.netIP(ts[0], swarmNet)
			if ip == "" {
				return fmt.Sprintf("%s: task %s has no address on %s", h.name, ts[0], swarmNet)
			}
			tasks[h.name], ips[h.name] = ts[0], ip
		}
		return ""
	}
}

// createService creates swarmSvc on swarmNet from manager m: a global
// service (one task per host) with DNS round robin, as overlayd networks
// need (no IPVS here, and dockerd builds no VIP for a plugin's network).
func (m *swarmHost) createService() {
	m.t.Helper()
	m.must("service", "create", "--detach", "--name", swarmSvc, "--mode", "global",
		"--endpoint-mode", "dnsrr", "--network", swarmNet, "--no-resolve-image",
		"--stop-grace-period", "1s", image, sleeper[0], sleeper[1], sleeper[2])
}

// swarmLab is the state TestSwarm's clean-up needs.
type swarmLab struct {
	t     *testing.T
	hosts []*swarmHost
	done  bool // the test removed everything itself
}

// installPlugins builds the managed plugin and installs it on every host of
// the swarm lab with one new cluster key.
func (s *swarmLab) installPlugins(l *lab) {
	s.t.Helper()
	dir := filepath.Join(l.dir, "plugin")
	buildPluginDir(s.t, dir)
	key := clusterKey()
	for _, h := range s.hosts {
		h.installPlugin(dir, key)
	}
}

// installPlugin creates and enables the managed plugin on h: scope global,
// the shared cluster key, its own state directory.
func (h *swarmHost) installPlugin(dir string, key []byte) {
	h.t.Helper()
	// No OVERLAYD_ADVERTISE_ADDR and no OVERLAYD_JOIN: the address comes
	// from the host (then swarm's DiscoverNew), the peers from DiscoverNew.
	h.installPluginWith(dir, key, "OVERLAYD_SCOPE=global")
}

// installPluginWith creates the managed plugin on h with its state mount
// holding the shared cluster key, sets env (beside the settings every host
// has), and enables it.
func (h *swarmHost) installPluginWith(dir string, key []byte, env ...string) {
	h.t.Helper()
	state := filepath.Join(h.dir, "plugin-state")
	if err := os.MkdirAll(state, 0o700); err != nil {
		h.t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(state, filepath.Base(swarmKeyFile)), key, 0o600); err != nil {
		h.t.Fatal(err)
	}
	h.must("plugin", "create", pluginRef, dir)
	set := append([]string{"plugin", "set", pluginRef, "state.source=" + state, "OVERLAYD_LOG_LEVEL=debug",
		"OVERLAYD_NODE_NAME=" + h.name, "OVERLAYD_SECRET_FILE=" + swarmKeyFile}, env...)
	h.must(set...)
	start := time.Now()
	h.must("plugin", "enable", pluginRef)
	h.enabled = time.Now()
	h.pluginID = h.must("plugin", "inspect", "-f", "{{.Id}}", pluginRef)
	h.t.Logf("engine %s: plugin %s enabled in %v", h.name, h.pluginID[:12], time.Since(start).Round(time.Millisecond))
}

// propagatedNetns is where the host's managed overlayd mounts its sandboxes,
// as dockerd's mount namespace sees it.
func (h *swarmHost) propagatedNetns() string {
	return filepath.Join(h.dir, "data", "plugins", h.pluginID, "propagated-mount", "netns")
}

// dump logs what helps to debug a failure: plugin status, the service's
// tasks, the sandboxes' links, neighbours and FDB, the plugin's log lines.
func (s *swarmLab) dump() {
	t := s.t
	for _, h := range s.hosts {
		if !h.running() {
			continue
		}
		if h.pluginID != "" {
			out, err := h.inMount(overlayd, "status", "--control-socket", "/run/docker/plugins/"+h.pluginID+"/control.sock")
			t.Logf("engine %s: overlayd status (%v):\n%s", h.name, err, out)
			dir := h.propagatedNetns()
			for _, sb := range sandboxesIn(h.mountsUnder(dir), dir) {
				out, _ := h.inMount("nsenter", "--net="+sb, "--", "sh", "-c", "ip -d -br link; ip neigh show; bridge fdb show")
				t.Logf("engine %s: sandbox %s:\n%s", h.name, filepath.Base(sb), out)
			}
		}
		t.Logf("engine %s: docker ps:\n%s", h.name, h.dockerQuiet("ps", "-a"))
		t.Logf("engine %s: FORWARD: %s", h.name, func() string { out, _ := h.in("iptables", "-S", "FORWARD"); return out }())
		b, _ := os.ReadFile(filepath.Join(h.dir, "dockerd.log"))
		t.Logf("engine %s: plugin log (tail):\n%s", h.name, tail(grepLines(string(b), "plugin="), 40))
	}
	if len(s.hosts) > 0 && s.hosts[0].running() {
		t.Logf("service tasks:\n%s", s.hosts[0].dockerQuiet("service", "ps", "--no-trunc", swarmSvc))
		t.Logf("nodes:\n%s", s.hosts[0].dockerQuiet("node", "ls"))
	}
}

// cleanup runs before the lab's: on failure it logs the debug dump, then
// removes what the test did not (service, swarm membership); the engines'
// close removes containers, networks and plugins.
func (s *swarmLab) cleanup() {
	if s.t.Failed() {
		s.dump()
	}
	if s.done {
		return
	}
	if len(s.hosts) > 0 && s.hosts[0].running() {
		s.hosts[0].dockerQuiet("service", "rm", swarmSvc)
	}
	for i := len(s.hosts) - 1; i >= 0; i-- {
		if h := s.hosts[i]; h.running() {
			if ids := strings.Fields(h.dockerQuiet("ps", "-aq")); len(ids) > 0 {
				h.dockerQuiet(append([]string{"rm", "-f"}, ids...)...)
			}
		}
	}
	if len(s.hosts) > 0 && s.hosts[0].running() {
		s.hosts[0].dockerQuiet("network", "rm", swarmNet, swarmNet2)
	}
	for i := len(s.hosts) - 1; i >= 0; i-- {
		if h := s.hosts[i]; h.running() {
			h.dockerQuiet("swarm", "leave", "--force")
		}
	}
}

// TestSwarm runs a swarm of three engines with overlayd as the managed
// plugin (scope global) on each: a swarm-scoped attachable overlayd network,
// a global service (one task per host, dnsrr) whose tasks ping each other
// across hosts, an attachable container, a restart of the leader's dockerd
// (VNIs stay), a SIGKILLed plugin that rejoins the gossip through the
// members it remembered, and a complete clean-up.
func TestSwarm(t *testing.T) {
	// Swarm's executor pulls a task's image before it runs it, even with
	// the image present; there is no registry (nor DNS) in the lab, so
	// that would fail only after resolver timeouts. dockerd inherits this.
	t.Setenv("DOCKER_SERVICE_PREFER_OFFLINE_IMAGE", "1")
	l := newLab(t)
	begin := time.Now()
	sw := &swarmLab{t: t}
	t.Cleanup(sw.cleanup) // runs before the lab's clean-up
	for _, e := range l.addEngines(3) {
		sw.hosts = append(sw.hosts, &swarmHost{engine: e})
	}
	h1, h2, h3 := sw.hosts[0], sw.hosts[1], sw.hosts[2]
	timing(t, "three engines up (namespaces, dockerd, image)", time.Since(begin))

	// The managed plugin on each engine, enabled before the swarm exists,
	// so that swarm's DiscoverNew tells every plugin of the other nodes.
	sw.installPlugins(l)
	// No swarm yet: a swarm-scoped plugin without an advertise address
	// waits for swarm to announce this node's address (DiscoverNew Self)
	// rather than start its control plane on the default route's address
	// and move later; it serves the plugin API meanwhile.
	for _, h := range sw.hosts {
		st, err := h.status()
		if err != nil {
			t.Fatalf("engine %s: overlayd status: %v", h.name, err)
		}
		if st.Cluster != nil || st.Driver.AdvertiseAddr != "" {
			t.Errorf("engine %s before swarm: control plane %v, VTEP %q; want none until swarm announces the address", h.name, st.Cluster != nil, st.Driver.AdvertiseAddr)
		}
		if st.Driver.Scope != "global" {
			t.Errorf("engine %s: driver scope %q, want global", h.name, st.Driver.Scope)
		}
	}

	// The swarm: h1 manager, h2 and h3 workers.
	formSwarm(t, h1, h2, h3)
	joined := time.Now()

	// DiscoverNew seeds overlayd's gossip: every plugin sees all three.
	want := []string{"h1", "h2", "h3"}
	waitGossip(t, sw.hosts)
	timing(t, "overlayd gossip formed (3 alive members everywhere) after the last swarm join", time.Since(joined))
	gossipFormed := time.Now()
	for _, h := range sw.hosts {
		st, err := h.status()
		if err != nil || st.Cluster == nil {
			t.Fatalf("engine %s: overlayd status: %v", h.name, err)
		}
		t.Logf("engine %s: overlayd VTEP %s, seeds from DiscoverNew %v", h.name, st.Cluster.Node.VTEP, st.Cluster.Node.Seeds)
		if st.Cluster.Node.VTEP != h.addr.String() {
			t.Errorf("engine %s: overlayd VTEP %s, want %s", h.name, st.Cluster.Node.VTEP, h.addr)
		}
	}

	// The network, allocated by the leader's plugin.
	allocBefore := h1.countInLog("method=AllocateNetwork")
	d := h1.createNetwork(pluginRef, swarmNet, "--scope", "swarm", "--attachable", "--subnet", swarmSubnet, "-o", "encrypted=false")
	timing(t, "docker network create (swarm scope, AllocateNetwork on the leader)", d)
	// dockerd relays the plugin's output to its log asynchronously.
	eventually(t, 5*time.Second, "the leader's plugin logs its AllocateNetwork call", func() string {
		if h1.countInLog("method=AllocateNetwork") == allocBefore {
			return "no AllocateNetwork in h1's dockerd log"
		}
		return ""
	})
	opts := h1.allocatedOptions(swarmNet)
	t.Logf("network %s options on the manager: %v", swarmNet, opts)
	vni := opts["vni"]
	if opts["encrypted"] != "false" {
		t.Errorf("AllocateNetwork did not echo encrypted=false: options %v", opts)
	}
	if v, err := strconv.Atoi(vni); err != nil || v < 4096 {
		t.Fatalf("AllocateNetwork gave no VNI from 4096 up: options %v", opts)
	}
	netID := h1.must("network", "inspect", "-f", "{{.Id}}", swarmNet)

	// A global service: one task per host, DNS round robin (no IPVS here).
	start := time.Now()
	h1.createService()
	ips := map[string]string{} // host → its task's address on swnet
	tasks := map[string]string{}
	converge := taskAddrs(sw.hosts, tasks, ips)
	eventually(t, 60*time.Second, "service tasks running on every host", converge)
	timing(t, "service converge (docker service create to a running task on each of 3 hosts)", time.Since(start))
	t.Logf("task addresses: %v", ips)

	// Cross-host pings over overlayd's VXLAN, in every direction.
	for _, p := range [][2]*swarmHost{{h1, h2}, {h1, h3}, {h2, h3}, {h3, h1}} {
		rtt := p[0].waitPing(tasks[p[0].name], ips[p[1].name])
		timing(t, fmt.Sprintf("cross-host ping RTT task %s -> task %s (swarm, avg of 3)", p[0].name, p[1].name), rtt)
	}
	// What the nodes' CreateNetwork got is what AllocateNetwork returned.
	for _, h := range []*swarmHost{h2, h3} {
		o := h.netOptions(swarmNet)
		if o["vni"] != vni || o["encrypted"] != "false" {
			t.Errorf("engine %s: network options %v, want vni=%s encrypted=false (AllocateNetwork's output)", h.name, o, vni)
		}
	}
	for _, h := range sw.hosts {
		st, err := h.status()
		if err != nil {
			t.Fatal(err)
		}
		if len(st.Driver.Networks) != 1 || st.Driver.Networks[0].ID != netID ||
			len(st.Driver.Networks[0].VNIs) != 1 || strconv.Itoa(int(st.Driver.Networks[0].VNIs[0])) != vni {
			t.Errorf("engine %s: overlayd networks %+v, want %s with VNI %s", h.name, st.Driver.Networks, netID, vni)
		}
	}

	// Restart the leader's dockerd: its containers stop, the plugin and the
	// swarm manager come back; the allocator re-sends AllocateNetwork with
	// its previous output, and the VNI must not change. The restarted
	// plugin hears of no other node (dockerd registers a managed plugin's
	// driver lazily and then announces only Self), and the others saw it
	// leave: it must find them again by itself, however soon after the
	// cluster formed the restart comes.
	t.Logf("restarting h1's dockerd %v after its plugin was enabled, %v after the gossip formed",
		time.Since(h1.enabled).Round(time.Millisecond), time.Since(gossipFormed).Round(time.Millisecond))
	allocBefore = h1.countInLog("method=AllocateNetwork")
	start = time.Now()
	h1.restartDockerd()
	// Watch for the rejoin from now on (for its timing), while the swarm
	// comes back.
	rejoined := make(chan time.Duration, 1)
	stopWatch := make(chan struct{})
	defer close(stopWatch)
	go func() {
		for {
			if st, err := h1.status(); err == nil && strings.Join(st.alive(), ",") == strings.Join(want, ",") {
				rejoined <- time.Since(start)
				return
			}
			select {
			case <-stopWatch:
				return
			case <-time.After(50 * time.Millisecond):
			}
		}
	}()
	eventually(t, 60*time.Second, "manager back with 3 ready nodes", readyNodes(h1, 3))
	timing(t, "leader dockerd restart: manager ready", time.Since(start))
	eventually(t, 60*time.Second, "service tasks running on every host after the leader restart", converge)
	timing(t, "leader dockerd restart: service converged again", time.Since(start))
	after := h1.netOptions(swarmNet)
	realloc := h1.countInLog("method=AllocateNetwork") - allocBefore
	t.Logf("network %s options after the leader restart: %v (AllocateNetwork calls to the restarted plugin: %d)", swarmNet, after, realloc)
	if realloc < 1 {
		t.Errorf("the restarted leader did not re-send AllocateNetwork: VNI stability across re-allocation was not exercised")
	}
	if after["vni"] != vni || after["encrypted"] != "false" {
		t.Errorf("options after the leader restart %v, want vni=%s encrypted=false as before", after, vni)
	}
	var rejoinTook time.Duration
	select {
	case rejoinTook = <-rejoined:
	case <-time.After(max(30*time.Second-time.Since(start), time.Second)):
	}
	if rejoinTook == 0 {
		st, err := h1.status()
		if err != nil {
			t.Fatal(err)
		}
		t.Fatalf("h1's overlayd, restarted with its dockerd, did not rejoin the gossip within %v: alive %v, seeds %v",
			time.Since(start).Round(time.Second), st.alive(), st.seeds())
	}
	timing(t, "leader dockerd restart (from stop) to its overlayd rejoined (3 alive members)", rejoinTook)
	for _, p := range [][2]*swarmHost{{h1, h2}, {h1, h3}, {h3, h1}} {
		rtt := p[0].waitPing(tasks[p[0].name], ips[p[1].name])
		timing(t, fmt.Sprintf("cross-host ping RTT task %s -> task %s after the leader restart", p[0].name, p[1].name), rtt)
	}

	// An attachable container on h2 reaches the tasks on h3 and h1.
	d = h2.run("att", swarmNet, "")
	timing(t, "docker run --network (attachable swarm network, worker)", d)
	attIP := h2.netIP("att", swarmNet)
	rtt := h2.waitPing("att", ips["h3"])
	timing(t, "cross-host ping RTT attachable container h2 -> task h3", rtt)
	h3.waitPing(tasks["h3"], attIP)
	h2.waitPing("att", ips["h1"])
	// The allocation survived: a new network does not get swnet's VNI.
	h1.createNetwork(pluginRef, swarmNet2, "--scope", "swarm", "--subnet", swarmSubnet2)
	o2 := h1.allocatedOptions(swarmNet2)
	t.Logf("network %s options: %v", swarmNet2, o2)
	if o2["vni"] == "" || o2["vni"] == vni {
		t.Errorf("network %s got VNI %q; want a VNI other than %s (which %s holds)", swarmNet2, o2["vni"], vni, swarmNet)
	}
	h1.must("network", "rm", swarmNet2)

	// Kill h3's plugin: dockerd restarts it and tells it only of itself
	// (DiscoverNew Self); it must rejoin through the members it remembered.
	if wait := rememberWait - time.Since(gossipFormed); wait > 0 {
		t.Logf("waiting %v so that h3's overlayd has remembered its members", wait.Round(time.Millisecond))
		time.Sleep(wait)
	}
	old := h3.pluginPIDs()
	if len(old) != 1 {
		t.Fatalf("engine h3: plugin processes %v, want one", old)
	}
	// Cross-host pings h1 -> h3 go on meanwhile (10 a second for 6 s):
	// h3's kernel state stays, and the others must not drop h3's peers.
	pings := make(chan string, 1)
	go func() {
		out, _ := h1.docker("exec", tasks["h1"], "ping", "-i", "0.1", "-c", "60", "-W", "1", ips["h3"])
		pings <- out
	}()
	time.Sleep(2 * time.Second)
	start = time.Now()
	syscall.Kill(old[0], syscall.SIGKILL)
	eventually(t, 30*time.Second, "h3's plugin restarted by dockerd", func() string {
		if now := h3.pluginPIDs(); len(now) != 1 || now[0] == old[0] || !h3.pluginServing(h3.pluginID) {
			return fmt.Sprintf("plugin processes %v", now)
		}
		return ""
	})
	timing(t, "h3 plugin SIGKILL to restarted and serving", time.Since(start))
	var seeds []string
	eventually(t, 30*time.Second, "h3's restarted plugin sees 3 alive members", func() string {
		st, err := h3.status()
		if err != nil {
			return err.Error()
		}
		if got := st.alive(); strings.Join(got, ",") != strings.Join(want, ",") {
			return fmt.Sprintf("alive %v", got)
		}
		seeds = st.seeds()
		return ""
	})
	timing(t, "h3 plugin SIGKILL to rejoined (3 alive members)", time.Since(start))
	t.Logf("h3's restarted plugin: seeds %v (remembered members; swarm announced only itself)", seeds)
	if len(seeds) == 0 {
		t.Errorf("h3's restarted plugin has no seeds: it did not rejoin through remembered members")
	}
	for _, h := range []*swarmHost{h1, h2} {
		eventually(t, 15*time.Second, h.name+" sees h3 alive again", func() string {
			st, err := h.status()
			if err != nil {
				return err.Error()
			}
			if got := st.alive(); strings.Join(got, ",") != strings.Join(want, ",") {
				return fmt.Sprintf("alive %v", got)
			}
			return ""
		})
	}
	out := <-pings
	if m := lossRE.FindStringSubmatch(out); m == nil {
		t.Errorf("ping h1 -> h3 during h3's plugin restart:\n%s", out)
	} else {
		sent, _ := strconv.Atoi(m[1])
		got, _ := strconv.Atoi(m[2])
		t.Logf("cross-host pings lost during h3's plugin restart (SIGKILL): %d of %d (every 100ms)", sent-got, sent)
		if got < sent-2 {
			t.Errorf("lost %d of %d cross-host pings across h3's plugin restart", sent-got, sent)
		}
	}
	h1.waitPing(tasks["h1"], ips["h3"])
	h3.waitPing(tasks["h3"], ips["h2"])
	h3.waitPing(tasks["h3"], attIP)
	h2.waitPing("att", ips["h3"])
	// The restarted plugin adopted the sandbox and was re-told the peers.
	if st, err := h3.status(); err != nil {
		t.Error(err)
	} else if len(st.Driver.Networks) != 1 || len(st.Driver.Networks[0].Endpoints) != 1 || len(st.Driver.Networks[0].RemotePeers) != 3 {
		t.Errorf("h3 after its plugin restart: networks %+v, want %s with 1 local endpoint and 3 remote peers", st.Driver.Networks, netID)
	}

	// Remove everything and check that nothing is left.
	h2.must("rm", "-f", "att")
	removeSwarm(t, sw.hosts)
	sw.done = true
	timing(t, "TestSwarm body", time.Since(begin))
	for _, h := range sw.hosts {
		if lines := pluginProblems(h.engine); lines != "" {
			t.Logf("engine %s: the plugin's warnings and errors:\n%s", h.name, lines)
		}
	}
}

// removeSwarm removes the service and the network, checks that nothing of
// them is left on any host, dissolves the swarm and removes the plugins.
// The first host is the manager.
func removeSwarm(t *testing.T, hosts []*swarmHost) {
	t.Helper()
	start := time.Now()
	hosts[0].must("service", "rm", swarmSvc)
	eventually(t, 30*time.Second, "service tasks gone", func() string {
		for _, h := range hosts {
			if ts := h.tasks(swarmSvc); len(ts) > 0 {
				return fmt.Sprintf("%s still runs %v", h.name, ts)
			}
		}
		return ""
	})
	hosts[0].must("network", "rm", swarmNet)
	eventually(t, 30*time.Second, "overlayd networks, sandboxes and links gone on every host", func() string {
		for _, h := range hosts {
			st, err := h.status()
			if err != nil {
				return err.Error()
			}
			if len(st.Driver.Networks) > 0 {
				return fmt.Sprintf("%s: overlayd still has networks %+v", h.name, st.Driver.Networks)
			}
			dir := h.propagatedNetns()
			if m := sandboxesIn(h.mountsUnder(dir), dir); len(m) > 0 {
				return fmt.Sprintf("%s: sandbox mounts %v", h.name, m)
			}
			if files, _ := os.ReadDir(dir); len(files) > 0 {
				return fmt.Sprintf("%s: %d sandbox files", h.name, len(files))
			}
			if links := h.overlaydLinks(); len(links) > 0 {
				return fmt.Sprintf("%s: overlayd links %v", h.name, links)
			}
		}
		return ""
	})
	timing(t, "service rm + network rm to nothing left", time.Since(start))
	for i := len(hosts) - 1; i >= 0; i-- {
		hosts[i].must("swarm", "leave", "--force")
	}
	for _, h := range hosts {
		h.must("plugin", "disable", pluginRef)
		h.must("plugin", "rm", pluginRef)
		if pids := h.pluginPIDs(); len(pids) > 0 {
			t.Errorf("engine %s: plugin processes left: %v", h.name, pids)
		}
	}
}

// pluginProblems returns the WARN and ERROR lines the managed plugin wrote
// to the engine's dockerd log, but for memberlist's complaints about its
// own closed socket while the plugin shuts down.
func pluginProblems(e *engine) string {
	b, _ := os.ReadFile(filepath.Join(e.dir, "dockerd.log"))
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if !strings.Contains(l, "plugin=") || strings.Contains(l, "use of closed network connection") {
			continue
		}
		if strings.Contains(l, "level=WARN") || strings.Contains(l, "level=ERROR") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
