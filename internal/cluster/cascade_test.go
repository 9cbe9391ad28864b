package cluster

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// TestGossipCascade: no cascade of false deaths. OVERLAYD_CASCADE=N hosts
// run as separate processes (this test binary re-executed, one cluster
// node each, on loopback) with OVERLAYD_CASCADE_PROFILE (default lan); one
// is SIGSTOPped for 2 s, another SIGKILLed. The deaths declared must be
// about those two only, and the cluster must be quiet (no new death
// declared anywhere for 10 s) within 30 s. By hand only: it needs N
// processes' worth of CPU.
func TestGossipCascade(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("OVERLAYD_CASCADE"))
	if n < 4 {
		t.Skip("set OVERLAYD_CASCADE=50 (hosts, at least 4) to run the cascade test")
	}
	profile := os.Getenv("OVERLAYD_CASCADE_PROFILE")
	type child struct {
		name string
		cmd  *exec.Cmd
		mu   sync.Mutex
		// last report: alive members, deaths declared, names seen dead
		alive, failures int
		dead            []string
	}
	var kids []*child
	seed := ""
	for i := range n {
		port := freePort(t, "127.0.0.1")
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		k := &child{name: fmt.Sprintf("c%d", i+1)}
		k.cmd = exec.Command(os.Args[0], "-test.run=^TestGossipCascadeChild$")
		k.cmd.Env = append(os.Environ(), "OVERLAYD_CASCADE_CHILD="+k.name, "OVERLAYD_CASCADE_ADDR="+addr,
			"OVERLAYD_CASCADE_SEED="+seed, "OVERLAYD_CASCADE_PROFILE="+profile)
		if seed == "" {
			seed = addr
		}
		out, err := k.cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		k.cmd.Stderr = os.Stderr
		if err := k.cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = k.cmd.Process.Kill(); _ = k.cmd.Wait() })
		go func(r io.Reader) {
			sc := bufio.NewScanner(r)
			for sc.Scan() {
				var alive, failures int
				var dead string
				if _, err := fmt.Sscanf(sc.Text(), "report alive=%d failures=%d dead=%s", &alive, &failures, &dead); err != nil {
					continue
				}
				k.mu.Lock()
				k.alive, k.failures, k.dead = alive, failures, strings.Split(strings.Trim(dead, "-"), ",")
				k.mu.Unlock()
			}
		}(out)
		kids = append(kids, k)
	}
	total := func(skip ...*child) (sum int, about map[string]int) {
		about = map[string]int{}
		for _, k := range kids {
			if slices.Contains(skip, k) {
				continue
			}
			k.mu.Lock()
			sum += k.failures
			for _, d := range k.dead {
				if d != "" {
					about[d]++
				}
			}
			k.mu.Unlock()
		}
		return sum, about
	}
	joined := waitFor(t, 120*time.Second, "every process sees every member alive", func() (bool, string) {
		for _, k := range kids {
			k.mu.Lock()
			a := k.alive
			k.mu.Unlock()
			if a != n {
				return false, fmt.Sprintf("%s sees %d alive", k.name, a)
			}
		}
		return true, ""
	})
	before, _ := total()
	t.Logf("%d processes (profile %q) joined in %v; %d deaths declared while joining", n, profile, joined, before)

	stalled, killed := kids[n/2], kids[n-1]
	_ = stalled.cmd.Process.Signal(syscall.SIGSTOP)
	_ = killed.cmd.Process.Kill()
	time.Sleep(2 * time.Second) // the stall's length, not synchronisation
	_ = stalled.cmd.Process.Signal(syscall.SIGCONT)

	// Quiet: no new death declared anywhere for 10 s.
	last, lastChange := -1, time.Now()
	quiet := waitFor(t, 120*time.Second, "a quiet cluster (no new death declared for 10 s)", func() (bool, string) {
		s, _ := total(killed)
		if s != last {
			last, lastChange = s, time.Now()
		}
		return time.Since(lastChange) >= 10*time.Second, fmt.Sprintf("%d deaths declared so far", s)
	})
	after, about := total(killed)
	quietAt := quiet - 10*time.Second
	t.Logf("after the stall of %s and the kill of %s: %d deaths declared (was %d), quiet %v after the stall ended; dead now as seen by the others: %v",
		stalled.name, killed.name, after, before, quietAt.Round(100*time.Millisecond), about)
	for name := range about {
		if name != stalled.name && name != killed.name {
			t.Errorf("%s is seen dead although neither stalled nor killed", name)
		}
	}
	// Each other host may declare the killed one dead once and the stalled
	// one once; the stalled one may declare every other host dead once.
	if max := 2*(n-2) + (n - 1); after-before > max {
		t.Errorf("%d deaths declared after the stall and kill; at most %d expected without a cascade", after-before, max)
	}
	if quietAt > 30*time.Second {
		t.Errorf("quiet only %v after the stall ended; want within 30 s", quietAt)
	}
}

// TestGossipCascadeChild is one process of TestGossipCascade: a cluster
// node that reports what it sees on stdout until killed.
func TestGossipCascadeChild(t *testing.T) {
	name := os.Getenv("OVERLAYD_CASCADE_CHILD")
	if name == "" {
		t.Skip("run by TestGossipCascade")
	}
	ap, err := netip.ParseAddrPort(os.Getenv("OVERLAYD_CASCADE_ADDR"))
	if err != nil {
		t.Fatal(err)
	}
	p := LANProfile
	if v := os.Getenv("OVERLAYD_CASCADE_PROFILE"); v != "" {
		if p, err = ParseProfile(v); err != nil {
			t.Fatal(err)
		}
	}
	var seeds []string
	if s := os.Getenv("OVERLAYD_CASCADE_SEED"); s != "" {
		seeds = []string{s}
	}
	c, err := New(Config{NodeName: name, BindAddr: ap.Addr(), BindPort: int(ap.Port()), Key: testKey,
		Seeds: seeds, Watcher: newTestWatcher(name), Logger: testLogger(t), Profile: p})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Shutdown()
	for {
		st := c.Status()
		alive, dead := 0, []string{}
		for _, m := range st.Members {
			switch m.State {
			case StateAlive, StateSuspect:
				alive++
			case StateDead:
				dead = append(dead, m.Name)
			}
		}
		fmt.Printf("report alive=%d failures=%d dead=-%s\n", alive, st.Stats.MemberFailures, strings.Join(dead, ","))
		time.Sleep(250 * time.Millisecond) // the report period
	}
}
