// Package logrec is an slog handler for tests that keeps every record, at
// every level, with its attributes, so that a test can assert that a state
// change was logged exactly once, at its level, with its keys (see
// internal/logkeys).
package logrec

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/overlayd/overlayd/internal/logkeys"
)

// Record is one log line: its level, message and attributes (values as
// slog prints them; groups are ignored).
type Record struct {
	Level slog.Level
	Msg   string
	Attrs map[string]string
}

func (r Record) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s %q", r.Level, r.Msg)
	for _, k := range slices.Sorted(maps.Keys(r.Attrs)) {
		fmt.Fprintf(&b, " %s=%s", k, r.Attrs[k])
	}
	return b.String()
}

// Recorder collects records; the zero value is ready. Safe for concurrent
// use.
type Recorder struct {
	mu   sync.Mutex
	recs []Record
}

// Logger returns a logger that writes to r.
func (r *Recorder) Logger() *slog.Logger { return slog.New(&handler{r: r}) }

// All returns every record so far.
func (r *Recorder) All() []Record {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]Record(nil), r.recs...)
}

// Events returns the records whose event key is event and whose
// attributes include every key=value pair of match.
func (r *Recorder) Events(event string, match ...string) []Record {
	var out []Record
	for _, rec := range r.All() {
		if rec.Attrs[logkeys.Event] != event {
			continue
		}
		ok := true
		for i := 0; i+1 < len(match); i += 2 {
			ok = ok && rec.Attrs[match[i]] == match[i+1]
		}
		if ok {
			out = append(out, rec)
		}
	}
	return out
}

// One fails t unless exactly one record has event and match (as Events),
// and it is at level and has every key of keys; it returns that record.
func (r *Recorder) One(t testing.TB, level slog.Level, event string, match []string, keys ...string) Record {
	t.Helper()
	got := r.Events(event, match...)
	if len(got) != 1 {
		t.Fatalf("%d %s lines matching %v, want exactly 1: %v", len(got), event, match, got)
	}
	rec := got[0]
	if rec.Level != level {
		t.Errorf("%s line at %s, want %s: %v", event, rec.Level, level, rec)
	}
	for _, k := range keys {
		if _, ok := rec.Attrs[k]; !ok {
			t.Errorf("%s line has no %s key: %v", event, k, rec)
		}
	}
	return rec
}

type handler struct {
	r     *Recorder
	attrs []slog.Attr
}

func (h *handler) Enabled(context.Context, slog.Level) bool { return true }

func (h *handler) Handle(_ context.Context, rec slog.Record) error {
	m := make(map[string]string, len(h.attrs)+rec.NumAttrs())
	for _, a := range h.attrs {
		m[a.Key] = a.Value.String()
	}
	rec.Attrs(func(a slog.Attr) bool { m[a.Key] = a.Value.String(); return true })
	h.r.mu.Lock()
	defer h.r.mu.Unlock()
	h.r.recs = append(h.r.recs, Record{Level: rec.Level, Msg: rec.Message, Attrs: m})
	return nil
}

func (h *handler) WithAttrs(as []slog.Attr) slog.Handler {
	return &handler{r: h.r, attrs: append(append([]slog.Attr(nil), h.attrs...), as...)}
}

func (h *handler) WithGroup(string) slog.Handler { return h }
