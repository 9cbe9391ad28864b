package netsync

import (
	"cmp"
	"slices"
	"time"

	"github.com/overlayd/overlayd/internal/netspec"
)

// Stamp orders the user's acts on one network name: when it happened
// (Unix nanoseconds) and on which host (a tie-break only).
type Stamp struct {
	Time int64
	Host string
}

// Compare is -1, 0 or +1 as a is before, the same as, or after b.
func (a Stamp) Compare(b Stamp) int {
	if c := cmp.Compare(a.Time, b.Time); c != 0 {
		return c
	}
	return cmp.Compare(a.Host, b.Host)
}

// Entry is the cluster's word on one network name: live with a
// definition, or removed (a tombstone), as of Stamp.
type Entry struct {
	Name  string
	Live  bool
	Spec  netspec.Spec // when Live
	Stamp Stamp
}

// Newer reports whether e supersedes old (the later act wins).
func (e *Entry) Newer(old *Entry) bool { return e.Stamp.Compare(old.Stamp) > 0 }

// Network is one overlayd network as the local engine has it now.
type Network struct {
	ID      string
	Name    string
	Created time.Time
	// Spec is its definition; SpecErr why it has none (swarm's, config-
	// only, outside the limits): such a network is never written, never
	// compared, never removed.
	Spec      netspec.Spec
	SpecErr   error
	Endpoints int // containers attached here
}

// Known is a network the ledger has seen on the local engine.
type Known struct {
	Name    string
	Replica bool         // created by netsync; false: by the user
	Spec    netspec.Spec // its definition when seen (valid only if HasSpec)
	HasSpec bool
}

// Ledger is what netsync remembers of the local engine between plans: it
// must be persisted before the plan's acts are carried out, so that a
// restart tells the user's acts from netsync's own.
type Ledger struct {
	Networks map[string]Known     // by network ID
	Creating map[string]time.Time // replicas asked of the engine, by name, since
	Removing map[string]bool      // replica IDs whose removal was asked
}

// NewLedger is an empty ledger.
func NewLedger() Ledger {
	return Ledger{Networks: map[string]Known{}, Creating: map[string]time.Time{}, Removing: map[string]bool{}}
}

func (l Ledger) clone() Ledger {
	n := NewLedger()
	for k, v := range l.Networks {
		n.Networks[k] = v
	}
	for k, v := range l.Creating {
		n.Creating[k] = v
	}
	for k, v := range l.Removing {
		n.Removing[k] = v
	}
	return n
}

// CreateRetry is how long a replica asked of the engine may take to show
// in its list before it is asked again.
const CreateRetry = 30 * time.Second

// Input is everything a plan depends on.
type Input struct {
	Host     string
	Now      time.Time
	Networks []Network        // the local engine's overlayd networks, now
	Entries  map[string]Entry // the cluster's entries, by name
	Ledger   Ledger
}

// Conflict is a network the user made here whose definition is not the
// cluster's: left alone.
type Conflict struct {
	Name string   `json:"name"`
	ID   string   `json:"id"`
	Diff []string `json:"differences"` // here: the local network; there: the cluster's
}

// Kept is a replica the cluster no longer wants, kept while in use.
type Kept struct {
	Name      string `json:"name"`
	ID        string `json:"id"`
	Endpoints int    `json:"containers"`
}

// Plan is what to do now.
type Plan struct {
	Writes    []Entry        // the user's acts seen on this host: merge and gossip
	Create    []netspec.Spec // replicas to create
	Remove    []Network      // idle replicas to remove
	Kept      []Kept
	Conflicts []Conflict
	Ledger    Ledger // persist before acting
}

// Compute is the plan for in. It is pure: the same input gives the same
// plan, and it never changes in.
func Compute(in Input) Plan {
	p := Plan{Ledger: in.Ledger.clone()}
	led := &p.Ledger
	entries := make(map[string]Entry, len(in.Entries))
	for k, v := range in.Entries {
		entries[k] = v
	}
	write := func(e Entry) {
		if old, ok := entries[e.Name]; ok && !e.Newer(&old) {
			return
		}
		entries[e.Name] = e
		p.Writes = append(p.Writes, e)
	}
	nets := slices.Clone(in.Networks)
	slices.SortFunc(nets, func(a, b Network) int { return cmp.Or(cmp.Compare(a.Name, b.Name), cmp.Compare(a.ID, b.ID)) })
	onEngine := make(map[string]bool, len(nets))
	byName := make(map[string][]Network)
	for _, n := range nets {
		onEngine[n.ID] = true
		byName[n.Name] = append(byName[n.Name], n)
	}

	// Networks that appeared: netsync's replicas, or the user's creates.
	for _, n := range nets {
		if _, ok := led.Networks[n.ID]; ok {
			continue
		}
		k := Known{Name: n.Name, Spec: n.Spec, HasSpec: n.SpecErr == nil}
		if _, asked := led.Creating[n.Name]; asked && k.HasSpec {
			k.Replica = true
			delete(led.Creating, n.Name)
		} else if k.HasSpec {
			e, ok := entries[n.Name]
			// A create writes a live entry unless one is live (the same
			// definition needs none; another is a conflict) or the
			// name's removal came after this network's creation.
			if !ok || (!e.Live && n.Created.UnixNano() > e.Stamp.Time) {
				write(Entry{Name: n.Name, Live: true, Spec: n.Spec, Stamp: Stamp{n.Created.UnixNano(), in.Host}})
			}
		}
		led.Networks[n.ID] = k
	}

	// Networks that went: netsync's removals, or the user's.
	gone := make([]string, 0)
	for id := range led.Networks {
		if !onEngine[id] {
			gone = append(gone, id)
		}
	}
	slices.Sort(gone)
	for _, id := range gone {
		k := led.Networks[id]
		delete(led.Networks, id)
		if led.Removing[id] {
			delete(led.Removing, id)
			continue
		}
		// The user removed it: the cluster's network if it had the live
		// definition. A removal comes after the create it undoes, on any
		// clock.
		if e, ok := entries[k.Name]; ok && e.Live && k.HasSpec && netspec.Equal(&k.Spec, &e.Spec) {
			t := max(in.Now.UnixNano(), e.Stamp.Time+1)
			write(Entry{Name: k.Name, Stamp: Stamp{t, in.Host}})
		}
	}
	for id := range led.Removing {
		if !onEngine[id] {
			delete(led.Removing, id)
		}
	}

	// What the entries want here.
	names := make([]string, 0, len(entries))
	for name := range entries {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		e := entries[name]
		if !e.Live {
			continue
		}
		local := byName[name]
		if len(local) == 0 {
			if since, asked := led.Creating[name]; asked && in.Now.Sub(since) < CreateRetry {
				continue
			}
			led.Creating[name] = in.Now
			p.Create = append(p.Create, e.Spec)
			continue
		}
		delete(led.Creating, name)
		same := false
		for _, n := range local {
			if n.SpecErr == nil && netspec.Equal(&n.Spec, &e.Spec) {
				same = true
			}
		}
		if same {
			continue
		}
		for _, n := range local {
			// An outdated replica is removed once idle (below) and
			// created again on the next plan; kept while in use.
			if n.SpecErr == nil && !led.Networks[n.ID].Replica {
				p.Conflicts = append(p.Conflicts, Conflict{Name: name, ID: n.ID, Diff: netspec.Diff(&n.Spec, &e.Spec)})
			}
		}
	}
	for name, since := range led.Creating {
		if e, ok := entries[name]; (!ok || !e.Live) && in.Now.Sub(since) >= CreateRetry {
			delete(led.Creating, name)
		}
	}

	// Replicas nobody wants any more (or an outdated one): removed once
	// idle here.
	for _, n := range nets {
		k := led.Networks[n.ID]
		if !k.Replica || led.Removing[n.ID] {
			continue
		}
		if e, ok := entries[n.Name]; ok && e.Live && n.SpecErr == nil && netspec.Equal(&n.Spec, &e.Spec) {
			continue
		}
		if n.Endpoints > 0 {
			p.Kept = append(p.Kept, Kept{Name: n.Name, ID: n.ID, Endpoints: n.Endpoints})
			continue
		}
		led.Removing[n.ID] = true
		p.Remove = append(p.Remove, n)
	}
	return p
}
