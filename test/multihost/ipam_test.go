package multihost

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os/exec"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

// The cluster IPAM across three overlayd processes, driven through each
// daemon's plugin socket as dockerd drives `--ipam-driver overlayd`.
// Pools in 127.0.0.0/8 are pure bookkeeping here (no address of them is
// ever configured or sent to), which gives large pools without leaving the
// documentation ranges for anything that carries traffic.

// ipamCall posts an IpamDriver call to h. It returns the answer, or an
// error with the daemon's text (its "Err") or the transport's failure.
// Safe to call from many goroutines (no t.Fatal).
func (h *host) ipamCall(method string, body any) (map[string]any, error) {
	raw, _ := json.Marshal(body)
	resp, err := h.plugin.Post("http://plugin/IpamDriver."+method, "application/json", bytes.NewReader(raw))
	if err != nil {
		return nil, fmt.Errorf("%s IpamDriver.%s: %w", h.name, method, err)
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	var m map[string]any
	json.Unmarshal(out, &m)
	if resp.StatusCode != 200 {
		if e, ok := m["Err"].(string); ok {
			return nil, errors.New(e)
		}
		return nil, fmt.Errorf("%s IpamDriver.%s: %s %s", h.name, method, resp.Status, out)
	}
	return m, nil
}

// requestPool asks h for pool (and its range) and returns the PoolID and
// the gateway the answer's Data names.
func (h *host) requestPool(t *testing.T, pool string) (string, string) {
	t.Helper()
	out, err := h.ipamCall("RequestPool", map[string]any{"AddressSpace": "overlayd", "Pool": pool, "Options": map[string]string{}})
	if err != nil {
		t.Fatalf("%s: RequestPool %s: %v", h.name, pool, err)
	}
	data, _ := out["Data"].(map[string]any)
	return fmt.Sprint(out["PoolID"]), fmt.Sprint(data["com.docker.network.gateway"])
}

// macFor is the MAC of the i-th endpoint of host hi, as dockerd would
// pass it (RequiresMACAddress).
func macFor(hi, i int) string {
	return fmt.Sprintf("02:42:%02x:%02x:%02x:%02x", 0x10+hi, byte(i>>16), byte(i>>8), byte(i))
}

// requestAddress asks h for an address of poolID (any if want is "") for
// the endpoint with mac.
func (h *host) requestAddress(poolID, want, mac string) (netip.Addr, error) {
	out, err := h.ipamCall("RequestAddress", map[string]any{"PoolID": poolID, "Address": want,
		"Options": map[string]string{"com.docker.network.endpoint.macaddress": mac}})
	if err != nil {
		return netip.Addr{}, err
	}
	p, err := netip.ParsePrefix(fmt.Sprint(out["Address"]))
	if err != nil {
		return netip.Addr{}, fmt.Errorf("%s answered address %v: %v", h.name, out["Address"], err)
	}
	return p.Addr(), nil
}

// ledger is what the test has been handed out: every address held, by
// whom; a second holder of an address is a duplicate, counted and named.
type ledger struct {
	pool  netip.Prefix
	gw    netip.Addr
	mu    sync.Mutex
	held  map[netip.Addr]string // address -> "host/mac"
	dups  []string
	wrong []string // outside the pool, or network/gateway/broadcast
}

func newLedger(pool string) *ledger {
	p := netip.MustParsePrefix(pool)
	return &ledger{pool: p, gw: p.Addr().Next(), held: map[netip.Addr]string{}}
}

func (l *ledger) take(a netip.Addr, holder string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	b := l.pool.Addr().As4()
	hostBits := uint32(1)<<(32-l.pool.Bits()) - 1
	n := (uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])) | hostBits
	bcast := netip.AddrFrom4([4]byte{byte(n >> 24), byte(n >> 16), byte(n >> 8), byte(n)})
	if !l.pool.Contains(a) || a == l.pool.Addr() || a == l.gw || a == bcast {
		l.wrong = append(l.wrong, fmt.Sprintf("%s to %s", a, holder))
	}
	if prev, ok := l.held[a]; ok {
		l.dups = append(l.dups, fmt.Sprintf("%s to %s while %s holds it", a, holder, prev))
		return
	}
	l.held[a] = holder
}

func (l *ledger) release(a netip.Addr) {
	l.mu.Lock()
	delete(l.held, a)
	l.mu.Unlock()
}

// check fails t if anything was handed out twice or outside the pool.
func (l *ledger) check(t *testing.T) {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.dups) > 0 {
		t.Errorf("%d addresses handed out twice in %s, e.g. %s", len(l.dups), l.pool, strings.Join(l.dups[:min(5, len(l.dups))], "; "))
	}
	if len(l.wrong) > 0 {
		t.Errorf("%d addresses handed out that no container may have in %s, e.g. %s", len(l.wrong), l.pool, strings.Join(l.wrong[:min(5, len(l.wrong))], "; "))
	}
}

// burst runs n concurrent RequestAddress calls on h (MACs from macFor(hi,
// first...)), entering what they got in l; it returns the addresses got
// and the errors, and the slowest answer.
func burst(h *host, hi int, poolID string, first, n int, l *ledger) ([]netip.Addr, []error, time.Duration) {
	var mu sync.Mutex
	var got []netip.Addr
	var errs []error
	var slowest time.Duration
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			mac := macFor(hi, first+i)
			start := time.Now()
			a, err := h.requestAddress(poolID, "", mac)
			took := time.Since(start)
			if err == nil {
				l.take(a, h.name+"/"+mac)
			}
			mu.Lock()
			defer mu.Unlock()
			slowest = max(slowest, took)
			if err != nil {
				errs = append(errs, err)
			} else {
				got = append(got, a)
			}
		})
	}
	wg.Wait()
	return got, errs, slowest
}

// waitAllAlive waits until every host sees every other alive.
func waitAllAlive(t *testing.T, hosts []*host) {
	t.Helper()
	if err := nstest.Eventually(20*time.Second, 100*time.Millisecond, func() error {
		for _, h := range hosts {
			if n := len(h.aliveMembers(t)); n != len(hosts) {
				return fmt.Errorf("%s sees %d members alive, want %d", h.name, n, len(hosts))
			}
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// ipamPool returns h's status of poolID (the "ipam" section of `overlayd
// status --json`).
func (h *host) ipamPool(t *testing.T, poolID string) map[string]any {
	t.Helper()
	ipam, _ := h.status(t)["ipam"].(map[string]any)
	pools, _ := ipam["pools"].([]any)
	for _, p := range pools {
		if pm := p.(map[string]any); pm["pool_id"] == poolID {
			return pm
		}
	}
	return nil
}

func errText(errs []error) string {
	seen := map[string]int{}
	for _, e := range errs {
		seen[e.Error()]++
	}
	var out []string
	for e, n := range seen {
		out = append(out, fmt.Sprintf("%dx %q", n, e))
	}
	sort.Strings(out)
	return strings.Join(out, "; ")
}

// TestIPAMThreeHostsConcurrent: three daemons request one pool at once
// (one claim wins cluster-wide) and get the same PoolID and gateway; then
// 300 concurrent RequestAddress per host: none fails, no address twice,
// every host got its 300. A /24 that runs out: 900 concurrent requests
// hand out each of its 253 addresses at most once (who gets the last ones
// is a race: a host may get none), the refused ones say the pool is full,
// and what is left is handed out until all 253 are.
func TestIPAMThreeHostsConcurrent(t *testing.T) {
	nstest.RequireRoot(t)
	hosts, _ := startHosts(t, 3, nil)
	waitAllAlive(t, hosts)

	for _, pool := range []string{"127.77.0.0/20", "198.51.100.0/24"} {
		ids, gws := make([]string, 3), make([]string, 3)
		var wg sync.WaitGroup
		for i, h := range hosts {
			wg.Go(func() { ids[i], gws[i] = h.requestPool(t, pool) })
		}
		wg.Wait()
		wantGW := netip.PrefixFrom(netip.MustParsePrefix(pool).Addr().Next(), netip.MustParsePrefix(pool).Bits()).String()
		for i := range hosts {
			if ids[i] != ids[0] || gws[i] != wantGW {
				t.Fatalf("pool %s: PoolIDs %v, gateways %v: want one PoolID and gateway %s on every host", pool, ids, gws, wantGW)
			}
			// dockerd's gateway request (network create) gets the same.
			out, err := hosts[i].ipamCall("RequestAddress", map[string]any{"PoolID": ids[i], "Address": "",
				"Options": map[string]string{"RequestAddressType": "com.docker.network.gateway"}})
			if err != nil || out["Address"] != wantGW {
				t.Fatalf("%s: gateway of %s: %v %v, want %s", hosts[i].name, pool, out, err, wantGW)
			}
		}
	}
	big, _ := hosts[0].requestPool(t, "127.77.0.0/20")
	small, _ := hosts[0].requestPool(t, "198.51.100.0/24")

	// 300 concurrent requests on every host at once.
	l := newLedger("127.77.0.0/20")
	var wg sync.WaitGroup
	got := make([][]netip.Addr, 3)
	errs := make([][]error, 3)
	slow := make([]time.Duration, 3)
	start := time.Now()
	for i, h := range hosts {
		wg.Go(func() { got[i], errs[i], slow[i] = burst(h, i, big, 0, 300, l) })
	}
	wg.Wait()
	t.Logf("900 concurrent RequestAddress (300 per host) answered in %v; slowest per host %v", time.Since(start).Round(time.Millisecond), slow)
	l.check(t)
	for i := range hosts {
		if len(got[i]) != 300 || len(errs[i]) != 0 {
			t.Errorf("%s: %d addresses, %d refusals (%s); want 300 and none", hosts[i].name, len(got[i]), len(errs[i]), errText(errs[i]))
		}
	}

	// The /24 runs out: 253 addresses for 900 requests.
	ls := newLedger("198.51.100.0/24")
	for i, h := range hosts {
		wg.Go(func() { got[i], errs[i], _ = burst(h, i, small, 1000, 300, ls) })
	}
	wg.Wait()
	ls.check(t)
	total := 0
	for i := range hosts {
		total += len(got[i])
		t.Logf("%s: %d addresses of the /24, refusals: %s", hosts[i].name, len(got[i]), errText(errs[i]))
		// Who gets the last addresses is a race; every refusal must say
		// why: the pool is full, or no host could give (each named).
		for _, err := range errs[i] {
			if msg := err.Error(); !strings.Contains(msg, "is full") && !(strings.Contains(msg, "no free address") && strings.Contains(msg, "no other host gave any")) {
				t.Errorf("%s: a refusal in a pool that runs out: %v", hosts[i].name, err)
				break
			}
		}
	}
	if total > 253 {
		t.Fatalf("%d addresses of a /24 handed out, more than its 253", total)
	}
	// What is left is handed out too, one request at a time, until every
	// host is refused: then all 253 are out, and the refusal says why.
	for i, h := range hosts {
		for n := 0; ; n++ {
			a, err := h.requestAddress(small, "", macFor(i, 5000+n))
			if err != nil {
				if !strings.Contains(strings.ToLower(err.Error()), "full") {
					t.Errorf("%s: the refusal of a request in a full pool does not say it is full: %v", h.name, err)
				}
				break
			}
			ls.take(a, h.name)
			total++
		}
	}
	ls.check(t)
	if total != 253 {
		t.Errorf("%d addresses of the /24 handed out in all, want 253 (every address but network, gateway and broadcast)", total)
	}

	// Status: every host shows the pool with the gateway; the hosts' own
	// figures (exact) add up to 253 used and none free; the cluster
	// totals, each owner's figures as it last reported them, never count
	// more than there is.
	used, free := 0.0, 0.0
	for _, h := range hosts {
		p := h.ipamPool(t, small)
		if p == nil {
			t.Fatalf("%s's status lacks pool %s", h.name, small)
		}
		used += p["local_used"].(float64)
		free += p["local_free"].(float64)
		t.Logf("%s's status of %s: gateway %v, this host %v used %v free, cluster %v used %v free", h.name, small,
			p["gateway"], p["local_used"], p["local_free"], p["cluster_used"], p["cluster_free"])
		if p["gateway"] != "198.51.100.1" || p["cluster_used"].(float64) > 253 {
			t.Errorf("%s: pool %s gateway %v, cluster used %v; want 198.51.100.1 and at most 253", h.name, small, p["gateway"], p["cluster_used"])
		}
	}
	if used != 253 || free != 0 {
		t.Errorf("the hosts' own figures of %s add up to %v used and %v free, want 253 and 0", small, used, free)
	}
	out, err := exec.Command(binary(t), "status", "--control-socket", hosts[1].control()).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "Address management") || !strings.Contains(string(out), "pool 198.51.100.0/24") {
		t.Errorf("overlayd status (text) lacks the pool: %v\n%s", err, out)
	}
	if i := strings.Index(string(out), "\nAddress management"); i >= 0 {
		t.Logf("overlayd status (text) of %s, its IPAM section:%s", hosts[1].name, strings.SplitN(string(out)[i:], "\nDriver:", 2)[0])
	}
}

// ipamHosts starts three hosts, waits until they see each other, and
// requests pool on each: it returns the hosts, the key file, the PoolID and
// a ledger of the pool.
func ipamHosts(t *testing.T, pool string) ([]*host, string, string, *ledger) {
	t.Helper()
	nstest.RequireRoot(t)
	hosts, keyFile := startHosts(t, 3, nil)
	waitAllAlive(t, hosts)
	var id string
	for _, h := range hosts {
		id, _ = h.requestPool(t, pool)
	}
	return hosts, keyFile, id, newLedger(pool)
}

// TestIPAMPartition: one host cut off from the others' gossip (nftables
// drops its gossip port in its namespace) for 30 s. Both sides allocate
// during the cut (each from the ranges it owns, with no round trip), the
// cut-off host until it is refused: that refusal says the others cannot
// be reached, never guessing; and after healing. Never an address twice.
func TestIPAMPartition(t *testing.T) {
	hosts, _, id, l := ipamHosts(t, "203.0.113.0/24")
	next := make([]int, 3) // next endpoint number per host
	alloc := func(hi, n int) ([]netip.Addr, []error) {
		var got []netip.Addr
		var errs []error
		for range n {
			mac := macFor(hi, next[hi])
			next[hi]++
			a, err := hosts[hi].requestAddress(id, "", mac)
			if err != nil {
				errs = append(errs, err)
				continue
			}
			l.take(a, hosts[hi].name+"/"+mac)
			got = append(got, a)
		}
		return got, errs
	}
	// Each host owns part of the ring before the cut.
	for hi := range hosts {
		if got, errs := alloc(hi, 20); len(got) != 20 {
			t.Fatalf("%s before the cut: %d of 20 (%s)", hosts[hi].name, len(got), errText(errs))
		}
	}

	cut := hosts[2]
	heal := cutGossip(t, cut)
	cutAt := time.Now()
	for _, h := range hosts[:2] {
		h.waitMemberState(t, cut.name, "dead")
	}
	t.Logf("%s cut off; the others declared it dead after %v", cut.name, time.Since(cutAt).Round(time.Millisecond))

	// During the cut: the connected side allocates; the cut-off host
	// allocates until it is refused.
	var wg sync.WaitGroup
	sideGot := make([]int, 2)
	for hi := range 2 {
		wg.Go(func() {
			got, errs := alloc(hi, 10)
			sideGot[hi] = len(got)
			if len(errs) > 0 {
				t.Errorf("%s (connected side) refused during the cut: %s", hosts[hi].name, errText(errs))
			}
		})
	}
	var cutGot []netip.Addr
	var refusal error
	for range 256 {
		got, errs := alloc(2, 1)
		if len(errs) > 0 {
			refusal = errs[0]
			break
		}
		cutGot = append(cutGot, got...)
	}
	wg.Wait()
	t.Logf("during the cut: %s got %d then was refused: %v; %s and %s got %d and %d",
		cut.name, len(cutGot), refusal, hosts[0].name, hosts[1].name, sideGot[0], sideGot[1])
	if refusal == nil {
		t.Fatalf("%s was never refused while cut off", cut.name)
	}
	// It names the other hosts and why they gave nothing: unreachable,
	// or down as far as it can tell.
	msg := refusal.Error()
	why := false
	for _, w := range []string{"unreachable", "down", "dead"} {
		why = why || strings.Contains(msg, w)
	}
	if !strings.Contains(msg, hosts[0].name) || !strings.Contains(msg, hosts[1].name) || !why {
		t.Errorf("the cut-off host's refusal does not name the hosts it cannot reach and why: %q", msg)
	}
	// It frees some of what it has: space for the others after healing.
	for _, a := range cutGot[:min(15, len(cutGot))] {
		if _, err := cut.ipamCall("ReleaseAddress", map[string]any{"PoolID": id, "Address": a.String()}); err != nil {
			t.Fatalf("%s: ReleaseAddress %s: %v", cut.name, a, err)
		}
		l.release(a)
	}
	if d := 30*time.Second - time.Since(cutAt); d > 0 {
		time.Sleep(d) // the cut lasts 30 s, whatever the test did meanwhile
	}
	heal()
	healed := time.Now()
	waitAllAlive(t, hosts)
	t.Logf("healed; all alive again after %v", time.Since(healed).Round(time.Millisecond))

	// After healing: every host allocates again (the cut-off one from the
	// others' space, the others from what it freed if they need to).
	for hi := range hosts {
		wg.Go(func() {
			if got, errs := alloc(hi, 5); len(got) != 5 {
				t.Errorf("%s after healing: %d of 5 (%s)", hosts[hi].name, len(got), errText(errs))
			}
		})
	}
	wg.Wait()
	l.check(t)
}

// cutGossip drops h's gossip traffic (TCP and UDP port 7947, both ways)
// with nftables rules in h's namespace (a table of the test's own, beside
// overlayd's); the returned func removes them.
func cutGossip(t *testing.T, h *host) func() {
	t.Helper()
	conn, err := nftables.New(nftables.WithNetNSFd(int(h.ns.Handle)))
	if err != nil {
		t.Fatalf("nftables in %s: %v", h.name, err)
	}
	table := conn.AddTable(&nftables.Table{Family: nftables.TableFamilyINet, Name: "ipamtest_cut"})
	prio := nftables.ChainPriority(-10)
	drop := nftables.ChainPolicyAccept
	for _, hook := range []*nftables.ChainHook{nftables.ChainHookInput, nftables.ChainHookOutput} {
		chain := conn.AddChain(&nftables.Chain{Table: table, Name: fmt.Sprintf("hook%d", *hook), Type: nftables.ChainTypeFilter,
			Hooknum: hook, Priority: &prio, Policy: &drop})
		for _, proto := range []byte{unix.IPPROTO_TCP, unix.IPPROTO_UDP} {
			for _, offset := range []uint32{0, 2} { // source port, destination port
				conn.AddRule(&nftables.Rule{Table: table, Chain: chain, Exprs: []expr.Any{
					&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
					&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}},
					&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: offset, Len: 2},
					&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(7947)},
					&expr.Verdict{Kind: expr.VerdictDrop},
				}})
			}
		}
	}
	if err := conn.Flush(); err != nil {
		t.Fatalf("cutting %s off: %v", h.name, err)
	}
	removed := false
	remove := func() {
		if removed {
			return
		}
		removed = true
		conn.DelTable(table)
		if err := conn.Flush(); err != nil {
			t.Errorf("healing %s: %v", h.name, err)
		}
	}
	t.Cleanup(remove)
	return remove
}

// TestIPAMSurvivesSIGKILL: overlayd is SIGKILLed in the middle of a burst
// of requests and restarted: every address it answered before the kill is
// still allocated to its endpoint (its replay with the same MAC gets it
// back, any other MAC is refused), and nothing handed out before is
// handed out again, on this host or another.
func TestIPAMSurvivesSIGKILL(t *testing.T) {
	hosts, keyFile, id, l := ipamHosts(t, "127.77.64.0/22")
	for i, h := range hosts {
		if got, errs, _ := burst(h, i, id, 0, 30, l); len(got) != 30 {
			t.Fatalf("%s: %d of 30 (%s)", h.name, len(got), errText(errs))
		}
	}
	victim := hosts[1]
	// A burst of 200 on the victim, killed once 50 have been answered.
	type answer struct {
		addr netip.Addr
		mac  string
	}
	var mu sync.Mutex
	var answered []answer
	fifty := make(chan struct{})
	var wg sync.WaitGroup
	for i := range 200 {
		wg.Go(func() {
			mac := macFor(1, 100+i)
			a, err := victim.requestAddress(id, "", mac)
			if err != nil {
				return // cut by the kill: unknown, may or may not be allocated
			}
			l.take(a, victim.name+"/"+mac)
			mu.Lock()
			answered = append(answered, answer{a, mac})
			if len(answered) == 50 {
				close(fifty)
			}
			mu.Unlock()
		})
	}
	select {
	case <-fifty:
	case <-time.After(30 * time.Second):
		t.Fatal("50 of 200 requests were not answered within 30 s")
	}
	if err := victim.cmd.Process.Signal(syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	victim.cmd.Wait()
	wg.Wait()
	mu.Lock()
	before := append([]answer(nil), answered...)
	mu.Unlock()
	t.Logf("%s SIGKILLed after %d of 200 answers", victim.name, len(before))

	startHost(t, victim, keyFile, victim.join0)
	waitAllAlive(t, hosts)
	for i, a := range before {
		got, err := victim.requestAddress(id, a.addr.String(), a.mac)
		if err != nil || got != a.addr {
			t.Errorf("%s after the restart: replay of %s for %s: %v %v, want it back", victim.name, a.addr, a.mac, got, err)
		}
		if i%10 == 0 {
			if _, err := victim.requestAddress(id, a.addr.String(), macFor(9, i)); err == nil || !strings.Contains(err.Error(), a.addr.String()) {
				t.Errorf("%s after the restart: %s asked for by another endpoint: %v, want a refusal naming it", victim.name, a.addr, err)
			}
		}
	}
	// New allocations everywhere: none of them was handed out before.
	for i, h := range hosts {
		if got, errs, _ := burst(h, i, id, 1000, 50, l); len(got) != 50 {
			t.Errorf("%s after the restart: %d of 50 (%s)", h.name, len(got), errText(errs))
		}
	}
	l.check(t)
}

// TestIPAMReclaim: `overlayd ipam reclaim NODE` over the control socket is
// refused while NODE is alive, saying so; once NODE is gone (its overlayd
// stopped for good) it gives this host NODE's space, the other hosts learn
// that NODE's identity is reclaimed, and the space is handed out again:
// the whole pool, NODE's former allocations included.
func TestIPAMReclaim(t *testing.T) {
	hosts, _, id, l := ipamHosts(t, "203.0.113.0/26")
	for i, h := range hosts {
		if got, errs, _ := burst(h, i, id, 0, 10, l); len(got) != 10 {
			t.Fatalf("%s: %d of 10 (%s)", h.name, len(got), errText(errs))
		}
	}
	reclaim := func(on *host, node string) (string, error) {
		out, err := exec.Command(binary(t), "ipam", "reclaim", node, "--control-socket", on.control()).CombinedOutput()
		return string(out), err
	}
	gone := hosts[2]
	out, err := reclaim(hosts[0], gone.name)
	if err == nil || !strings.Contains(out, gone.name) || !strings.Contains(out, "alive") {
		t.Fatalf("reclaim of an alive host: %v\n%s\nwant a refusal saying it is alive", err, out)
	}
	t.Logf("reclaim of an alive host, refused: %s", strings.TrimSpace(out))

	gone.stop(t) // gone for good: the others see it dead
	hosts[0].waitMemberState(t, gone.name, "dead")
	out, err = reclaim(hosts[0], gone.name)
	if err != nil {
		t.Fatalf("reclaim of a dead host: %v\n%s", err, out)
	}
	var res struct {
		Node       string
		Identities []string
		Pools      []struct {
			PoolID    string `json:"pool_id"`
			Addresses uint64
		}
	}
	if err := json.Unmarshal([]byte(out), &res); err != nil || res.Node != gone.name || len(res.Identities) != 1 || len(res.Pools) != 1 ||
		res.Pools[0].PoolID != id || res.Pools[0].Addresses < 10 {
		t.Fatalf("reclaim answer %s (%v): want node %s, its identity, and pool %s with at least its 10 addresses", out, err, gone.name, id)
	}
	t.Logf("reclaim answer: %s", strings.Join(strings.Fields(out), " "))
	if err := nstest.Eventually(30*time.Second, 200*time.Millisecond, func() error {
		ipam, _ := hosts[1].status(t)["ipam"].(map[string]any)
		recl, _ := ipam["reclaimed"].([]any)
		if len(recl) != 1 || !strings.HasPrefix(fmt.Sprint(recl[0]), gone.name+"/") {
			return fmt.Errorf("%s lists reclaimed identities %v, want %s's", hosts[1].name, recl, gone.name)
		}
		return nil
	}); err != nil {
		t.Error(err)
	}
	// The gone host's addresses are free again: the two others fill the
	// whole pool (61 addresses), and nothing is handed out twice among
	// them.
	for _, a := range heldBy(l, gone.name) {
		l.release(a)
	}
	total := 20
	for i, h := range hosts[:2] {
		for n := 0; ; n++ {
			a, err := h.requestAddress(id, "", macFor(i, 100+n))
			if err != nil {
				break
			}
			l.take(a, h.name)
			total++
		}
	}
	l.check(t)
	if total != 61 {
		t.Errorf("%d addresses of %s in use after the reclaim, want all 61", total, id)
	}
}

// heldBy returns the addresses l has handed to the host named name.
func heldBy(l *ledger, name string) []netip.Addr {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []netip.Addr
	for a, h := range l.held {
		if strings.HasPrefix(h, name+"/") {
			out = append(out, a)
		}
	}
	return out
}
