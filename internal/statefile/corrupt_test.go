package statefile

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// The tests below damage real state files the ways a disk, a crash or a
// hand can, and want each one refused with a CorruptError that names the
// file and what is wrong, never a crash and never a silent loss; and every
// file that still holds everything to open with everything.

// damageFixture is a state file written by overlayd and closed: network n1
// with endpoints, the last of them, "last", written by the file's last
// transaction of its own.
type damageFixture struct {
	dir       string
	endpoints int    // how many endpoints it holds, "last" included
	pageSize  int64  // bbolt's page size
	need      int64  // the bytes the last transaction's pages run to
	size      int64  // the file's size
	txid      uint64 // the last transaction
}

func newDamageFixture(t *testing.T, endpoints int) damageFixture {
	t.Helper()
	s, dir := openNew(t)
	if err := s.PutNetwork(Network{ID: "n1", VNIs: []uint32{5}}); err != nil {
		t.Fatal(err)
	}
	for i := range endpoints - 1 {
		if err := s.PutEndpoint(Endpoint{Network: "n1", ID: fmt.Sprintf("e%03d", i), Addr: "192.0.2.3/24", MAC: "02:42:c0:00:02:03"}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.PutEndpoint(Endpoint{Network: "n1", ID: "last", Addr: "192.0.2.4/24"}); err != nil {
		t.Fatal(err)
	}
	fx := damageFixture{dir: dir, endpoints: endpoints}
	s.view(func(tx *txAlias) error {
		fx.pageSize, fx.need, fx.txid = int64(tx.DB().Info().PageSize), tx.Size(), uint64(tx.ID())
		return nil
	})
	s.Close()
	fi, err := os.Stat(fx.path())
	if err != nil {
		t.Fatal(err)
	}
	fx.size = fi.Size()
	return fx
}

func (fx damageFixture) path() string { return filepath.Join(fx.dir, FileName) }

// copy returns a copy of the fixture's state directory, to damage.
func (fx damageFixture) copy(t *testing.T) damageFixture {
	t.Helper()
	c := fx
	c.dir = t.TempDir()
	entries, err := os.ReadDir(fx.dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join(fx.dir, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(c.dir, e.Name()), b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return c
}

// overwrite writes b over the state file at offset off.
func (fx damageFixture) overwrite(t *testing.T, off int64, b []byte) {
	t.Helper()
	f, err := os.OpenFile(fx.path(), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

// addEndpoint opens the fixture's file, writes an endpoint of n1 and
// closes it.
func (fx damageFixture) addEndpoint(t *testing.T, id string) {
	t.Helper()
	s, err := Open(fx.dir)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	if err := s.PutEndpoint(Endpoint{Network: "n1", ID: id, Addr: "192.0.2.5/24"}); err != nil {
		t.Fatal(err)
	}
}

// openAndLoad does what a starting daemon does with the file: open it and
// read every table.
func openAndLoad(dir string) (*State, error) {
	s, err := Open(dir)
	if err != nil {
		return nil, err
	}
	defer s.Close()
	st, err := s.Load()
	if err != nil {
		return nil, err
	}
	if _, err := s.LoadIPAM(); err != nil {
		return nil, err
	}
	return st, nil
}

// wantRefused checks that err is a CorruptError for the fixture's file
// that says what (once: a wrapped error does not repeat the message) and
// how to recover.
func (fx damageFixture) wantRefused(t *testing.T, err error, what string) {
	t.Helper()
	if _, ok := errors.AsType[*CorruptError](err); !ok {
		t.Fatalf("want a CorruptError, got %v", err)
	}
	msg := err.Error()
	if !strings.HasPrefix(msg, "state file "+fx.path()+" ") || strings.Count(msg, "state file "+fx.path()) != 1 ||
		!strings.Contains(msg, what) || !strings.Contains(msg, "refuses to start") || !strings.Contains(msg, ". To recover: ") {
		t.Fatalf("want the message to start with the file, say %q once, and how to recover; got %q", what, msg)
	}
}

// wantWhole checks that the fixture's file opens with everything it held
// and takes a write that survives a reopen.
func (fx damageFixture) wantWhole(t *testing.T) {
	t.Helper()
	st, err := openAndLoad(fx.dir)
	if err != nil {
		t.Fatalf("a file that holds everything was refused: %v", err)
	}
	if len(st.Endpoints) != fx.endpoints || st.Endpoints[len(st.Endpoints)-1].ID != "last" {
		t.Fatalf("%d endpoints (the last %+v), want %d ending with \"last\"", len(st.Endpoints), st.Endpoints[len(st.Endpoints)-1], fx.endpoints)
	}
	fx.wantWritable(t, len(st.Endpoints))
}

// wantWritable checks that the fixture's file, holding endpoints, takes a
// write that survives a reopen.
func (fx damageFixture) wantWritable(t *testing.T, endpoints int) {
	t.Helper()
	fx.addEndpoint(t, "zz-after")
	if st, err := openAndLoad(fx.dir); err != nil || len(st.Endpoints) != endpoints+1 {
		t.Fatalf("after a write: %v, %+v", err, st)
	}
}

// A truncated file is refused before bbolt maps it (which faulted past
// the end of the file: SIGBUS, a traceback and exit 2); one cut only
// after the last page in use holds everything and opens. Transactions
// alternate between two sets of pages, so the cuts are tried on files
// whose last transaction ended on either.
func TestTruncatedFileRefused(t *testing.T) {
	for _, endpoints := range []int{4, 5} {
		t.Run(fmt.Sprintf("%d endpoints", endpoints), func(t *testing.T) { testTruncated(t, newDamageFixture(t, endpoints)) })
	}
}

func testTruncated(t *testing.T, fx damageFixture) {
	ps := fx.pageSize
	if fx.need <= fx.size/2 || fx.need <= 3*ps {
		t.Fatalf("fixture: the pages in use (%d bytes) must reach past half the file (%d bytes) and three pages", fx.need, fx.size)
	}
	for _, c := range []struct {
		name string
		size int64
		want string
	}{
		{"1 byte", 1, "page 0 is cut short (1 of its 80 bytes are in the file)"},
		{"50 bytes", 50, "has no valid meta page"},
		{"100 bytes", 100, fmt.Sprintf("is truncated: 100 of the %d bytes its last transaction needs", fx.need)},
		{"one page", ps, fmt.Sprintf("is truncated: %d of the %d bytes", ps, fx.need)},
		{"two pages", 2 * ps, fmt.Sprintf("is truncated: %d of the %d bytes", 2*ps, fx.need)},
		{"half", fx.size / 2, fmt.Sprintf("is truncated: %d of the %d bytes", fx.size/2, fx.need)},
		{"all but the last page in use", fx.need - ps, fmt.Sprintf("is truncated: %d of the %d bytes", fx.need-ps, fx.need)},
		{"one byte short", fx.need - 1, fmt.Sprintf("is truncated: %d of the %d bytes", fx.need-1, fx.need)},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := fx.copy(t)
			if err := os.Truncate(d.path(), c.size); err != nil {
				t.Fatal(err)
			}
			_, err := openAndLoad(d.dir)
			d.wantRefused(t, err, c.want)
			if !strings.Contains(err.Error(), "restore the file from a backup") || !strings.Contains(err.Error(), "move the file aside (mv "+d.path()+" "+d.path()+".broken)") {
				t.Fatalf("the message does not offer a backup or an empty start: %v", err)
			}
		})
	}
	// bbolt grows the file ahead of its use: what lies past the last page
	// in use is free space, and a file cut there (or mid-page there) has
	// lost nothing.
	for _, size := range []int64{fx.need, fx.need + 100} {
		t.Run(fmt.Sprintf("cut at %d of %d bytes, after the pages in use", size, fx.size), func(t *testing.T) {
			d := fx.copy(t)
			if err := os.Truncate(d.path(), size); err != nil {
				t.Fatal(err)
			}
			d.wantWhole(t)
		})
	}
	t.Run("untouched", func(t *testing.T) { fx.copy(t).wantWhole(t) })
	// The check docs/operations.md offers for a truncated file: extend it
	// to its size again (truncate -s), with zeros where the pages were.
	// Where the cut took only pages no transaction uses, the file holds
	// everything and opens; where it took one in use, the zeros are
	// refused when the file is read at open. Never a silent loss.
	t.Run("cut at half and extended again", func(t *testing.T) {
		d := fx.copy(t)
		for _, size := range []int64{fx.size / 2, fx.need} {
			if err := os.Truncate(d.path(), size); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := openAndLoad(d.dir); err != nil {
			d.wantRefused(t, err, "is unreadable: ")
			return
		}
		d.wantWhole(t)
	})
}

// A page of the data overwritten is refused when the file is opened (not
// at some later call that reaches it), with one message, however the
// garbage looks to bbolt: a page it cannot make sense of (a panic), or
// records that point outside the file (a fault, which killed overlayd
// with a traceback). Garbage over a page no transaction uses loses
// nothing.
func TestOverwrittenDataPageRefused(t *testing.T) {
	fx := newDamageFixture(t, 100)
	var table int64 // the endpoints table's root page
	var free int64  // a page no transaction uses
	s, err := Open(fx.copy(t).dir)
	if err != nil {
		t.Fatal(err)
	}
	s.view(func(tx *txAlias) error {
		table = int64(tx.Bucket(bucketEndpoints).Root())
		for id := 2; id < int(fx.need/fx.pageSize); id++ {
			if p, err := tx.Page(id); err == nil && p != nil && p.Type == "free" {
				free = int64(id)
			}
		}
		return nil
	})
	s.Close()
	if table == 0 || free == 0 {
		t.Fatalf("fixture: the endpoints table has no page of its own (%d) or no page is free (%d)", table, free)
	}
	ps := int(fx.pageSize)
	garbage := []byte(strings.Repeat("garbage!", ps/8))
	outside := make([]byte, ps) // a leaf page whose three records lie 128 MiB further
	order := binary.NativeEndian
	order.PutUint64(outside[0:], uint64(table))
	order.PutUint16(outside[8:], 0x02) // leaf
	order.PutUint16(outside[10:], 3)
	for i := range 3 {
		e := outside[pageHeaderSize+16*i:]
		order.PutUint32(e[4:], 1<<27) // offset of the key from the element
		order.PutUint32(e[8:], 8)     // key size
		order.PutUint32(e[12:], 8)    // value size
	}
	at := table * fx.pageSize
	for _, c := range []struct {
		name string
		off  int64
		b    []byte
		want string
	}{
		{"garbage", at, garbage, "is unreadable: "},
		{"zeros", at, make([]byte, ps), "is unreadable: "},
		{"records outside the file", at, outside, "is unreadable: a page it refers to is damaged or missing (reading it faulted at "},
		{"page header flags", at + 8, []byte{0xff}, "is unreadable: "},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := fx.copy(t)
			d.overwrite(t, c.off, c.b)
			s, err := Open(d.dir)
			if err == nil {
				s.Close()
			}
			d.wantRefused(t, err, c.want)
		})
	}
	// Damage done while the file is open (bbolt maps it shared: the
	// next read sees it) is refused by the call that reads it, a fault
	// included, and the message says it once.
	for _, c := range []struct {
		name   string
		damage func(d damageFixture)
	}{
		{"garbage while open", func(d damageFixture) { d.overwrite(t, at, garbage) }},
		{"records outside the file while open", func(d damageFixture) { d.overwrite(t, at, outside) }},
		{"truncated while open", func(d damageFixture) {
			if err := os.Truncate(d.path(), 2*fx.pageSize); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := fx.copy(t)
			s, err := Open(d.dir)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			c.damage(d)
			_, err = s.Load()
			d.wantRefused(t, err, "is unreadable: ")
		})
	}
	t.Run("a free page", func(t *testing.T) {
		d := fx.copy(t)
		d.overwrite(t, free*fx.pageSize, garbage)
		d.wantWhole(t)
	})
}

// A flipped byte that breaks a record is refused by the load that reads
// it, naming the record.
func TestFlippedRecordByteRefused(t *testing.T) {
	fx := newDamageFixture(t, 100)
	b, err := os.ReadFile(fx.path())
	if err != nil {
		t.Fatal(err)
	}
	rec := []byte(`{"network":"n1","id":"e050"`)
	at := bytes.Index(b, rec)
	if at < 0 || bytes.Count(b, rec) != 1 {
		t.Fatalf("fixture: record %s found %d times", rec, bytes.Count(b, rec))
	}
	fx.overwrite(t, int64(at), []byte{'{' ^ 0x01})
	_, err = openAndLoad(fx.dir)
	fx.wantRefused(t, err, `is unreadable: endpoint "n1/e050"`)
}

// fixtureNewestIn returns a fixture whose last transaction wrote meta page
// page (transaction n writes page n%2).
func fixtureNewestIn(t *testing.T, page int) damageFixture {
	t.Helper()
	fx := newDamageFixture(t, 4)
	if int(fx.txid%2) != page {
		fx = newDamageFixture(t, 5)
	}
	if int(fx.txid%2) != page {
		t.Fatalf("fixture: transaction %d is not in meta page %d", fx.txid, page)
	}
	return fx
}

// metaDamage is the ways a meta page is damaged in these tests: damage
// changes a copy of the page.
var metaDamage = []struct {
	name   string
	damage func(page []byte)
	want   string
}{
	{"garbage", func(p []byte) { copy(p, strings.Repeat("garbage!", len(p)/8)) }, "lacks bbolt's marker"},
	{"zeros", func(p []byte) { clear(p) }, "lacks bbolt's marker"},
	{"a flipped bit of its txid", func(p []byte) { p[pageHeaderSize+48] ^= 0x10 }, "fails its checksum"},
}

// damageMeta applies damage to meta page page of the fixture's file.
func (fx damageFixture) damageMeta(t *testing.T, page int, damage func([]byte)) {
	t.Helper()
	b, err := os.ReadFile(fx.path())
	if err != nil {
		t.Fatal(err)
	}
	p := b[int64(page)*fx.pageSize : int64(page+1)*fx.pageSize]
	damage(p)
	fx.overwrite(t, int64(page)*fx.pageSize, p)
}

// Garbage over the meta page of the last transaction made bbolt open the
// one before it without a word: the last transaction's endpoint was gone.
// It is refused, on either meta page.
func TestDamagedNewestMetaPageRefused(t *testing.T) {
	for page := range 2 {
		fx := fixtureNewestIn(t, page)
		for _, c := range metaDamage {
			t.Run(fmt.Sprintf("page %d %s", page, c.name), func(t *testing.T) {
				d := fx.copy(t)
				d.damageMeta(t, page, c.damage)
				_, err := openAndLoad(d.dir)
				d.wantRefused(t, err, fmt.Sprintf("has a damaged meta page: page %d %s", page, c.want))
				for _, want := range []string{
					fmt.Sprintf("would open transaction %d (in meta page %d) without a word, but transaction %d was committed", fx.txid-1, 1-page, fx.txid),
					fmt.Sprintf("restore the file from a backup; or keep transaction %d and lose what came after it", fx.txid-1),
					"move the file aside (mv " + d.path() + " " + d.path() + ".broken)",
				} {
					if !strings.Contains(err.Error(), want) {
						t.Errorf("the message does not say %q: %v", want, err)
					}
				}
			})
		}
	}
	// Without the record (an older overlayd wrote the file, or it was
	// removed) nothing says which transaction the damaged page held.
	t.Run("older meta page without the record", func(t *testing.T) {
		d := fixtureNewestIn(t, 0)
		if err := os.Remove(filepath.Join(d.dir, RecordName)); err != nil && !errors.Is(err, os.ErrNotExist) {
			t.Fatal(err)
		}
		d.damageMeta(t, 1, metaDamage[0].damage)
		_, err := openAndLoad(d.dir)
		d.wantRefused(t, err, "without a transaction record")
	})
	t.Run("both pages", func(t *testing.T) {
		d := newDamageFixture(t, 4)
		d.damageMeta(t, 0, metaDamage[0].damage)
		d.damageMeta(t, 1, metaDamage[0].damage)
		_, err := openAndLoad(d.dir)
		d.wantRefused(t, err, "has no valid meta page (bbolt's two headers that say where the data is): page 0 lacks bbolt's marker")
	})
}

// Garbage over the meta page of the transaction before the last loses
// nothing, and the record proves it: the file opens with everything.
func TestDamagedOlderMetaPageOpens(t *testing.T) {
	for page := range 2 {
		fx := fixtureNewestIn(t, 1-page)
		for _, c := range metaDamage {
			t.Run(fmt.Sprintf("page %d %s", page, c.name), func(t *testing.T) {
				d := fx.copy(t)
				d.damageMeta(t, page, c.damage)
				d.wantWhole(t)
				if l, err := checkFile(d.path()); err != nil || l.damaged >= 0 {
					t.Fatalf("the damaged page was not rewritten: %+v, %v", l, err)
				}
			})
		}
	}
}

// The recovery docs/operations.md gives for a damaged meta page, to keep
// the transaction before it: copy the valid meta page over the damaged
// one (dd), which the record still refuses as an older copy, and remove
// the record. The file then opens without the last transaction's
// endpoint, and its next transaction rewrites the copied page.
func TestKeepOlderTransactionRecovery(t *testing.T) {
	for page := range 2 {
		t.Run(fmt.Sprintf("page %d", page), func(t *testing.T) {
			fx := fixtureNewestIn(t, page)
			fx.damageMeta(t, page, metaDamage[0].damage)
			b, err := os.ReadFile(fx.path())
			if err != nil {
				t.Fatal(err)
			}
			// dd if=overlayd.db of=overlayd.db bs=<page size> skip=<valid page> seek=<damaged page> count=1 conv=notrunc
			valid := 1 - page
			fx.overwrite(t, int64(page)*fx.pageSize, b[int64(valid)*fx.pageSize:int64(valid+1)*fx.pageSize])
			_, err = openAndLoad(fx.dir)
			fx.wantRefused(t, err, fmt.Sprintf("holds transaction %d, but transaction %d was committed", fx.txid-1, fx.txid))
			if err := os.Remove(filepath.Join(fx.dir, RecordName)); err != nil {
				t.Fatal(err)
			}
			st, err := openAndLoad(fx.dir)
			if err != nil {
				t.Fatalf("after the recovery: %v", err)
			}
			if len(st.Endpoints) != fx.endpoints-1 || slices.ContainsFunc(st.Endpoints, func(e Endpoint) bool { return e.ID == "last" }) {
				t.Fatalf("after the recovery: %+v, want the endpoints before \"last\"", st.Endpoints)
			}
			fx.wantWritable(t, len(st.Endpoints))
		})
	}
}
