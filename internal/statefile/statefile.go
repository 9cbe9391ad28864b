// Package statefile persists overlayd's state in a bbolt file in the state
// directory: networks, endpoints, VNI allocations and small metadata (the
// cluster identity). dockerd replays nothing after a restart of the plugin or
// of itself, so everything the driver has told dockerd must be on disk before
// the answer is sent.
//
// Values are JSON documents; the file carries a schema version. A File is
// safe for concurrent use (bbolt serialises writers; its lock is a leaf: no
// overlayd lock is taken while a transaction runs).
package statefile

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"maps"
	"os"
	"path/filepath"
	"runtime/debug"
	"slices"
	"time"

	bolt "go.etcd.io/bbolt"
	bolterrors "go.etcd.io/bbolt/errors"

	"github.com/overlayd/overlayd/internal/latency"
)

// SchemaVersion is the version of the file's layout. Version 2 added the
// ipam table (cluster address management); a version 1 file gains it, empty,
// when it is opened.
const SchemaVersion = 2

// FileName is the state file's name inside the state directory.
const FileName = "overlayd.db"

var (
	bucketMeta      = []byte("meta")
	bucketNetworks  = []byte("networks")
	bucketEndpoints = []byte("endpoints") // key: network id + "/" + endpoint id
	bucketAllocs    = []byte("allocations")
	bucketIPAM      = []byte("ipam") // owned by internal/ipam: opaque keys and values
	keySchema       = []byte("schema")
)

// Network is a persisted network.
type Network struct {
	ID       string   `json:"id"`
	VNIs     []uint32 `json:"vnis"`
	Pools    []string `json:"pools"`
	Gateways []string `json:"gateways"` // "" where Docker gave none
	// Pools6 and Gateways6 are the IPv6 subnets of a network with IPv6,
	// which has one segment (one VNI; its Pools entry is "" when it has no
	// IPv4 subnet). Absent in files written before IPv6 and for networks
	// without it, so those load as they always did.
	Pools6    []string          `json:"pools6,omitempty"`
	Gateways6 []string          `json:"gateways6,omitempty"` // "" where Docker gave none
	MTU       int               `json:"mtu"`
	Internal  bool              `json:"internal,omitempty"`
	Encrypted bool              `json:"encrypted,omitempty"`
	Options   map[string]string `json:"options,omitempty"`
}

// Endpoint is a persisted endpoint.
type Endpoint struct {
	Network     string `json:"network"`
	ID          string `json:"id"`
	Addr        string `json:"addr"`                // IPv4 with prefix length; "" for an IPv6-only endpoint
	AddrIPv6    string `json:"addr_ipv6,omitempty"` // IPv6 with prefix length; absent when none
	MAC         string `json:"mac"`
	Joined      bool   `json:"joined"`
	HostName    string `json:"host_name"`
	SandboxName string `json:"sandbox_name"`
	// SandboxKey is the container's namespace as Join named it; DNSRoute
	// says whether this endpoint's Join gave that container the route to
	// the name server (one endpoint per container holds it).
	SandboxKey string `json:"sandbox_key,omitempty"`
	DNSRoute   bool   `json:"dns_route,omitempty"`
	// Names are the endpoint's DNS names, packed (internal/dnsname), as
	// last read from the engine: served again at once after a restart.
	Names string `json:"names,omitempty"`
}

// State is everything Load returns.
type State struct {
	Networks    []Network
	Endpoints   []Endpoint
	Allocations map[string][]uint32 // network id → VNIs handed out by AllocateNetwork
}

// File is the open state file.
type File struct {
	db   *bolt.DB
	path string
	lock *os.File // the state directory, flocked while the file is open
	// record holds the newest committed transaction's id, beside the
	// file: what tells a rolled-back file at the next open.
	record *txRecord
	// writes times every write transaction (bbolt fsyncs each one): the
	// figure that tells a slow disk from a slow plugin call.
	writes latency.Recorder
	// ipamCommit coalesces concurrent WriteIPAM calls into one transaction.
	ipamCommit groupCommit
}

// WriteLatency returns how long the write transactions took so far.
func (s *File) WriteLatency() latency.Snapshot { return s.writes.Snapshot() }

// CorruptError says the state file cannot be read. The daemon refuses to
// start rather than dropping networks silently.
type CorruptError struct {
	Path string
	Err  error
}

func (e *CorruptError) Error() string {
	what := fmt.Sprintf("is unreadable: %v", e.Err)
	advice := "To recover: " + startEmpty(e.Path) + "; or restore the file from a backup"
	if d, ok := errors.AsType[*fileDamage](e.Err); ok {
		what = d.what
		if d.advice != "" {
			advice = d.advice
		}
	}
	return fmt.Sprintf("state file %s %s. overlayd refuses to start rather than forget networks that containers use. %s", e.Path, what, advice)
}

// keepOlder is the recovery of a file that lost (or may have lost) the
// transactions after txid.
func keepOlder(path string, txid uint64) string {
	return fmt.Sprintf("To recover: restore the file from a backup; or keep transaction %d and lose what came after it (see \"A refused state file\" in docs/operations.md); or %s",
		txid, startEmpty(path))
}

// startEmpty is the recovery that always works and loses the host's
// networks.
func startEmpty(path string) string {
	return fmt.Sprintf("stop the containers on overlayd networks, move the file aside (mv %s %s.broken), start overlayd, and re-create the networks", path, path)
}

func (e *CorruptError) Unwrap() error { return e.Err }

// Open opens (creating if needed) the state file in dir. It fails clearly if
// another process holds the file or if it is corrupt: every page of the
// file is read before it returns.
func Open(dir string) (s *File, err error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("failed to create state directory %s: %w", dir, err)
	}
	path := filepath.Join(dir, FileName)
	lock, err := lockDir(dir)
	if err != nil {
		return nil, err
	}
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	var db *bolt.DB
	defer func() {
		if r := recover(); r != nil {
			if db != nil {
				db.Close()
			}
			s, err = nil, &CorruptError{Path: path, Err: fromPanic(r)}
		}
		if err != nil {
			lock.Close()
		}
	}()
	// Only a missing file is a fresh start. An empty one is what a crash
	// during creation or a truncation by hand leaves: bbolt would quietly
	// initialise it, and every network of this host would be forgotten.
	rpath := filepath.Join(dir, RecordName)
	fresh := false
	var rec recordState
	switch fi, err := os.Stat(path); {
	case errors.Is(err, os.ErrNotExist):
		fresh = true
		// A record left by a file that is gone (moved aside to start
		// empty) does not count this one's transactions.
		if err := removeRecord(rpath); err != nil {
			return nil, err
		}
	case err != nil:
		return nil, fmt.Errorf("failed to check state file %s: %w", path, err)
	case fi.Size() == 0:
		return nil, &CorruptError{Path: path, Err: errors.New("the file is empty (0 bytes), not a state file")}
	default:
		if rec, err = checkHistory(path, rpath); err != nil {
			return nil, err
		}
	}
	db, err = bolt.Open(path, 0o600, &bolt.Options{Timeout: 2 * time.Second})
	if err != nil {
		if errors.Is(err, bolterrors.ErrTimeout) {
			return nil, fmt.Errorf("state file %s is locked by another process (is another overlayd running with --state-dir %s?)", path, dir)
		}
		return nil, &CorruptError{Path: path, Err: err}
	}
	s = &File{db: db, path: path, lock: lock}
	s.ipamCommit.init()
	var txid uint64
	err = db.Update(func(tx *bolt.Tx) error {
		txid = uint64(tx.ID())
		if err := initTables(tx, path, fresh); err != nil {
			return err
		}
		return readAll(tx)
	})
	if err != nil {
		db.Close()
		if _, ok := errors.AsType[*CorruptError](err); ok {
			return nil, err
		}
		return nil, fmt.Errorf("failed to initialise state file %s: %w", path, err)
	}
	if rec.present {
		if s.record, err = openRecord(rpath, rec.txid, rec.slot); err == nil {
			if err = s.record.advance(txid); err != nil {
				s.record.close()
			}
		}
	} else {
		s.record, err = createRecord(rpath, txid)
	}
	if err != nil {
		db.Close()
		return nil, err
	}
	return s, nil
}

// recordState is what the transaction record held when the file was
// opened.
type recordState struct {
	txid    uint64
	slot    int
	present bool
}

// checkHistory checks the state file at path (checkLayout) and that it
// holds every transaction its record at rpath says was committed. A
// damaged meta page passes only when the record proves that the valid one
// holds the newest transaction (bbolt's next commit then rewrites the
// damaged page).
func checkHistory(path, rpath string) (recordState, error) {
	l, err := checkFile(path)
	if err != nil {
		return recordState{}, err
	}
	var r recordState
	r.txid, r.slot, r.present, err = readRecord(rpath)
	if _, ok := errors.AsType[*fileDamage](err); ok {
		return recordState{}, &CorruptError{Path: path, Err: err}
	}
	if err != nil {
		return recordState{}, err
	}
	lost := r.present && r.txid > l.txid
	var d *fileDamage
	switch {
	case l.damaged >= 0 && lost:
		d = &fileDamage{
			what: fmt.Sprintf("has a damaged meta page: page %d %v. bbolt would open transaction %d (in meta page %d) without a word, but transaction %d was committed (%s says so): "+
				"the changes after transaction %d would be lost", l.damaged, l.why, l.txid, 1-l.damaged, r.txid, rpath, l.txid),
			advice: keepOlder(path, l.txid),
		}
	case l.damaged >= 0 && !r.present:
		d = &fileDamage{
			what: fmt.Sprintf("has a damaged meta page: page %d %v. bbolt would open the transaction before (%d, in meta page %d) without a word, "+
				"and without a transaction record (%s) nothing proves that the damaged page did not hold a newer one, whose changes would be lost",
				l.damaged, l.why, l.txid, 1-l.damaged, rpath),
			advice: keepOlder(path, l.txid),
		}
	case lost:
		d = &fileDamage{
			what: fmt.Sprintf("holds transaction %d, but transaction %d was committed (%s says so): an older copy of the file is in its place, and the changes after transaction %d are lost",
				l.txid, r.txid, rpath, l.txid),
			advice: fmt.Sprintf("To recover: put the newest copy of the file back; or, if this copy is the one to keep, remove the record (rm %s) and start overlayd again; or %s",
				rpath, startEmpty(path)),
		}
	}
	if d != nil {
		return recordState{}, &CorruptError{Path: path, Err: d}
	}
	return r, nil
}

// initTables checks the schema version and the tables of the file at path
// and creates what a fresh file, or one of an older schema, lacks.
func initTables(tx *bolt.Tx, path string, fresh bool) error {
	meta := tx.Bucket(bucketMeta)
	stored := 0 // the file's schema version; 0 for a fresh file
	if meta != nil {
		if v := meta.Get(keySchema); v != nil {
			if err := json.Unmarshal(v, &stored); err != nil {
				return &CorruptError{Path: path, Err: fmt.Errorf("schema version %q: %w", v, err)}
			}
			if stored > SchemaVersion {
				return fmt.Errorf("state file %s has schema version %d, newer than this overlayd understands (%d): run the newer overlayd, or move the file aside", path, stored, SchemaVersion)
			}
		}
	}
	for _, b := range [][]byte{bucketMeta, bucketNetworks, bucketEndpoints, bucketAllocs, bucketIPAM} {
		if tx.Bucket(b) != nil {
			continue
		}
		// A table missing from a file this process did not just
		// create was lost: re-creating it empty would drop what it
		// held without a word. The one exception is a table newer
		// than the file's schema (ipam in a version 1 file).
		upgrade := bytes.Equal(b, bucketIPAM) && stored == 1
		if !fresh && !upgrade {
			return &CorruptError{Path: path, Err: fmt.Errorf("table %q is missing", b)}
		}
		if _, err := tx.CreateBucket(b); err != nil {
			return err
		}
	}
	if stored == 0 && !fresh {
		return &CorruptError{Path: path, Err: errors.New("the schema version is missing")}
	}
	if stored == SchemaVersion {
		return nil
	}
	return tx.Bucket(bucketMeta).Put(keySchema, []byte(fmt.Sprint(SchemaVersion)))
}

// readAll reads every key and value of every table, so that a damaged page
// anywhere in the file stops the start, rather than a later call that
// happens to reach it. (bbolt panics on a page it cannot make sense of;
// Open turns that into a CorruptError.)
func readAll(tx *bolt.Tx) error {
	h := crc32.NewIEEE() // reading means touching every byte
	var read func(b *bolt.Bucket) error
	read = func(b *bolt.Bucket) error {
		return b.ForEach(func(k, v []byte) error {
			h.Write(k)
			h.Write(v)
			if v != nil {
				return nil
			}
			if sub := b.Bucket(k); sub != nil {
				return read(sub)
			}
			return nil
		})
	}
	return tx.ForEach(func(_ []byte, b *bolt.Bucket) error { return read(b) })
}

// fromPanic is the error a CorruptError carries for what bbolt panicked
// with: an assertion on a damaged page, or a fault reading a page the file
// does not back (SetPanicOnFault turns that into a panic).
func fromPanic(r any) error {
	if f, ok := r.(interface{ Addr() uintptr }); ok {
		return fmt.Errorf("a page it refers to is damaged or missing (reading it faulted at %#x)", f.Addr())
	}
	return fmt.Errorf("%v", r)
}

// corrupt returns err as a CorruptError of the file at path (as it is when
// it is one already).
func corrupt(path string, err error) error {
	if _, ok := errors.AsType[*CorruptError](err); ok {
		return err
	}
	return &CorruptError{Path: path, Err: err}
}

// Path returns the state file's path.
func (s *File) Path() string { return s.path }

// Close closes the file.
func (s *File) Close() error {
	err := s.db.Close()
	s.record.close()
	s.lock.Close()
	return err
}

func epKey(network, id string) []byte { return []byte(network + "/" + id) }

func put(tx *bolt.Tx, bucket, key []byte, v any) error {
	raw, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return tx.Bucket(bucket).Put(key, raw)
}

// PutNetwork stores n, replacing a network with the same id.
func (s *File) PutNetwork(n Network) error {
	return s.update("network "+n.ID, func(tx *bolt.Tx) error { return put(tx, bucketNetworks, []byte(n.ID), n) })
}

// DeleteNetwork removes a network and its endpoints.
func (s *File) DeleteNetwork(id string) error {
	return s.update("network "+id, func(tx *bolt.Tx) error {
		if err := tx.Bucket(bucketNetworks).Delete([]byte(id)); err != nil {
			return err
		}
		c := tx.Bucket(bucketEndpoints).Cursor()
		prefix := []byte(id + "/")
		var keys [][]byte
		for k, _ := c.Seek(prefix); k != nil && len(k) >= len(prefix) && string(k[:len(prefix)]) == string(prefix); k, _ = c.Next() {
			keys = append(keys, append([]byte(nil), k...))
		}
		for _, k := range keys {
			if err := tx.Bucket(bucketEndpoints).Delete(k); err != nil {
				return err
			}
		}
		return nil
	})
}

// PutEndpoint stores e, replacing an endpoint with the same ids.
func (s *File) PutEndpoint(e Endpoint) error {
	return s.update("endpoint "+e.ID, func(tx *bolt.Tx) error { return put(tx, bucketEndpoints, epKey(e.Network, e.ID), e) })
}

// DeleteEndpoint removes an endpoint.
func (s *File) DeleteEndpoint(network, id string) error {
	return s.update("endpoint "+id, func(tx *bolt.Tx) error { return tx.Bucket(bucketEndpoints).Delete(epKey(network, id)) })
}

// PutAllocation records the VNIs AllocateNetwork handed to a network; nil
// removes the record.
func (s *File) PutAllocation(network string, vnis []uint32) error {
	return s.update("allocation "+network, func(tx *bolt.Tx) error {
		if vnis == nil {
			return tx.Bucket(bucketAllocs).Delete([]byte(network))
		}
		return put(tx, bucketAllocs, []byte(network), vnis)
	})
}

// PutMeta stores a small value under key (e.g. the cluster identity).
func (s *File) PutMeta(key string, value []byte) error {
	if key == string(keySchema) {
		return fmt.Errorf("meta key %q is reserved", key)
	}
	return s.update("meta "+key, func(tx *bolt.Tx) error { return tx.Bucket(bucketMeta).Put([]byte(key), value) })
}

// UpdateMeta stores the values of puts under their keys in one
// transaction, all or none; a nil value deletes its key.
func (s *File) UpdateMeta(puts map[string][]byte) error {
	for key := range puts {
		if key == string(keySchema) {
			return fmt.Errorf("meta key %q is reserved", key)
		}
	}
	what := fmt.Sprintf("%d meta records", len(puts))
	return s.update(what, func(tx *bolt.Tx) error { return putAll(tx.Bucket(bucketMeta), "meta record", puts) })
}

// putAll stores every value of puts in b under its key, in key order
// (bbolt writes fewer pages for ordered puts); a nil value deletes its
// key. what names the records in an error.
func putAll(b *bolt.Bucket, what string, puts map[string][]byte) error {
	for _, k := range slices.Sorted(maps.Keys(puts)) {
		var err error
		if v := puts[k]; v == nil {
			err = b.Delete([]byte(k))
		} else {
			err = b.Put([]byte(k), v)
		}
		if err != nil {
			return fmt.Errorf("%s %q: %w", what, k, err)
		}
	}
	return nil
}

// ListMeta returns the values stored under keys starting with prefix.
func (s *File) ListMeta(prefix string) (map[string][]byte, error) {
	out := map[string][]byte{}
	err := s.view(func(tx *bolt.Tx) error {
		c := tx.Bucket(bucketMeta).Cursor()
		for k, v := c.Seek([]byte(prefix)); k != nil && bytes.HasPrefix(k, []byte(prefix)); k, v = c.Next() {
			out[string(k)] = bytes.Clone(v)
		}
		return nil
	})
	return out, err
}

// GetMeta returns the value stored under key, or nil.
func (s *File) GetMeta(key string) ([]byte, error) {
	var v []byte
	err := s.view(func(tx *bolt.Tx) error {
		v = append([]byte(nil), tx.Bucket(bucketMeta).Get([]byte(key))...)
		if len(v) == 0 {
			v = nil
		}
		return nil
	})
	return v, err
}

// Load reads the whole state. A record that does not decode is reported as
// corruption rather than skipped.
func (s *File) Load() (*State, error) {
	st := &State{Allocations: map[string][]uint32{}}
	err := s.view(func(tx *bolt.Tx) error {
		if err := tx.Bucket(bucketNetworks).ForEach(func(k, v []byte) error {
			var n Network
			if err := json.Unmarshal(v, &n); err != nil {
				return fmt.Errorf("network %q: %w", k, err)
			}
			st.Networks = append(st.Networks, n)
			return nil
		}); err != nil {
			return err
		}
		nets := make(map[string]bool, len(st.Networks))
		for _, n := range st.Networks {
			nets[n.ID] = true
		}
		if err := tx.Bucket(bucketEndpoints).ForEach(func(k, v []byte) error {
			var e Endpoint
			if err := json.Unmarshal(v, &e); err != nil {
				return fmt.Errorf("endpoint %q: %w", k, err)
			}
			if string(k) != string(epKey(e.Network, e.ID)) {
				return fmt.Errorf("endpoint record %q names network %q and endpoint %q", k, e.Network, e.ID)
			}
			if !nets[e.Network] {
				// Its network's record is gone: the endpoint (maybe a
				// running container) would be forgotten silently.
				return fmt.Errorf("endpoint %q belongs to network %q, which the file does not hold", e.ID, e.Network)
			}
			st.Endpoints = append(st.Endpoints, e)
			return nil
		}); err != nil {
			return err
		}
		return tx.Bucket(bucketAllocs).ForEach(func(k, v []byte) error {
			var vnis []uint32
			if err := json.Unmarshal(v, &vnis); err != nil {
				return fmt.Errorf("allocation %q: %w", k, err)
			}
			st.Allocations[string(k)] = vnis
			return nil
		})
	})
	if err != nil {
		return nil, corrupt(s.path, err)
	}
	return st, nil
}

func (s *File) update(what string, fn func(*bolt.Tx) error) (err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			err = &CorruptError{Path: s.path, Err: fromPanic(r)}
		}
	}()
	start := time.Now()
	var txid uint64
	err = s.db.Update(func(tx *bolt.Tx) error {
		txid = uint64(tx.ID())
		return fn(tx)
	})
	if err == nil {
		// Committed: the record follows before the caller is told.
		err = s.record.advance(txid)
	}
	s.writes.Observe(time.Since(start))
	if err != nil {
		return fmt.Errorf("failed to save %s to %s: %w", what, s.path, err)
	}
	return nil
}

func (s *File) view(fn func(*bolt.Tx) error) (err error) {
	defer debug.SetPanicOnFault(debug.SetPanicOnFault(true))
	defer func() {
		if r := recover(); r != nil {
			err = &CorruptError{Path: s.path, Err: fromPanic(r)}
		}
	}()
	return s.db.View(fn)
}
