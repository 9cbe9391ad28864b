package cluster

import (
	"fmt"
	"net"
	"os"
	"strconv"
	"testing"
	"time"

	"github.com/overlayd/overlayd/internal/testutil/impair"
)

// impairedNode is a node whose gossip traffic reaches it only through its
// impairment relay (it advertises the relay's address).
type impairedNode struct {
	*node
	relay *impair.Relay
}

// startImpaired starts n nodes on loopback, each behind a relay that drops
// loss of the UDP datagrams and delays everything by oneWay (a round trip
// crosses two relays), all with profile p; the others join the first
// through its relay.
func startImpaired(t *testing.T, n int, p Profile, loss float64, oneWay time.Duration) []*impairedNode {
	t.Helper()
	var out []*impairedNode
	var seed string
	for i := range n {
		host := fmt.Sprintf("127.0.0.%d", 1+i)
		r, err := impair.New(host, loss, oneWay)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { r.Close() })
		o := nodeOpts{tweak: func(c *Config) {
			c.Profile = p
			c.AdvertiseAddr, c.AdvertisePort = c.BindAddr, r.Port()
			if err := r.SetTarget(net.JoinHostPort(host, strconv.Itoa(c.BindPort))); err != nil {
				t.Fatal(err)
			}
		}}
		if seed != "" {
			o.seeds = []string{seed}
		} else {
			seed = net.JoinHostPort(host, strconv.Itoa(r.Port()))
		}
		out = append(out, &impairedNode{startNode(t, fmt.Sprintf("w%d", i+1), host, 0, o), r})
	}
	return out
}

func nodesOf(in []*impairedNode) []*node {
	out := make([]*node, len(in))
	for i, n := range in {
		out[i] = n.node
	}
	return out
}

// failures sums, over nodes, the members each has declared dead.
func failures(nodes []*node) (total uint64, detail string) {
	for _, n := range nodes {
		f := n.c.Status().Stats.MemberFailures
		total += f
		if f > 0 {
			detail += fmt.Sprintf(" %s:%d", n.name, f)
		}
	}
	return total, detail
}

// TestWANProfileHoldsOnImpairedUnderlay: six hosts in the wan profile on
// an underlay with 10% loss and 100 ms round trip (impair relays; see
// package impair for why a relay) declare no host dead while all are
// healthy, and keep every record in force; a host then killed (shut down
// without leaving, its relay gone: nothing answers) is declared dead by
// every other host within 15 s, and it is the only death.
//
// The impaired phase lasts 90 s; OVERLAYD_IMPAIR_DURATION (a duration,
// like 10m) lengthens it for the measurement the issue asks for. The lan
// profile fails this test (it measured 1 false death in 58 s).
func TestWANProfileHoldsOnImpairedUnderlay(t *testing.T) {
	dur := 90 * time.Second
	if v := os.Getenv("OVERLAYD_IMPAIR_DURATION"); v != "" {
		d, err := time.ParseDuration(v)
		if err != nil {
			t.Fatalf("OVERLAYD_IMPAIR_DURATION %q: %v", v, err)
		}
		dur = d
	}
	const loss, oneWay = 0.10, 50 * time.Millisecond
	in := startImpaired(t, 6, WANProfile, loss, oneWay)
	nodes := nodesOf(in)
	waitMembers(t, 60*time.Second, nodes)
	for i, n := range nodes {
		n.publish(42, n.peer("e", fmt.Sprintf("10.42.0.%d", i+1)))
	}
	waitConverged(t, 60*time.Second, nodes)
	if f, d := failures(nodes); f != 0 {
		t.Fatalf("false dead detections while joining:%s", d)
	}

	// The impaired phase: poll (not sleep) so that the first false death
	// fails the test at once, with who declared it.
	start := time.Now()
	tick := time.NewTicker(500 * time.Millisecond)
	suspectSamples := 0
	for time.Since(start) < dur {
		<-tick.C
		if f, d := failures(nodes); f != 0 {
			t.Fatalf("false dead detections after %v of %v (declared by):%s", time.Since(start).Round(time.Second), dur, d)
		}
		for _, n := range nodes {
			for _, m := range n.c.Status().Members {
				if m.State == StateSuspect {
					suspectSamples++
				}
			}
		}
	}
	tick.Stop()
	var fwd, dropped uint64
	for _, n := range in {
		fwd, dropped = fwd+n.relay.Forwarded.Load(), dropped+n.relay.Dropped.Load()
	}
	for _, n := range nodes {
		if d := diffState(inForce(n, map[uint32]bool{42: true}), expectedFor(n, nodes)); d != "" {
			t.Fatalf("%s lost records on the impaired underlay: %s", n.name, d)
		}
	}
	t.Logf("impaired %v: 0 false dead detections; %d UDP datagrams relayed, %d dropped (%.1f%%); %d member samples showed a suspect",
		dur, fwd+dropped, dropped, 100*float64(dropped)/float64(fwd+dropped), suspectSamples)

	// A real death.
	victim, survivors := in[5], nodes[:5]
	victim.stop()
	victim.relay.Close()
	took := waitDeadWithin(t, 15*time.Second, survivors, victim.name)
	if f, d := failures(survivors); f != uint64(len(survivors)) {
		t.Fatalf("deaths declared after the kill: %d, want %d (the victim, once per survivor):%s", f, len(survivors), d)
	}
	t.Logf("killed %s: declared dead by all %d survivors %v after the kill", victim.name, len(survivors), took.Round(10*time.Millisecond))
}

// TestLANProfileDetectsWithin5s: on a clean underlay, the default (lan)
// profile has every host declare a killed host dead within 5 s (six hosts).
func TestLANProfileDetectsWithin5s(t *testing.T) {
	var hosts []string
	for i := range 6 {
		hosts = append(hosts, fmt.Sprintf("127.0.0.%d", 1+i))
	}
	nodes := startCluster(t, "l", hosts, nodeOpts{})
	waitMembers(t, 20*time.Second, nodes)
	victim, survivors := nodes[5], nodes[:5]
	victim.stop()
	took := waitDeadWithin(t, 5*time.Second, survivors, victim.name)
	if f, d := failures(survivors); f != uint64(len(survivors)) {
		t.Fatalf("deaths declared: %d, want %d:%s", f, len(survivors), d)
	}
	t.Logf("lan: killed %s declared dead by all %d survivors %v after the kill", victim.name, len(survivors), took.Round(10*time.Millisecond))
}
