package docker

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// Swarm in any order: overlayd's gossip forms, and tasks on different
// nodes reach each other, whatever the order in which the swarm and the
// plugin are set up. TestSwarm covers the plugin enabled before the swarm
// exists; TestSwarmAnyOrder the other cases, each from a fresh swarm (and
// plugins with empty state) on the same three engines:
//
//   - swarm-then-plugin: the swarm is formed, then the plugin is enabled
//     on every node. dockerd announces each node only to itself then
//     (DiscoverNew Self); the gossip seeds in the leader's AllocateNetwork
//     answer are what the nodes find each other by.
//   - node-added-later: a node (plugin enabled) joins a swarm whose
//     network and service exist; its task reaches the others'.
//   - plugin-re-enabled: a node's plugin is disabled and enabled again
//     (drained meanwhile, as a plugin upgrade needs); its task reaches the
//     others' again.

// startService creates swarmNet (allocated by manager m's plugin) and the
// global service on it, and waits until every host of hosts runs a task
// with an address; it returns the tasks and their addresses by host name.
func startService(t *testing.T, m *swarmHost, hosts ...*swarmHost) (tasks, ips map[string]string) {
	t.Helper()
	d := m.createNetwork(pluginRef, swarmNet, "--scope", "swarm", "--attachable", "--subnet", swarmSubnet)
	timing(t, "docker network create (swarm scope)", d)
	start := time.Now()
	m.createService()
	tasks, ips = map[string]string{}, map[string]string{}
	eventually(t, 60*time.Second, "service tasks running on every host", taskAddrs(hosts, tasks, ips))
	timing(t, fmt.Sprintf("service converge on %d hosts", len(hosts)), time.Since(start))
	return tasks, ips
}

// pingMesh checks that every host's task reaches every other host's.
func pingMesh(t *testing.T, hosts []*swarmHost, tasks, ips map[string]string) {
	t.Helper()
	for _, a := range hosts {
		for _, b := range hosts {
			if a != b {
				rtt := a.waitPing(tasks[a.name], ips[b.name])
				timing(t, fmt.Sprintf("cross-host ping RTT task %s -> task %s", a.name, b.name), rtt)
			}
		}
	}
}

// waitGossip waits until every host's overlayd sees exactly the hosts
// alive.
func waitGossip(t *testing.T, hosts []*swarmHost) time.Duration {
	t.Helper()
	var want []string
	for _, h := range hosts {
		want = append(want, h.name)
	}
	return eventually(t, 30*time.Second, fmt.Sprintf("overlayd gossip of %v", want), func() string {
		for _, h := range hosts {
			st, err := h.status()
			if err != nil {
				return err.Error()
			}
			if got := st.alive(); strings.Join(got, ",") != strings.Join(want, ",") {
				return fmt.Sprintf("%s sees alive %v", h.name, got)
			}
		}
		return ""
	})
}

// forget removes what a case may have left of the plugins, and their
// state, so that the next case starts afresh.
func forget(hosts []*swarmHost) error {
	for _, h := range hosts {
		if h.running() {
			h.dockerQuiet("plugin", "rm", "-f", pluginRef)
		}
		h.pluginID = ""
		if err := os.RemoveAll(filepath.Join(h.dir, "plugin-state")); err != nil {
			return err
		}
	}
	return nil
}

func TestSwarmAnyOrder(t *testing.T) {
	// See TestSwarm: no registry in the lab.
	t.Setenv("DOCKER_SERVICE_PREFER_OFFLINE_IMAGE", "1")
	l := newLab(t)
	begin := time.Now()
	var all []*swarmHost
	for _, e := range l.addEngines(3) {
		all = append(all, &swarmHost{engine: e})
	}
	timing(t, "three engines up (namespaces, dockerd, image)", time.Since(begin))
	dir := filepath.Join(l.dir, "plugin")
	buildPluginDir(t, dir)
	key := clusterKey()

	// Each case runs on the first n engines, from a fresh swarm and
	// plugins with empty state; whatever it leaves is removed.
	run := func(name string, n int, body func(t *testing.T, hosts []*swarmHost)) {
		t.Run(name, func(t *testing.T) {
			hosts := all[:n]
			parent := all[0].t
			for _, h := range all {
				h.engine.t = t // the engines fail this case, not the parent
			}
			t.Cleanup(func() {
				if err := forget(all); err != nil {
					t.Error(err)
				}
				for _, h := range all {
					h.engine.t = parent
				}
			})
			sw := &swarmLab{t: t, hosts: hosts}
			t.Cleanup(sw.cleanup) // runs first: on failure, the debug dump
			start := time.Now()
			body(t, hosts)
			removeSwarm(t, hosts)
			sw.done = true
			timing(t, "case "+name, time.Since(start))
			for _, h := range hosts {
				if lines := pluginProblems(h.engine); lines != "" {
					t.Logf("engine %s: the plugin's warnings and errors so far:\n%s", h.name, lines)
				}
			}
		})
	}

	// Swarm first, then the plugin on every node: nothing but the
	// network's seeds tells the nodes of each other. It runs first, on
	// engines that were never in a swarm: an engine that was (an earlier
	// case) sometimes announces the other nodes to a plugin enabled later
	// (DiscoverNew, about 12 s on, measured with 20.10), which would hide
	// missing seeds.
	run("swarm-then-plugin", 2, func(t *testing.T, pair []*swarmHost) {
		h1 := pair[0]
		formSwarm(t, pair...)
		for _, h := range pair {
			h.installPlugin(dir, key)
		}
		for _, h := range pair {
			if st, err := h.status(); err == nil {
				t.Logf("engine %s: plugin enabled in the swarm: VTEP %q, alive %v", h.name, st.Driver.AdvertiseAddr, st.alive())
			}
		}
		warns := h1.countInLog("level=WARN", "--endpoint-mode dnsrr")
		tasks, ips := startService(t, h1, pair...)
		if seeds := h1.netOptions(swarmNet)["overlayd.seeds"]; !strings.HasPrefix(seeds, h1.addr.String()+":") {
			t.Errorf("network %s: overlayd.seeds %q, want the leader's gossip address %s:port first", swarmNet, seeds, h1.addr)
		}
		pingMesh(t, pair, tasks, ips)
		waitGossip(t, pair)
		// The leader says once that services need dnsrr (dockerd relays
		// the plugin's output asynchronously).
		eventually(t, 5*time.Second, "the leader's dnsrr warning", func() string {
			if h1.countInLog("level=WARN", "--endpoint-mode dnsrr") == warns {
				return "no WARN about --endpoint-mode dnsrr in h1's log"
			}
			return ""
		})
		if n := h1.countInLog("level=WARN", "--endpoint-mode dnsrr") - warns; n != 1 {
			t.Errorf("h1 logged the dnsrr warning %d times for one network, want once", n)
		}
	})

	// A node joins later, its plugin enabled before it joins.
	run("node-added-later", 3, func(t *testing.T, hosts []*swarmHost) {
		h1, h2, h3 := hosts[0], hosts[1], hosts[2]
		pair := hosts[:2]
		for _, h := range pair {
			h.installPlugin(dir, key)
		}
		formSwarm(t, pair...)
		tasks, ips := startService(t, h1, pair...)
		pingMesh(t, pair, tasks, ips)
		h3.installPlugin(dir, key)
		joinSwarm(t, h1, h3)
		start := time.Now()
		eventually(t, 30*time.Second, "3 swarm nodes ready", readyNodes(h1, 3))
		eventually(t, 60*time.Second, "service tasks running on every host", taskAddrs(hosts, tasks, ips))
		timing(t, "swarm join to the new node's task running", time.Since(start))
		for _, p := range [][2]*swarmHost{{h3, h1}, {h3, h2}, {h1, h3}, {h2, h3}} {
			rtt := p[0].waitPing(tasks[p[0].name], ips[p[1].name])
			timing(t, fmt.Sprintf("ping RTT task %s -> task %s", p[0].name, p[1].name), rtt)
		}
		waitGossip(t, hosts)
		timing(t, "swarm join to overlayd gossip of 3", time.Since(start))
	})

	// A node's plugin disabled and enabled again (an upgrade, say). Docker
	// unmounts a disabled plugin's propagated mount, and the sandboxes
	// with it (see the README), so the node is drained first, as for any
	// plugin upgrade; its task comes back once it is active again.
	run("plugin-re-enabled", 2, func(t *testing.T, pair []*swarmHost) {
		h1, h2 := pair[0], pair[1]
		formSwarm(t, pair...)
		for _, h := range pair {
			h.installPlugin(dir, key)
		}
		tasks, ips := startService(t, h1, pair...)
		pingMesh(t, pair, tasks, ips)
		waitGossip(t, pair)
		start := time.Now()
		h1.must("node", "update", "--availability", "drain", h2.name)
		eventually(t, 30*time.Second, "h2 drained: no task, no overlayd network", func() string {
			if ts := h2.tasks(swarmSvc); len(ts) > 0 {
				return fmt.Sprintf("h2 still runs %v", ts)
			}
			if st, err := h2.status(); err != nil {
				return err.Error()
			} else if len(st.Driver.Networks) > 0 {
				return fmt.Sprintf("h2's overlayd still has networks %+v", st.Driver.Networks)
			}
			return ""
		})
		h2.must("plugin", "disable", pluginRef)
		h2.must("plugin", "enable", pluginRef)
		timing(t, "drain, disable and enable h2's plugin", time.Since(start))
		h1.must("node", "update", "--availability", "active", h2.name)
		eventually(t, 60*time.Second, "service tasks running on every host", taskAddrs(pair, tasks, ips))
		pingMesh(t, pair, tasks, ips)
		waitGossip(t, pair)
		timing(t, "drain of h2 to its new task reaching h1's", time.Since(start))
	})
	timing(t, "TestSwarmAnyOrder", time.Since(begin))
}
