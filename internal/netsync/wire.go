package netsync

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/overlayd/overlayd/internal/netspec"
)

// Messages travel as the cluster's application messages, beside the
// address management's: 'o' 'n', the version, the kind, then a JSON body.
// The address management's start with 'o' 'i'; Is tells them apart.
const (
	wireVersion = 1

	// kindPush: entries the sender just wrote or took; merge them.
	kindPush byte = 1
	// kindSync: the sender's whole table; merge it and answer with a
	// push of what the sender lacks or has older.
	kindSync byte = 2
	// kindUsage: the replicas the sender keeps while in use although the
	// cluster removed them, with their containers there (the origin of a
	// removal reports where the network is still used).
	kindUsage byte = 3
)

// MaxEntries bounds one message's entries (and the names a peer can make
// this host hold per message); a table is sent in pages of at most this.
const MaxEntries = 256

// maxMessage bounds a message: MaxEntries definitions of at most
// netspec.MaxWire each would exceed the cluster's 1 MiB application
// payload, so pages are cut by size too (see pages).
const maxMessage = 1 << 20

// Is reports whether an application payload is netsync's.
func Is(payload []byte) bool { return len(payload) >= 2 && payload[0] == 'o' && payload[1] == 'n' }

type wireEntry struct {
	Name string          `json:"name"`
	Live bool            `json:"live,omitempty"`
	Spec json.RawMessage `json:"spec,omitempty"`
	Time int64           `json:"t"`
	Host string          `json:"host"`
}

type message struct {
	kind    byte
	entries []Entry // kindPush, kindSync
	usage   []Kept  // kindUsage (IDs are the sender's, not sent)
}

type wireUsage struct {
	Name       string `json:"name"`
	Containers int    `json:"containers"`
}

func encodeMessage(m *message) ([]byte, error) {
	if m.kind == kindUsage {
		us := make([]wireUsage, 0, len(m.usage))
		for _, k := range m.usage {
			us = append(us, wireUsage{Name: k.Name, Containers: k.Endpoints})
		}
		body, err := json.Marshal(us)
		if err != nil {
			return nil, err
		}
		return append([]byte{'o', 'n', wireVersion, m.kind}, body...), nil
	}
	ws := make([]wireEntry, 0, len(m.entries))
	for _, e := range m.entries {
		w := wireEntry{Name: e.Name, Live: e.Live, Time: e.Stamp.Time, Host: e.Stamp.Host}
		if e.Live {
			b, err := e.Spec.Encode()
			if err != nil {
				return nil, err
			}
			w.Spec = b
		}
		ws = append(ws, w)
	}
	body, err := json.Marshal(ws)
	if err != nil {
		return nil, err
	}
	out := append([]byte{'o', 'n', wireVersion, m.kind}, body...)
	if len(out) > maxMessage {
		return nil, fmt.Errorf("netsync message of %d bytes: at most %d", len(out), maxMessage)
	}
	return out, nil
}

// decodeMessage reads a peer's message, refusing the whole message if any
// entry is malformed (a peer that sends one sends nothing usable).
func decodeMessage(b []byte) (*message, error) {
	if len(b) < 4 || !Is(b) {
		return nil, errors.New("not a netsync message (bad magic)")
	}
	if len(b) > maxMessage {
		return nil, fmt.Errorf("netsync message of %d bytes: at most %d", len(b), maxMessage)
	}
	if b[2] != wireVersion {
		return nil, fmt.Errorf("netsync message version %d, this host speaks %d", b[2], wireVersion)
	}
	m := &message{kind: b[3]}
	if m.kind != kindPush && m.kind != kindSync && m.kind != kindUsage {
		return nil, fmt.Errorf("netsync message kind %d unknown", m.kind)
	}
	dec := json.NewDecoder(bytes.NewReader(b[4:]))
	dec.DisallowUnknownFields()
	if m.kind == kindUsage {
		return decodeUsage(dec, m)
	}
	var ws []wireEntry
	if err := dec.Decode(&ws); err != nil {
		return nil, fmt.Errorf("netsync message: %w", err)
	}
	if dec.More() {
		return nil, errors.New("netsync message: data after the entries")
	}
	if len(ws) > MaxEntries {
		return nil, fmt.Errorf("netsync message with %d entries: at most %d", len(ws), MaxEntries)
	}
	seen := make(map[string]bool, len(ws))
	for i, w := range ws {
		e, err := w.entry()
		if err != nil {
			return nil, fmt.Errorf("netsync message: entry %d: %w", i+1, err)
		}
		if seen[e.Name] {
			return nil, fmt.Errorf("netsync message: entry %d: network %q given twice", i+1, e.Name)
		}
		seen[e.Name] = true
		m.entries = append(m.entries, e)
	}
	return m, nil
}

func (w *wireEntry) entry() (Entry, error) {
	if err := netspec.ValidName(w.Name); err != nil {
		return Entry{}, err
	}
	if w.Host == "" || len(w.Host) > 255 {
		return Entry{}, fmt.Errorf("network %q: host %q: must be 1..255 bytes", w.Name, w.Host)
	}
	if w.Time <= 0 {
		return Entry{}, fmt.Errorf("network %q: time %d: must be positive", w.Name, w.Time)
	}
	e := Entry{Name: w.Name, Live: w.Live, Stamp: Stamp{w.Time, w.Host}}
	switch {
	case w.Live && len(w.Spec) == 0:
		return Entry{}, fmt.Errorf("network %q: live without a definition", w.Name)
	case !w.Live && len(w.Spec) != 0:
		return Entry{}, fmt.Errorf("network %q: removed, with a definition", w.Name)
	case w.Live:
		s, err := netspec.Decode(w.Spec)
		if err != nil {
			return Entry{}, err
		}
		if s.Name != w.Name {
			return Entry{}, fmt.Errorf("network %q: definition of network %q", w.Name, s.Name)
		}
		e.Spec = s
	}
	return e, nil
}

// pages cuts entries into messages of kind of at most MaxEntries entries
// and about half of maxMessage bytes each.
func pages(kind byte, entries []Entry) ([][]byte, error) {
	var out [][]byte
	for len(entries) > 0 {
		n := min(len(entries), MaxEntries)
		for {
			b, err := encodeMessage(&message{kind: kind, entries: entries[:n]})
			if err == nil && (len(b) <= maxMessage/2 || n == 1) {
				out = append(out, b)
				break
			}
			if n == 1 {
				return nil, err
			}
			n /= 2
		}
		entries = entries[n:]
	}
	return out, nil
}

func decodeUsage(dec *json.Decoder, m *message) (*message, error) {
	var us []wireUsage
	if err := dec.Decode(&us); err != nil {
		return nil, fmt.Errorf("netsync usage message: %w", err)
	}
	if dec.More() {
		return nil, errors.New("netsync usage message: data after the list")
	}
	if len(us) > MaxEntries {
		return nil, fmt.Errorf("netsync usage message with %d networks: at most %d", len(us), MaxEntries)
	}
	for i, u := range us {
		if err := netspec.ValidName(u.Name); err != nil {
			return nil, fmt.Errorf("netsync usage message: network %d: %w", i+1, err)
		}
		if u.Containers < 1 {
			return nil, fmt.Errorf("netsync usage message: network %q: %d containers: must be at least 1", u.Name, u.Containers)
		}
		m.usage = append(m.usage, Kept{Name: u.Name, Endpoints: u.Containers})
	}
	return m, nil
}
