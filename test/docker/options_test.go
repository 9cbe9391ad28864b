package docker

import (
	"strings"
	"testing"
	"time"
)

// TestSwarmOptionTypo: a swarm network with a typo in an option's name.
// Swarm allocates a network after docker network create has answered, so
// no plugin can refuse it there; overlayd refuses it in every node's
// CreateNetwork instead, and the reason, with its did-you-mean, is what
// docker service ps shows for the tasks (a refusal in the leader's
// AllocateNetwork would leave them "New" without a word). One engine is
// enough: the manager is also the node that runs the task.
func TestSwarmOptionTypo(t *testing.T) {
	t.Setenv("DOCKER_SERVICE_PREFER_OFFLINE_IMAGE", "1") // see TestSwarm
	l := newLab(t)
	sw := &swarmLab{t: t}
	t.Cleanup(sw.cleanup)
	h := &swarmHost{engine: l.addEngines(1)[0]}
	sw.hosts = append(sw.hosts, h)
	sw.installPlugins(l)
	h.must("swarm", "init", "--advertise-addr", h.addr.String(),
		"--default-addr-pool", "192.0.2.0/25", "--default-addr-pool-mask-length", "26")

	h.createNetwork(pluginRef, swarmNet, "--scope", "swarm", "--attachable", "--subnet", swarmSubnet, "-o", "encrypt")
	h.must("service", "create", "--detach", "--name", swarmSvc, "--endpoint-mode", "dnsrr",
		"--network", swarmNet, "--no-resolve-image", "--stop-grace-period", "1s", image, sleeper[0], sleeper[1], sleeper[2])
	var errs string
	d := eventually(t, 30*time.Second, "the service's task refused with overlayd's reason", func() string {
		errs = h.dockerQuiet("service", "ps", "--no-trunc", "--format", "{{.CurrentState}}: {{.Error}}", swarmSvc)
		if !strings.Contains(errs, `unknown option "encrypt" (did you mean "encrypted"?)`) {
			return "docker service ps: " + errs
		}
		return ""
	})
	t.Logf("docker service ps after %v:\n%s", d.Round(time.Millisecond), errs)
	if running := h.tasks(swarmSvc); len(running) != 0 {
		t.Errorf("tasks running on a network with an unknown option: %v", running)
	}
	st, err := h.status()
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Driver.Networks) != 0 {
		t.Errorf("overlayd holds networks after refusing the only one: %+v", st.Driver.Networks)
	}
	h.must("service", "rm", swarmSvc)
	h.must("network", "rm", swarmNet)
}
