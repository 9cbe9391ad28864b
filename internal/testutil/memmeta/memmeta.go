// Package memmeta is an in-memory store of small records by key (the
// MetaStore of encryption.Owner, the meta table of the state file) for
// tests, whose writes can be made to fail.
package memmeta

import "sync"

// Store is safe for concurrent use; its zero value is empty and ready.
type Store struct {
	mu   sync.Mutex
	m    map[string][]byte
	fail error // PutMeta fails with it
}

// New returns a store holding recs (copied).
func New(recs map[string][]byte) *Store {
	s := &Store{m: map[string][]byte{}}
	for k, v := range recs {
		s.m[k] = append([]byte(nil), v...)
	}
	return s
}

// SetFail makes every later PutMeta fail with err (nil: succeed again).
func (s *Store) SetFail(err error) {
	s.mu.Lock()
	s.fail = err
	s.mu.Unlock()
}

// GetMeta returns the record of k (nil when absent).
func (s *Store) GetMeta(k string) ([]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]byte(nil), s.m[k]...), nil
}

// PutMeta stores v under k, unless SetFail said to fail.
func (s *Store) PutMeta(k string, v []byte) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fail != nil {
		return s.fail
	}
	if s.m == nil {
		s.m = map[string][]byte{}
	}
	s.m[k] = append([]byte(nil), v...)
	return nil
}
