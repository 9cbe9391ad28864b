// Package memmeta is an in-memory store of small records by key (the
// MetaStore of encryption.Owner, the meta table of the state file) for
// tests, whose writes can be made to fail.
package memmeta

import (
	"strings"
	"sync"
)

// Store is safe for concurrent use; its zero value is empty and ready.
type Store struct {
	mu   sync.Mutex
	m    map[string][]byte
	fail error // PutMeta and UpdateMeta fail with it
	// updates counts successful writes (PutMeta, UpdateMeta) and keys
	// the keys they wrote or deleted.
	updates, keys int
}

// New returns a store holding recs (copied).
func New(recs map[string][]byte) *Store {
	s := &Store{m: map[string][]byte{}}
	for k, v := range recs {
		s.m[k] = append([]byte(nil), v...)
	}
	return s
}

// SetFail makes every later PutMeta and UpdateMeta fail with err (nil: succeed again).
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
	return s.UpdateMeta(map[string][]byte{k: append([]byte{}, v...)})
}

// UpdateMeta stores every value of puts under its key (nil: deletes it),
// all or none, unless SetFail said to fail.
func (s *Store) UpdateMeta(puts map[string][]byte) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.fail != nil {
		return s.fail
	}
	if s.m == nil {
		s.m = map[string][]byte{}
	}
	s.updates++
	for k, v := range puts {
		s.keys++
		if v == nil {
			delete(s.m, k)
		} else {
			s.m[k] = append([]byte(nil), v...)
		}
	}
	return nil
}

// ListMeta returns the records whose key starts with prefix.
func (s *Store) ListMeta(prefix string) (map[string][]byte, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[string][]byte{}
	for k, v := range s.m {
		if strings.HasPrefix(k, prefix) {
			out[k] = append([]byte(nil), v...)
		}
	}
	return out, nil
}

// Writes returns how many writes (PutMeta, UpdateMeta) succeeded and how
// many keys they wrote or deleted in all.
func (s *Store) Writes() (updates, keys int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.updates, s.keys
}
