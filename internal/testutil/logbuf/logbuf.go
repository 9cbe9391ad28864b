// Package logbuf is a log sink for tests: a buffer safe for concurrent
// writers (a daemon's goroutines) that tests read and search.
package logbuf

import (
	"bytes"
	"strings"
	"sync"
)

// Buffer collects log output; the zero value is ready.
type Buffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *Buffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// String returns everything written so far.
func (l *Buffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

// Count returns the number of lines that contain every one of parts.
func (l *Buffer) Count(parts ...string) int {
	n := 0
	for _, line := range strings.Split(l.String(), "\n") {
		all := true
		for _, p := range parts {
			all = all && strings.Contains(line, p)
		}
		if all {
			n++
		}
	}
	return n
}
