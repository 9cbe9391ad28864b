package statefile

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
)

func (fx damageFixture) recordPath() string { return filepath.Join(fx.dir, RecordName) }

// recorded returns the txid the fixture's record holds.
func (fx damageFixture) recorded(t *testing.T) uint64 {
	t.Helper()
	txid, _, present, err := readRecord(fx.recordPath())
	if err != nil || !present {
		t.Fatalf("record: %v (present %v)", err, present)
	}
	return txid
}

// An older copy of the file put in place of the newest (a backup restored
// by mistake, a snapshot of the disk) is a valid bbolt file: only the
// record tells that it lost transactions. It is refused; removing the
// record accepts it.
func TestRolledBackFileRefused(t *testing.T) {
	old := newDamageFixture(t, 4)
	fx := old.copy(t)
	fx.addEndpoint(t, "newer")
	newest := fx.txidNow(t)
	b, err := os.ReadFile(old.path())
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(fx.path(), b, 0o600); err != nil { // cp old/overlayd.db new/overlayd.db
		t.Fatal(err)
	}
	_, err = openAndLoad(fx.dir)
	fx.wantRefused(t, err, fmt.Sprintf("holds transaction %d, but transaction %d was committed (%s says so): an older copy of the file is in its place",
		old.txid, newest, fx.recordPath()))
	if !strings.Contains(err.Error(), "rm "+fx.recordPath()) {
		t.Fatalf("the message does not say how to accept the copy: %v", err)
	}
	if err := os.Remove(fx.recordPath()); err != nil {
		t.Fatal(err)
	}
	fx.wantWhole(t) // the old copy's contents, "newer" gone
	if got, want := fx.recorded(t), fx.txidNow(t); got != want {
		t.Fatalf("the new record holds %d, the file %d", got, want)
	}
}

// txidNow returns the fixture file's newest transaction.
func (fx damageFixture) txidNow(t *testing.T) uint64 {
	t.Helper()
	l, err := checkFile(fx.path())
	if err != nil {
		t.Fatal(err)
	}
	return l.txid
}

// The record follows every write, also concurrent ones, and the ways it
// can legitimately lag or go missing do not stop a start.
func TestRecordFollowsTheFile(t *testing.T) {
	fx := newDamageFixture(t, 4)
	if got := fx.recorded(t); got != fx.txid {
		t.Fatalf("record %d, file %d", got, fx.txid)
	}
	t.Run("concurrent writers", func(t *testing.T) {
		d := fx.copy(t)
		s, err := Open(d.dir)
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		for i := range 32 {
			wg.Go(func() {
				if err := s.WriteIPAM(map[string][]byte{fmt.Sprint(i): {1}}); err != nil {
					t.Error(err)
				}
				if err := s.PutMeta(fmt.Sprint("k", i), []byte{1}); err != nil {
					t.Error(err)
				}
			})
		}
		wg.Wait()
		s.Close()
		if got, want := d.recorded(t), d.txidNow(t); got != want {
			t.Fatalf("record %d, file %d", got, want)
		}
	})
	// A crash after bbolt's commit and before the record's write leaves
	// the record one behind: the file holds more, nothing is lost.
	t.Run("record behind the file", func(t *testing.T) {
		d := fx.copy(t)
		rec := append(formatSlot(fx.txid-2), formatSlot(fx.txid-1)...)
		if err := os.WriteFile(d.recordPath(), rec, 0o600); err != nil {
			t.Fatal(err)
		}
		d.wantWhole(t)
	})
	// A crash in the middle of the record's write leaves the other slot.
	t.Run("a torn slot", func(t *testing.T) {
		d := fx.copy(t)
		rec := append(formatSlot(fx.txid-1), formatSlot(fx.txid)...)
		copy(rec[slotSize+20:], "torn")
		if err := os.WriteFile(d.recordPath(), rec, 0o600); err != nil {
			t.Fatal(err)
		}
		d.wantWhole(t)
	})
	// A file written by an overlayd from before the record has none.
	t.Run("no record", func(t *testing.T) {
		d := fx.copy(t)
		if err := os.Remove(d.recordPath()); err != nil {
			t.Fatal(err)
		}
		d.wantWhole(t)
		if got, want := d.recorded(t), d.txidNow(t); got != want {
			t.Fatalf("new record %d, file %d", got, want)
		}
	})
	// The state file moved aside to start empty: the record left behind
	// counted the old file's transactions, not the new one's.
	t.Run("state file moved aside", func(t *testing.T) {
		d := fx.copy(t)
		if err := os.Rename(d.path(), d.path()+".broken"); err != nil {
			t.Fatal(err)
		}
		s, err := Open(d.dir)
		if err != nil {
			t.Fatal(err)
		}
		s.Close()
		if st, err := openAndLoad(d.dir); err != nil || len(st.Networks) != 0 {
			t.Fatalf("the fresh file: %+v, %v", st, err)
		}
	})
	t.Run("both slots damaged", func(t *testing.T) {
		d := fx.copy(t)
		if err := os.WriteFile(d.recordPath(), []byte("garbage\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := openAndLoad(d.dir)
		d.wantRefused(t, err, fmt.Sprintf("has a damaged transaction record %s (8 bytes, no whole slot)", d.recordPath()))
		if !strings.Contains(err.Error(), "rm "+d.recordPath()) {
			t.Fatalf("the message does not say how to start anyway: %v", err)
		}
		if err := os.Remove(d.recordPath()); err != nil {
			t.Fatal(err)
		}
		d.wantWhole(t)
	})
}
