package netsync

import (
	"cmp"
	"slices"
	"time"

	"github.com/overlayd/overlayd/internal/lockorder"
)

// TombstoneTTL is how long a removal is remembered. A host away (down or
// partitioned) for longer may still hold the removed network's live entry
// and bring the name back when it returns; a week covers maintenance and
// long partitions, and a tombstone is a name and a stamp (docs/networks.md).
const TombstoneTTL = 7 * 24 * time.Hour

// Table is this host's copy of the cluster's entries. Safe for concurrent
// use; its lock is a leaf (it never calls out while held).
type Table struct {
	mu      *lockorder.Mutex // level LevelLeaf
	entries map[string]Entry // guarded by mu
}

// NewTable is a table holding entries (e.g. loaded from the state file).
func NewTable(entries []Entry) *Table {
	t := &Table{mu: lockorder.New(lockorder.LevelLeaf), entries: map[string]Entry{}}
	t.Merge(entries)
	return t
}

// Merge takes every entry newer than the table's of its name and returns
// those it took, sorted by name.
func (t *Table) Merge(es []Entry) []Entry {
	t.mu.Lock()
	defer t.mu.Unlock()
	var took []Entry
	for _, e := range es {
		if old, ok := t.entries[e.Name]; ok && !e.Newer(&old) {
			continue
		}
		t.entries[e.Name] = e
		took = append(took, e)
	}
	slices.SortFunc(took, func(a, b Entry) int { return cmp.Compare(a.Name, b.Name) })
	return took
}

// Older returns the table's entries that are newer than theirs (a peer's
// full table, by name), or that they lack: what to send back.
func (t *Table) Older(theirs []Entry) []Entry {
	have := make(map[string]Entry, len(theirs))
	for _, e := range theirs {
		have[e.Name] = e
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	var out []Entry
	for name, e := range t.entries {
		if o, ok := have[name]; !ok || e.Newer(&o) {
			out = append(out, e)
		}
	}
	slices.SortFunc(out, func(a, b Entry) int { return cmp.Compare(a.Name, b.Name) })
	return out
}

// Map is a copy of the entries by name.
func (t *Table) Map() map[string]Entry {
	t.mu.Lock()
	defer t.mu.Unlock()
	m := make(map[string]Entry, len(t.entries))
	for k, v := range t.entries {
		m[k] = v
	}
	return m
}

// List is a copy of the entries, sorted by name.
func (t *Table) List() []Entry {
	m := t.Map()
	out := make([]Entry, 0, len(m))
	for _, e := range m {
		out = append(out, e)
	}
	slices.SortFunc(out, func(a, b Entry) int { return cmp.Compare(a.Name, b.Name) })
	return out
}

// Expire forgets tombstones older than TombstoneTTL at now and returns
// their names.
func (t *Table) Expire(now time.Time) []string {
	t.mu.Lock()
	defer t.mu.Unlock()
	var gone []string
	for name, e := range t.entries {
		if !e.Live && now.UnixNano()-e.Stamp.Time > int64(TombstoneTTL) {
			delete(t.entries, name)
			gone = append(gone, name)
		}
	}
	slices.Sort(gone)
	return gone
}
