package encryption

import (
	"crypto/sha256"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/google/nftables"

	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

// kernelView is everything of ours the kernel holds in ns, one line per
// object, sorted, comparable between namespaces: SAs (with a hash of their
// key), policies, the nftables sets and rules.
func kernelView(t *testing.T, ns *nstest.NS) []string {
	t.Helper()
	states, pols := dumpOurs(t, ns)
	var out []string
	for _, s := range states {
		line := fmt.Sprintf("SA %v -> %v spi %08x mode %d esn %v replay %d", addrOf(s.Src), addrOf(s.Dst), uint32(s.Spi), s.Mode, s.ESN, s.ReplayWindow)
		if s.Aead != nil {
			line += fmt.Sprintf(" %s/%d key %x", s.Aead.Name, s.Aead.ICVLen, sha256.Sum256(s.Aead.Key))
		}
		if sel := s.Selector; sel != nil {
			line += fmt.Sprintf(" sel %v -> %v proto %d dport %d", prefixOf(sel.Src), prefixOf(sel.Dst), sel.Proto, sel.DstPort)
		}
		out = append(out, line)
	}
	for _, p := range pols {
		line := fmt.Sprintf("policy dir %v %v -> %v proto %d dport %d prio %d", p.Dir, prefixOf(p.Src), prefixOf(p.Dst), p.Proto, p.DstPort, p.Priority)
		if p.Mark != nil {
			line += fmt.Sprintf(" mark %#x/%#x", p.Mark.Value, p.Mark.Mask)
		}
		for _, tm := range p.Tmpls {
			line += fmt.Sprintf(" tmpl %v -> %v spi %08x reqid %#x", addrOf(tm.Src), addrOf(tm.Dst), uint32(tm.Spi), tm.Reqid)
		}
		out = append(out, line)
	}
	v := nftDumpView(t, ns)
	if v.exists {
		out = append(out, "table inet "+TableName)
	}
	for vni := range v.vnis {
		out = append(out, fmt.Sprintf("nft %s %d", SetName, vni))
	}
	for vni := range v.clear {
		out = append(out, fmt.Sprintf("nft %s %d", ClearSetName, vni))
	}
	for chain, rules := range v.rules {
		for _, r := range rules {
			out = append(out, fmt.Sprintf("nft chain %s rule %q", chain, r))
		}
	}
	slices.Sort(out)
	return out
}

// testSeed is OVERLAYD_SEED if set, else a new seed (logged, to replay).
func testSeed(t *testing.T) uint64 {
	t.Helper()
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("OVERLAYD_SEED"); s != "" {
		v, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			t.Fatalf("OVERLAYD_SEED=%q: %v", s, err)
		}
		seed = v
	}
	t.Logf("seed %d (replay with OVERLAYD_SEED=%d)", seed, seed)
	return seed
}

// TestApplyDeltaMatchesFull: a random sequence of changes (remotes coming
// and going, their generations changing, VNIs encrypted, clear or gone, key
// rotations) is applied to one namespace as deltas (applyDelta: no dump,
// only the changes from what it programmed) and to another by full
// reconciles (Apply: dump, diff, apply). After every step both kernels hold
// exactly the same objects, and the delta namespace audits clean.
func TestApplyDeltaMatchesFull(t *testing.T) {
	nstest.RequireRoot(t)
	supported := espSupported(t)
	rng := rand.New(rand.NewPCG(testSeed(t), 14))
	nsDelta, nsFull := nstest.NewNS(t, "delta"), nstest.NewNS(t, "full")
	pd := newTracked(t, nsDelta)
	pf, err := NewProgrammer(nsFull.Handle)
	if err != nil {
		t.Fatal(err)
	}
	defer pf.Close()

	pool := make([]netip.Addr, 16)
	for i := range pool {
		pool[i] = testRemote(i)
	}
	gens := map[netip.Addr]uint64{}
	for i, r := range pool {
		gens[r] = 1000 + uint64(i)
	}
	in := map[netip.Addr]bool{}
	vnis := map[uint32]int{} // 1 encrypted, 2 clear
	keys := NodeKeys{Accept: []uint32{1}, Send: 1, Target: 1}
	desired := func() Desired {
		d := Desired{Local: testLocal, Port: 4799, Accept: slices.Clone(keys.Accept), Send: keys.Send, Gen: testGen, Secret: testSecret,
			RemoteGens: map[netip.Addr]uint64{}, NoSAs: !supported}
		for v, kind := range vnis {
			if kind == 1 {
				d.VNIs = append(d.VNIs, v)
			} else {
				d.ClearVNIs = append(d.ClearVNIs, v)
			}
		}
		slices.Sort(d.VNIs)
		slices.Sort(d.ClearVNIs)
		for r := range in {
			d.Remotes = append(d.Remotes, r)
			d.RemoteGens[r] = gens[r]
		}
		slices.SortFunc(d.Remotes, netip.Addr.Compare)
		return d
	}
	vnis[100], vnis[200] = 1, 2
	in[pool[0]], in[pool[1]] = true, true
	d := desired()
	// The first apply of each has no record: both reconcile in full.
	if err := pd.Apply(d); err != nil {
		t.Fatal(err)
	}
	if err := pf.Apply(d); err != nil {
		t.Fatal(err)
	}
	steps := 60
	if inVM {
		steps = 20 // SAs under software emulation: about 2 s a step
	}
	for step := 0; step < steps; step++ {
		var what string
		x := rng.IntN(20)
		if step%10 == 9 {
			x = 19 // a rotation step at least every ten: both kinds of delta
		}
		switch {
		case x < 7:
			r := pool[rng.IntN(len(pool))]
			in[r] = !in[r]
			what = fmt.Sprintf("remote %v in=%v", r, in[r])
		case x < 9:
			r := pool[rng.IntN(len(pool))]
			gens[r]++
			what = fmt.Sprintf("remote %v restarted with generation %d", r, gens[r])
		case x < 11:
			for n := rng.IntN(4); n >= 0; n-- {
				r := pool[rng.IntN(len(pool))]
				in[r] = !in[r]
			}
			what = "several remotes"
		case x < 16:
			v := uint32(100 + rng.IntN(6))
			kind := rng.IntN(3)
			if kind == 0 {
				delete(vnis, v)
			} else {
				vnis[v] = kind
			}
			what = fmt.Sprintf("VNI %d kind %d", v, kind)
		default:
			// One step of a rotation: accept the next epoch, send with
			// it, retire the old one.
			switch {
			case len(keys.Accept) == 1:
				keys.Accept = []uint32{keys.Send, keys.Send + 1}
			case keys.Send == keys.Accept[0]:
				keys.Send++
			default:
				keys.Accept = []uint32{keys.Send}
			}
			what = fmt.Sprintf("keys accept %v send %d", keys.Accept, keys.Send)
		}
		if !slices.Contains(slices.Collect(func(yield func(int) bool) {
			for _, k := range vnis {
				if !yield(k) {
					return
				}
			}
		}), 1) {
			vnis[100] = 1 // keep one encrypted VNI: an empty state removes everything (Apply's case)
		}
		d = desired()
		before := pd.Stats()
		res, err, done := pd.applyDelta(&d)
		if !done {
			t.Fatalf("step %d (%s): no delta was possible", step, what)
		}
		if err != nil || len(res.collisions) > 0 {
			t.Fatalf("step %d (%s): delta: %v %v", step, what, err, res.collisions)
		}
		if s := pd.Stats().Sub(before); s.XfrmDumps+s.NftDumps != 0 {
			t.Fatalf("step %d (%s): the delta dumped: %v", step, what, s)
		}
		if err := pf.Apply(d); err != nil {
			t.Fatalf("step %d (%s): full apply: %v", step, what, err)
		}
		gotDelta, gotFull := kernelView(t, nsDelta), kernelView(t, nsFull)
		if !slices.Equal(gotDelta, gotFull) {
			t.Fatalf("step %d (%s): the delta's kernel differs from the full reconcile's:\ndelta only: %v\nfull only: %v",
				step, what, minusStrings(gotDelta, gotFull), minusStrings(gotFull, gotDelta))
		}
		if a := pd.Audit(d); len(a) != 0 {
			t.Fatalf("step %d (%s): audit after the delta: %v", step, what, a)
		}
	}
	st := pd.Stats()
	if st.RemoteDeltas == 0 || st.RemoteDeltas == st.Deltas {
		t.Fatalf("%d of %d deltas were planned remote by remote: want both kinds", st.RemoteDeltas, st.Deltas)
	}
	t.Logf("final state: %d objects; %d deltas, %d of them remote by remote", len(kernelView(t, nsDelta)), st.Deltas, st.RemoteDeltas)
}

func minusStrings(a, b []string) []string {
	var out []string
	for _, s := range a {
		if !slices.Contains(b, s) {
			out = append(out, s)
		}
	}
	return out
}

// trackedProgrammer is a Programmer driven through a tracker as the Owner
// drives it: Apply resyncs (dumps), and applyDelta plans against the
// record, for the remotes whose state differs from the last Desired's
// alone when the keys, generation and VTEP are the same (what the Owner
// marks dirty), else for every remote.
type trackedProgrammer struct {
	*Programmer
	t tracker
}

func newTracked(t *testing.T, ns *nstest.NS) *trackedProgrammer {
	t.Helper()
	p, err := NewProgrammer(ns.Handle)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return &trackedProgrammer{Programmer: p}
}

// Apply is a resync to d.
func (tp *trackedProgrammer) Apply(d Desired) error {
	tp.t.markResync()
	ax, an, dumped, err := tp.t.view(tp.Programmer)
	if err != nil {
		return err
	}
	res, err := tp.t.apply(tp.Programmer, &d, nil, nil, true, ax, an, dumped)
	return errors.Join(append([]error{err}, res.collisions...)...)
}

// applyDelta applies d against the record; ok is false (nothing done)
// without a record, or when d wants nothing (a resync's case).
func (tp *trackedProgrammer) applyDelta(d *Desired) (res execResult, err error, ok bool) {
	if tp.t.kernel == nil || tp.t.resync || d.Empty() {
		return execResult{}, nil, false
	}
	if l := tp.t.last; l != nil && d.normalized() && sameXfrmBasis(l, d) {
		tp.t.markDirty(touchedRemotes(l, d)...)
	} else {
		tp.t.markAll()
	}
	scope, whole := tp.t.scope(d, false)
	var dx *desiredXfrm
	if !whole {
		if dx, ok = tp.t.fits(d, tp.derived, scope); !ok {
			scope, whole = nil, true
		}
	}
	ax, an, dumped, err := tp.t.view(tp.Programmer)
	if err != nil {
		return execResult{}, err, true
	}
	res, err = tp.t.apply(tp.Programmer, d, dx, scope, whole, ax, an, dumped)
	return res, err, true
}

// touchedRemotes returns, sorted, the remotes whose xfrm state differs
// between a and b (both normalized, with the same basis): those in one of
// their Remotes, KeepOutbound or Blocked lists but not in the other's, and
// those whose generation changed.
func touchedRemotes(a, b *Desired) []netip.Addr {
	var out []netip.Addr
	symdiff := func(x, y []netip.Addr) {
		added, gone := diffSorted(x, y)
		out = append(append(out, added...), gone...)
	}
	symdiff(a.Remotes, b.Remotes)
	symdiff(a.KeepOutbound, b.KeepOutbound)
	symdiff(a.Blocked, b.Blocked)
	for _, r := range b.Remotes {
		if a.RemoteGens[r] != b.RemoteGens[r] {
			out = append(out, r)
		}
	}
	slices.SortFunc(out, netip.Addr.Compare)
	return slices.Compact(out)
}

// establishKeys gives o epoch 1 and a generation for each remote, as if
// the others had advertised them (tests without gossip).
func establishKeys(o *Owner, remotes []netip.Addr) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.led.keys = NodeKeys{Accept: []uint32{1}, Send: 1, Target: 1}
	for i, r := range remotes {
		o.led.remoteGens[r] = uint64(2000 + i)
	}
}

// fullReconcile runs what the loop's tick runs and returns how many
// kernel requests changed something.
func fullReconcile(o *Owner) int {
	o.mu.Lock()
	before := o.prog.changed
	o.mu.Unlock()
	o.cycle("tick")
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.prog.changed - before
}

// TestOwnerChangesWithoutDumps: random Updates and Removes of four
// networks' shares each reach the kernel without a single dump, and leave
// exactly what a full reconcile wants: the Owner's audit is clean and the
// reconcile that follows changes nothing and counts no repair.
func TestOwnerChangesWithoutDumps(t *testing.T) {
	nstest.RequireRoot(t)
	rng := rand.New(rand.NewPCG(testSeed(t), 6))
	ns := nstest.NewNS(t, "host")
	o := newOwner(t, ns, ownerOpts{tick: time.Hour, noNotify: true})
	pool := make([]netip.Addr, 12)
	for i := range pool {
		pool[i] = testRemote(i)
	}
	establishKeys(o, pool)
	if err := o.SetLocal(testLocal); err != nil {
		t.Fatal(err)
	}
	// The first encrypted share is a full reconcile (and finds out whether
	// the kernel has ESP).
	okOrUnsupported(t, "first share", o.Update(1, Share{VNIs: []uint32{100}, Encrypted: true, Remotes: pool[:2]}, false))
	if changes := fullReconcile(o); changes != 0 {
		t.Fatalf("the reconcile after the first share changed %d objects", changes)
	}
	deltas := 0
	for step := 0; step < 40; step++ {
		id := ShareID(1 + rng.IntN(4))
		var s Share
		var err error
		before := o.prog.Stats()
		if rng.IntN(6) == 0 && id != 1 {
			err = o.Remove(id)
			s = Share{}
		} else {
			s = Share{VNIs: []uint32{uint32(100*id) + uint32(rng.IntN(2))}, Encrypted: id%2 == 1}
			if s.Encrypted {
				for _, r := range pool {
					if rng.IntN(3) == 0 {
						s.Remotes = append(s.Remotes, r)
					}
				}
			}
			err = o.Update(id, s, rng.IntN(4) == 0)
		}
		okOrUnsupported(t, fmt.Sprintf("step %d: share %d: %+v", step, id, s), err)
		st := o.prog.Stats().Sub(before)
		if st.XfrmDumps+st.NftDumps != 0 {
			t.Fatalf("step %d: share %d %+v: the change dumped: %v", step, id, s, st)
		}
		deltas += st.Deltas
		if a := o.Audit(); len(a) != 0 {
			t.Fatalf("step %d: share %d %+v: audit: %v", step, id, s, a)
		}
		repairs := o.Status().Repairs
		if changes := fullReconcile(o); changes != 0 {
			t.Fatalf("step %d: share %d %+v: the full reconcile after the change made %d changes", step, id, s, changes)
		}
		if st := o.Status(); st.Repairs != repairs || st.DeltaFailures != 0 {
			t.Fatalf("step %d: repairs %d -> %d, delta failures %d", step, repairs, st.Repairs, st.DeltaFailures)
		}
	}
	if deltas == 0 || o.prog.Stats().RemoteDeltas == 0 {
		t.Fatalf("%d changes went through the delta path, %d remote by remote", deltas, o.prog.Stats().RemoteDeltas)
	}
	t.Logf("%d of 40 changes were deltas (the others changed nothing); stats %v", deltas, o.prog.Stats())
}

// TestOwnerFailedDeltaRepaired: the table was deleted behind overlayd's
// back and no reconcile ran since (no loop, no notifications), so the
// Programmer's record is wrong. A change that adds an encrypted VNI fails
// in the kernel (its set is gone); the Owner reconciles in full at once,
// so Update succeeds and the kernel holds everything.
func TestOwnerFailedDeltaRepaired(t *testing.T) {
	nstest.RequireRoot(t)
	ns := nstest.NewNS(t, "host")
	o := newOwner(t, ns, ownerOpts{tick: time.Hour, noNotify: true})
	establishKeys(o, []netip.Addr{ownerRemote})
	setupShares(t, ns, o)
	c, err := nftables.New(nftables.WithNetNSFd(int(ns.Handle)))
	if err != nil {
		t.Fatal(err)
	}
	c.DelTable(table)
	if err := c.Flush(); err != nil {
		t.Fatal(err)
	}
	before := o.prog.Stats()
	err = o.Update(1, Share{VNIs: []uint32{100, 101}, Encrypted: true, Remotes: []netip.Addr{ownerRemote}}, false)
	okOrUnsupported(t, "update after the table vanished", err)
	st := o.prog.Stats().Sub(before)
	if st.Deltas != 1 || st.DeltaFailures != 1 {
		t.Fatalf("want one failed delta, got %v (deltas %d, failed %d)", st, st.Deltas, st.DeltaFailures)
	}
	if st.XfrmDumps == 0 || st.NftDumps == 0 || st.NftRebuilds != 1 {
		t.Fatalf("the failed delta was not followed by a full reconcile that rebuilt the table: %v", st)
	}
	if a := o.Audit(); len(a) != 0 {
		t.Fatalf("audit after the failed delta: %v", a)
	}
	if v := nftDumpView(t, ns); !v.vnis[100] || !v.vnis[101] || !v.clear[200] {
		t.Fatalf("nft after the repair: %+v", v)
	}
	if s := o.Status(); s.DeltaFailures != 1 || s.Error != "" && !errorsIsUnsupported(o) {
		t.Fatalf("status: delta failures %d, error %q", s.DeltaFailures, s.Error)
	}
}

func errorsIsUnsupported(o *Owner) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.noESP != nil
}

// TestOwnerRepairsAfterDelta: a change made while the kernel lost state
// behind overlayd's back succeeds without seeing the loss (it does not
// dump); the next full reconcile (the loop's tick or a kernel
// notification) repairs it and counts the repair.
func TestOwnerRepairsAfterDelta(t *testing.T) {
	nstest.RequireRoot(t)
	ns := nstest.NewNS(t, "host")
	o := newOwner(t, ns, ownerOpts{tick: time.Hour, noNotify: true})
	other := netip.MustParseAddr("192.0.2.12")
	establishKeys(o, []netip.Addr{ownerRemote, other})
	setupShares(t, ns, o)
	if err := xfrmHandle(t, ns).XfrmPolicyFlush(); err != nil {
		t.Fatal(err)
	}
	okOrUnsupported(t, "add a remote", o.Update(1, Share{VNIs: []uint32{100}, Encrypted: true, Remotes: []netip.Addr{ownerRemote, other}}, false))
	if a := o.Audit(); len(a) == 0 {
		t.Fatal("the change saw the flushed policies: it dumped")
	}
	repairs := o.Status().Repairs
	if changes := fullReconcile(o); changes == 0 {
		t.Fatal("the full reconcile changed nothing")
	}
	if a := o.Audit(); len(a) != 0 {
		t.Fatalf("audit after the reconcile: %v", a)
	}
	if st := o.Status(); st.Repairs != repairs+1 {
		t.Fatalf("repairs %d -> %d, want one more", repairs, st.Repairs)
	}
}
