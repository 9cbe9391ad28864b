package encryption

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/nftables"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/lockorder"
	"github.com/overlayd/overlayd/internal/logkeys"
	"github.com/overlayd/overlayd/internal/testutil/logrec"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

type ownerOpts struct {
	tick     time.Duration
	noNotify bool
	store    MetaStore
	log      *slog.Logger
}

// newOwner makes an Owner for ns, closed when the test ends.
func newOwner(t *testing.T, ns *nstest.NS, o ownerOpts) *Owner {
	t.Helper()
	ow, err := NewOwner(OwnerConfig{NS: ns.Handle, Port: 4799, Secret: testSecret, Tick: o.tick, Store: o.store, Logger: o.log})
	if err != nil {
		t.Fatal(err)
	}
	if o.noNotify {
		ow.notify = false
	}
	t.Cleanup(ow.Close)
	return ow
}

// okOrUnsupported fails unless err is nil or says the kernel cannot
// install ESP (this project's workplace kernel).
func okOrUnsupported(t testing.TB, what string, err error) {
	t.Helper()
	if err != nil && !errors.Is(err, ErrKernelUnsupported) {
		t.Fatalf("%s: %v", what, err)
	}
}

// inVM: running in test/vm's guest, whose busybox ip has no xfrm.
var inVM = os.Getenv("OVERLAYD_VM_GUEST") != ""

// xfrmHandle returns an xfrm netlink handle in ns, closed with the test.
func xfrmHandle(t *testing.T, ns *nstest.NS) *netlink.Handle {
	t.Helper()
	h, err := netlink.NewHandleAt(ns.Handle, unix.NETLINK_XFRM)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(h.Close)
	return h
}

// inNS runs a command (ip, nft…) inside ns through nsenter, as an operator
// would.
func inNS(t *testing.T, ns *nstest.NS, args ...string) {
	t.Helper()
	fd, err := unix.FcntlInt(uintptr(ns.Handle), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "netns")
	defer f.Close()
	cmd := exec.Command("nsenter", append([]string{"--net=/proc/self/fd/3"}, args...)...)
	cmd.ExtraFiles = []*os.File{f}
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("%v in %s: %v\n%s", args, ns.Name, err, out)
	}
}

// flushRuleset is `nft flush ruleset` in ns (the nft tool is not installed
// everywhere; this sends the same request: delete every table).
func flushRuleset(t *testing.T, ns *nstest.NS) {
	t.Helper()
	c, err := nftables.New(nftables.WithNetNSFd(int(ns.Handle)))
	if err != nil {
		t.Fatal(err)
	}
	c.FlushRuleset()
	if err := c.Flush(); err != nil {
		t.Fatalf("nft flush ruleset in %s: %v", ns.Name, err)
	}
}

// waitAudit polls until o.Audit is empty and returns how long it took; it
// fails the test after limit.
func waitAudit(t *testing.T, o *Owner, limit time.Duration) time.Duration {
	t.Helper()
	t0 := time.Now()
	var last []string
	for time.Since(t0) < limit {
		if last = o.Audit(); len(last) == 0 {
			return time.Since(t0)
		}
		// Audit takes the Owner's lock: poll gently.
		time.Sleep(20 * time.Millisecond)
	}
	t.Fatalf("not restored within %v: %v", limit, last)
	return 0
}

// quiet checks that the Owner stops reconciling once nothing changes: its
// own changes, echoed back by the kernel, cost at most a reconcile or two.
func quiet(t *testing.T, o *Owner, window time.Duration, max int) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		r0 := o.Status().Reconciles
		time.Sleep(window) // an observation window, not synchronisation
		r1 := o.Status().Reconciles
		if r1-r0 <= max {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the Owner keeps reconciling: %d reconciles in %v", r1-r0, window)
		}
	}
}

var (
	ownerLocal  = netip.MustParseAddr("192.0.2.10")
	ownerRemote = netip.MustParseAddr("192.0.2.11")
)

// setupShares gives o one encrypted share (VNI 100, one remote) and one
// clear share (VNI 200), and checks what the kernel holds.
func setupShares(t *testing.T, ns *nstest.NS, o *Owner) {
	t.Helper()
	if err := o.SetLocal(ownerLocal); err != nil {
		t.Fatal(err)
	}
	okOrUnsupported(t, "encrypted share", o.Update(1, Share{VNIs: []uint32{100}, Encrypted: true, Remotes: []netip.Addr{ownerRemote}}, false))
	okOrUnsupported(t, "clear share", o.Update(2, Share{VNIs: []uint32{200}}, false))
	if a := o.Audit(); len(a) != 0 {
		t.Fatalf("audit after the updates: %v", a)
	}
	_, all := dumpOurs(t, ns)
	pols, clear := remotePolicies(all)
	if len(pols) != 1 || !clear || addrOf(pols[0].Dst.IP) != ownerRemote || pols[0].Mark != nil {
		t.Fatalf("want the remote's unmarked policy and the clear policy: %v", all)
	}
	if v := nftDumpView(t, ns); !v.exists || !v.vnis[100] || !v.clear[200] || len(v.vnis) != 1 || len(v.clear) != 1 {
		t.Fatalf("nft: %+v", v)
	}
}

type disruption struct {
	name string
	do   func(t *testing.T, ns *nstest.NS)
}

func disruptions() []disruption {
	return []disruption{
		{"nft flush ruleset", flushRuleset},
		{"ip xfrm policy flush", func(t *testing.T, ns *nstest.NS) {
			if inVM {
				if err := xfrmHandle(t, ns).XfrmPolicyFlush(); err != nil {
					t.Fatal(err)
				}
				return
			}
			inNS(t, ns, "ip", "xfrm", "policy", "flush")
		}},
		{"delete table inet overlayd", func(t *testing.T, ns *nstest.NS) {
			c, _ := nftables.New(nftables.WithNetNSFd(int(ns.Handle)))
			c.DelTable(table)
			if err := c.Flush(); err != nil {
				t.Fatal(err)
			}
		}},
		{"delete clear VNI element", func(t *testing.T, ns *nstest.NS) {
			c, _ := nftables.New(nftables.WithNetNSFd(int(ns.Handle)))
			if err := c.SetDeleteElements(vniSet(ClearSetName), elements([]uint32{200})); err != nil {
				t.Fatal(err)
			}
			if err := c.Flush(); err != nil {
				t.Fatal(err)
			}
		}},
		{"delete the clear policy", func(t *testing.T, ns *nstest.NS) {
			if inVM {
				k := clearKey(ownerLocal, 4799)
				if err := xfrmHandle(t, ns).XfrmPolicyDel(k.netlink(&wantPolicy{clear: true}, ownerLocal)); err != nil {
					t.Fatal(err)
				}
				return
			}
			inNS(t, ns, "ip", "xfrm", "policy", "delete", "dir", "out", "src", "0.0.0.0/0", "dst", "0.0.0.0/0", "proto", "udp", "dport", "4799",
				"mark", fmt.Sprint(ClearMark), "mask", "0xffffffff")
		}},
		{"ip xfrm state flush", func(t *testing.T, ns *nstest.NS) {
			if inVM {
				if err := xfrmHandle(t, ns).XfrmStateFlush(0); err != nil {
					t.Fatal(err)
				}
				return
			}
			inNS(t, ns, "ip", "xfrm", "state", "flush")
		}},
	}
}

// runDisruptions applies each disruption and checks the Owner restores
// everything within 1 s, counting it as a repair and logging each repair
// as one INFO reconcile_repair line (o logs to rec).
func runDisruptions(t *testing.T, ns *nstest.NS, o *Owner, rec *logrec.Recorder) {
	for _, d := range disruptions() {
		before := o.Status().Repairs
		d.do(t, ns)
		took := waitAudit(t, o, time.Second)
		if st := o.Status(); d.name != "ip xfrm state flush" && st.Repairs <= before {
			t.Fatalf("%s: restored but not counted as a repair (%d -> %d)", d.name, before, st.Repairs)
		}
		t.Logf("FIGURE: %s restored in %v", d.name, took.Round(time.Millisecond))
	}
	st := o.Status()
	if st.Repairs == 0 || st.LastRepair.IsZero() || st.LastRepairWas == "" {
		t.Fatalf("status does not show the repairs: %+v", st)
	}
	t.Logf("status: %d repairs, last %q", st.Repairs, st.LastRepairWas)
	lines := rec.Events(logkeys.ReconcileRepair)
	if len(lines) != st.Repairs {
		t.Errorf("%d repairs, %d reconcile_repair lines: %v", st.Repairs, len(lines), lines)
	}
	for _, l := range lines {
		if l.Level != slog.LevelInfo || l.Attrs[logkeys.Kind] != logkeys.KindEncryption || l.Attrs[logkeys.Trigger] == "" ||
			l.Attrs[logkeys.Count] == "" || l.Attrs[logkeys.Count] == "0" || l.Attrs["kernel"] == "" {
			t.Errorf("repair line is not at INFO with kind=encryption, a trigger, a count and the kernel changes: %v", l)
		}
	}
}

// TestOwnerRepairsOnNotification: with a tick of an hour only kernel
// notifications can trigger a reconcile; every flush is undone within 1 s.
func TestOwnerRepairsOnNotification(t *testing.T) {
	nstest.RequireRoot(t)
	ns := nstest.NewNS(t, "host")
	rec := &logrec.Recorder{}
	o := newOwner(t, ns, ownerOpts{tick: time.Hour, log: rec.Logger()})
	o.Start()
	setupShares(t, ns, o)
	quiet(t, o, 300*time.Millisecond, 0)
	runDisruptions(t, ns, o, rec)
	quiet(t, o, 300*time.Millisecond, 0)
	if a := o.Audit(); len(a) != 0 {
		t.Fatalf("audit: %v", a)
	}
}

// TestOwnerRepairsOnTick: with notifications off only the tick repairs.
func TestOwnerRepairsOnTick(t *testing.T) {
	nstest.RequireRoot(t)
	ns := nstest.NewNS(t, "host")
	rec := &logrec.Recorder{}
	o := newOwner(t, ns, ownerOpts{tick: 100 * time.Millisecond, noNotify: true, log: rec.Logger()})
	o.Start()
	setupShares(t, ns, o)
	runDisruptions(t, ns, o, rec)
	if a := o.Audit(); len(a) != 0 {
		t.Fatalf("audit: %v", a)
	}
}

// TestOwnerNoRepairWithoutLoop: the Owner repairs only through its loop:
// without Start, a flushed ruleset stays flushed (so the tests above prove
// the loop, not something else).
func TestOwnerNoRepairWithoutLoop(t *testing.T) {
	nstest.RequireRoot(t)
	ns := nstest.NewNS(t, "host")
	o := newOwner(t, ns, ownerOpts{tick: time.Hour})
	setupShares(t, ns, o)
	flushRuleset(t, ns)
	time.Sleep(300 * time.Millisecond) // an observation window
	if a := o.Audit(); len(a) == 0 {
		t.Fatal("restored without a loop running")
	}
}

// TestOwnerShares: counts (countmap) decide what the kernel holds: a remote
// needed by two shares stays until both let it go, a widening update keeps
// the old remotes until the next narrowing one, a VNI both clear and
// encrypted is encrypted, and removing every encrypted share removes
// everything.
func TestOwnerShares(t *testing.T) {
	nstest.RequireRoot(t)
	ns := nstest.NewNS(t, "host")
	o := newOwner(t, ns, ownerOpts{tick: time.Hour})
	if err := o.SetLocal(ownerLocal); err != nil {
		t.Fatal(err)
	}
	r2 := netip.MustParseAddr("192.0.2.12")
	remotes := func() []netip.Addr {
		_, all := dumpOurs(t, ns)
		pols, _ := remotePolicies(all)
		var out []netip.Addr
		for _, p := range pols {
			out = append(out, addrOf(p.Dst.IP))
		}
		slices.SortFunc(out, netip.Addr.Compare)
		return out
	}
	check := func(what string, want ...netip.Addr) {
		t.Helper()
		if got := remotes(); !slices.Equal(got, want) {
			t.Fatalf("%s: policies for %v, want %v", what, got, want)
		}
		if a := o.Audit(); len(a) != 0 {
			t.Fatalf("%s: audit: %v", what, a)
		}
	}
	okOrUnsupported(t, "a", o.Update(1, Share{VNIs: []uint32{100}, Encrypted: true, Remotes: []netip.Addr{ownerRemote}}, false))
	okOrUnsupported(t, "b", o.Update(2, Share{VNIs: []uint32{101}, Encrypted: true, Remotes: []netip.Addr{ownerRemote, r2, ownerLocal}}, false))
	check("two shares", ownerRemote, r2)
	okOrUnsupported(t, "a gone", o.Remove(1))
	check("one share left", ownerRemote, r2)
	okOrUnsupported(t, "widen", o.Update(2, Share{VNIs: []uint32{101}, Encrypted: true, Remotes: []netip.Addr{r2}}, true))
	check("widened", ownerRemote, r2)
	okOrUnsupported(t, "narrow", o.Update(2, Share{VNIs: []uint32{101}, Encrypted: true, Remotes: []netip.Addr{r2}}, false))
	check("narrowed", r2)
	okOrUnsupported(t, "clear 101", o.Update(3, Share{VNIs: []uint32{101, 102}}, false))
	if v := nftDumpView(t, ns); !v.vnis[101] || v.clear[101] || !v.clear[102] {
		t.Fatalf("VNI 101 both clear and encrypted must be encrypted only: %+v", v)
	}
	st := o.Status()
	if !slices.Equal(st.EncryptedVNIs, []uint32{101}) || !slices.Equal(st.ClearVNIs, []uint32{102}) || st.Shares != 2 || len(st.Pairs) != 1 || st.Pairs[0].Remote != r2 || st.Pairs[0].Shares != 1 {
		t.Fatalf("status: %+v", st)
	}
	raw, err := json.Marshal(st)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("status: %s", raw)
	okOrUnsupported(t, "remove", o.Remove(2))
	okOrUnsupported(t, "remove clear", o.Remove(3))
	if s, p := dumpOurs(t, ns); len(s)+len(p) != 0 || nftDumpView(t, ns).exists {
		t.Fatalf("left behind: %d SAs, %d policies, table %v", len(s), len(p), nftDumpView(t, ns).exists)
	}
	if err := o.Remove(42); err != nil {
		t.Fatalf("removing an unknown share: %v", err)
	}
}

// TestOwnerRefusesBadInput: every refusal names its object and changes
// nothing.
func TestOwnerRefusesBadInput(t *testing.T) {
	nstest.RequireRoot(t)
	ns := nstest.NewNS(t, "host")
	o := newOwner(t, ns, ownerOpts{tick: time.Hour})
	if err := o.SetLocal(netip.Addr{}); err == nil {
		t.Fatal("invalid local VTEP accepted")
	}
	if err := o.Update(1, Share{VNIs: []uint32{100}, Encrypted: true}, false); err == nil || !strings.Contains(err.Error(), "local VTEP") {
		t.Fatalf("an encrypted share before SetLocal: %v", err)
	}
	if err := o.SetLocal(ownerLocal); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		s    Share
		want string
	}{
		{Share{VNIs: []uint32{1 << 24}}, "invalid VNI 16777216"},
		{Share{VNIs: []uint32{0}, Encrypted: true}, "invalid VNI 0"},
		{Share{VNIs: []uint32{5}, Encrypted: true, Remotes: []netip.Addr{{}}}, "invalid remote VTEP"},
		{Share{VNIs: []uint32{5}, Encrypted: true, Remotes: []netip.Addr{netip.MustParseAddr("2001:db8::1")}}, "remote VTEP 2001:db8::1 is not of the local VTEP's"},
	} {
		err := o.Update(7, c.s, false)
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "share 7") {
			t.Errorf("%+v: error %v, want one naming share 7 and %q", c.s, err, c.want)
		}
	}
	// Share 1 (valid, waiting for the local VTEP) is recorded; share 7
	// never was.
	if st := o.Status(); st.Shares != 1 || !slices.Equal(st.EncryptedVNIs, []uint32{100}) {
		t.Fatalf("a refused share was recorded: %+v", st)
	}
	noSecret, err := NewOwner(OwnerConfig{NS: ns.Handle, Port: 4799})
	if err != nil {
		t.Fatal(err)
	}
	defer noSecret.Close()
	if err := noSecret.Update(1, Share{VNIs: []uint32{5}, Encrypted: true}, false); err == nil || !strings.Contains(err.Error(), "cluster secret") {
		t.Fatalf("encrypted share without secret: %v", err)
	}
	if err := noSecret.CheckSupport(); err == nil || !strings.Contains(err.Error(), "cluster secret") {
		t.Fatalf("CheckSupport without secret: %v", err)
	}
	if _, err := NewOwner(OwnerConfig{NS: ns.Handle, Port: 4799, Secret: []byte("short")}); !errors.Is(err, ErrBadSecret) {
		t.Fatalf("short secret: %v", err)
	}
	if _, err := NewOwner(OwnerConfig{NS: ns.Handle, Port: 0, Secret: testSecret}); err == nil {
		t.Fatal("port 0 accepted")
	}
	bad := OwnerConfig{NS: ns.Handle, Port: 4799, Secret: testSecret, CheckKernel: func() error { return errors.New("no esp4") }}
	ob, err := NewOwner(bad)
	if err != nil {
		t.Fatal(err)
	}
	defer ob.Close()
	if err := ob.CheckSupport(); err == nil || !strings.Contains(err.Error(), "no esp4") || !strings.Contains(err.Error(), "never sent in clear") {
		t.Fatalf("CheckSupport: %v", err)
	}
}

// memGossip wires Owners together in memory, as the control plane would:
// Advertise stores the advert and pokes every other Owner. Its lock is at
// the network level, above the Owner's: with -tags lockcheck, an Owner
// calling it with its own lock held is reported.
type memGossip struct {
	mu      *lockorder.Mutex
	adverts map[netip.Addr]Advert
	owners  map[netip.Addr]*Owner
	calls   int
}

func newMemGossip() *memGossip {
	return &memGossip{mu: lockorder.New(lockorder.LevelNetwork), adverts: map[netip.Addr]Advert{}, owners: map[netip.Addr]*Owner{}}
}

// memberView is one member's view of a memGossip.
type memberView struct {
	g    *memGossip
	self netip.Addr
}

func (g *memGossip) attach(self netip.Addr, o *Owner) {
	g.mu.Lock()
	g.owners[self] = o
	g.mu.Unlock()
	o.AttachGossip(memberView{g, self})
}

func (v memberView) Adverts() map[netip.Addr]Advert {
	v.g.mu.Lock()
	defer v.g.mu.Unlock()
	v.g.calls++
	out := map[netip.Addr]Advert{}
	for a, adv := range v.g.adverts {
		if a != v.self {
			// Through the wire format, as the cluster carries it.
			d, err := DecodeAdvert(adv.Encode())
			if err != nil {
				panic(err)
			}
			out[a] = d
		}
	}
	return out
}

func (v memberView) Advertise(a Advert) error {
	v.g.mu.Lock()
	v.g.adverts[v.self] = a
	var others []*Owner
	for addr, o := range v.g.owners {
		if addr != v.self {
			others = append(others, o)
		}
	}
	v.g.mu.Unlock()
	for _, o := range others {
		o.Poke()
	}
	return nil
}

func (g *memGossip) advert(a netip.Addr) (Advert, bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	adv, ok := g.adverts[a]
	return adv, ok
}

// TestOwnerRotation: two Owners wired through an in-memory KeyGossip
// bootstrap epoch 1, learn each other's generation, and carry a rotation
// asked on one of them through accept, send and retire, each host logging
// each step once at INFO and nothing at ERROR.
func TestOwnerRotation(t *testing.T) {
	nstest.RequireRoot(t)
	hosts, addrs := nstest.Hosts(t, 2, false)
	g := newMemGossip()
	var owners [2]*Owner
	var recs [2]logrec.Recorder
	for i := range owners {
		o := newOwner(t, hosts[i], ownerOpts{tick: time.Hour, log: recs[i].Logger()})
		if err := o.SetLocal(addrs[i]); err != nil {
			t.Fatal(err)
		}
		okOrUnsupported(t, "share", o.Update(1, Share{VNIs: []uint32{100}, Encrypted: true, Remotes: []netip.Addr{addrs[1-i]}}, false))
		if _, err := o.Rotate(); err == nil {
			t.Fatal("Rotate before gossip is attached succeeded")
		}
		o.Start()
		owners[i] = o
	}
	for i, o := range owners {
		g.attach(addrs[i], o)
	}
	waitKeys := func(what string, want NodeKeys) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for {
			done := true
			for i, o := range owners {
				st := o.Status()
				adv, ok := g.advert(addrs[i])
				if !(NodeKeys{Accept: st.Accept, Send: st.Send, Target: st.Target}).Equal(want) || !ok || !adv.Keys.Equal(want) || adv.Gen != st.Gen {
					done = false
				}
				// Each knows the other's generation (for its inbound SAs).
				if len(st.Pairs) != 1 || st.Pairs[0].RemoteGen != owners[1-i].Status().Gen {
					done = false
				}
			}
			if done {
				return
			}
			if time.Now().After(deadline) {
				for i, o := range owners {
					adv, _ := g.advert(addrs[i])
					st := o.Status()
					t.Logf("host %d: keys accept=%v send=%d target=%d, advertised %v, error %q", i, st.Accept, st.Send, st.Target, adv, st.Error)
				}
				t.Fatalf("%s: not converged on %v", what, want)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	waitKeys("bootstrap", NodeKeys{Accept: []uint32{1}, Send: 1, Target: 1})
	var booted [2]int
	for i := range recs {
		booted[i] = len(recs[i].Events(logkeys.RotationStep))
	}
	for i, o := range owners {
		if n := o.RotationDurations().Count; n != 0 {
			t.Fatalf("host %d: bootstrapping epoch 1 counted as %d rotations", i, n)
		}
	}
	target, err := owners[0].Rotate()
	if err != nil || target != 2 {
		t.Fatalf("Rotate: %d, %v", target, err)
	}
	waitKeys("rotation", NodeKeys{Accept: []uint32{2}, Send: 2, Target: 2})
	for i, o := range owners {
		if st := o.Status(); st.Rotating || st.Error != "" && !strings.Contains(st.Error, "ESP") {
			t.Fatalf("host %d after the rotation: %+v", i, st)
		}
		// Both took part (one asked, the other followed): one rotation
		// each, timed (the metrics' rotations and their duration).
		if r := o.RotationDurations(); r.Count != 1 || r.SumSeconds <= 0 {
			t.Errorf("host %d: rotations %d taking %vs, want 1 taking some time", i, r.Count, r.SumSeconds)
		}
	}
	for i := range recs {
		checkRotationLog(t, fmt.Sprintf("host %d", i), &recs[i], booted[i], owners[i].Status().ESPUnsupported)
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.calls == 0 {
		t.Fatal("the gossip was never read")
	}
}

// checkRotationLog checks the log of a host that bootstrapped (the first
// booted rotation_step lines) then went through one rotation to epoch 2:
// every change of its key epochs is one INFO line (never the same twice in
// a row), the rotation's lines name the target, accept, send and retire
// steps, and the last one is the keys it ended with. A kernel that cannot
// install ESP is said once at WARN; nothing is at ERROR.
func checkRotationLog(t *testing.T, host string, rec *logrec.Recorder, booted int, noESP bool) {
	t.Helper()
	steps := rec.Events(logkeys.RotationStep)
	if booted == 0 || len(steps) <= booted {
		t.Fatalf("%s: %d rotation_step lines at the bootstrap, %d in all: %v", host, booted, len(steps), steps)
	}
	seen := map[string]bool{}
	prev := ""
	for i, s := range steps {
		state := fmt.Sprint(s.Attrs["accept"], s.Attrs["send"], s.Attrs["target"])
		if s.Level != slog.LevelInfo || s.Attrs[logkeys.Step] == "" || state == prev {
			t.Errorf("%s: rotation_step line %d is at %s, without a step or repeats the one before: %v", host, i, s.Level, s)
		}
		prev = state
		if i >= booted {
			for _, p := range strings.Split(s.Attrs[logkeys.Step], "+") {
				seen[p] = true
			}
		}
	}
	for _, want := range []string{logkeys.StepTarget, logkeys.StepAccept, logkeys.StepSend, logkeys.StepRetire} {
		if !seen[want] {
			t.Errorf("%s: no %q step logged during the rotation: %v", host, want, steps[booted:])
		}
	}
	if last := steps[len(steps)-1].Attrs; last["accept"] != "[2]" || last["send"] != "2" || last["target"] != "2" {
		t.Errorf("%s: last rotation_step line %v, want accept [2], send 2, target 2", host, last)
	}
	if noESP {
		rec.One(t, slog.LevelWarn, logkeys.EncryptionUnsupported, nil, logkeys.Error)
	} else if got := rec.Events(logkeys.EncryptionUnsupported); len(got) != 0 {
		t.Errorf("%s: a kernel that installs ESP logged %v", host, got)
	}
	for _, r := range rec.All() {
		if r.Level >= slog.LevelError {
			t.Errorf("%s: routine rotation logged at ERROR: %v", host, r)
		}
	}
}

// TestLockOrder: Update under a network lock is the hierarchy's order.
func TestOwnerLockOrder(t *testing.T) {
	nstest.RequireRoot(t)
	ns := nstest.NewNS(t, "host")
	o := newOwner(t, ns, ownerOpts{tick: time.Hour})
	if err := o.SetLocal(ownerLocal); err != nil {
		t.Fatal(err)
	}
	netMu := lockorder.New(lockorder.LevelNetwork)
	netMu.Lock()
	okOrUnsupported(t, "update under a network lock", o.Update(1, Share{VNIs: []uint32{1}, Encrypted: true}, false))
	netMu.Unlock()
}
