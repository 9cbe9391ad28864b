package docker

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// docker compose with overlayd on two hosts: the example of docs/compose,
// run from its very files. The external network is created with the
// command docs/compose/README.md gives; compose.yaml adds a network of its
// own (driver overlayd, driver_opts, ipam driver overlayd). A container of
// h1 pings h2's on both networks, by address (names do not cross hosts).

func composeDocs() string { return filepath.Join(moduleRoot(), "docs", "compose") }

// readmeCommands returns the lines of README's sh blocks that start with
// prefix.
func readmeCommands(t *testing.T, readme, prefix string) [][]string {
	t.Helper()
	b, err := os.ReadFile(readme)
	if err != nil {
		t.Fatal(err)
	}
	var out [][]string
	in := false
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		l := sc.Text()
		switch {
		case strings.HasPrefix(l, "```sh"):
			in = true
		case strings.HasPrefix(l, "```"):
			in = false
		case in && strings.HasPrefix(l, prefix):
			if i := strings.Index(l, " #"); i >= 0 {
				l = l[:i]
			}
			out = append(out, strings.Fields(l))
		}
	}
	return out
}

// compose runs `docker compose` of the example's directory on the engine.
func (e *engine) compose(args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, dockerCLI, append([]string{"-H", "unix://" + e.sock, "compose"}, args...)...)
	cmd.Dir = composeDocs()
	cmd.Env = append(os.Environ(), "DOCKER_CONFIG="+e.cliConfig, "IMAGE="+image)
	out, err := cmd.CombinedOutput()
	s := strings.TrimSpace(string(out))
	if err != nil {
		return s, fmt.Errorf("docker compose %s: %v: %s", strings.Join(args, " "), err, s)
	}
	return s, nil
}

// needCompose skips a test on an engine without compose and returns the
// compose example's README.
func needCompose(t *testing.T) string {
	t.Helper()
	prepare(t)
	if composePlugin == "" {
		t.Skipf("engine %s has no docker compose plugin (only the 28.5 engine's packages bring docker-compose 2.x)", selected.name)
	}
	return filepath.Join(composeDocs(), "README.md")
}

// linkCompose gives the engine's CLI the compose plugin: `docker compose`
// finds it in the CLI's configuration directory.
func (e *engine) linkCompose() {
	e.t.Helper()
	if err := os.MkdirAll(filepath.Join(e.cliConfig, "cli-plugins"), 0o755); err != nil {
		e.t.Fatal(err)
	}
	if err := os.Symlink(composePlugin, filepath.Join(e.cliConfig, "cli-plugins", "docker-compose")); err != nil {
		e.t.Fatal(err)
	}
}

func TestCompose(t *testing.T) {
	readme := needCompose(t)
	creates := readmeCommands(t, readme, "docker network create ")
	removes := readmeCommands(t, readme, "docker network rm ")
	if len(creates) != 1 || len(removes) != 1 {
		t.Fatalf("%s: want one docker network create and one docker network rm in its sh blocks, have %v and %v", readme, creates, removes)
	}
	external := creates[0][len(creates[0])-1]

	_, es := joinedPair(t)
	for _, e := range es {
		e.linkCompose()
	}
	t.Logf("docker compose version: %s", es[0].must("compose", "version"))
	for _, e := range es {
		e.must(creates[0][1:]...)
		t.Cleanup(func() {
			// Before the lab's clean-up (which would remove all this
			// too), so that down and rm are checked on failure as well.
			if _, err := e.compose("down", "--timeout", "1"); err != nil {
				t.Errorf("engine %s: %v", e.name, err)
			}
			if _, err := e.docker(removes[0][1:]...); err != nil {
				t.Errorf("engine %s: %v", e.name, err)
			}
		})
		start := time.Now()
		if out, err := e.compose("up", "-d"); err != nil {
			t.Fatalf("engine %s: %v", e.name, err)
		} else {
			t.Logf("engine %s: compose up in %v:\n%s", e.name, time.Since(start).Round(time.Millisecond), out)
		}
	}
	// The compose-defined network is an overlayd network with the file's
	// options on each host.
	for _, e := range es {
		got := e.must("network", "inspect", "-f", `{{.Driver}} {{.IPAM.Driver}} {{index .Options "vni"}} {{range .IPAM.Config}}{{.Subnet}}{{end}}`, "demo_backend")
		if want := "overlayd overlayd 4243 192.0.2.128/25"; got != want {
			t.Errorf("engine %s: demo_backend: %q, want %q", e.name, got, want)
		}
	}
	addrs := func(e *engine) map[string]string {
		m := map[string]string{}
		for _, l := range strings.Split(e.must("inspect", "-f", `{{range $n, $e := .NetworkSettings.Networks}}{{$n}} {{$e.IPAddress}}{{"\n"}}{{end}}`, "demo-app-1"), "\n") {
			if n, a, ok := strings.Cut(strings.TrimSpace(l), " "); ok {
				m[n] = a
			}
		}
		return m
	}
	a, b := addrs(es[0]), addrs(es[1])
	t.Logf("addresses: h1 %v, h2 %v", a, b)
	for _, n := range []string{external, "demo_backend"} {
		if a[n] == "" || b[n] == "" || a[n] == b[n] {
			t.Fatalf("network %s: addresses h1 %q, h2 %q: want one each, distinct", n, a[n], b[n])
		}
		// The peer's record reaches h1 by gossip: poll until the ping
		// goes through.
		deadline := time.Now().Add(30 * time.Second)
		for {
			out, err := es[0].compose("exec", "-T", "app", "ping", "-c", "1", "-W", "1", b[n])
			if err == nil {
				t.Logf("network %s: h1 pings h2's %s:\n%s", n, b[n], out)
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("network %s: h1's container does not reach h2's %s within 30s: %v", n, b[n], err)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
}
