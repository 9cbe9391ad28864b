package countmap

import (
	"fmt"
	"maps"
	"math"
	"slices"
	"strings"
	"testing"
)

func snapshot[T comparable](m *Map[T]) map[T]int {
	out := map[T]int{}
	m.Range(func(k T, n int) bool { out[k] = n; return true })
	return out
}

func TestAdd(t *testing.T) {
	type op struct {
		key   string
		delta int
		want  int
	}
	tests := []struct {
		name  string
		ops   []op
		final map[string]int
	}{
		{"empty", nil, map[string]int{}},
		{"add one", []op{{"a", 1, 1}}, map[string]int{"a": 1}},
		{"accumulate", []op{{"a", 1, 1}, {"a", 2, 3}, {"b", 5, 5}}, map[string]int{"a": 3, "b": 5}},
		{"add then remove vanishes", []op{{"a", 2, 2}, {"a", -1, 1}, {"a", -1, 0}}, map[string]int{}},
		{"remove in one step", []op{{"a", 4, 4}, {"b", 1, 1}, {"a", -4, 0}}, map[string]int{"b": 1}},
		{"zero delta on absent key stores nothing", []op{{"a", 0, 0}}, map[string]int{}},
		{"zero delta on present key", []op{{"a", 3, 3}, {"a", 0, 3}}, map[string]int{"a": 3}},
		{"re-add after vanish", []op{{"a", 1, 1}, {"a", -1, 0}, {"a", 1, 1}}, map[string]int{"a": 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var m Map[string] // zero value must be usable
			for i, o := range tt.ops {
				if got := m.Add(o.key, o.delta); got != o.want {
					t.Fatalf("op %d: Add(%q, %d) = %d, want %d", i, o.key, o.delta, got, o.want)
				}
				if got := m.Get(o.key); got != o.want {
					t.Fatalf("op %d: Get(%q) = %d, want %d", i, o.key, got, o.want)
				}
			}
			if got := snapshot(&m); !maps.Equal(got, tt.final) {
				t.Fatalf("final = %v, want %v", got, tt.final)
			}
			if m.Len() != len(tt.final) {
				t.Fatalf("Len() = %d, want %d", m.Len(), len(tt.final))
			}
			keys := m.Keys()
			slices.Sort(keys)
			if want := slices.Sorted(maps.Keys(tt.final)); !slices.Equal(keys, want) {
				t.Fatalf("Keys() = %v, want %v", keys, want)
			}
			for k := range tt.final {
				if m.Get(k) <= 0 {
					t.Fatalf("key %q present with count %d", k, m.Get(k))
				}
			}
		})
	}
}

func TestZeroValue(t *testing.T) {
	var m Map[int]
	if m.Len() != 0 || m.Get(7) != 0 || m.Keys() != nil {
		t.Fatal("zero Map is not empty")
	}
	m.Range(func(int, int) bool { t.Fatal("Range visited an entry of the zero Map"); return true })
	if got := m.Add(7, 2); got != 2 {
		t.Fatalf("Add on zero Map = %d, want 2", got)
	}
}

type key struct {
	Net string
	ID  int
}

func TestNegativePanics(t *testing.T) {
	tests := []struct {
		name     string
		setup    map[key]int
		key      key
		delta    int
		wantMsgs []string
	}{
		{"absent key", nil, key{"n1", 1}, -1, []string{"negative", "{n1 1}", "= -1"}},
		{"below existing", map[key]int{{"n1", 1}: 2}, key{"n1", 1}, -3, []string{"negative", "{n1 1}", "2 + (-3) = -1"}},
		{"other keys kept", map[key]int{{"a", 1}: 1, {"b", 2}: 5}, key{"b", 2}, -6, []string{"{b 2}", "= -1"}},
		{"overflow", map[key]int{{"o", 0}: math.MaxInt}, key{"o", 0}, 1, []string{"overflow", "{o 0}"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var m Map[key]
			for k, n := range tt.setup {
				m.Add(k, n)
			}
			before := snapshot(&m)
			msg := func() (msg string) {
				defer func() {
					r := recover()
					if r == nil {
						t.Fatalf("Add(%v, %d) did not panic", tt.key, tt.delta)
					}
					msg = fmt.Sprint(r)
				}()
				m.Add(tt.key, tt.delta)
				return ""
			}()
			for _, w := range tt.wantMsgs {
				if !strings.Contains(msg, w) {
					t.Errorf("panic message %q does not contain %q", msg, w)
				}
			}
			if after := snapshot(&m); !maps.Equal(before, after) {
				t.Fatalf("map changed by a panicking Add: before %v, after %v", before, after)
			}
		})
	}
}

func TestRangeStopsAndAllowsDelete(t *testing.T) {
	var m Map[int]
	for i := range 10 {
		m.Add(i, i+1)
	}
	visits := 0
	m.Range(func(int, int) bool { visits++; return visits < 3 })
	if visits != 3 {
		t.Fatalf("Range visited %d entries after f returned false on the 3rd", visits)
	}
	m.Range(func(k, n int) bool { m.Add(k, -n); return true })
	if m.Len() != 0 {
		t.Fatalf("Len() = %d after removing every key during Range", m.Len())
	}
}
