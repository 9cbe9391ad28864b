package docker

import (
	"fmt"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// memberState returns the state status gives the member named name ("" if
// it lists none).
func (s *ovdStatus) memberState(name string) string {
	if s.Cluster != nil {
		for _, m := range s.Cluster.Members {
			if m.Name == name {
				return m.State
			}
		}
	}
	return ""
}

// TestPluginBackAfterDeclaredDead: a managed plugin that dockerd restarts
// only after the other hosts declared it dead keeps its peers on them. This
// is what Docker 26.1 does to a killed plugin under load (restarted after
// 0.8-2.5 s, past overlayd's ~1.3 s dead-node detection; 20.10 after
// 0.5-1 s): here the plugin is stopped (SIGSTOP) until the other host has
// declared it dead, then killed, and dockerd restarts it. Pings across go on
// all the while: the other host keeps the dead member's records in force
// for the cluster's FailedGrace and takes the restarted plugin's records
// when it is back. Without the grace (DefaultFailedGrace -1) pings are lost
// from the death until the rejoin.
func TestPluginBackAfterDeclaredDead(t *testing.T) {
	l := newLab(t)
	sw := &swarmLab{t: t}
	t.Cleanup(sw.cleanup) // runs before the lab's clean-up
	for _, e := range l.addEngines(2) {
		sw.hosts = append(sw.hosts, &swarmHost{engine: e})
	}
	h1, h2 := sw.hosts[0], sw.hosts[1]
	sw.installPlugins(l)
	h1.must("swarm", "init", "--advertise-addr", h1.addr.String(),
		"--default-addr-pool", "192.0.2.0/25", "--default-addr-pool-mask-length", "26")
	h2.must("swarm", "join", "--token", h1.must("swarm", "join-token", "-q", "worker"),
		"--advertise-addr", h2.addr.String(), h1.addr.String()+":2377")
	both := "h1,h2"
	eventually(t, 30*time.Second, "overlayd gossip of 2 alive members on both hosts", func() string {
		for _, h := range sw.hosts {
			st, err := h.status()
			if err != nil {
				return err.Error()
			}
			if got := strings.Join(st.alive(), ","); got != both {
				return fmt.Sprintf("%s sees alive %s", h.name, got)
			}
		}
		return ""
	})
	h1.createNetwork(pluginRef, swarmNet, "--scope", "swarm", "--attachable", "--subnet", swarmSubnet)
	h1.allocatedOptions(swarmNet)
	h1.run("c1", swarmNet, "")
	h2.run("c2", swarmNet, "")
	ip1, ip2 := h1.netIP("c1", swarmNet), h2.netIP("c2", swarmNet)
	h1.waitPing("c1", ip2)
	h2.waitPing("c2", ip1)

	old := h2.pluginPIDs()
	if len(old) != 1 {
		t.Fatalf("engine h2: plugin processes %v, want one", old)
	}
	// Pings h1 -> h2 every 100 ms for 15 s, through the stop, the death,
	// the kill and the restart.
	pings := make(chan string, 1)
	go func() {
		out, _ := h1.docker("exec", "c1", "ping", "-i", "0.1", "-c", "150", "-W", "1", ip2)
		pings <- out
	}()
	eventually(t, 10*time.Second, "pings under way", func() string {
		if out, _ := h1.docker("exec", "c1", "pidof", "ping"); out == "" {
			return "no ping in c1"
		}
		return ""
	})
	stopped := time.Now()
	syscall.Kill(old[0], syscall.SIGSTOP)
	eventually(t, 15*time.Second, "h1 declares h2 dead", func() string {
		st, err := h1.status()
		if err != nil {
			return err.Error()
		}
		if s := st.memberState(h2.name); s != "dead" {
			return fmt.Sprintf("h1 sees h2 %q", s)
		}
		return ""
	})
	dead := time.Since(stopped)
	killed := time.Now()
	syscall.Kill(old[0], syscall.SIGKILL)
	eventually(t, 30*time.Second, "h2's plugin restarted by dockerd", func() string {
		if now := h2.pluginPIDs(); len(now) != 1 || now[0] == old[0] || !h2.pluginServing(h2.pluginID) {
			return fmt.Sprintf("plugin processes %v", now)
		}
		return ""
	})
	restarted := time.Since(killed)
	for _, h := range sw.hosts {
		eventually(t, 20*time.Second, h.name+" sees both members alive again", func() string {
			st, err := h.status()
			if err != nil {
				return err.Error()
			}
			if got := strings.Join(st.alive(), ","); got != both {
				return fmt.Sprintf("alive %s", got)
			}
			return ""
		})
	}
	back := time.Since(killed)
	out := <-pings
	m := lossRE.FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("ping h1 -> h2 across h2's plugin death and restart:\n%s", out)
	}
	sent, _ := strconv.Atoi(m[1])
	got, _ := strconv.Atoi(m[2])
	t.Logf("FIGURE: h2's plugin stopped, declared dead by h1 after %v, killed, restarted by dockerd in %v, both alive again %v after the kill: %d of %d pings h1 -> h2 lost",
		dead.Round(time.Millisecond), restarted.Round(time.Millisecond), back.Round(time.Millisecond), sent-got, sent)
	if got != sent {
		t.Errorf("lost %d of %d pings h1 -> h2 across h2's plugin death and restart", sent-got, sent)
	}
	h2.waitPing("c2", ip1)
}
