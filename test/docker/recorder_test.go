package docker

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// What an engine sends a plugin, recorded: a pluginRecorder listens where
// dockerd looks for the legacy overlayd and passes every call on to the
// real overlayd, keeping the path, the request body and the answer's status.
// TestPluginRequests drives one engine through a network's life and logs the
// calls, so that engines can be compared (OVERLAYD_TEST_RECORD_DIR keeps
// them, one file per engine); the engine notes say what differs.

const recordDirEnv = "OVERLAYD_TEST_RECORD_DIR"

type pluginCall struct {
	path   string
	body   string // compacted JSON (or the raw body)
	status int
}

type pluginRecorder struct {
	ln     net.Listener
	srv    *http.Server
	client *http.Client
	mu     sync.Mutex
	calls  []pluginCall // guarded by mu
}

// recordPluginCalls starts overlayd (with extra) on a socket of its own and
// a recorder on the engine's overlayd.sock in front of it.
func (e *engine) recordPluginCalls(extra ...string) *pluginRecorder {
	e.t.Helper()
	real := filepath.Join(e.dir, "ovd", "plugin.sock")
	e.startOverlaydAt(real, extra...)
	ln, err := net.Listen("unix", filepath.Join(e.pluginDir, "overlayd.sock"))
	if err != nil {
		e.t.Fatalf("engine %s: recorder: %v", e.name, err)
	}
	r := &pluginRecorder{ln: ln, client: &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", real)
		}}}}
	r.srv = &http.Server{Handler: http.HandlerFunc(r.forward), ReadHeaderTimeout: 10 * time.Second}
	e.rec = r // closed by the engine after overlayd
	go r.srv.Serve(ln)
	return r
}

func (r *pluginRecorder) forward(w http.ResponseWriter, req *http.Request) {
	body, _ := io.ReadAll(req.Body)
	call := pluginCall{path: req.URL.Path, body: strings.TrimSpace(string(body))}
	var b bytes.Buffer
	if json.Compact(&b, body) == nil {
		call.body = b.String()
	}
	out, err := http.NewRequestWithContext(req.Context(), req.Method, "http://plugin"+req.URL.RequestURI(), bytes.NewReader(body))
	if err == nil {
		out.Header = req.Header.Clone()
		var resp *http.Response
		if resp, err = r.client.Do(out); err == nil {
			rb, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			for k, v := range resp.Header {
				w.Header()[k] = v
			}
			w.WriteHeader(resp.StatusCode)
			w.Write(rb)
			call.status = resp.StatusCode
		}
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		call.status = http.StatusBadGateway
	}
	r.mu.Lock()
	r.calls = append(r.calls, call)
	r.mu.Unlock()
}

func (r *pluginRecorder) recorded() []pluginCall {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]pluginCall(nil), r.calls...)
}

func (r *pluginRecorder) close() {
	r.srv.Close()
	r.client.CloseIdleConnections()
}

// engineMajor is the selected engine's major version (20, 26, 28).
func engineMajor() int {
	n, _ := strconv.Atoi(strings.SplitN(selected.name, ".", 2)[0])
	return n
}

func TestPluginRequests(t *testing.T) {
	l := newLab(t)
	e := l.addEngine("h1", 1)
	rec := e.recordPluginCalls()

	// A container's life on a network with overlayd's IPAM (IPv4 only)
	// and on a dual-stack one with Docker's.
	e.must("network", "create", "-d", "overlayd", "--ipam-driver", "overlayd", "-o", "vni=4901",
		"--subnet", "192.0.2.64/26", "rq")
	e.must("network", "create", "-d", "overlayd", "-o", "vni=4903",
		"--ipv6", "--subnet", "192.0.2.128/26", "--subnet", "2001:db8:9::/64", "ds")
	for _, n := range []string{"rq", "ds"} {
		e.run("rq1", n, "")
		e.must("stop", "rq1")
		e.must("rm", "rq1")
		e.must("network", "rm", n)
	}

	// IPv6-only networks are new in Docker 28 (--ipv4=false): the
	// container has an IPv6 address only.
	if engineMajor() >= 28 {
		e.must("network", "create", "-d", "overlayd", "-o", "vni=4902",
			"--ipv4=false", "--ipv6", "--subnet", "2001:db8:a::/64", "v6only")
		e.run("rq2", "v6only", "")
		got := e.must("inspect", "-f", `{{range .NetworkSettings.Networks}}{{.IPAddress}}|{{.GlobalIPv6Address}}{{end}}`, "rq2")
		v4, v6, _ := strings.Cut(got, "|")
		if v4 != "" || !strings.HasPrefix(v6, "2001:db8:a:") {
			t.Errorf("container on the IPv6-only network: IPv4 %q, IPv6 %q; want none and one of 2001:db8:a::/64", v4, v6)
		}
		if out, err := e.docker("exec", "rq2", "ip", "-4", "addr", "show", "eth0"); err != nil || strings.Contains(out, "inet ") {
			t.Errorf("rq2's eth0 on the IPv6-only network has IPv4 (or failed: %v): %s", err, out)
		}
		e.must("rm", "-f", "rq2")
		e.must("network", "rm", "v6only")
	}

	var text strings.Builder
	for _, c := range rec.recorded() {
		fmt.Fprintf(&text, "%s %d %s\n", c.path, c.status, c.body)
		// Every call dockerd makes is one overlayd serves: a 404 is a
		// call of a newer engine that overlayd does not know.
		if c.status == http.StatusNotFound {
			t.Errorf("engine %s called %s, which overlayd does not serve (404); body %s", selected.name, c.path, c.body)
		}
	}
	t.Logf("engine %s: plugin calls:\n%s", selected.name, text.String())
	if d := os.Getenv(recordDirEnv); d != "" {
		if err := os.WriteFile(filepath.Join(d, "plugin-calls-"+selected.name+".txt"), []byte(text.String()), 0o644); err != nil {
			t.Error(err)
		}
	}
}
