package encryption

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

// TestOwnerIncrementalMatchesScratch: a seeded random sequence of share
// changes — Update with whole lists (widening or not, sometimes with other
// VNIs), AddRemotes, RemoveRemotes, Remove, a remote's generation changing,
// full reconciles in between — and after every step the state the Owner
// keeps incrementally equals the one computed from scratch: the need
// counts and their sorted index (against a model of the shares), the
// tracker's patched copy of the last Desired, the remotes persisted as
// programmed; and the kernel holds exactly the desired state (audit).
// Most changes must take the remote-by-remote path without a dump.
// OVERLAYD_SEED replays a sequence.
func TestOwnerIncrementalMatchesScratch(t *testing.T) {
	nstest.RequireRoot(t)
	seed := testSeed(t)
	rng := rand.New(rand.NewPCG(seed, 14))
	ns := nstest.NewNS(t, "host")
	o := newOwner(t, ns, ownerOpts{tick: time.Hour, noNotify: true})
	pool := make([]netip.Addr, 24)
	for i := range pool {
		pool[i] = testRemote(i)
	}
	establishKeys(o, pool)
	if err := o.SetLocal(testLocal); err != nil {
		t.Fatal(err)
	}
	// model: the remotes of each registered share (nil: clear share).
	model := map[ShareID]map[netip.Addr]bool{}
	encrypted := func(id ShareID) bool { return id%2 == 1 }
	// Now and then our own VTEP (the driver passes every FDB entry's VTEP,
	// ours included when our endpoint is seen through another network):
	// counted, but no pair.
	pick := func() []netip.Addr {
		var out []netip.Addr
		for range 1 + rng.IntN(4) {
			if rng.IntN(8) == 0 {
				out = append(out, testLocal)
				continue
			}
			out = append(out, pool[rng.IntN(len(pool))])
		}
		return out
	}
	steps, remoteDeltas := 120, 0
	if inVM {
		steps = 40 // SAs under software emulation
	}
	for step := range steps {
		id := ShareID(1 + rng.IntN(4))
		var what string
		var err error
		before := o.prog.Stats()
		byDelta := false
		switch op := rng.IntN(10); {
		case op < 3 && model[id] != nil && encrypted(id):
			rs := pick()
			what = fmt.Sprintf("AddRemotes(%d, %v)", id, rs)
			err = o.AddRemotes(id, rs...)
			for _, r := range rs {
				model[id][r] = true
			}
			byDelta = true
		case op < 6 && model[id] != nil && encrypted(id):
			rs := pick()
			what = fmt.Sprintf("RemoveRemotes(%d, %v)", id, rs)
			err = o.RemoveRemotes(id, rs...)
			for _, r := range rs {
				delete(model[id], r)
			}
			byDelta = true
		case op == 6 && id != 1:
			what = fmt.Sprintf("Remove(%d)", id)
			err = o.Remove(id)
			delete(model, id)
		case op == 7:
			// A remote advertises a new generation, recorded and marked
			// as a rotation step does before its apply, but not applied:
			// the next change must apply it too (the remote is dirty),
			// so the kernel differs from the desired state until then.
			r := pool[rng.IntN(len(pool))]
			what = fmt.Sprintf("new generation of %v", r)
			o.mu.Lock()
			o.led.remoteGens[r]++
			o.markLocked(r)
			o.mu.Unlock()
		case op == 8:
			what = "full reconcile"
			fullReconcile(o)
		default:
			s := Share{VNIs: []uint32{uint32(100 * id)}, Encrypted: encrypted(id)}
			if rng.IntN(8) == 0 {
				s.VNIs = append(s.VNIs, uint32(100*id)+1)
			}
			widen := rng.IntN(3) == 0
			if s.Encrypted {
				for _, r := range pool {
					if rng.IntN(3) == 0 {
						s.Remotes = append(s.Remotes, r)
					}
				}
				if rng.IntN(6) == 0 {
					s.Remotes = append(s.Remotes, testLocal)
				}
				rng.Shuffle(len(s.Remotes), func(i, j int) { s.Remotes[i], s.Remotes[j] = s.Remotes[j], s.Remotes[i] })
			}
			what = fmt.Sprintf("Update(%d, %+v, widen %v)", id, s, widen)
			err = o.Update(id, s, widen)
			m := map[netip.Addr]bool{}
			if widen && model[id] != nil {
				maps.Copy(m, model[id])
			}
			for _, r := range s.Remotes {
				m[r] = true
			}
			model[id] = m
		}
		what = fmt.Sprintf("step %d: %s", step, what)
		okOrUnsupported(t, what, err)
		st := o.prog.Stats().Sub(before)
		if byDelta && st.XfrmDumps+st.NftDumps != 0 {
			t.Fatalf("%s: the change dumped: %v", what, st)
		}
		remoteDeltas += st.RemoteDeltas
		checkIncremental(t, o, model, what)
		o.mu.Lock()
		dirty := len(o.trk.dirty) > 0
		o.mu.Unlock()
		if a := o.Audit(); len(a) != 0 && !dirty {
			t.Fatalf("%s: audit: %v", what, a)
		}
	}
	if remoteDeltas < steps/4 {
		t.Fatalf("only %d of %d steps changed the kernel remote by remote", remoteDeltas, steps)
	}
	t.Logf("seed %d: %d steps, %d remote-by-remote changes; %v", seed, steps, remoteDeltas, o.prog.Stats())
}

// checkIncremental compares what o keeps incrementally with what the
// shares in model give computed from scratch.
func checkIncremental(t *testing.T, o *Owner, model map[ShareID]map[netip.Addr]bool, what string) {
	t.Helper()
	o.mu.Lock()
	defer o.mu.Unlock()
	need := map[netip.Addr]int{}
	for id, rs := range model {
		sh := o.idx.shares[id]
		if sh == nil {
			t.Fatalf("%s: share %d not registered", what, id)
		}
		want := slices.SortedFunc(maps.Keys(rs), netip.Addr.Compare)
		if !slices.Equal(sh.remotes, want) && (len(want) != 0 || len(sh.remotes) != 0) {
			t.Fatalf("%s: share %d has remotes %v, want %v", what, id, sh.remotes, want)
		}
		for r := range rs {
			need[r]++
		}
	}
	if len(o.idx.shares) != len(model) {
		t.Fatalf("%s: %d shares registered, want %d", what, len(o.idx.shares), len(model))
	}
	if o.idx.need.Len() != len(need) {
		t.Fatalf("%s: %d remotes counted, want %d", what, o.idx.need.Len(), len(need))
	}
	for r, n := range need {
		if got := o.idx.need.Get(r); got != n {
			t.Fatalf("%s: remote %v counted %d times, want %d", what, r, got, n)
		}
	}
	if want := slices.SortedFunc(maps.Keys(need), netip.Addr.Compare); !slices.Equal(o.idx.needSorted, want) && len(want)+len(o.idx.needSorted) > 0 {
		t.Fatalf("%s: sorted index %v, want %v", what, o.idx.needSorted, want)
	}
	if o.applyErr != nil || len(o.trk.dirty) > 0 {
		return // nothing claims to be applied
	}
	d := o.desiredLocked()
	last := o.trk.last
	if last == nil || !o.trk.clean(&d) {
		t.Fatalf("%s: nothing is marked, but the tracker's last applied state is not the desired state's computed from scratch", what)
	}
	if !slices.Equal(o.led.programmed.remotes, d.Remotes) && len(d.Remotes)+len(o.led.programmed.remotes) > 0 {
		t.Fatalf("%s: programmed remotes %v, desired %v", what, o.led.programmed.remotes, d.Remotes)
	}
	if !slices.Equal(last.Remotes, d.Remotes) && len(d.Remotes)+len(last.Remotes) > 0 {
		t.Fatalf("%s: the tracker's remotes %v, desired %v", what, last.Remotes, d.Remotes)
	}
	if !maps.Equal(last.RemoteGens, d.RemoteGens) {
		t.Fatalf("%s: the tracker's generations %v, desired %v", what, last.RemoteGens, d.RemoteGens)
	}
	ax, err := o.prog.xfrmDump()
	if err != nil {
		t.Fatal(err)
	}
	if kept := o.keptLocked(&d, ax); !slices.Equal(last.KeepOutbound, kept) && len(kept)+len(last.KeepOutbound) > 0 {
		t.Fatalf("%s: the tracker keeps outbound SAs to %v, from scratch %v", what, last.KeepOutbound, kept)
	}
}

// TestOwnerIncrementalOwnVTEP: a share gaining or losing our own VTEP (our
// endpoint seen through another network: the driver passes every FDB
// entry's VTEP) changes the need counts but no pair, so the kernel must be
// left as it is. The remote-by-remote path once handed the Programmer a
// change of no remote, which it planned as a change of every remote with
// none wanted: it deleted every remote's outbound policy, while the
// fingerprint said the kernel held the desired state (until a full
// reconcile repaired it). Checked for AddRemotes, RemoveRemotes and an
// Update of the remotes alone, each followed by the audit and by a full
// reconcile that must change nothing.
func TestOwnerIncrementalOwnVTEP(t *testing.T) {
	nstest.RequireRoot(t)
	ns := nstest.NewNS(t, "host")
	o := newOwner(t, ns, ownerOpts{tick: time.Hour, noNotify: true})
	remotes := []netip.Addr{testRemote(0), testRemote(1), testRemote(2)}
	establishKeys(o, remotes)
	if err := o.SetLocal(testLocal); err != nil {
		t.Fatal(err)
	}
	share := Share{VNIs: []uint32{100}, Encrypted: true, Remotes: remotes}
	okOrUnsupported(t, "first share", o.Update(1, share, false))
	if a := o.Audit(); len(a) != 0 {
		t.Fatalf("audit after the first share: %v", a)
	}
	withOwn := share
	withOwn.Remotes = append(slices.Clone(remotes), testLocal)
	for _, step := range []struct {
		what string
		do   func() error
	}{
		{"AddRemotes of the own VTEP", func() error { return o.AddRemotes(1, testLocal) }},
		{"RemoveRemotes of the own VTEP", func() error { return o.RemoveRemotes(1, testLocal) }},
		{"Update adding the own VTEP", func() error { return o.Update(1, withOwn, false) }},
		{"Update dropping the own VTEP", func() error { return o.Update(1, share, false) }},
	} {
		before := o.prog.Stats()
		okOrUnsupported(t, step.what, step.do())
		if st := o.prog.Stats().Sub(before); st.XfrmDumps+st.NftDumps != 0 {
			t.Fatalf("%s: the change dumped: %v", step.what, st)
		}
		if a := o.Audit(); len(a) != 0 {
			t.Fatalf("%s: audit: %v", step.what, a)
		}
		if changes := fullReconcile(o); changes != 0 {
			t.Fatalf("%s: the full reconcile after it changed %d objects", step.what, changes)
		}
	}
}
