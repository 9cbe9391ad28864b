package multihost

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/netnsutil"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

// metricsAddr is where every host serves its metrics: loopback inside the
// host's own namespace, so the same address on each.
const metricsAddr = "127.0.0.1:9447"

// get fetches path from h's metrics listener, connecting from inside h's
// namespace (its loopback is not the test's).
func (h *host) get(path string) (int, string, error) {
	c := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		DialContext: func(_ context.Context, network, addr string) (net.Conn, error) {
			var conn net.Conn
			err := netnsutil.DoIn(h.ns.Handle, func() error {
				var err error
				conn, err = net.DialTimeout(network, addr, 5*time.Second)
				return err
			})
			return conn, err
		},
		DisableKeepAlives: true,
	}}
	resp, err := c.Get("http://" + h.metricsAddr + path)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body), err
}

// scrape is one parse of /metrics.
type scrape struct {
	text     string
	families map[string]*dto.MetricFamily
}

func (h *host) scrape(t *testing.T) scrape {
	t.Helper()
	code, body, err := h.get("/metrics")
	if err != nil || code != 200 {
		t.Fatalf("%s: GET /metrics: %d %v\n%s", h.name, code, err, body)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(strings.NewReader(body))
	if err != nil {
		t.Fatalf("%s: /metrics does not parse: %v\n%s", h.name, err, body)
	}
	return scrape{text: body, families: fams}
}

// value returns the sample of name with exactly labels (name=value
// pairs); counters, gauges and a histogram's count. ok is false when the
// series is absent.
func (s scrape) value(name string, labels ...string) (float64, bool) {
	f := s.families[name]
	if f == nil {
		return 0, false
	}
	want := map[string]string{}
	for i := 0; i+1 < len(labels); i += 2 {
		want[labels[i]] = labels[i+1]
	}
	for _, m := range f.Metric {
		if len(m.Label) != len(want) {
			continue
		}
		match := true
		for _, l := range m.Label {
			if want[l.GetName()] != l.GetValue() {
				match = false
			}
		}
		if !match {
			continue
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue(), true
		case m.Gauge != nil:
			return m.Gauge.GetValue(), true
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount()), true
		}
	}
	return 0, false
}

func (s scrape) must(t *testing.T, name string, labels ...string) float64 {
	t.Helper()
	v, ok := s.value(name, labels...)
	if !ok {
		t.Fatalf("no series %s%v in the scrape", name, labels)
	}
	return v
}

// The acceptance scenario of the metrics: two hosts serve metrics on
// loopback; /readyz turns 200 once the control plane joined; N endpoints
// joined on one host show up as N active remote peers on the other, the
// plugin call counters move by exactly the calls made, the peer programming
// counters by the entries those peers need, and promtool accepts the output.
func TestMetricsTwoHosts(t *testing.T) {
	nstest.RequireRoot(t)
	promtool := requirePromtool(t)
	hosts := startClusterWith(t, 2, func(h *host) { h.metricsAddr = metricsAddr })
	a, b := hosts[0], hosts[1]

	for _, h := range hosts {
		if code, body, err := h.get("/healthz"); err != nil || code != 200 {
			t.Fatalf("%s: /healthz: %d %v %q", h.name, code, err, body)
		}
		var last string
		err := nstest.Eventually(30*time.Second, 100*time.Millisecond, func() error {
			code, body, err := h.get("/readyz")
			last = body
			if err != nil {
				return err
			}
			if code != 200 {
				return fmt.Errorf("/readyz %d: %s", code, body)
			}
			return nil
		})
		if err != nil {
			t.Fatalf("%s never became ready: %v", h.name, err)
		}
		if last != "ready\n" {
			t.Errorf("%s: /readyz body %q", h.name, last)
		}
		// overlayd status says the same.
		out, err := exec.Command(binary(t), "status", "--control-socket", h.control()).CombinedOutput()
		if err != nil || !strings.Contains(string(out), "Readiness: ready\n") {
			t.Errorf("%s: overlayd status lacks the readiness line: %v\n%s", h.name, err, out)
		}
	}

	// b needs a sandbox to program a's peers into.
	b.join(t, "b-ep", netip.MustParsePrefix("198.51.100.50/24"))
	activePeers := func(h *host, want float64) error {
		return nstest.Eventually(15*time.Second, 50*time.Millisecond, func() error {
			got, _ := h.scrape(t).value("overlayd_remote_peers", "vni", fmt.Sprint(vni), "state", "active")
			if got != want {
				return fmt.Errorf("%s: overlayd_remote_peers{vni=%d,state=active} = %v, want %v", h.name, vni, got, want)
			}
			return nil
		})
	}
	if err := activePeers(a, 1); err != nil {
		t.Fatal(err)
	}
	a0, b0 := a.scrape(t), b.scrape(t)

	// On a: N endpoints joined, and one Join that fails (unknown endpoint).
	const n = 3
	for i := range n {
		a.join(t, fmt.Sprintf("a-ep%d", i), netip.MustParsePrefix(fmt.Sprintf("198.51.100.%d/24", 10+i)))
	}
	raw, _ := json.Marshal(map[string]any{"NetworkID": netID, "EndpointID": "no-such-endpoint", "SandboxKey": "/none"})
	resp, err := a.plugin.Post("http://plugin/NetworkDriver.Join", "application/json", bytes.NewReader(raw))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()

	if err := activePeers(b, n); err != nil {
		t.Fatal(err)
	}
	a1, b1 := a.scrape(t), b.scrape(t)

	// Plugin calls on a: exactly the ones made, every other series still.
	moved := map[[2]string]float64{{"CreateEndpoint", "ok"}: n, {"Join", "ok"}: n, {"Join", "error"}: 1}
	for _, f := range a1.families["overlayd_plugin_calls_total"].GetMetric() {
		var meth, outcome string
		for _, l := range f.Label {
			switch l.GetName() {
			case "method":
				meth = l.GetValue()
			case "outcome":
				outcome = l.GetValue()
			}
		}
		before := a0.must(t, "overlayd_plugin_calls_total", "method", meth, "outcome", outcome)
		if d := f.Counter.GetValue() - before; d != moved[[2]string{meth, outcome}] {
			t.Errorf("a: overlayd_plugin_calls_total{method=%s,outcome=%s} moved by %v, want %v", meth, outcome, d, moved[[2]string{meth, outcome}])
		}
	}
	if d := a1.must(t, "overlayd_plugin_call_duration_seconds", "method", "Join") - a0.must(t, "overlayd_plugin_call_duration_seconds", "method", "Join"); d != n+1 {
		t.Errorf("a: Join latency histogram counted %v calls, want %d", d, n+1)
	}
	if got := a1.must(t, "overlayd_endpoints", "vni", fmt.Sprint(vni), "state", "joined"); got != n {
		t.Errorf("a: overlayd_endpoints{state=joined} = %v, want %d", got, n)
	}
	// b programmed a neighbour and an FDB entry for each new peer, and sent
	// the kernel a message for each.
	if d := b1.must(t, "overlayd_peer_changes_total") - b0.must(t, "overlayd_peer_changes_total"); d != 2*n {
		t.Errorf("b: overlayd_peer_changes_total moved by %v, want %d (a neighbour and an FDB entry per peer)", d, 2*n)
	}
	if d := b1.must(t, "overlayd_netlink_messages_total") - b0.must(t, "overlayd_netlink_messages_total"); d != 2*n {
		t.Errorf("b: overlayd_netlink_messages_total moved by %v, want %d", d, 2*n)
	}
	if d := b1.must(t, "overlayd_gossip_messages_received_total") - b0.must(t, "overlayd_gossip_messages_received_total"); d < 1 {
		t.Errorf("b: overlayd_gossip_messages_received_total did not move (%v) while a's records arrived", d)
	}
	// a saved each endpoint when it was created and when it joined.
	if d := a1.must(t, "overlayd_state_write_duration_seconds") - a0.must(t, "overlayd_state_write_duration_seconds"); d < 2*n {
		t.Errorf("a: %v state-file writes, want at least %d", d, 2*n)
	}
	for _, s := range []struct {
		name string
		sc   scrape
	}{{"a", a1}, {"b", b1}} {
		if got := s.sc.must(t, "overlayd_gossip_members", "state", "alive"); got != 2 {
			t.Errorf("%s: overlayd_gossip_members{state=alive} = %v, want 2", s.name, got)
		}
		if got := s.sc.must(t, "overlayd_gossip_members", "state", "dead"); got != 0 {
			t.Errorf("%s: overlayd_gossip_members{state=dead} = %v, want 0", s.name, got)
		}
		if got := s.sc.must(t, "overlayd_audit_differences"); got != 0 {
			t.Errorf("%s: overlayd_audit_differences = %v, want 0 (the kernel holds what the driver says)", s.name, got)
		}
		if got := s.sc.must(t, "overlayd_ready"); got != 1 {
			t.Errorf("%s: overlayd_ready = %v, want 1", s.name, got)
		}
		promtoolCheck(t, promtool, s.name, s.sc.text)
	}

	// The periodic reconcile runs and repairs a peer entry removed behind
	// the driver's back, and counts it by kind.
	runs := b1.must(t, "overlayd_reconcile_runs_total")
	repairs := b1.must(t, "overlayd_reconcile_repairs_total", "kind", "peer_entry")
	nl, vx := b.vxlan(t)
	neigh, _ := nl.NeighList(vx.Attrs().Index, unix.AF_INET)
	deleted := false
	for _, ne := range neigh {
		if ne.IP.String() == "198.51.100.10" {
			if err := nl.NeighDel(&ne); err != nil {
				t.Fatal(err)
			}
			deleted = true
		}
	}
	nl.Close()
	if !deleted {
		t.Fatal("b has no neighbour for a's first endpoint to delete")
	}
	if err := nstest.Eventually(15*time.Second, 100*time.Millisecond, func() error {
		s := b.scrape(t)
		if got := s.must(t, "overlayd_reconcile_repairs_total", "kind", "peer_entry") - repairs; got != 1 {
			return fmt.Errorf("b: overlayd_reconcile_repairs_total{kind=peer_entry} moved by %v, want 1", got)
		}
		if s.must(t, "overlayd_reconcile_runs_total") <= runs {
			return fmt.Errorf("b: overlayd_reconcile_runs_total did not move")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// promtoolCheck runs `promtool check metrics` on text: the exposition is
// valid and follows Prometheus's naming conventions (its lint).
func promtoolCheck(t *testing.T, promtool, name, text string) {
	t.Helper()
	cmd := exec.Command(promtool, "check", "metrics")
	cmd.Stdin = strings.NewReader(text)
	out, err := cmd.CombinedOutput()
	if err != nil || len(bytes.TrimSpace(out)) > 0 {
		t.Errorf("%s: promtool check metrics: %v\n%s", name, err, out)
	}
}

// requirePromtool returns promtool's path, installing Debian's prometheus
// package when it is missing (its service kept from starting).
func requirePromtool(t *testing.T) string {
	t.Helper()
	if p, err := exec.LookPath("promtool"); err == nil {
		return p
	}
	const policy = "/usr/sbin/policy-rc.d"
	if _, err := os.Lstat(policy); os.IsNotExist(err) {
		if err := os.WriteFile(policy, []byte("#!/bin/sh\n# written by overlayd's multihost test during apt-get install; removed afterwards\nexit 101\n"), 0o755); err != nil {
			t.Fatal(err)
		}
		defer os.Remove(policy)
	}
	for _, args := range [][]string{
		{"-q", "-o", "DPkg::Lock::Timeout=300", "update"},
		{"-q", "-y", "--no-install-recommends", "--no-remove", "-o", "DPkg::Lock::Timeout=300", "install", "prometheus"},
	} {
		cmd := exec.Command("apt-get", args...)
		cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("apt-get %s: %v\n%s", strings.Join(args, " "), err, tail(string(out), 30))
		}
	}
	p, err := exec.LookPath("promtool")
	if err != nil {
		t.Fatalf("promtool missing after installing the prometheus package: %v", err)
	}
	return p
}

// A host told to join a cluster is not ready while nobody answers: /readyz
// says 503 with the reason, and overlayd status says the same, although the
// host serves (/healthz 200).
func TestReadyzWaitsForTheJoin(t *testing.T) {
	nstest.RequireRoot(t)
	nsHosts, vteps := nstest.Hosts(t, 1, false)
	keyFile := filepath.Join(t.TempDir(), "cluster.key")
	if err := os.WriteFile(keyFile, bytes.Repeat([]byte{7}, 32), 0o600); err != nil {
		t.Fatal(err)
	}
	h := &host{name: "lonely", ns: nsHosts[0], vtep: vteps[0], dir: t.TempDir(), netnsDir: nstest.NetnsDir(t), metricsAddr: metricsAddr}
	startHost(t, h, keyFile, []string{"192.0.2.99"}) // on the underlay, but nobody there
	const why = "not ready: the control plane has not joined the cluster yet"
	if err := nstest.Eventually(15*time.Second, 100*time.Millisecond, func() error {
		code, body, err := h.get("/readyz")
		if err != nil {
			return err
		}
		if code != 503 || !strings.HasPrefix(body, why) {
			return fmt.Errorf("/readyz: %d %q, want 503 %q", code, body, why)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if code, _, err := h.get("/healthz"); err != nil || code != 200 {
		t.Errorf("/healthz: %d %v, want 200 while serving", code, err)
	}
	out, err := exec.Command(binary(t), "status", "--control-socket", h.control()).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "Readiness: "+why) {
		t.Errorf("overlayd status lacks %q: %v\n%s", why, err, out)
	}
	if v := h.scrape(t).must(t, "overlayd_ready"); v != 0 {
		t.Errorf("overlayd_ready = %v, want 0", v)
	}
}
