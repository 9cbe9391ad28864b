package docker

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
)

// labResolver is the address of each engine host's own resolver in the
// lab (a dnsRecorder: every A query gets 192.0.2.99): what "the host's
// resolvers" are here.
const labResolver = "203.0.113.200"

// namesPair is two joined engines set up as docs/names.md says: daemon.json
// lists overlayd's name server first and the host's resolver second, and
// overlayd forwards to the host's resolver.
func namesPair(t *testing.T) []*engine {
	t.Helper()
	_, es := joinedPairWith(t, func(e *engine) {
		lo, err := e.ns.nl.LinkByName("lo")
		if err != nil {
			t.Fatal(err)
		}
		a, _ := netlink.ParseAddr(labResolver + "/32")
		if err := e.ns.nl.AddrAdd(lo, a); err != nil {
			t.Fatal(err)
		}
		newDNSRecorder(t, e, labResolver)
		if err := os.WriteFile(filepath.Join(e.dir, "ovd-resolv.conf"), []byte("nameserver "+labResolver+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(e.dir, "daemon.json"), []byte(`{"dns": ["169.254.53.53", "`+labResolver+`"]}`+"\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		e.restartDockerd()
	})
	return es
}

var nsAddrRE = regexp.MustCompile(`(?m)^Address(?: \d+)?:\s+([0-9a-f.:]+)\s*$`)

// lookup runs nslookup NAME (A records) in container c and returns the
// addresses answered, sorted; an error when the name does not resolve.
func (e *engine) lookup(c, name string) ([]string, error) {
	out, err := e.docker("exec", c, "nslookup", "-type=a", name)
	if err != nil {
		return nil, fmt.Errorf("nslookup %s in %s: %v", name, c, err)
	}
	// The answer follows the server's lines ("Server:", "Address:
	// 127.0.0.11:53").
	_, ans, ok := strings.Cut(out, "Name:")
	if !ok {
		return nil, fmt.Errorf("nslookup %s in %s: no answer: %s", name, c, out)
	}
	var addrs []string
	for _, m := range nsAddrRE.FindAllStringSubmatch(ans, -1) {
		addrs = append(addrs, m[1])
	}
	slices.Sort(addrs)
	return addrs, nil
}

// waitLookup polls lookup until it gives want (nil: until it fails) and
// returns how long that took.
func (e *engine) waitLookup(c, name string, want []string, timeout time.Duration) time.Duration {
	e.t.Helper()
	start := time.Now()
	for {
		got, err := e.lookup(c, name)
		if want == nil && err != nil || want != nil && err == nil && slices.Equal(got, want) {
			return time.Since(start)
		}
		if time.Since(start) > timeout {
			e.t.Fatalf("engine %s: %s from %s: %v %v after %v, want %v\noverlayd:\n%s", e.name, name, c, got, err, timeout, want, e.ovd.logTail(30))
		}
		time.Sleep(50 * time.Millisecond) // the poll's interval; the deadline decides
	}
}

func (e *engine) addrOn(c, network string) string {
	e.t.Helper()
	return e.must("inspect", "-f", `{{(index .NetworkSettings.Networks "`+network+`").IPAddress}}`, c)
}

// Names across hosts, on a real engine, as a user sets it up
// (docs/names.md): a container finds another host's container by its name
// and alias, tasks.NAME gives every holder on both hosts, external names
// and containers on bridge networks resolve through the host's resolver
// as before, and a removed container's name is gone on the other host.
func TestNamesAcrossHosts(t *testing.T) {
	es := namesPair(t)
	a, b := es[0], es[1]
	for _, e := range es {
		e.createNetwork("overlayd", "ov", "--ipam-driver", "overlayd", "-o", "vni=4420", "--subnet", "192.0.2.0/24")
	}
	a.run("web1", "ov", "", "--network-alias", "web")
	a.run("web2", "ov", "", "--network-alias", "web")
	b.run("web3", "ov", "", "--network-alias", "web")
	b.run("web4", "ov", "", "--network-alias", "web")
	b.run("db", "ov", "", "--network-alias", "Primary.DB")
	dbAddr := b.addrOn("db", "ov")
	var webs []string
	for _, w := range []struct {
		e *engine
		c string
	}{{a, "web1"}, {a, "web2"}, {b, "web3"}, {b, "web4"}} {
		webs = append(webs, w.e.addrOn(w.c, "ov"))
	}
	slices.Sort(webs)

	took := a.waitLookup("web1", "db", []string{dbAddr}, 10*time.Second)
	t.Logf("engine %s: db (on %s) resolved on %s %v after it started", selected.name, b.name, a.name, took.Round(time.Millisecond))
	a.mustPing("web1", "db")
	a.waitLookup("web1", "primary.db", []string{dbAddr}, 5*time.Second)
	// web: dockerd answers it with its own two; tasks.web is every holder.
	a.waitLookup("web1", "tasks.web", webs, 10*time.Second)
	b.waitLookup("web3", "tasks.web", webs, 10*time.Second)
	if got, err := a.lookup("web1", "web"); err != nil || len(got) != 2 {
		t.Errorf("web from web1: %v %v: want dockerd's two local holders", got, err)
	}
	// Every other name goes to the host's resolver, as before.
	a.waitLookup("web1", "www.ext.example", []string{"192.0.2.99"}, 5*time.Second)
	a.createNetwork("bridge", "br", "--subnet", "203.0.113.128/28")
	a.run("onbridge", "br", "")
	a.run("ondefault", "bridge", "")
	for _, c := range []string{"onbridge", "ondefault"} {
		a.waitLookup(c, "www.ext.example", []string{"192.0.2.99"}, 5*time.Second)
		if got, err := a.lookup(c, "db"); err == nil && slices.Contains(got, dbAddr) {
			t.Errorf("%s, on no overlayd network, resolves db: %v", c, got)
		}
	}
	// overlayd status lists the names per network.
	st, err := a.ovd.status()
	if err != nil {
		t.Fatal(err)
	}
	var parsed struct {
		Names struct {
			Networks map[string][]struct {
				Name      string
				Addresses []string
			}
		}
	}
	if err := json.Unmarshal([]byte(st), &parsed); err != nil {
		t.Fatal(err)
	}
	netID := a.must("network", "inspect", "-f", "{{.ID}}", "ov")
	var listed []string
	for _, n := range parsed.Names.Networks[netID] {
		listed = append(listed, n.Name)
	}
	for _, want := range []string{"db", "primary.db", "web", "web1", "web4"} {
		if !slices.Contains(listed, want) {
			t.Errorf("overlayd status on %s lists names %v for ov: %s missing", a.name, listed, want)
		}
	}

	// A restarted overlayd answers again as soon as it has rejoined (its
	// own names are restored from the state file; db's come back with
	// the cluster's records).
	if err := a.ovd.stop(); err != nil {
		t.Fatal(err)
	}
	if err := a.ovd.start(); err != nil {
		t.Fatal(err)
	}
	back := a.waitLookup("web1", "db", []string{dbAddr}, 10*time.Second)
	b.waitLookup("web3", "tasks.web", webs, 10*time.Second)
	t.Logf("engine %s: db resolves on %s %v after its overlayd restarted", selected.name, a.name, back.Round(time.Millisecond))

	start := time.Now()
	b.must("rm", "-f", "db")
	removed := time.Since(start)
	gone := a.waitLookup("web1", "db", nil, 10*time.Second)
	t.Logf("engine %s: db gone on %s %v after rm -f on %s returned (rm took %v)", selected.name, a.name, gone.Round(time.Millisecond), b.name, removed.Round(time.Millisecond))
}
