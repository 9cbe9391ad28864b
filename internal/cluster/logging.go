package cluster

import (
	"bytes"
	"context"
	"log"
	"log/slog"
	"strings"
	"time"

	"github.com/overlayd/overlayd/internal/lockorder"
)

// rateLimiter lets one log line per key through per period and counts the
// ones it suppressed, so bad input from the network cannot flood the log.
type rateLimiter struct {
	mu     *lockorder.Mutex // LevelLeaf; guards keys
	period time.Duration
	keys   map[string]*rlEntry
}

type rlEntry struct {
	last       time.Time
	suppressed int
}

func newRateLimiter(period time.Duration) *rateLimiter {
	return &rateLimiter{mu: lockorder.New(lockorder.LevelLeaf), period: period, keys: make(map[string]*rlEntry)}
}

// allow reports whether a line for key may be logged now, and how many
// were suppressed since the last one that was.
func (r *rateLimiter) allow(key string, now time.Time) (bool, int) {
	r.mu.Lock()
	defer r.mu.Unlock()
	e := r.keys[key]
	if e == nil {
		if len(r.keys) > 1024 { // bounded: forget everything rather than grow
			clear(r.keys)
		}
		e = &rlEntry{}
		r.keys[key] = e
	}
	if !e.last.IsZero() && now.Sub(e.last) < r.period {
		e.suppressed++
		return false, 0
	}
	n := e.suppressed
	e.last, e.suppressed = now, 0
	return true, n
}

// mlLogWriter turns memberlist's log lines ("[LEVEL] memberlist: ...")
// into slog records at the matching level, rate-limited per kind of line,
// and counts the drops memberlist does itself (authentication, label).
type mlLogWriter struct {
	log       *slog.Logger
	rl        *rateLimiter
	dropped   func(DropReason)
	suspected func(node string) // this node's probe of node failed
}

func (w *mlLogWriter) logger() *log.Logger { return log.New(w, "", 0) }

func (w *mlLogWriter) Write(p []byte) (int, error) {
	line := string(bytes.TrimRight(p, "\n"))
	level := slog.LevelInfo
	for _, l := range []struct {
		tag   string
		level slog.Level
	}{{"[DEBUG]", slog.LevelDebug}, {"[INFO]", slog.LevelInfo}, {"[WARN]", slog.LevelWarn}, {"[ERR]", slog.LevelError}, {"[ERROR]", slog.LevelError}} {
		if strings.HasPrefix(line, l.tag) {
			level = l.level
			line = strings.TrimSpace(line[len(l.tag):])
			break
		}
	}
	line = strings.TrimPrefix(line, "memberlist: ")
	if routineLine(line) {
		level = min(level, slog.LevelDebug)
	}
	lower := strings.ToLower(line)
	switch {
	case strings.Contains(lower, "decrypt") || strings.Contains(lower, "not encrypted") || strings.Contains(lower, "encryption is not configured"):
		w.dropped(DropGossipAuth)
	case strings.Contains(lower, "unacceptable label"):
		w.dropped(DropGossipLabel)
	case strings.HasPrefix(line, "Suspect ") && strings.Contains(line, " has failed"):
		// memberlist: "Suspect %s has failed, no acks received"
		if w.suspected != nil {
			w.suspected(strings.TrimPrefix(line[:strings.Index(line, " has failed")], "Suspect "))
		}
	}
	if !w.log.Enabled(context.Background(), level) {
		return len(p), nil
	}
	if level >= slog.LevelWarn {
		if ok, n := w.rl.allow("ml:"+lineKind(line), time.Now()); !ok {
			return len(p), nil
		} else if n > 0 {
			w.log.Log(context.Background(), level, line, "component", "memberlist", "suppressed", n)
			return len(p), nil
		}
	}
	w.log.Log(context.Background(), level, line, "component", "memberlist")
	return len(p), nil
}

// lineKind reduces a log line to its constant part (up to the first digit,
// colon, quote or parenthesis) to rate-limit lines that differ only in
// addresses and numbers together.
func lineKind(s string) string {
	if i := strings.IndexAny(s, "0123456789:\"'(["); i >= 0 {
		s = s[:i]
	}
	if len(s) > 48 {
		s = s[:48]
	}
	return s
}

// routineLine reports whether a memberlist line describes something
// expected around restarts, which memberlist logs as a warning or an
// error: a node refuting a suspicion or death of itself (it restarted or
// stalled), or an alive message for a member at another address (a
// restart at a new address, handled by NotifyConflict, which logs its
// own line).
func routineLine(line string) bool {
	return strings.HasPrefix(line, "Refuting a") || strings.HasPrefix(line, "Conflicting address for")
}
