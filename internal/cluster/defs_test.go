package cluster

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/overlayd/overlayd/internal/netdef"
)

// defsAt returns what n has in force for vni as "host=MTU" strings, sorted.
func defsAt(n *node, vni uint32) []string {
	var out []string
	for _, r := range n.c.Definitions(vni) {
		if r.Pending {
			continue
		}
		out = append(out, fmt.Sprintf("%s=%d", r.Host, r.Def.MTU))
	}
	return out
}

func waitDefs(t *testing.T, n *node, vni uint32, want ...string) {
	t.Helper()
	waitFor(t, 10*time.Second, fmt.Sprintf("%s's definitions of VNI %d to be %v", n.name, vni, want), func() (bool, string) {
		got := defsAt(n, vni)
		return slices.Equal(got, want), fmt.Sprint(got)
	})
}

// TestDefinitionsReplicate: each node's network definitions reach every
// member, with their host and VTEP; a withdrawn one disappears; a node cut
// off keeps them in force for FailedGrace only, and they are back once
// the partition heals; a restarted node's definitions are those of its
// new process.
func TestDefinitionsReplicate(t *testing.T) {
	t.Parallel()
	nodes, hs, part := partitionable(t, "df", 151, 3)
	a, b, c := nodes[0], nodes[1], nodes[2]
	da := sampleDef(1450, false, 151)
	db := sampleDef(1400, true, 151, 152)
	if err := a.c.PublishDefinition(151, &da); err != nil {
		t.Fatal(err)
	}
	b.c.SyncDefinitions(b.c.LocalMark(), map[uint32]netdef.Definition{151: db, 152: db})
	waitDefs(t, c, 151, a.name+"=1450", b.name+"=1400")
	waitDefs(t, c, 152, b.name+"=1400")
	waitDefs(t, a, 151, b.name+"=1400") // never its own
	if p := a.c.Definitions(152); len(p) != 2 || p[0].Pending || p[1].Host != c.name || !p[1].Pending {
		t.Fatalf("%s's definitions of VNI 152: %+v, want %s's and %s pending (it has none)", a.name, p, b.name, c.name)
	}
	got := c.c.Definitions(151)
	if len(got) != 2 {
		t.Fatalf("%s has %d definitions of VNI 151, want 2: %+v", c.name, len(got), got)
	}
	if got[1].VTEP != b.vtep || !netdef.Equal(&got[1].Def, &db) {
		t.Fatalf("%s's definition as seen by %s: %+v, want VTEP %v and %+v", b.name, c.name, got[1], b.vtep, db)
	}

	// Withdrawn (the network was deleted): gone everywhere.
	b.c.SyncDefinitions(b.c.LocalMark(), map[uint32]netdef.Definition{152: db})
	waitDefs(t, c, 151, a.name+"=1450")
	waitDefs(t, c, 152, b.name+"=1400")

	// An invalid definition is refused, not published.
	bad := sampleDef(1450, false, 153)
	if err := a.c.PublishDefinition(154, &bad); err == nil {
		t.Fatal("a definition that does not define its own VNI was published")
	}

	// a cut off: the others drop its definitions after FailedGrace, and
	// have them again once healed.
	part.set(hs[:1], hs[1:])
	waitDefs(t, c, 151)
	part.heal()
	waitDefs(t, c, 151, a.name+"=1450")

	// A restart: the new process publishes another set, which replaces
	// the former one.
	b.stop()
	b.start(nodeOpts{part: part, seeds: []string{a.addr()}, tweak: func(cfg *Config) {
		cfg.LocalDefinitions = map[uint32]netdef.Definition{151: da}
	}})
	waitDefs(t, c, 151, a.name+"=1450", b.name+"=1450")
	waitDefs(t, c, 152)
	checkAllViolations(t, nodes)
}
