package multihost

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

// aliveMembers returns the names of the members h's control plane sees
// alive (none before it started).
func (h *host) aliveMembers(t *testing.T) []string {
	t.Helper()
	cl, _ := h.status(t)["cluster"].(map[string]any)
	ms, _ := cl["members"].([]any)
	var out []string
	for _, m := range ms {
		if mm, _ := m.(map[string]any); mm["state"] == "alive" {
			out = append(out, fmt.Sprint(mm["name"]))
		}
	}
	sort.Strings(out)
	return out
}

// A swarm that exists before the plugin is enabled, as the plugin API sees
// it: dockerd announces each node only to itself (DiscoverNew Self), the
// leader allocates the network, and every node's CreateNetwork gets the
// leader's answer. The answer's gossip seeds are all the nodes have to
// find each other — no --join, no remembered members — and a node that
// comes later finds them the same way. Before, each node stayed alone and
// containers on different nodes could not reach each other.
func TestSwarmSeedsFromAllocateNetwork(t *testing.T) {
	nstest.RequireRoot(t)
	nsHosts, vteps := nstest.Hosts(t, 3, false)
	keyFile := filepath.Join(t.TempDir(), "cluster.key")
	if err := os.WriteFile(keyFile, []byte(strings.Repeat("k", 32)), 0o600); err != nil {
		t.Fatal(err)
	}
	var hosts []*host
	start := func(i int) *host {
		h := &host{name: fmt.Sprintf("node%d", i), ns: nsHosts[i], vtep: vteps[i], dir: t.TempDir(), netnsDir: nstest.NetnsDir(t), swarm: true}
		startHost(t, h, keyFile, nil)
		h.call(t, "DiscoverNew", map[string]any{"DiscoveryType": 1,
			"DiscoveryData": map[string]any{"Address": h.vtep.String(), "BindAddress": "0.0.0.0", "Self": true}})
		if err := nstest.Eventually(10*time.Second, 20*time.Millisecond, func() error {
			if got := h.aliveMembers(t); len(got) != 1 || got[0] != h.name {
				return fmt.Errorf("%s: alive members %v, want itself alone", h.name, got)
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		hosts = append(hosts, h)
		return h
	}
	leader := start(0)
	start(1)

	alloc := leader.call(t, "AllocateNetwork", map[string]any{"NetworkID": "swarmnet", "Options": map[string]string{},
		"IPv4Data": []map[string]string{{"Pool": subnet}}})
	opts, _ := alloc["Options"].(map[string]any)
	if want := vteps[0].String() + ":7947"; opts["overlayd.seeds"] != want || opts["vni"] == nil {
		t.Fatalf("AllocateNetwork options %v: want a vni and overlayd.seeds=%s", opts, want)
	}
	create := func(h *host) {
		h.call(t, "CreateNetwork", map[string]any{"NetworkID": netID,
			"Options":  map[string]any{"com.docker.network.generic": opts},
			"IPv4Data": []map[string]string{{"Pool": subnet, "Gateway": gateway}}})
	}
	addrs := []netip.Prefix{netip.MustParsePrefix("198.51.100.30/24"), netip.MustParsePrefix("198.51.100.31/24"), netip.MustParsePrefix("198.51.100.32/24")}
	var ctrs []*nstest.NS
	for i, h := range hosts {
		create(h)
		ctrs = append(ctrs, h.join(t, fmt.Sprintf("ep%d", i), addrs[i]))
	}
	pingAll := func() {
		t.Helper()
		for i := range ctrs {
			for j := range ctrs {
				if i == j {
					continue
				}
				if err := nstest.PingEventually(ctrs[i], addrs[j].Addr(), 15*time.Second); err != nil {
					t.Fatalf("node%d → node%d: %v (node%d sees alive %v)", i, j, err, i, hosts[i].aliveMembers(t))
				}
			}
		}
	}
	pingAll()

	// A node added later gets the same options and finds both.
	late := start(2)
	create(late)
	ctrs = append(ctrs, late.join(t, "ep2", addrs[2]))
	pingAll()
	for _, h := range hosts {
		if got := h.aliveMembers(t); strings.Join(got, ",") != "node0,node1,node2" {
			t.Errorf("%s: alive members %v, want node0,node1,node2", h.name, got)
		}
	}
	// A leader restart re-sends its previous answer: the seeds are
	// refreshed to the members it knows now, itself first; the VNI stays.
	again := leader.call(t, "AllocateNetwork", map[string]any{"NetworkID": "swarmnet", "Options": opts,
		"IPv4Data": []map[string]string{{"Pool": subnet}}})
	reopts, _ := again["Options"].(map[string]any)
	want := fmt.Sprintf("%s:7947,%s:7947,%s:7947", vteps[0], vteps[1], vteps[2])
	if reopts["overlayd.seeds"] != want || reopts["vni"] != opts["vni"] {
		t.Errorf("re-sent AllocateNetwork: options %v, want overlayd.seeds=%s and vni %v", reopts, want, opts["vni"])
	}
}
