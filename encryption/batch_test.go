package encryption

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/testutil/logrec"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

// plantInbound installs, behind overlayd's back, an SA with the SPI and
// addresses of remote r's inbound SA in d but another key: the kernel
// then refuses overlayd's add of that SA (EEXIST), and only that one.
// It returns the SA overlayd wants.
func plantInbound(t *testing.T, ns *nstest.NS, d Desired, r netip.Addr) *wantState {
	t.Helper()
	dx, err := xfrmOf(&d)
	if err != nil {
		t.Fatal(err)
	}
	var w *wantState
	for _, s := range dx.states {
		if s.remote == r && !s.outbound {
			w = s
		}
	}
	if w == nil {
		t.Fatalf("no inbound SA for %v in %+v", r, d)
	}
	st := w.netlink(d.Port)
	st.Aead.Key = slices.Clone(st.Aead.Key)
	st.Aead.Key[0] ^= 0xff
	if err := xfrmHandle(t, ns).XfrmStateAdd(st); err != nil {
		t.Fatal(err)
	}
	return w
}

// TestBatchRefusedRequestReported: the xfrm requests of a change go to the
// kernel together; when the kernel refuses one of them, the error names
// exactly that request (the SA's spi, source and destination), the other
// requests of the batch took effect, the change counts as a failed delta,
// and the Owner falls back to the full reconcile, which repairs. Needs a
// kernel with ESP (test/vm runs it; mustPass there).
func TestBatchRefusedRequestReported(t *testing.T) {
	nstest.RequireRoot(t)
	if !espSupported(t) {
		t.Skip("needs a kernel with ESP: runs in test/vm (a refused SA add is the refusal a real kernel makes on request)")
	}
	t.Run("Programmer", func(t *testing.T) {
		ns := nstest.NewNS(t, "host")
		p := newTracked(t, ns)
		if err := p.Apply(testDesired(2)); err != nil {
			t.Fatal(err)
		}
		d := testDesired(3)
		added := testRemote(2)
		w := plantInbound(t, ns, d, added)
		before := p.Stats()
		_, err, ok := p.applyDelta(&d)
		if !ok {
			t.Fatal("the change was not planned as a delta")
		}
		st := p.Stats().Sub(before)
		if st.XfrmSends != 1 || st.StateAdds != 2 || st.PolicyAdds != 1 || st.DeltaFailures != 1 {
			t.Fatalf("want the remote's 2 SAs and policy in one datagram, one failed delta: %v, %d datagrams, %d failed", st, st.XfrmSends, st.DeltaFailures)
		}
		want := fmt.Sprintf("failed to add inbound SA spi 0x%08x src %v dst %v", w.key.spi, added, testLocal)
		if err == nil || !errors.Is(err, unix.EEXIST) || !strings.Contains(err.Error(), want) || strings.Count(err.Error(), "failed to") != 1 {
			t.Fatalf("want exactly the refused request (%s: file exists), got %v", want, err)
		}
		// The outbound SA and the policy of the same datagram are there.
		states, pols := dumpOurs(t, ns)
		out := false
		for _, s := range states {
			out = out || addrOf(s.Dst) == added && addrOf(s.Src) == testLocal
		}
		remote, _ := remotePolicies(pols)
		if !out || !slices.ContainsFunc(remote, func(p netlink.XfrmPolicy) bool { return addrOf(p.Dst.IP) == added }) {
			t.Fatalf("the requests after the refused one were not applied: outbound SA %v, policies %d", out, len(remote))
		}
		if p.t.kernel != nil {
			t.Fatal("the record is still trusted after a refused request")
		}
		if err := p.Apply(d); err != nil {
			t.Fatalf("full reconcile after the refused request: %v", err)
		}
		if a := p.Audit(d); len(a) != 0 {
			t.Fatalf("audit after the repair: %v", a)
		}
	})
	t.Run("Owner", func(t *testing.T) {
		ns := nstest.NewNS(t, "host")
		rec := &logrec.Recorder{}
		o := newOwner(t, ns, ownerOpts{tick: time.Hour, noNotify: true, log: rec.Logger()})
		added := netip.MustParseAddr("192.0.2.12")
		establishKeys(o, []netip.Addr{ownerRemote, added})
		setupShares(t, ns, o)
		o.mu.Lock()
		d := o.desiredLocked()
		d.Remotes = append(slices.Clone(d.Remotes), added)
		d.RemoteGens = maps.Clone(d.RemoteGens)
		d.RemoteGens[added] = o.led.remoteGens[added]
		o.mu.Unlock()
		w := plantInbound(t, ns, d, added)
		before := o.Status().DeltaFailures
		if err := o.AddRemotes(1, added); err != nil {
			t.Fatalf("the full reconcile after the refused request did not repair: %v", err)
		}
		if got := o.Status().DeltaFailures - before; got != 1 {
			t.Fatalf("%d failed deltas, want 1", got)
		}
		want := fmt.Sprintf("failed to add inbound SA spi 0x%08x src %v dst %v", w.key.spi, added, ownerLocal)
		var found []string
		for _, r := range rec.All() {
			if strings.Contains(r.String(), "an incremental encryption change failed") {
				found = append(found, r.String())
			}
		}
		if len(found) != 1 || !strings.Contains(found[0], want) || strings.Count(found[0], "failed to") != 1 {
			t.Fatalf("want one log of the failed change naming %q alone, got %q", want, found)
		}
		if a := o.Audit(); len(a) != 0 {
			t.Fatalf("audit after the repair: %v", a)
		}
	})
}

// TestBatchPolicyExistsRetried: a policy the record does not know of but
// the kernel holds (added behind overlayd's back since the last
// reconcile) makes the batched add fail with EEXIST; it is retried as an
// update in the next round, so the change succeeds and the kernel holds
// overlayd's policy, not the planted one. Policies only: runs here.
func TestBatchPolicyExistsRetried(t *testing.T) {
	nstest.RequireRoot(t)
	ns := nstest.NewNS(t, "host")
	p := newTracked(t, ns)
	base := testDesired(2)
	base.NoSAs = true
	if err := p.Apply(base); err != nil {
		t.Fatal(err)
	}
	d := testDesired(3)
	d.NoSAs = true
	added := testRemote(2)
	dx, err := xfrmOf(&d)
	if err != nil {
		t.Fatal(err)
	}
	k := remoteKey(d.Local, added, d.Port)
	planted := k.netlink(dx.policies[k], d.Local)
	planted.Priority = 7
	if err := xfrmHandle(t, ns).XfrmPolicyAdd(planted); err != nil {
		t.Fatal(err)
	}
	before := p.Stats()
	_, err, ok := p.applyDelta(&d)
	if !ok || err != nil {
		t.Fatalf("delta: planned %v, error %v", ok, err)
	}
	if st := p.Stats().Sub(before); st.PolicyAdds != 1 || st.PolicyUpdates != 1 || st.XfrmSends != 2 {
		t.Fatalf("want the add refused and retried as an update in a second round trip: %v, %d round trips", st, st.XfrmSends)
	}
	if a := p.Audit(d); len(a) != 0 {
		t.Fatalf("audit: %v", a)
	}
}
