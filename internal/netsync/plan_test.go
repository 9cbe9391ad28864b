package netsync

import (
	"math/rand/v2"
	"net/netip"
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/overlayd/overlayd/internal/netspec"
)

var t0 = time.Date(2026, 12, 7, 2, 0, 0, 0, time.UTC)

func spec(vni string) netspec.Spec {
	return netspec.Spec{
		Name: "net1", Options: map[string]string{"vni": vni}, IPAMDriver: "overlayd", IPAMOptions: map[string]string{},
		Pools: []netspec.Pool{{Subnet: netip.MustParsePrefix("192.0.2.0/24"), Aux: map[string]netip.Addr{}}}, IPv4: true, Labels: map[string]string{},
	}
}

// host is one host's side of the plans: its engine's networks, its ledger
// and the cluster's entries as it has them, stepped as the caller of
// Compute would (carrying out creates and removes on its engine).
type host struct {
	t       *testing.T
	name    string
	now     time.Time
	nets    []Network
	entries map[string]Entry
	ledger  Ledger
	nextID  int
}

func newHost(t *testing.T, name string) *host {
	return &host{t: t, name: name, now: t0, entries: map[string]Entry{}, ledger: NewLedger()}
}

func (h *host) userCreate(s netspec.Spec) string {
	h.nextID++
	id := h.name + "-" + string(rune('0'+h.nextID))
	h.nets = append(h.nets, Network{ID: id, Name: s.Name, Created: h.now, Spec: s})
	return id
}

func (h *host) drop(id string) {
	h.nets = slices.DeleteFunc(h.nets, func(n Network) bool { return n.ID == id })
}

func (h *host) setEndpoints(name string, k int) {
	for i := range h.nets {
		if h.nets[i].Name == name {
			h.nets[i].Endpoints = k
		}
	}
}

func (h *host) merge(es ...Entry) {
	for _, e := range es {
		if old, ok := h.entries[e.Name]; !ok || e.Newer(&old) {
			h.entries[e.Name] = e
		}
	}
}

// step computes a plan, merges its writes and carries out its creates and
// removes (removes only of idle networks, as the engine does).
func (h *host) step() Plan {
	h.now = h.now.Add(time.Second)
	p := Compute(Input{Host: h.name, Now: h.now, Networks: h.nets, Entries: h.entries, Ledger: h.ledger})
	h.ledger = p.Ledger
	h.merge(p.Writes...)
	for _, s := range p.Create {
		h.nextID++
		h.nets = append(h.nets, Network{ID: h.name + "-r" + string(rune('0'+h.nextID)), Name: s.Name, Created: h.now, Spec: s})
	}
	for _, n := range p.Remove {
		if n.Endpoints != 0 {
			h.t.Fatalf("%s: plan removes %s in use", h.name, n.Name)
		}
		h.drop(n.ID)
	}
	return p
}

func (h *host) has(name string) bool {
	return slices.ContainsFunc(h.nets, func(n Network) bool { return n.Name == name })
}

// The story, three hosts: create on A only; B and C get it; rm on
// A while C uses it: removed on B, kept on C; C's container goes: removed
// on C. No replica ever writes an entry.
func TestCreateOnceRemoveOnce(t *testing.T) {
	a, b, c := newHost(t, "a"), newHost(t, "b"), newHost(t, "c")
	a.userCreate(spec("4242"))
	pa := a.step()
	if len(pa.Writes) != 1 || !pa.Writes[0].Live || pa.Writes[0].Stamp != (Stamp{t0.UnixNano(), "a"}) {
		t.Fatalf("a's create wrote %+v", pa.Writes)
	}
	for _, h := range []*host{b, c} {
		h.merge(pa.Writes...)
		if p := h.step(); len(p.Create) != 1 || len(p.Writes) != 0 {
			t.Fatalf("%s: plan %+v, want one create and no write", h.name, p)
		}
		if p := h.step(); len(p.Create)+len(p.Writes)+len(p.Remove)+len(p.Conflicts) != 0 {
			t.Fatalf("%s: second plan %+v, want nothing", h.name, p)
		}
		if len(h.ledger.Creating) != 0 || !h.ledger.Networks[h.nets[0].ID].Replica {
			t.Fatalf("%s: replica not adopted: %+v", h.name, h.ledger)
		}
	}
	c.setEndpoints("net1", 1)

	a.drop(a.nets[0].ID) // docker network rm on A
	pa = a.step()
	if len(pa.Writes) != 1 || pa.Writes[0].Live || pa.Writes[0].Stamp.Host != "a" {
		t.Fatalf("a's rm wrote %+v, want a tombstone", pa.Writes)
	}
	for _, h := range []*host{b, c} {
		h.merge(pa.Writes...)
	}
	if p := b.step(); len(p.Remove) != 1 || len(p.Writes) != 0 {
		t.Fatalf("b: plan %+v, want the replica removed", p)
	}
	if p := b.step(); len(p.Writes) != 0 || b.has("net1") {
		t.Fatalf("b: netsync's own removal wrote %+v", p.Writes)
	}
	p := c.step()
	if len(p.Remove) != 0 || len(p.Kept) != 1 || p.Kept[0].Endpoints != 1 {
		t.Fatalf("c: plan %+v, want the replica kept (in use)", p)
	}
	c.setEndpoints("net1", 0)
	if p := c.step(); len(p.Remove) != 1 {
		t.Fatalf("c: plan %+v, want the idle replica removed", p)
	}
	for _, h := range []*host{a, b, c} {
		if p := h.step(); len(p.Writes)+len(p.Create) != 0 || h.has("net1") {
			t.Fatalf("%s: after the removal: plan %+v, has net1 %v", h.name, p, h.has("net1"))
		}
	}
}

// A host partitioned during the removal keeps its replica (it never
// writes), and removes it on hearing the tombstone: nothing resurrects.
func TestPartitionResurrectsNothing(t *testing.T) {
	a, c := newHost(t, "a"), newHost(t, "c")
	a.userCreate(spec("4242"))
	c.merge(a.step().Writes...)
	c.step()
	a.drop(a.nets[0].ID)
	tomb := a.step().Writes
	for range 5 { // partitioned: c hears nothing
		if p := c.step(); len(p.Writes) != 0 || len(p.Remove) != 0 || !c.has("net1") {
			t.Fatalf("c partitioned: %+v", p)
		}
	}
	// Heal: a learns nothing from c that brings net1 back; c removes it.
	a.merge(c.entriesList()...)
	if e := a.entries["net1"]; e.Live {
		t.Fatalf("a's entry after heal: %+v", e)
	}
	c.merge(tomb...)
	if p := c.step(); len(p.Remove) != 1 || len(p.Writes) != 0 {
		t.Fatalf("c after heal: %+v", p)
	}
	if p := a.step(); len(p.Create) != 0 {
		t.Fatalf("a recreates after heal: %+v", p)
	}
}

func (h *host) entriesList() []Entry {
	var out []Entry
	for _, e := range h.entries {
		out = append(out, e)
	}
	return out
}

// A network of that name made by hand with another definition is left
// alone and reported; one with the same definition is the cluster's and
// is never removed by netsync (the user made it).
func TestHandMadeNetworksAreLeftAlone(t *testing.T) {
	a, b := newHost(t, "a"), newHost(t, "b")
	a.userCreate(spec("4242"))
	w := a.step().Writes
	b.now = b.now.Add(time.Minute)
	b.userCreate(spec("5000"))
	b.merge(w...)
	p := b.step()
	if len(p.Writes) != 0 || len(p.Create) != 0 || len(p.Conflicts) != 1 {
		t.Fatalf("b: %+v, want one conflict, nothing written or created", p)
	}
	if want := []string{"driver options: {vni=5000} here, {vni=4242} there"}; !slices.Equal(p.Conflicts[0].Diff, want) {
		t.Fatalf("conflict diff %q, want %q", p.Conflicts[0].Diff, want)
	}

	c := newHost(t, "c")
	c.userCreate(spec("4242")) // typed on every host, as before netsync
	c.merge(w...)
	if p := c.step(); len(p.Writes)+len(p.Create)+len(p.Conflicts) != 0 {
		t.Fatalf("c (same definition by hand): %+v", p)
	}
	a.drop(a.nets[0].ID)
	c.merge(a.step().Writes...)
	if p := c.step(); len(p.Remove) != 0 || !c.has("net1") {
		t.Fatalf("c's own network removed: %+v", p)
	}
	// Removing a conflicting network writes nothing either.
	b.drop(b.nets[0].ID)
	if p := b.step(); len(p.Writes) != 0 {
		t.Fatalf("b's conflicting network's removal wrote %+v", p.Writes)
	}
}

// docker network rm of a replica is the user's act too: a tombstone.
func TestRemovingAReplicaRemovesEverywhere(t *testing.T) {
	a, b := newHost(t, "a"), newHost(t, "b")
	a.userCreate(spec("4242"))
	w := a.step().Writes
	b.merge(w...)
	b.step()
	b.step()
	b.drop(b.nets[0].ID)
	p := b.step()
	if len(p.Writes) != 1 || p.Writes[0].Live {
		t.Fatalf("b's rm of its replica wrote %+v, want a tombstone", p.Writes)
	}
	if len(p.Create) != 0 {
		t.Fatalf("b recreates what its user removed: %+v", p.Create)
	}
	a.merge(p.Writes...)
	// a's own network is the user's: not removed by netsync.
	if p := a.step(); len(p.Remove) != 0 {
		t.Fatalf("a: %+v", p)
	}
}

// A tombstone stamped on a clock behind the create's still wins: a
// removal comes after the create it undoes.
func TestRemovalAfterCreateOnAnyClock(t *testing.T) {
	a, b := newHost(t, "a"), newHost(t, "b")
	a.now = t0.Add(time.Hour) // a's clock is an hour ahead
	a.userCreate(spec("4242"))
	w := a.step().Writes
	b.merge(w...)
	b.step()
	b.step()
	b.drop(b.nets[0].ID)
	p := b.step()
	if len(p.Writes) != 1 || !p.Writes[0].Newer(&w[0]) {
		t.Fatalf("tombstone %+v does not supersede %+v", p.Writes, w[0])
	}
}

// A network created again after a removal is live again; one that the
// ledger did not know but that is older than the removal is not.
func TestCreateAfterRemoval(t *testing.T) {
	a := newHost(t, "a")
	id := a.userCreate(spec("4242"))
	a.step()
	a.drop(id)
	a.step()
	a.now = a.now.Add(time.Second)
	a.userCreate(spec("4243"))
	p := a.step()
	if len(p.Writes) != 1 || !p.Writes[0].Live || p.Writes[0].Spec.Options["vni"] != "4243" {
		t.Fatalf("create after removal wrote %+v", p.Writes)
	}

	// A host whose ledger was lost finds a network older than the
	// tombstone: it does not bring the name back.
	b := newHost(t, "b")
	b.nets = []Network{{ID: "old", Name: "net1", Created: t0.Add(-time.Hour), Spec: spec("4242")}}
	b.merge(Entry{Name: "net1", Stamp: Stamp{t0.UnixNano(), "a"}})
	if p := b.step(); len(p.Writes) != 0 {
		t.Fatalf("an old network revived a removed name: %+v", p.Writes)
	}
}

// A replica asked of the engine is asked again only after CreateRetry; a
// crash between the create and the next list adopts it as a replica.
func TestCreateInFlight(t *testing.T) {
	b := newHost(t, "b")
	b.merge(Entry{Name: "net1", Live: true, Spec: spec("4242"), Stamp: Stamp{t0.UnixNano(), "a"}})
	p := Compute(Input{Host: "b", Now: t0, Entries: b.entries, Ledger: b.ledger})
	if len(p.Create) != 1 {
		t.Fatalf("plan %+v", p)
	}
	again := Compute(Input{Host: "b", Now: t0.Add(CreateRetry / 2), Entries: b.entries, Ledger: p.Ledger})
	if len(again.Create) != 0 {
		t.Fatal("asked again before CreateRetry")
	}
	late := Compute(Input{Host: "b", Now: t0.Add(CreateRetry), Entries: b.entries, Ledger: p.Ledger})
	if len(late.Create) != 1 {
		t.Fatal("not asked again after CreateRetry")
	}
	shown := Compute(Input{Host: "b", Now: t0.Add(time.Second), Entries: b.entries, Ledger: p.Ledger,
		Networks: []Network{{ID: "r", Name: "net1", Created: t0, Spec: spec("4242")}}})
	if !shown.Ledger.Networks["r"].Replica || len(shown.Writes) != 0 || len(shown.Ledger.Creating) != 0 {
		t.Fatalf("the created network is not adopted as a replica: %+v", shown)
	}
}

// An outdated replica (the name was defined again, differently) is
// removed once idle and created again with the new definition.
func TestOutdatedReplicaIsReplacedWhenIdle(t *testing.T) {
	b := newHost(t, "b")
	b.merge(Entry{Name: "net1", Live: true, Spec: spec("4242"), Stamp: Stamp{t0.UnixNano(), "a"}})
	b.step()
	b.step()
	b.setEndpoints("net1", 2)
	b.merge(Entry{Name: "net1", Live: true, Spec: spec("4243"), Stamp: Stamp{t0.Add(time.Minute).UnixNano(), "a"}})
	p := b.step()
	if len(p.Kept) != 1 || len(p.Remove) != 0 || len(p.Conflicts) != 0 {
		t.Fatalf("outdated replica in use: %+v", p)
	}
	b.setEndpoints("net1", 0)
	if p := b.step(); len(p.Remove) != 1 {
		t.Fatalf("idle outdated replica: %+v", p)
	}
	if p := b.step(); len(p.Create) != 1 || p.Create[0].Options["vni"] != "4243" {
		t.Fatalf("not created again with the new definition: %+v", p)
	}
}

// Networks without a definition (swarm's, config-only) are never written,
// compared or removed.
func TestNetworksWithoutSpecAreIgnored(t *testing.T) {
	b := newHost(t, "b")
	b.nets = []Network{{ID: "s", Name: "net1", Created: t0, SpecErr: &netspec.Unreplicable{Network: "net1", Why: "swarm"}}}
	b.merge(Entry{Name: "net1", Live: true, Spec: spec("4242"), Stamp: Stamp{t0.UnixNano(), "a"}})
	p := b.step()
	if len(p.Writes)+len(p.Conflicts)+len(p.Remove)+len(p.Create) != 0 {
		t.Fatalf("plan touches a network without definition: %+v", p)
	}
	b.drop("s")
	if p := b.step(); len(p.Writes) != 0 {
		t.Fatalf("its removal wrote %+v", p.Writes)
	}
}

// Compute is pure: it does not change its input, and the order of the
// engine's list does not change the plan.
func TestComputeIsPure(t *testing.T) {
	nets := []Network{
		{ID: "1", Name: "net1", Created: t0, Spec: spec("1")},
		{ID: "2", Name: "net2", Created: t0, Spec: func() netspec.Spec { s := spec("2"); s.Name = "net2"; return s }()},
		{ID: "3", Name: "net3", Created: t0, Spec: func() netspec.Spec { s := spec("3"); s.Name = "net3"; return s }(), Endpoints: 1},
	}
	led := NewLedger()
	led.Networks["3"] = Known{Name: "net3", Replica: true, Spec: nets[2].Spec, HasSpec: true}
	led.Networks["9"] = Known{Name: "gone", Spec: spec("9"), HasSpec: true}
	entries := map[string]Entry{"gone": {Name: "gone", Live: true, Spec: spec("9"), Stamp: Stamp{1, "x"}},
		"net4": {Name: "net4", Live: true, Spec: spec("4"), Stamp: Stamp{1, "x"}}}
	in := Input{Host: "h", Now: t0, Networks: nets, Entries: entries, Ledger: led}
	want := Compute(in)
	if len(led.Networks) != 2 || len(entries) != 2 {
		t.Fatal("Compute changed its input")
	}
	for range 20 {
		shuffled := slices.Clone(nets)
		rand.Shuffle(len(shuffled), func(i, j int) { shuffled[i], shuffled[j] = shuffled[j], shuffled[i] })
		in.Networks = shuffled
		if got := Compute(in); !reflect.DeepEqual(got, want) {
			t.Fatalf("plan depends on the list's order:\n%+v\n%+v", got, want)
		}
	}
}
