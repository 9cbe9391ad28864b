package netsync

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"
)

func TestWireRoundTrip(t *testing.T) {
	es := []Entry{
		{Name: "net1", Live: true, Spec: spec("4242"), Stamp: Stamp{t0.UnixNano(), "h1"}},
		{Name: "gone", Stamp: Stamp{t0.Add(time.Hour).UnixNano(), "h2"}},
	}
	b, err := encodeMessage(&message{kind: kindSync, entries: es})
	if err != nil {
		t.Fatal(err)
	}
	if !Is(b) {
		t.Fatal("Is does not recognise a netsync message")
	}
	m, err := decodeMessage(b)
	if err != nil {
		t.Fatal(err)
	}
	if m.kind != kindSync || len(m.entries) != 2 || m.entries[0].Stamp != es[0].Stamp || !m.entries[0].Live || m.entries[1].Live {
		t.Fatalf("decoded %+v", m)
	}
	if Is([]byte{'o', 'i', 1, 1}) {
		t.Fatal("an address management message taken for netsync's")
	}
}

func TestUsageRoundTrip(t *testing.T) {
	b, err := encodeMessage(&message{kind: kindUsage, usage: []Kept{{Name: "ov", ID: "not sent", Endpoints: 2}}})
	if err != nil {
		t.Fatal(err)
	}
	m, err := decodeMessage(b)
	if err != nil {
		t.Fatal(err)
	}
	if len(m.usage) != 1 || m.usage[0] != (Kept{Name: "ov", Endpoints: 2}) {
		t.Fatalf("decoded %+v", m.usage)
	}
	for _, tc := range []struct{ in, want string }{
		{`[{"name":"ov","containers":0}]`, "0 containers: must be at least 1"},
		{`[{"name":"a/b","containers":1}]`, "is not allowed"},
		{`[{"name":"ov","containers":1,"id":"x"}]`, `unknown field "id"`},
	} {
		if _, err := decodeMessage([]byte("on\x01\x03" + tc.in)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("usage %s: %v, want %q", tc.in, err, tc.want)
		}
	}
}

func TestDecodeMessageRefuses(t *testing.T) {
	good, _ := encodeMessage(&message{kind: kindPush, entries: []Entry{{Name: "net1", Live: true, Spec: spec("4242"), Stamp: Stamp{1, "h1"}}}})
	body := string(good[4:])
	for _, tc := range []struct {
		in   string
		want string
	}{
		{"oi\x01\x01[]", "bad magic"},
		{"on\x02\x01[]", "version 2, this host speaks 1"},
		{"on\x01\x09[]", "kind 9 unknown"},
		{"on\x01\x01" + strings.Replace(body, `"t":1`, `"t":0`, 1), "time 0: must be positive"},
		{"on\x01\x01" + strings.Replace(body, `"host":"h1"`, `"host":""`, 1), `host "": must be 1..255 bytes`},
		{"on\x01\x01" + strings.Replace(body, `"live":true,`, ``, 1), "removed, with a definition"},
		{"on\x01\x01" + `[{"name":"x","live":true,"t":1,"host":"h"}]`, "live without a definition"},
		{"on\x01\x01" + strings.Replace(body, `[{"name":"net1"`, `[{"name":"other"`, 1), `definition of network "net1"`},
		{"on\x01\x01[" + body[1:len(body)-1] + "," + body[1:], `network "net1" given twice`},
		{"on\x01\x01" + `[{"name":"a b","t":1,"host":"h"}]`, "is not allowed"},
		{"on\x01\x01" + `[{"name":"x","t":1,"host":"h","extra":1}]`, `unknown field "extra"`},
		{"on\x01\x01[] []", "data after the entries"},
		{"on\x01\x01" + manyEntries(MaxEntries+1), "257 entries: at most 256"},
	} {
		if _, err := decodeMessage([]byte(tc.in)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("decode %.50q: %v, want an error containing %q", tc.in, err, tc.want)
		}
	}
}

func manyEntries(n int) string {
	parts := make([]string, n)
	for i := range parts {
		parts[i] = fmt.Sprintf(`{"name":"n%d","t":1,"host":"h"}`, i)
	}
	return "[" + strings.Join(parts, ",") + "]"
}

// A table larger than one message goes in pages that each decode.
func TestPages(t *testing.T) {
	var es []Entry
	for i := range 600 {
		s := spec("4242")
		s.Name = fmt.Sprintf("net%03d", i)
		es = append(es, Entry{Name: s.Name, Live: true, Spec: s, Stamp: Stamp{1, "h"}})
	}
	ps, err := pages(kindSync, es)
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, p := range ps {
		m, err := decodeMessage(p)
		if err != nil {
			t.Fatal(err)
		}
		n += len(m.entries)
	}
	if n != len(es) || len(ps) < 3 {
		t.Fatalf("%d pages carry %d entries, want %d in at least 3", len(ps), n, len(es))
	}
}

// Whatever a peer sends, decoding never panics, and what it accepts
// encodes back to a message that decodes to the same entries.
func FuzzDecodeMessage(f *testing.F) {
	good, _ := encodeMessage(&message{kind: kindPush, entries: []Entry{
		{Name: "net1", Live: true, Spec: spec("4242"), Stamp: Stamp{1, "h1"}}, {Name: "x", Stamp: Stamp{2, "h2"}}}})
	f.Add(good)
	f.Add([]byte("on\x01\x02[]"))
	f.Add([]byte(`on` + "\x01\x03" + `[{"name":"ov","containers":1}]`))
	f.Fuzz(func(t *testing.T, b []byte) {
		m, err := decodeMessage(b)
		if err != nil {
			return
		}
		again, err := encodeMessage(m)
		if err != nil {
			t.Fatalf("accepted message does not encode: %v", err)
		}
		m2, err := decodeMessage(again)
		if err != nil || len(m2.entries) != len(m.entries) || !slices.Equal(m2.usage, m.usage) {
			t.Fatalf("round trip: %v", err)
		}
		for i := range m.entries {
			if m.entries[i].Stamp != m2.entries[i].Stamp || m.entries[i].Live != m2.entries[i].Live || m.entries[i].Name != m2.entries[i].Name {
				t.Fatalf("entry %d changed: %+v %+v", i, m.entries[i], m2.entries[i])
			}
		}
	})
}

func TestTableMergeAndExpire(t *testing.T) {
	tb := NewTable(nil)
	live := Entry{Name: "n", Live: true, Spec: spec("1"), Stamp: Stamp{t0.UnixNano(), "a"}}
	tomb := Entry{Name: "n", Stamp: Stamp{t0.UnixNano() + 1, "b"}}
	if took := tb.Merge([]Entry{tomb}); len(took) != 1 {
		t.Fatal("tombstone not taken")
	}
	if took := tb.Merge([]Entry{live}); len(took) != 0 {
		t.Fatal("an older live entry replaced the tombstone")
	}
	if back := tb.Older([]Entry{live}); len(back) != 1 || back[0].Live {
		t.Fatalf("Older: %+v, want the tombstone back", back)
	}
	if back := tb.Older([]Entry{tomb}); len(back) != 0 {
		t.Fatalf("Older of an equal table: %+v", back)
	}
	if gone := tb.Expire(t0.Add(TombstoneTTL)); len(gone) != 0 {
		t.Fatal("expired at the TTL, not after")
	}
	if gone := tb.Expire(t0.Add(TombstoneTTL + time.Second)); len(gone) != 1 || len(tb.List()) != 0 {
		t.Fatalf("not expired after the TTL: %v", gone)
	}
}
