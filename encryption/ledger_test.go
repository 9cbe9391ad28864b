package encryption

import (
	"encoding/json"
	"fmt"
	"net/netip"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/overlayd/overlayd/internal/testutil/memmeta"
	"github.com/overlayd/overlayd/internal/testutil/nstest"
)

// TestOwnerPersistence: the key state and generation survive a restart; a
// restart keeps what the previous run programmed until Restored; a fresh
// state starts a new random generation; a corrupt record stops the start;
// the driver's old record keeps its epochs with a new generation.
func TestOwnerPersistence(t *testing.T) {
	nstest.RequireRoot(t)
	ns := nstest.NewNS(t, "host")
	store := memmeta.New(nil)
	o1, err := NewOwner(OwnerConfig{NS: ns.Handle, Port: 4799, Secret: testSecret, Tick: time.Hour, Store: store})
	if err != nil {
		t.Fatal(err)
	}
	gen1 := o1.Status().Gen
	if gen1 == 0 {
		t.Fatal("no send generation")
	}
	setupShares(t, ns, o1)
	o1.Close()
	var rec record
	if err := json.Unmarshal(mustMeta(t, store), &rec); err != nil {
		t.Fatal(err)
	}
	t.Logf("persisted under %q: %s", MetaKey, mustMeta(t, store))
	if rec.Version != recordVersion || rec.Gen != gen1 || rec.Local != ownerLocal || !slices.Equal(rec.Programmed.Encrypted, []uint32{100}) || len(rec.Programmed.Remotes)+len(rec.Installed)+len(rec.PeerGens) != 0 {
		t.Fatalf("record: %+v", rec)
	}
	// The remote's state is in its own entry.
	entries, _ := store.ListMeta(remoteKeyPrefix)
	if len(entries) != 1 || string(entries[remoteKeyPrefix+ownerRemote.String()]) != `{"programmed":true}` {
		t.Fatalf("remotes' entries: %q", entries)
	}
	for k, v := range entries {
		if strings.Contains(k+string(v)+string(mustMeta(t, store)), string(testSecret[:8])) {
			t.Fatal("the record holds the secret")
		}
	}

	// A restart: the new Owner keeps the previous run's state until
	// Restored, whatever its loop does meanwhile.
	o2 := newOwner(t, ns, ownerOpts{tick: 50 * time.Millisecond, store: store})
	if g := o2.Status().Gen; g != gen1 {
		t.Fatalf("generation %x after a restart, want %x", g, gen1)
	}
	o2.Start()
	deadline := time.Now().Add(300 * time.Millisecond)
	for o2.Status().Reconciles < 2 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if a := o2.Audit(); len(a) != 0 {
		t.Fatalf("after a restart: %v", a)
	}
	if _, all := dumpOurs(t, ns); len(all) != 2 || !nftDumpView(t, ns).exists {
		t.Fatalf("a restart removed state before the driver re-registered its shares: %d policies", len(all))
	}
	okOrUnsupported(t, "restored", o2.Restored())
	if s, p := dumpOurs(t, ns); len(s)+len(p) != 0 || nftDumpView(t, ns).exists {
		t.Fatalf("after Restored with no share the state stays: %d SAs %d policies", len(s), len(p))
	}
	o2.Close()

	// Fresh state: a new random generation each time.
	a, _ := NewOwner(OwnerConfig{NS: ns.Handle, Port: 4799, Secret: testSecret})
	b, _ := NewOwner(OwnerConfig{NS: ns.Handle, Port: 4799, Secret: testSecret})
	if a.Status().Gen == b.Status().Gen || a.Status().Gen == gen1 {
		t.Fatal("fresh Owners share a generation")
	}
	a.Close()
	b.Close()

	// Corrupt, newer and old records.
	for raw, want := range map[string]string{
		`{"version":2,`:                     "corrupt",
		`{"version":4,"keys":{}}`:           "newer overlayd",
		`{"version":2,"gen":"x","keys":{}}`: "corrupt",
	} {
		_, err := NewOwner(OwnerConfig{NS: ns.Handle, Port: 4799, Secret: testSecret, Store: memmeta.New(map[string][]byte{MetaKey: []byte(raw)})})
		if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), MetaKey) {
			t.Errorf("record %s: %v, want an error naming the key and %q", raw, err, want)
		}
	}
	for key, raw := range map[string]string{
		remoteKeyPrefix + "192.0.2.11": `{"installed":"x"}`,
		remoteKeyPrefix + "not-an-ip":  `{}`,
	} {
		bad := memmeta.New(map[string][]byte{MetaKey: []byte(`{"version":3,"keys":{},"gen":"7"}`), key: []byte(raw)})
		_, err := NewOwner(OwnerConfig{NS: ns.Handle, Port: 4799, Secret: testSecret, Store: bad})
		if err == nil || !strings.Contains(err.Error(), "corrupt") || !strings.Contains(err.Error(), key) {
			t.Errorf("entry %s = %s: %v, want an error naming the key and corrupt", key, raw, err)
		}
	}
	old := memmeta.New(map[string][]byte{MetaKey: []byte(`{"keys":{"Accept":[3,4],"Send":3,"Target":4},"remotes":["192.0.2.11"]}`)})
	oo, err := NewOwner(OwnerConfig{NS: ns.Handle, Port: 4799, Secret: testSecret, Store: old})
	if err != nil {
		t.Fatal(err)
	}
	defer oo.Close()
	if st := oo.Status(); st.Send != 3 || st.Target != 4 || !slices.Equal(st.Accept, []uint32{3, 4}) || st.Gen == 0 || !oo.led.adopting || !slices.Equal(oo.led.adopted.remotes, []netip.Addr{ownerRemote}) {
		t.Fatalf("old record: %+v", st)
	}
}

// TestOwnerRecordPerRemote: a version 2 record (one JSON of every remote)
// is read whole and rewritten as version 3 by the first write — a core and
// an entry per remote, which a restart reads back to the same state — and
// after that a remote host added or removed writes its own entry only, one
// key per change whatever the number of hosts.
func TestOwnerRecordPerRemote(t *testing.T) {
	nstest.RequireRoot(t)
	ns := nstest.NewNS(t, "host")
	r1, r2, r3 := netip.MustParseAddr("192.0.2.21"), netip.MustParseAddr("192.0.2.22"), netip.MustParseAddr("192.0.2.23")
	v2 := `{"version":2,"keys":{"accept":[1],"send":1,"target":1},"local":"192.0.2.10","gen":"77",` +
		`"installed":[{"epoch":1,"remotes":["192.0.2.21","192.0.2.22"]}],` +
		`"peer_gens":[{"vtep":"192.0.2.21","gen":"5"},{"vtep":"192.0.2.23","gen":"6"}],` +
		`"programmed":{"encrypted_vnis":[100],"remotes":["192.0.2.21","192.0.2.22"]}}`
	store := memmeta.New(map[string][]byte{MetaKey: []byte(v2)})
	state := func(o *Owner) string {
		o.mu.Lock()
		defer o.mu.Unlock()
		return fmt.Sprintf("gen %d keys %v installed %v gens %v adopted %v %v %v", o.led.gen, o.led.keys, o.led.installed, o.led.remoteGens, o.led.adopted.enc, o.led.adopted.clear, o.led.adopted.remotes)
	}
	o1, err := NewOwner(OwnerConfig{NS: ns.Handle, Port: 4799, Secret: testSecret, Tick: time.Hour, Store: store})
	if err != nil {
		t.Fatal(err)
	}
	want := "gen 77 keys accept=[1] send=1 target=1 installed map[1:map[192.0.2.21:true 192.0.2.22:true]] gens map[192.0.2.21:5 192.0.2.23:6] adopted [100] [] [192.0.2.21 192.0.2.22]"
	if got := state(o1); got != want {
		t.Fatalf("loaded from version 2:\n%s\nwant\n%s", got, want)
	}
	// The first write rewrites it whole, as version 3 (after the
	// reconcile that programs what the restart adopted), even when it is
	// a change of one remote's.
	o1.mu.Lock()
	o1.led.programmed = programmed{enc: o1.led.adopted.enc, remotes: slices.Clone(o1.led.adopted.remotes)}
	err = o1.led.persist([]netip.Addr{r1})
	o1.mu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	o1.Close()
	var rec record
	if err := json.Unmarshal(mustMeta(t, store), &rec); err != nil || rec.Version != 3 || rec.Gen != 77 || len(rec.Installed)+len(rec.PeerGens) != 0 {
		t.Fatalf("rewritten record: %s (%v)", mustMeta(t, store), err)
	}
	entries, _ := store.ListMeta(remoteKeyPrefix)
	wantEntries := map[string]string{
		remoteKeyPrefix + r1.String(): `{"installed":[1],"gen":"5","programmed":true}`,
		remoteKeyPrefix + r2.String(): `{"installed":[1],"programmed":true}`,
		remoteKeyPrefix + r3.String(): `{"gen":"6"}`,
	}
	if len(entries) != len(wantEntries) {
		t.Fatalf("entries %q, want %q", entries, wantEntries)
	}
	for k, v := range wantEntries {
		if string(entries[k]) != v {
			t.Fatalf("entries %q, want %q", entries, wantEntries)
		}
	}
	// Read back: the same state.
	o2, err := NewOwner(OwnerConfig{NS: ns.Handle, Port: 4799, Secret: testSecret, Tick: time.Hour, Store: store})
	if err != nil {
		t.Fatal(err)
	}
	defer o2.Close()
	if got := state(o2); got != want {
		t.Fatalf("read back from version 3:\n%s\nwant\n%s", got, want)
	}

	// A host coming and going writes its entry alone, with 1 or 200
	// other hosts in the share.
	for _, n := range []int{1, 200} {
		ns := nstest.NewNS(t, "perremote")
		st := memmeta.New(nil)
		o := newOwner(t, ns, ownerOpts{tick: time.Hour, store: st})
		if err := o.SetLocal(ownerLocal); err != nil {
			t.Fatal(err)
		}
		var remotes []netip.Addr
		for i := range n {
			remotes = append(remotes, netip.AddrFrom4([4]byte{198, 51, 100, byte(i + 1)}))
		}
		okOrUnsupported(t, "share", o.Update(1, Share{VNIs: []uint32{100}, Encrypted: true, Remotes: remotes}, false))
		okOrUnsupported(t, "share again", o.Update(1, Share{VNIs: []uint32{100}, Encrypted: true, Remotes: remotes}, false))
		extra := netip.MustParseAddr("203.0.113.9")
		u0, k0 := st.Writes()
		okOrUnsupported(t, "add", o.AddRemotes(1, extra))
		u1, k1 := st.Writes()
		if e, _ := st.GetMeta(remoteKeyPrefix + extra.String()); string(e) != `{"programmed":true}` {
			t.Fatalf("%d hosts: the added host's entry is %s", n, e)
		}
		okOrUnsupported(t, "remove", o.RemoveRemotes(1, extra))
		u2, k2 := st.Writes()
		if e, _ := st.GetMeta(remoteKeyPrefix + extra.String()); e != nil {
			t.Fatalf("%d hosts: the removed host's entry is %s, want none", n, e)
		}
		if u1-u0 != 1 || k1-k0 != 1 || u2-u1 != 1 || k2-k1 != 1 {
			t.Fatalf("%d hosts: an add wrote %d keys in %d transactions and a removal %d in %d; want 1 in 1 each", n, k1-k0, u1-u0, k2-k1, u2-u1)
		}
		if a := o.Audit(); len(a) != 0 {
			t.Fatalf("audit: %v", a)
		}
	}
}

// mustMeta returns what the Owner persisted in store.
func mustMeta(t *testing.T, store *memmeta.Store) []byte {
	t.Helper()
	b, err := store.GetMeta(MetaKey)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
