package statefile

import (
	"bytes"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/overlayd/overlayd/internal/lockorder"
)

// The transaction record, RecordName beside the state file, holds the id
// of the newest transaction the state file committed: every write
// records it, synced, after bbolt's commit and before the write returns.
// A state file whose newest transaction is older than the record has lost
// transactions that overlayd had reported done: bbolt fell back to its
// older meta page, or an older copy of the file was put in its place. The
// record must live outside the bbolt file, since a rolled-back file
// rolls back whatever it holds.
//
// It has two slots, 512 bytes apart (separate disk sectors), written in
// turn, so that a write torn by a crash leaves the other slot whole; each
// is a line of text with a checksum, padded with spaces:
//
//	overlayd state file transaction 1234 checksum 0123456789abcdef
//
// The record never runs ahead of the file (it is written after the
// commit), so a stale record, or none, can hide a loss but never invent
// one.

// RecordName is the transaction record's name inside the state directory.
const RecordName = FileName + ".txid"

const slotSize = 512

// formatSlot is a record slot holding txid.
func formatSlot(txid uint64) []byte {
	line := fmt.Sprintf("overlayd state file transaction %d", txid)
	h := fnv.New64a()
	h.Write([]byte(line))
	b := bytes.Repeat([]byte{' '}, slotSize)
	copy(b, fmt.Sprintf("%s checksum %016x", line, h.Sum64()))
	b[slotSize-1] = '\n'
	return b
}

// parseSlot returns the txid slot b holds, if it is whole.
func parseSlot(b []byte) (uint64, bool) {
	var txid uint64
	if _, err := fmt.Sscanf(string(b), "overlayd state file transaction %d", &txid); err != nil {
		return 0, false
	}
	return txid, bytes.Equal(b, formatSlot(txid))
}

// txRecord is the open transaction record.
type txRecord struct {
	mu   *lockorder.Mutex // leaf: taken after a commit, never during one
	path string
	f    *os.File
	// last: the txid recorded; slot: the slot that holds it. Guarded
	// by mu.
	last uint64
	slot int
}

// readRecord reads the record at path: the newest txid its whole slots
// hold and which slot that is; present is false when there is no record.
// A record with no whole slot is a *fileDamage.
func readRecord(path string) (txid uint64, slot int, present bool, err error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return 0, 0, false, nil
	}
	if err != nil {
		return 0, 0, false, fmt.Errorf("failed to read the transaction record %s: %w", path, err)
	}
	whole := false
	for i := range 2 {
		if len(b) < (i+1)*slotSize {
			break
		}
		if id, ok := parseSlot(b[i*slotSize : (i+1)*slotSize]); ok && (!whole || id > txid) {
			txid, slot, whole = id, i, true
		}
	}
	if !whole {
		return 0, 0, true, &fileDamage{
			what:   fmt.Sprintf("has a damaged transaction record %s (%d bytes, no whole slot): it cannot tell whether the file lost a transaction", path, len(b)),
			advice: fmt.Sprintf("To recover: remove the record (rm %s) and start overlayd again, which skips that check this once and writes a new record", path),
		}
	}
	return txid, slot, true, nil
}

// createRecord writes a new record at path holding txid, atomically (a
// crash leaves the old record or the new one, never a part), and opens it.
func createRecord(path string, txid uint64) (*txRecord, error) {
	tmp := path + ".new"
	f, err := os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_TRUNC, 0o600)
	if err != nil {
		return nil, fmt.Errorf("failed to create the transaction record %s: %w", tmp, err)
	}
	slot := formatSlot(txid)
	if _, err = f.Write(append(slot, slot...)); err == nil {
		err = f.Sync()
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err == nil {
		err = syncDir(filepath.Dir(path))
	}
	if err != nil {
		f.Close()
		os.Remove(tmp)
		return nil, fmt.Errorf("failed to write the transaction record %s: %w", path, err)
	}
	return &txRecord{mu: lockorder.New(lockorder.LevelLeaf), path: path, f: f, last: txid}, nil
}

// openRecord opens the record at path, which holds txid in slot.
func openRecord(path string, txid uint64, slot int) (*txRecord, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("failed to open the transaction record %s: %w", path, err)
	}
	return &txRecord{mu: lockorder.New(lockorder.LevelLeaf), path: path, f: f, last: txid, slot: slot}, nil
}

// removeRecord removes the record at path, if there is one, durably: a
// fresh state file starts its own count.
func removeRecord(path string) error {
	err := os.Remove(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err == nil {
		err = syncDir(filepath.Dir(path))
	}
	if err != nil {
		return fmt.Errorf("failed to remove the transaction record %s of a state file that is gone: %w", path, err)
	}
	return nil
}

// advance records txid, a committed transaction, unless a later one is
// recorded already; it returns once the record is on disk. Concurrent
// writers share the sync: one that finds its transaction covered by
// another's record returns at once.
func (r *txRecord) advance(txid uint64) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if txid <= r.last {
		return nil
	}
	next := 1 - r.slot
	if _, err := r.f.WriteAt(formatSlot(txid), int64(next*slotSize)); err != nil {
		return fmt.Errorf("failed to record transaction %d in %s: %w", txid, r.path, err)
	}
	if err := unix.Fdatasync(int(r.f.Fd())); err != nil {
		return fmt.Errorf("failed to record transaction %d in %s: %w", txid, r.path, err)
	}
	r.last, r.slot = txid, next
	return nil
}

func (r *txRecord) close() error { return r.f.Close() }

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
